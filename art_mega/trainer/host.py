"""Agent side of the trainer service: start this host's trainer ranks, relay jobs and events.

Each rank is a supervised child (`python -m art_mega.trainer.rank_main`) that talks to the agent
over an inherited socket in newline-delimited JSON: jobs go down, events come up (ready,
accepted, progress, adapter_ready, done, failed). When a rank process exits, the agent adds an
`exited` event with its code and log path at once, so the controller learns of a death in seconds.

Each `start` begins a new generation: the event log restarts at index 0 and late events of the
previous generation's ranks (an `exited` after `stop`) are dropped, so a controller that starts
the ranks again (a retry from the last checkpoint) never reads the old ranks' deaths as its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_mega.agent.supervisor import Child, Supervisor, spawn_child
from art_mega.trainer.protocol import (
    TrainerEventsResponse,
    TrainerStartRequest,
    TrainerStartResponse,
)

STREAM_LIMIT = 64 * 1024 * 1024


@dataclass
class _Rank:
    rank: int
    child: Child
    writer: asyncio.StreamWriter
    generation: int = 0
    reader_task: asyncio.Task[None] | None = None


@dataclass
class TrainerRanks:
    """This agent's trainer ranks and the ordered log of their events."""

    supervisor: Supervisor
    ranks: dict[int, _Rank] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    generation: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _emit(self, event: dict[str, Any], generation: int | None = None) -> None:
        if generation is not None and generation != self.generation:
            return  # a rank of an earlier start
        event.setdefault("time", time.time())
        self.events.append(event)
        self._changed.set()

    async def start(self, request: TrainerStartRequest) -> TrainerStartResponse:
        """Spawn one process per requested rank; readiness arrives later as `ready` events."""
        if self.ranks:
            raise RuntimeError("trainer ranks already run on this agent; stop them first")
        self.generation += 1
        self.events.clear()
        pids = []
        for launch in request.ranks:
            parent_sock, child_sock = socket.socketpair()
            env = dict(os.environ)
            env.pop("ART_MEGA_SECRET", None)
            env.update(launch.env)
            env["PYTHONUNBUFFERED"] = "1"
            env["ART_MEGA_SYS_PATH"] = os.pathsep.join(request.sys_path)
            Path(launch.log_path).parent.mkdir(parents=True, exist_ok=True)
            log = open(launch.log_path, "ab")
            config = json.dumps({**request.config, "rank": launch.rank})
            argv = [
                request.python or sys.executable,
                "-m",
                "art_mega.trainer.rank_main",
                "--fd",
                str(child_sock.fileno()),
                "--config",
                config,
            ]
            try:
                process = await spawn_child(
                    argv, env=env, stdout=log, stderr=log, pass_fds=(child_sock.fileno(),)
                )
            finally:
                child_sock.close()
                log.close()
            child = Child(
                child_id=f"trainer-rank{launch.rank}",
                role="trainer",
                process=process,
                log_path=launch.log_path,
            )
            self.supervisor.add(child)
            reader, writer = await asyncio.open_connection(sock=parent_sock, limit=STREAM_LIMIT)
            rank = _Rank(launch.rank, child, writer, self.generation)
            rank.reader_task = asyncio.create_task(self._read(rank, reader))
            self.ranks[launch.rank] = rank
            pids.append(process.pid)
        return TrainerStartResponse(pids=tuple(pids))

    async def _read(self, rank: _Rank, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                event["rank"] = rank.rank
                self._emit(event, rank.generation)
        finally:
            code = await rank.child.process.wait()
            exited = {"event": "exited", "rank": rank.rank, "code": code, "log_path": rank.child.log_path}
            self._emit(exited, rank.generation)

    async def send_job(self, job: dict[str, Any]) -> int:
        """Write `job` to every local rank; returns how many ranks it reached."""
        line = json.dumps(job, separators=(",", ":")).encode() + b"\n"
        sent = 0
        for rank in self.ranks.values():
            if rank.child.process.returncode is not None:
                continue
            try:
                rank.writer.write(line)
                await rank.writer.drain()
                sent += 1
            except (ConnectionError, RuntimeError):
                continue
        return sent

    async def wait_events(self, after: int, timeout_s: float) -> TrainerEventsResponse:
        """Events with index >= `after`; waits up to `timeout_s` seconds when there are none yet."""
        deadline = time.monotonic() + timeout_s
        while len(self.events) <= after:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                break
        return TrainerEventsResponse(events=tuple(self.events[after:]), next=len(self.events))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Close every rank's channel (it exits), then SIGTERM/SIGKILL what is left."""
        for rank in self.ranks.values():
            rank.writer.close()
        ids = [r.child.child_id for r in self.ranks.values()]
        if ids:
            await self.supervisor.stop(ids, grace_s)
        for rank in self.ranks.values():
            if rank.reader_task is not None:
                rank.reader_task.cancel()
        self.ranks.clear()
