"""The per-host agent: an authenticated HTTP server (Starlette on uvicorn) that supervises this host's children.

It is the only long-lived art-mega process per host. Every request must carry a valid HMAC
signature made for this agent process (its address and incarnation, see `auth`); refused
requests execute nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from art_mega import __version__
from art_mega.agent.auth import (
    NONCE_HEADER,
    REPLY_SIGNATURE_HEADER,
    AgentIdentity,
    Verifier,
    new_incarnation,
)
from art_mega.agent.lease import DEFAULT_CONTROLLER_LEASE_S, ControllerLease
from art_mega.agent.protocol import (
    READY_PREFIX,
    FreePortRequest,
    FreePortResponse,
    HealthResponse,
    LeaseRequest,
    ShutdownResponse,
)
from art_mega.agent.routes import RouteError, SignedRouter, body_error, capped_head_protocol, json_reply
from art_mega.agent.supervisor import Child, Supervisor
from art_mega.preflight.fs_probe import FsProbeOps
from art_mega.preflight.protocol import (
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
from art_mega.rollouts.protocol import (
    STREAM_LIMIT,
    CallableRef,
    RemoteFailure,
    RunRolloutRequest,
    RunRolloutResponse,
    StartRolloutWorkersRequest,
    StartRolloutWorkersResponse,
    StopRolloutWorkersRequest,
)
from art_mega.trainer.host import STREAM_LIMIT as TRAINER_STREAM_LIMIT
from art_mega.trainer.protocol import (
    TrainerEventsRequest,
    TrainerEventsResponse,
    TrainerJobRequest,
    TrainerJobResponse,
    TrainerStartRequest,
    TrainerStartResponse,
)

WORKER_HELLO_TIMEOUT_S = 60.0
MAX_CACHED_CALLABLES = 1024
FILES_CHECK_MAX_BODY_BYTES = 16 << 20
"""Body cap of /v1/files/check: `FILES_PER_CHECK` paths of up to 4 KiB each."""
"""Distinct rollout callables whose worker-protocol form an agent keeps (more are dumped per call)."""


def boot_id() -> str:
    """The kernel's boot id (Linux), or "" where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass
class _RolloutWorker:
    child: Child
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=itertools.count)
    reader_task: asyncio.Task[None] | None = None

    async def read_loop(self) -> None:
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    break
                message = json.loads(line)
                future = self.pending.pop(int(message.get("id", -1)), None)
                if future is not None and not future.done():
                    future.set_result(message)
        finally:
            code = await self.child.process.wait()
            failure = RemoteFailure(
                kind="error",
                message=f"rollout worker {self.child.child_id} (pid {self.child.pid}) exited with code {code}",
            ).model_dump()
            for future in self.pending.values():
                if not future.done():
                    future.set_result({"ok": False, "failure": failure})
            self.pending.clear()

    async def call(self, message: dict[str, Any]) -> dict[str, Any]:
        request_id = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        try:
            self.writer.write(
                json.dumps({"id": request_id, **message}, separators=(",", ":")).encode() + b"\n"
            )
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            self.pending.pop(request_id, None)
            code = self.child.process.returncode
            return {
                "ok": False,
                "failure": RemoteFailure(
                    kind="error", message=f"rollout worker {self.child.child_id} is gone (exit code {code})"
                ).model_dump(),
            }
        return await future


