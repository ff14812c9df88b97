"""Agent side of the trainer service: start this host's trainer ranks, relay jobs and events.

Each rank is a supervised child (`python -m art_mega.trainer.rank.main`) that talks to the agent
over an inherited socket in newline-delimited JSON (`trainer.protocol`): its `RankConfig` and then
each `TrainerJobRequest` go down, `RankEvent`s come up (starting, ready, accepted, adapter_ready,
done, failed). When a rank process exits, the agent adds an `Exited` event with its code and log
path at once, so the controller learns of a death in seconds. A line from a rank that is not a
`RankEvent` is logged as that rank's `Failed` event naming the invalid field, never dropped.

Each `start` begins a new generation: the event log restarts at index 0 and late events of the
previous generation's ranks (an `exited` after `stop`) are dropped, so a controller that starts
the ranks again (a retry from the last checkpoint) never reads the old ranks' deaths as its own.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from art_mega.agent.protocol import ShutdownResponse
from art_mega.agent.routes import SignedRouter
from art_mega.agent.supervisor import Child, Supervisor, spawn_child
from art_mega.trainer.protocol import (
    BODY_LIMIT,
    RANK_EVENT,
    TRAINER_EVENTS,
    TRAINER_JOB,
    TRAINER_START,
    TRAINER_STOP,
    Exited,
    Failed,
    RankEvent,
    TrainerEvent,
    TrainerEventsRequest,
    TrainerEventsResponse,
    TrainerJobRequest,
    TrainerJobResponse,
    TrainerStartRequest,
    TrainerStartResponse,
    describe_invalid,
)


@dataclass
class _Rank:
    rank: int
    child: Child
    writer: asyncio.StreamWriter
    generation: int = 0
    reader_task: asyncio.Task[None] | None = None


def _rank_event(rank: int, line: bytes) -> RankEvent:
    """Rank `rank`'s event `line`, or the `Failed` event that names why it is none (an `Exited`
    is only ever the agent's to report: a rank that sent one would fake its own death)."""
    try:
        event: RankEvent = RANK_EVENT.validate_json(line)
    except ValidationError as exc:
        message = describe_invalid(f"trainer rank {rank}'s event", exc)
    else:
        if not isinstance(event, Exited):
            return event
        message = f"trainer rank {rank}'s event: kind 'exited' is reported by its agent, never by the rank."
    return Failed(error=f"InvalidEvent: {message}", error_type="InvalidEvent", message=message)


@dataclass
class TrainerRanks:
    """This agent's trainer ranks and the ordered log of their events."""

    supervisor: Supervisor
    ranks: dict[int, _Rank] = field(default_factory=dict)
    events: list[TrainerEvent] = field(default_factory=list)
    generation: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _emit(self, rank: int, event: RankEvent, generation: int) -> None:
        if generation != self.generation:
            return  # a rank of an earlier start
        self.events.append(TrainerEvent(rank=rank, time=time.time(), event=event))
        self._changed.set()

    async def start(self, request: TrainerStartRequest) -> TrainerStartResponse:
        """Spawn one process per requested rank; readiness arrives later as `ready` events."""
        if self.ranks:
            raise RuntimeError("trainer ranks already run on this agent; stop them first")
        self.generation += 1
        self.events.clear()
        config_line = request.config.model_dump_json().encode() + b"\n"
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
            argv = [
                request.python or sys.executable,
                "-m",
                "art_mega.trainer.rank.main",
                "--fd",
                str(child_sock.fileno()),
                "--rank",
                str(launch.rank),
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
            reader, writer = await asyncio.open_connection(sock=parent_sock, limit=BODY_LIMIT)
            # the config goes over the socket, not argv: a large world's rank table would pass
            # the kernel's limit on one argument (128 KiB)
            writer.write(config_line)
            await writer.drain()
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
                self._emit(rank.rank, _rank_event(rank.rank, line), rank.generation)
        finally:
            code = await rank.child.process.wait()
            self._emit(rank.rank, Exited(code=code, log_path=rank.child.log_path or ""), rank.generation)

    async def send_job(self, request: TrainerJobRequest) -> int:
        """Write `request` to every local rank; returns how many ranks it reached."""
        line = request.model_dump_json().encode() + b"\n"
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


def register(router: SignedRouter, supervisor: Supervisor) -> None:
    """Add the /trainer/* routes to the agent's `router`; the ranks join `supervisor`'s children,
    and the agent's close first closes their channels (`TrainerRanks.stop`)."""
    ranks = TrainerRanks(supervisor)
    supervisor.on_close(ranks.stop)

    @router.serve(TRAINER_START)
    async def trainer_start(body: TrainerStartRequest) -> TrainerStartResponse:
        try:
            return await ranks.start(body)
        except (OSError, RuntimeError) as exc:
            return TrainerStartResponse(error=str(exc))

    @router.serve(TRAINER_JOB)
    async def trainer_job(body: TrainerJobRequest) -> TrainerJobResponse:
        return TrainerJobResponse(sent=await ranks.send_job(body))

    @router.serve(TRAINER_EVENTS)
    async def trainer_events(body: TrainerEventsRequest) -> TrainerEventsResponse:
        return await ranks.wait_events(body.after, body.timeout_s)

    @router.serve(TRAINER_STOP)
    async def trainer_stop() -> ShutdownResponse:
        await ranks.stop()
        return ShutdownResponse()
