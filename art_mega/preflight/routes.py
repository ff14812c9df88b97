"""The agent's preflight routes: host facts, FS probe steps, file reach checks, the managed etcd,
and the preflight-collective probe.

`register(router, supervisor)` adds `GET /v1/facts`, `POST /v1/fs/op`, `/v1/files/check`,
`/v1/etcd/start|stop|check` and `/v1/preflight/prepare|run|discard`; the router's signature check
guards them like every other route. Probes and etcd are supervised children; what the agent holds
beyond them (FS probe locks, etcd's data dir) is released when the agent closes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
from typing import Any

from art_mega.agent.protocol import ShutdownResponse
from art_mega.agent.routes import SignedRouter
from art_mega.agent.supervisor import Child, Supervisor, spawn_child, stop_process
from art_mega.preflight.fs_probe import FsProbeOps
from art_mega.preflight.protocol import (
    ETCD_CHECK,
    ETCD_START,
    ETCD_STOP,
    FACTS,
    FILES_CHECK,
    FS_OP,
    PREFLIGHT_DISCARD,
    PREFLIGHT_PREPARE,
    PREFLIGHT_RUN,
    EtcdCheckRequest,
    EtcdCheckResponse,
    EtcdStartRequest,
    EtcdStartResponse,
    FilesCheckRequest,
    FilesCheckResponse,
    FsOpRequest,
    FsOpResponse,
    HostFacts,
    PreflightPrepareRequest,
    PreflightPrepareResponse,
    PreflightRunRequest,
    PreflightRunResponse,
)


class PreflightProbes:
    """One agent's preflight probes (children of `supervisor`, role "preflight", "preflight-N"):
    at most one warm probe per Python waits for its config."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._ids = itertools.count()
        self._warm: dict[str, Child] = {}
        self._discards = 0
        """How often `discard` ran: a probe it killed is not replaced by a cold one."""

    async def _spawn(self, python: str, args: list[str], warm: bool) -> Child:
        from art_mega.preflight.probe import probe_command

        argv, env = probe_command(python, args, os.environ)
        process = await spawn_child(
            argv,
            env=env,
            stdin=asyncio.subprocess.PIPE if warm else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        child = Child(child_id=f"preflight-{next(self._ids)}", role="preflight", process=process)
        self.supervisor.add(child)
        return child

    async def prepare(self, request: PreflightPrepareRequest) -> PreflightPrepareResponse:
        """Start a warm probe (`preflight.probe --stdin`) for `request.python` unless one waits."""
        from art_mega.preflight.probe import WARM_FLAG

        python = request.python or sys.executable
        waiting = self._warm.get(python)
        if waiting is not None and waiting.process.returncode is None:
            return PreflightPrepareResponse(started=False)
        try:
            self._warm[python] = await self._spawn(python, [WARM_FLAG], warm=True)
        except OSError:  # no such interpreter: `run` answers that, naming the rank
            return PreflightPrepareResponse(started=False)
        return PreflightPrepareResponse(started=True)

    async def run(self, request: PreflightRunRequest) -> PreflightRunResponse:
        """Run one preflight rank as a supervised child; kill it after `timeout_s` + 10 s.

        Uses the warm probe `prepare` started for this Python when it is still alive (the config
        goes to its stdin), else starts a cold one with the config in argv. A warm probe that
        ended before it read the config (killed, idle exit) is replaced by a cold one, unless
        `discard` killed it.
        """
        python = request.python or sys.executable
        config = json.dumps(request.config)
        discards = self._discards
        warm = self._warm.pop(python, None)
        if warm is not None and warm.process.returncode is None:
            reply, took_config = await self._finish(warm, config.encode() + b"\n", request.timeout_s)
            if took_config or reply.timed_out or self._discards != discards:
                return reply
        try:
            cold = await self._spawn(python, [config], warm=False)
        except OSError as exc:
            error = f"cannot run the interpreter {python}: {exc.strerror or exc}"
            return PreflightRunResponse(
                exit_code=None, result={"ok": False, "phase": "spawn", "error": error}
            )
        reply, _ = await self._finish(cold, None, request.timeout_s)
        return reply

    async def _finish(
        self, child: Child, stdin_line: bytes | None, timeout_s: float
    ) -> tuple[PreflightRunResponse, bool]:
        """Feed `stdin_line`, wait for the probe (killed after `timeout_s` + 10 s); its reply and
        whether it read its config (`preflight.probe.CONFIG_READ`)."""
        from art_mega.preflight.probe import CONFIG_READ, RESULT_PREFIX

        process = child.process
        timed_out = False
        try:
            out, err = await asyncio.wait_for(process.communicate(stdin_line), timeout_s + 10)
        except TimeoutError:
            timed_out = True
            await stop_process(process, 2.0)
            out, err = b"", b""
        finally:
            await self.supervisor.stop([child.child_id], 2.0)
        lines = out.decode(errors="replace").splitlines()
        result = None
        for line in lines:
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
        reply = PreflightRunResponse(
            exit_code=process.returncode,
            timed_out=timed_out,
            result=result,
            stderr_tail=err.decode(errors="replace")[-1500:],
        )
        return reply, CONFIG_READ in lines

    async def discard(self) -> None:
        """Stop every preflight probe here: warm ones still waiting for a config (the proof ended
        before its collective) and running ones (another rank failed: this one would wait out
        its rendezvous timeout)."""
        self._warm = {}
        self._discards += 1
        probes = [c.child_id for c in self.supervisor.children() if c.role == "preflight"]
        await self.supervisor.stop(probes, 2.0)


class EtcdHolder:
    """The one managed etcd an agent may run (`preflight.etcd.start_managed_etcd`)."""

    def __init__(self, launch_id: str) -> None:
        self.launch_id = launch_id
        self.etcd: Any = None

    async def start(self, request: EtcdStartRequest) -> EtcdStartResponse:
        from art_mega.preflight.etcd import start_managed_etcd

        if self.etcd is not None and self.etcd.process.returncode is not None:
            await self.stop()  # it exited on its own: clean its data dir, start a new one
        if self.etcd is not None:
            return EtcdStartResponse(ok=False, error="a managed etcd already runs on this agent")
        try:
            self.etcd = await start_managed_etcd(request, self.launch_id)
        except (TimeoutError, OSError, ValueError, RuntimeError) as exc:
            return EtcdStartResponse(ok=False, error=str(exc))
        etcd = self.etcd
        return EtcdStartResponse(
            ok=True,
            endpoint=etcd.endpoint.url,
            pid=etcd.process.pid,
            data_dir=etcd.data_dir,
            version=etcd.version,
        )

    async def stop(self) -> None:
        if self.etcd is not None:
            etcd, self.etcd = self.etcd, None
            await etcd.stop()


def _missing(paths: tuple[str, ...]) -> tuple[str, ...]:
    """The paths that are not absolute, readable regular files here, in order."""
    return tuple(p for p in paths if not (os.path.isabs(p) and os.path.isfile(p) and os.access(p, os.R_OK)))


def register(router: SignedRouter, supervisor: Supervisor) -> None:
    """Add the preflight routes to the agent's `router`; probes and etcd join `supervisor`'s
    children, and the agent's close stops etcd (deleting its data dir) and drops the FS probe's
    locks."""
    probes = PreflightProbes(supervisor)
    etcd = EtcdHolder(supervisor.launch_id)
    fs_probe = FsProbeOps()
    facts_cache: list[HostFacts] = []

    async def close_fs_probe() -> None:
        fs_probe.close()

    supervisor.on_close(etcd.stop)
    supervisor.on_close(close_fs_probe)

    def facts_once() -> HostFacts:
        from art_mega.preflight.host_facts import collect_host_facts

        if not facts_cache:
            facts_cache.append(collect_host_facts())
        return facts_cache[0]

    @router.serve(FACTS)
    async def facts() -> HostFacts:
        return await asyncio.to_thread(facts_once)

    @router.serve(FS_OP)
    async def fs_op(body: FsOpRequest) -> FsOpResponse:
        return await asyncio.to_thread(fs_probe.run, body)

    @router.serve(FILES_CHECK)
    async def files_check(body: FilesCheckRequest) -> FilesCheckResponse:
        return FilesCheckResponse(missing=await asyncio.to_thread(_missing, body.paths))

    @router.serve(ETCD_START)
    async def etcd_start(body: EtcdStartRequest) -> EtcdStartResponse:
        return await etcd.start(body)

    @router.serve(ETCD_STOP)
    async def etcd_stop() -> ShutdownResponse:
        await etcd.stop()
        return ShutdownResponse()

    @router.serve(ETCD_CHECK)
    async def etcd_check(body: EtcdCheckRequest) -> EtcdCheckResponse:
        from art_mega.preflight.etcd import check_endpoint

        return await asyncio.to_thread(check_endpoint, body)

    @router.serve(PREFLIGHT_PREPARE)
    async def preflight_prepare(body: PreflightPrepareRequest) -> PreflightPrepareResponse:
        return await probes.prepare(body)

    @router.serve(PREFLIGHT_DISCARD)
    async def preflight_discard() -> ShutdownResponse:
        await probes.discard()
        return ShutdownResponse()

    @router.serve(PREFLIGHT_RUN)
    async def preflight_run(body: PreflightRunRequest) -> PreflightRunResponse:
        return await probes.run(body)