class AgentState:
    """Everything one agent owns: identity, verifier, supervised children."""

    def __init__(
        self,
        launch_id: str,
        secret: bytes,
        address: str,
        controller_lease_s: float = DEFAULT_CONTROLLER_LEASE_S,
    ) -> None:
        self.launch_id = launch_id
        self.address = address
        self.identity = AgentIdentity(address=address, incarnation=new_incarnation())
        """Whom a request must be signed for: this address and this process's incarnation."""
        self.verifier = Verifier(secret, self.identity)
        self.supervisor = Supervisor()
        self.workers: dict[str, _RolloutWorker] = {}
        self.started_at = time.time()
        self.boot_id = boot_id()
        self.shutdown_requested = asyncio.Event()
        self.lease = ControllerLease(controller_lease_s)
        self.closing = False
        """Set once `close` began: requests in flight may then lose their children and sockets."""
        self._worker_ids = itertools.count()
        self._warm_probes: dict[str, Child] = {}
        self._preflight_discards = 0
        """How often `discard_preflight` ran: a probe it killed is not replaced by a cold one."""
        self.fs_probe = FsProbeOps()
        from art_mega.trainer.host import TrainerRanks

        self.trainer = TrainerRanks(self.supervisor)
        self.etcd: Any = None
        self._facts: HostFacts | None = None

    def facts(self) -> HostFacts:
        from art_mega.preflight.host_facts import collect_host_facts

        if self._facts is None:
            self._facts = collect_host_facts()
        return self._facts

    async def start_etcd(self, request: EtcdStartRequest) -> EtcdStartResponse:
        from art_mega.preflight.etcd import start_managed_etcd

        if self.etcd is not None and self.etcd.process.returncode is not None:
            await self.stop_etcd()  # it exited on its own: clean its data dir, start a new one
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

    async def _spawn_probe(self, python: str, args: list[str], warm: bool) -> Child:
        from art_mega.agent.supervisor import spawn_child
        from art_mega.preflight.probe import probe_command

        argv, env = probe_command(python, args, os.environ)
        process = await spawn_child(
            argv,
            env=env,
            stdin=asyncio.subprocess.PIPE if warm else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        child = Child(child_id=f"preflight-{next(self._worker_ids)}", role="preflight", process=process)
        self.supervisor.add(child)
        return child

    async def prepare_preflight(self, request: PreflightPrepareRequest) -> PreflightPrepareResponse:
        """Start a warm probe (`preflight.probe --stdin`) for `request.python` unless one waits."""
        from art_mega.preflight.probe import WARM_FLAG

        python = request.python or sys.executable
        waiting = self._warm_probes.get(python)
        if waiting is not None and waiting.process.returncode is None:
            return PreflightPrepareResponse(started=False)
        try:
            self._warm_probes[python] = await self._spawn_probe(python, [WARM_FLAG], warm=True)
        except OSError:  # no such interpreter: `run_preflight` answers that, naming the rank
            return PreflightPrepareResponse(started=False)
        return PreflightPrepareResponse(started=True)

    async def run_preflight(self, request: PreflightRunRequest) -> PreflightRunResponse:
        """Run one preflight rank as a supervised child; kill it after `timeout_s` + 10 s.

        Uses the warm probe `prepare_preflight` started for this Python when it is still alive
        (the config goes to its stdin), else starts a cold one with the config in argv. A warm
        probe that ended before it read the config (killed, idle exit) is replaced by a cold one,
        unless `discard_preflight` killed it.
        """
        python = request.python or sys.executable
        config = json.dumps(request.config)
        discards = self._preflight_discards
        warm = self._warm_probes.pop(python, None)
        if warm is not None and warm.process.returncode is None:
            reply, took_config = await self._finish_probe(warm, config.encode() + b"\n", request.timeout_s)
            if took_config or reply.timed_out or self._preflight_discards != discards:
                return reply
        try:
            cold = await self._spawn_probe(python, [config], warm=False)
        except OSError as exc:
            error = f"cannot run the interpreter {python}: {exc.strerror or exc}"
            return PreflightRunResponse(
                exit_code=None, result={"ok": False, "phase": "spawn", "error": error}
            )
        reply, _ = await self._finish_probe(cold, None, request.timeout_s)
        return reply

    async def _finish_probe(
        self, child: Child, stdin_line: bytes | None, timeout_s: float
    ) -> tuple[PreflightRunResponse, bool]:
        """Feed `stdin_line`, wait for the probe (killed after `timeout_s` + 10 s); its reply and
        whether it read its config (`preflight.probe.CONFIG_READ`)."""
        from art_mega.agent.supervisor import stop_process
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

    async def discard_preflight(self) -> None:
        """Stop every preflight probe here: warm ones still waiting for a config (the proof ended
        before its collective) and running ones (another rank failed: this one would wait out
        its rendezvous timeout)."""
        self._warm_probes = {}
        self._preflight_discards += 1
        probes = [c.child_id for c in self.supervisor.children() if c.role == "preflight"]
        await self.supervisor.stop(probes, 2.0)

    async def stop_etcd(self) -> None:
        if self.etcd is not None:
            etcd, self.etcd = self.etcd, None
            await etcd.stop()

    def health(self) -> HealthResponse:
        return HealthResponse(
            launch_id=self.launch_id,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            address=self.address,
            boot_id=self.boot_id,
            python=sys.executable,
            art_mega_version=__version__,
            started_at=self.started_at,
            children=self.supervisor.statuses(),
            controller_lease_s=self.lease.lease_s,
        )

    async def start_rollout_workers(self, request: StartRolloutWorkersRequest) -> StartRolloutWorkersResponse:
        from art_mega.agent.supervisor import spawn_child

        started: list[_RolloutWorker] = []
        env = dict(os.environ)
        env.pop("ART_MEGA_SECRET", None)
        env["ART_MEGA_SYS_PATH"] = os.pathsep.join(request.sys_path)
        env["PYTHONUNBUFFERED"] = "1"
        hello = {"op": "hello", "callables": [c.model_dump() for c in request.callables]}
        try:
            for _ in range(request.count):
                parent_sock, child_sock = socket.socketpair()
                try:
                    process = await spawn_child(
                        [
                            sys.executable,
                            "-m",
                            "art_mega.rollouts.worker",
                            "--fd",
                            str(child_sock.fileno()),
                        ],
                        env=env,
                        pass_fds=(child_sock.fileno(),),
                    )
                finally:
                    child_sock.close()
                child = Child(child_id=f"rollout-{next(self._worker_ids)}", role="rollout", process=process)
                self.supervisor.add(child)
                reader, writer = await asyncio.open_connection(sock=parent_sock, limit=STREAM_LIMIT)
                worker = _RolloutWorker(child=child, reader=reader, writer=writer)
                started.append(worker)
                writer.write(json.dumps(hello).encode() + b"\n")
                await writer.drain()
            for worker in started:
                try:
                    line = await asyncio.wait_for(worker.reader.readline(), WORKER_HELLO_TIMEOUT_S)
                except ConnectionError:  # it died (or was stopped by a shutdown) before its hello
                    line = b""
                if not line:
                    code = await worker.child.process.wait()
                    raise _WorkerStartError(
                        RemoteFailure(
                            kind="error",
                            message=f"rollout worker {worker.child.child_id} exited with code {code} before it was ready",
                        )
                    )
                reply = json.loads(line)
                if reply.get("failure"):
                    raise _WorkerStartError(RemoteFailure.model_validate(reply["failure"]))
        except BaseException:
            await self.supervisor.stop([w.child.child_id for w in started])
            raise
        for worker in started:
            worker.reader_task = asyncio.create_task(worker.read_loop())
            self.workers[worker.child.child_id] = worker
        return StartRolloutWorkersResponse(
            worker_ids=tuple(w.child.child_id for w in started),
            pids=tuple(w.child.pid for w in started),
        )

    async def stop_rollout_workers(self, worker_ids: tuple[str, ...]) -> ShutdownResponse:
        ids = list(worker_ids) if worker_ids else list(self.workers)
        for worker_id in ids:
            worker = self.workers.pop(worker_id, None)
            if worker is not None:
                worker.writer.close()
        return ShutdownResponse(stopped=await self.supervisor.stop(ids))

    async def close(self) -> ShutdownResponse:
        self.closing = True
        for worker in self.workers.values():
            worker.writer.close()
        self.workers.clear()
        await self.stop_etcd()
        await self.trainer.stop()
        self.fs_probe.close()
        return ShutdownResponse(stopped=await self.supervisor.stop(None))


class _WorkerStartError(Exception):
    def __init__(self, failure: RemoteFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def create_app(state: AgentState) -> Starlette:
    """Build the agent's app over `state`: every route requires a signed request (`routes`).

    `/v1/health` and `/v1/rollouts/run`, the calls made per rollout and per heartbeat, parse and
    answer by hand (one pydantic parse, no per-call model dumps of the callable);
    `/v1/identity` tells a client whom to sign for. A refused request gets 401 `{"detail": reason}`
    (413 for a body over its route's cap) and executes nothing.
    """
    router = SignedRouter(state.verifier, on_verified=state.lease.renew)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await state.close()

    async def health(request: Request, body: bytes) -> Response:
        return json_reply(state.health())

    async def identity(request: Request, body: bytes) -> Response:
        """Whom to sign for (see `auth`), with a reply signature over the request's nonce."""
        reply = state.identity.model_dump_json().encode()
        signature = state.verifier.sign_reply(request.headers[NONCE_HEADER], reply)
        return Response(reply, media_type="application/json", headers={REPLY_SIGNATURE_HEADER: signature})

    callables: dict[CallableRef, dict[str, Any]] = {}

    def callable_message(ref: CallableRef) -> dict[str, Any]:
        """`ref` as the worker protocol sends it, dumped once per callable rather than per call."""
        dumped = callables.get(ref)
        if dumped is None:
            dumped = ref.model_dump()
            if len(callables) < MAX_CACHED_CALLABLES:
                callables[ref] = dumped
        return dumped

    async def run_rollout(request: Request, body: bytes) -> Response:
        try:
            run = RunRolloutRequest.model_validate_json(body)
        except ValidationError as exc:
            raise body_error(exc) from None
        worker = state.workers.get(run.worker_id)
        if worker is None:
            raise RouteError(404, f"no rollout worker {run.worker_id!r} on this agent")
        reply = await worker.call(
            {"callable": callable_message(run.callable), "args": run.args, "kwargs": run.kwargs}
        )
        if reply.get("ok"):
            return json_reply(RunRolloutResponse(ok=True, result=reply.get("result")))
        return json_reply(
            RunRolloutResponse(ok=False, failure=RemoteFailure.model_validate(reply["failure"]))
        )

    router.raw("/health", health, ["GET"], max_body_bytes=0)
    router.raw("/identity", identity, ["GET"], max_body_bytes=0, unbound=True)

    @router.post("/lease", LeaseRequest)
    async def lease(body: LeaseRequest) -> HealthResponse:
        if body.hold:
            state.lease.hold()
        else:
            state.lease.release()
        return state.health()

    router.raw("/rollouts/run", run_rollout, ["POST"], max_body_bytes=STREAM_LIMIT)

    @router.post("/rollout-workers/start", StartRolloutWorkersRequest)
    async def start_workers(body: StartRolloutWorkersRequest) -> StartRolloutWorkersResponse:
        try:
            return await state.start_rollout_workers(body)
        except _WorkerStartError as exc:
            return StartRolloutWorkersResponse(failure=exc.failure)

    @router.post("/rollout-workers/stop", StopRolloutWorkersRequest)
    async def stop_workers(body: StopRolloutWorkersRequest) -> ShutdownResponse:
        return await state.stop_rollout_workers(body.worker_ids)

    @router.get("/facts")
    async def facts() -> HostFacts:
        return await asyncio.to_thread(state.facts)

    @router.post("/fs/op", FsOpRequest)
    async def fs_op(body: FsOpRequest) -> FsOpResponse:
        return await asyncio.to_thread(state.fs_probe.run, body)

    @router.post("/files/check", FilesCheckRequest, max_body_bytes=FILES_CHECK_MAX_BODY_BYTES)
    async def files_check(body: FilesCheckRequest) -> FilesCheckResponse:
        def missing() -> tuple[str, ...]:
            return tuple(
                p
                for p in body.paths
                if not (os.path.isabs(p) and os.path.isfile(p) and os.access(p, os.R_OK))
            )

        return FilesCheckResponse(missing=await asyncio.to_thread(missing))

    @router.post("/etcd/start", EtcdStartRequest)
    async def etcd_start(body: EtcdStartRequest) -> EtcdStartResponse:
        return await state.start_etcd(body)

    @router.post("/etcd/stop")
    async def etcd_stop() -> ShutdownResponse:
        await state.stop_etcd()
        return ShutdownResponse()

    @router.post("/etcd/check", EtcdCheckRequest)
    async def etcd_check(body: EtcdCheckRequest) -> EtcdCheckResponse:
        from art_mega.preflight.etcd import check_endpoint

        return await asyncio.to_thread(check_endpoint, body)

    @router.post("/free-port", FreePortRequest)
    async def free_port(body: FreePortRequest) -> FreePortResponse:
        from art_mega.agent.ports import free_port

        return FreePortResponse(port=free_port(body.host))

    @router.post("/preflight/prepare", PreflightPrepareRequest)
    async def preflight_prepare(body: PreflightPrepareRequest) -> PreflightPrepareResponse:
        return await state.prepare_preflight(body)

    @router.post("/preflight/discard")
    async def preflight_discard() -> ShutdownResponse:
        await state.discard_preflight()
        return ShutdownResponse()

    @router.post("/preflight/run", PreflightRunRequest)
    async def preflight_run(body: PreflightRunRequest) -> PreflightRunResponse:
        return await state.run_preflight(body)

    from art_mega.inference.agent_routes import register_inference_routes

    register_inference_routes(router, state.supervisor)

    from art_mega.transfer.routes import register_adapter_transport_routes

    register_adapter_transport_routes(router, state.supervisor)

    from art_mega.transfer.files import register_artifact_file_routes

    register_artifact_file_routes(router)

    @router.post("/trainer/start", TrainerStartRequest, max_body_bytes=TRAINER_STREAM_LIMIT)
    async def trainer_start(body: TrainerStartRequest) -> TrainerStartResponse:
        try:
            return await state.trainer.start(body)
        except (OSError, RuntimeError) as exc:
            return TrainerStartResponse(error=str(exc))

    @router.post("/trainer/job", TrainerJobRequest, max_body_bytes=TRAINER_STREAM_LIMIT)
    async def trainer_job(body: TrainerJobRequest) -> TrainerJobResponse:
        return TrainerJobResponse(sent=await state.trainer.send_job(body.job))

    @router.post("/trainer/events", TrainerEventsRequest)
    async def trainer_events(body: TrainerEventsRequest) -> TrainerEventsResponse:
        return await state.trainer.wait_events(body.after, body.timeout_s)

    @router.post("/trainer/stop")
    async def trainer_stop() -> ShutdownResponse:
        await state.trainer.stop()
        return ShutdownResponse()

    @router.post("/shutdown")
    async def shutdown() -> ShutdownResponse:
        stopped = await state.close()
        state.shutdown_requested.set()
        return stopped

    return router.app(lifespan)


def _watch_stdin_eof(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Set `event` when stdin reaches end of file (the launcher's SSH channel closed).

    The thread reads the file descriptor, not `sys.stdin`: at exit the interpreter would wait
    (a second, then abort) for the buffered reader's lock that a blocked `read1` holds.
    """

    def read() -> None:
        try:
            while os.read(sys.stdin.fileno(), 65536):
                pass
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(event.set)

    threading.Thread(target=read, name="art-mega-stdin-eof", daemon=True).start()


def _quiet_while_closing(app: Any, state: AgentState) -> Any:
    """`app`, except that a request which fails once the agent is closing logs no traceback.

    A shutdown (or an expired lease) stops the children and sockets that requests in flight
    wait on, e.g. a rollout worker still starting when the controller got SIGTERM: those
    requests fail by design, and one traceback per request and host would flood the terminal
    the launcher forwards agent output to. Their caller has already stopped listening.
    """

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        except Exception:
            if not state.closing:
                raise

    return guarded


async def serve(
    sock: socket.socket, state: AgentState, on_ready: Any = None, exit_on_stdin_eof: bool = False
) -> None:
    """Serve the agent on an already-listening socket until SIGTERM/SIGINT or /v1/shutdown.

    With `exit_on_stdin_eof`, end of file on stdin (the launcher's SSH channel closed) stops
    the agent and its children like a shutdown request. So does an expired controller lease
    (`state.lease.expired` is then True), after one line on stderr.
    """
    import uvicorn

    app = _quiet_while_closing(create_app(state), state)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # no proxy in front of an agent: skip X-Forwarded-* parsing per request
        http=capped_head_protocol(),  # an unsigned request's headers are not buffered without bound
        timeout_graceful_shutdown=2,
        # Idle connections are the client's to close (after `client.KEEPALIVE_S`): a controller
        # whose event loop the user's program blocked sends, once it runs again, on connections
        # it took from its pool before the block; closed here meanwhile, that request would fail.
        timeout_keep_alive=600,
        lifespan="on",
    )
    server = uvicorn.Server(config)

    async def watch_shutdown() -> None:
        await state.shutdown_requested.wait()
        await asyncio.sleep(0.05)  # let the shutdown response leave
        server.should_exit = True

    async def watch_lease() -> None:
        await state.lease.wait_expired()
        print(
            f"art-mega: agent {state.address}: its controller was not heard from for "
            f"{state.lease.lease_s:g} s (--controller-lease); stopping every child and exiting",
            file=sys.stderr,
            flush=True,
        )
        await state.close()
        state.shutdown_requested.set()

    async def watch_stdin(closed: asyncio.Event) -> None:
        await closed.wait()
        await state.close()  # the launcher is gone: stop the children before the server
        state.shutdown_requested.set()

    watchers = [asyncio.create_task(watch_shutdown()), asyncio.create_task(watch_lease())]
    if exit_on_stdin_eof:
        stdin_closed = asyncio.Event()
        _watch_stdin_eof(asyncio.get_running_loop(), stdin_closed)
        watchers.append(asyncio.create_task(watch_stdin(stdin_closed)))
    if on_ready is not None:
        on_ready()
    try:
        await server.serve(sockets=[sock])
    finally:
        for task in watchers:
            task.cancel()
        await state.close()


def agent_main(
    address: str,
    launch_id: str,
    secret: bytes,
    exit_on_stdin_eof: bool = False,
    controller_lease_s: float = DEFAULT_CONTROLLER_LEASE_S,
) -> int:
    """Run an agent listening on `address` (tcp://HOST:PORT); prints the ready line on stdout.

    `controller_lease_s`: seconds the agent waits for a word from the controller that holds it
    before it stops its children and exits (see `lease`).

    Returns the process exit code: 0, or 1 when the controller lease expired. Raises
    `UserError` for an address already in use.
    """
    from art_mega.agent.listeners import bind_listener, is_address_in_use, listener_pids
    from art_mega.errors import UserError
    from art_mega.topology import EndpointSpec

    endpoint = EndpointSpec.parse(address)
    try:
        sock = bind_listener(endpoint.host, endpoint.port)
    except OSError as exc:
        if is_address_in_use(exc):
            raise UserError(
                f"worker address {address} is already in use: refusing to reuse a pre-existing listener; "
                "pick a free port"
            ) from None
        raise UserError(f"worker address {address} cannot be bound: {exc.strerror}") from None
    port = sock.getsockname()[1]
    bound = EndpointSpec(host=endpoint.host, port=port)
    state = AgentState(launch_id, secret, bound.address, controller_lease_s)

    def announce() -> None:
        holders = listener_pids(port) if sys.platform.startswith("linux") else {os.getpid()}
        ready = {
            "launch_id": launch_id,
            "pid": os.getpid(),
            "address": bound.address,
            "port": port,
            "holds_listener": os.getpid() in holders,
            "platform": platform.system(),
        }
        sys.stdout.write(READY_PREFIX + json.dumps(ready) + "\n")
        sys.stdout.flush()

    asyncio.run(serve(sock, state, announce, exit_on_stdin_eof))
    return 1 if state.lease.expired else 0
