"""Controller side of the trainer service: start the ranks through their agents, run jobs.

Ranks stay up between steps. A job goes to every rank through its host's agent; the service
collects each rank's events until all are `done`. A `failed` event or a rank's death (`exited`,
reported by its agent at once) fails the job naming the rank, host and log file.

Retry after a failed job: a job can fail after the optimizer step and before the checkpoint is
committed (an exception in the save, a full disk, one rank's export) while every rank stays up;
their in-memory LoRA weights and optimizer state are then one step ahead of the commit, and a
retry of the same step would apply its update twice. So a failed job marks the service `dirty`
(unless every rank refused it before touching its state, e.g. a wrong step number), `run` refuses
jobs while it is dirty, and `recover(resume_dir)` restarts the ranks from the last committed
checkpoint, the same path as a resume (`jobs.build_engine` -> `TrainerEngine.load_state`).

Why restart rather than have each rank reload the commit in place: a reload is only possible on a
rank that is idle and in step with its peers, and a failure on one rank is exactly when they are
not. A rank that raised leaves its peers blocked inside the next collective (a barrier of the
save, an all-reduce of the step) until gloo/NCCL time out after many minutes; a dead rank, or a
CUDA error, leaves nothing to reload into. Stopping the ranks (SIGTERM; a rank blocked in a
collective dies with it) and starting them from the commit recovers every one of these with one
path that the resume tests already cover. The cost, paid only after a failure, is one trainer
start (process start, rendezvous, model build, state load; `recover` returns the seconds).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_mega.agent.client import AgentClient
from art_mega.errors import RankRefusedStepError, TrainerJobError
from art_mega.readahead import READ_AHEAD_ENV, listing_path
from art_mega.topology import CompiledTopology
from art_mega.trainer.protocol import (
    TRAINER_EVENTS,
    TRAINER_JOB,
    TRAINER_START,
    TRAINER_STOP,
    AdapterReady,
    Done,
    EngineConfig,
    Exited,
    Failed,
    RankConfig,
    Ready,
    TrainerEvent,
    TrainerEventsRequest,
    TrainerJobRequest,
    TrainerRankLaunch,
    TrainerStartRequest,
    TrainJob,
)

POLL_S = 2.0
EXIT_GRACE_S = 5.0
"""After a rank's `failed` event, how long (seconds) the service waits for a rank's `exited` event
(the likelier cause) while some ranks have not reported yet."""


REFUSALS = ("NonFiniteStepError", "NonFiniteCheckpointError")
"""The `art_mega.errors` exceptions of a rank that `RankRefusedStepError` reports."""


@dataclass
class JobResult:
    """Each rank's `Done` event of one job (by rank), the job's wall time in seconds, and rank
    0's `AdapterReady` when the job committed a checkpoint."""

    job_id: str
    events: dict[int, Done]
    seconds: float
    adapter_ready: list[AdapterReady] = field(default_factory=list)

    @property
    def rank0(self) -> Done:
        return self.events[0]


class TrainerService:
    """The trainer ranks of a compiled topology, started and driven through the agents."""

    def __init__(
        self, clients: Mapping[str, AgentClient], topology: CompiledTopology, log_dir: str | Path
    ) -> None:
        if not topology.trainer_ranks:
            raise ValueError("the topology has no trainer ranks; compile it with a TrainerSpec")
        if topology.trainer is not None and topology.trainer.master_port is None:
            raise ValueError(
                "the topology's TrainerSpec.master_port is None, a port chosen when the runtime "
                "starts; pass the started runtime's runtime.topology, which holds it"
            )
        self._clients = clients
        self._topology = topology
        self._log_dir = Path(log_dir)
        self._hosts = sorted({r.host_id for r in topology.trainer_ranks}, key=topology.cluster.host_ids.index)
        self._next = {h: 0 for h in self._hosts}
        self._host_of = {r.rank: r.host_id for r in topology.trainer_ranks}
        self._log_of: dict[int, str] = {}
        self._engine: EngineConfig | None = None
        self._start_args: dict[str, Any] = {}
        self.started = False
        self.dirty = False
        """True after a failed job or start: the ranks' state may be ahead of the last commit, and
        `run` refuses jobs until `recover` restarted them. Callers set it when a step's commit fails
        after its job succeeded (the ranks then hold an uncommitted step)."""

    @property
    def world_size(self) -> int:
        return len(self._topology.trainer_ranks)

    def _where(self, rank: int) -> str:
        return f"rank {rank} on host {self._host_of.get(rank)} (log {self._log_of.get(rank)})"

    def rank_config(self, engine: EngineConfig | None) -> RankConfig:
        """The ranks' launch config: the topology's world, rendezvous and layout, and `engine`."""
        topology = self._topology
        rank0 = topology.trainer_ranks[0]
        assert topology.trainer is not None
        return RankConfig(
            world_size=self.world_size,
            master_addr=topology.cluster.host(rank0.host_id).worker_address.host,
            master_port=topology.trainer.master_port,
            trainer=topology.trainer,
            rank_table=tuple(sorted(topology.trainer_ranks, key=lambda r: r.rank)),
            host_local_root=not topology.cluster.shared_artifact_root,
            engine=engine,
        )

    async def start(
        self,
        engine: EngineConfig | None = None,
        python: str | None = None,
        timeout_s: float = 600.0,
        sys_path: tuple[str, ...] = (),
    ) -> float:
        """Start every rank with `engine` (None: ranks that only run `PingJob`s) and wait until
        all report `Ready`; returns the seconds it took.

        Raises:
            TrainerJobError: a rank failed to initialise, died, or was not ready in `timeout_s`;
                or an agent refused to start its ranks.
        """
        started = time.monotonic()
        self._engine = engine
        self._start_args = {"python": python, "timeout_s": timeout_s, "sys_path": sys_path}
        self._next = {h: 0 for h in self._hosts}  # each start restarts the agents' event logs
        config = self.rank_config(engine)
        env_of = {p.rank: p.environ for p in self._topology.processes if p.role == "trainer"}
        for host in self._hosts:
            launches = []
            for r in self._topology.trainer_ranks:
                if r.host_id != host:
                    continue
                log_path = str(self._log_dir / f"trainer-rank{r.rank}.log")
                self._log_of[r.rank] = log_path
                env = dict(env_of.get(r.rank, {}))
                if not self._topology.cluster.host(host).gpu_ids:
                    # one thread per CPU rank between jobs (start-up, idle while the replicas
                    # generate): torch's default, every core, was measured ~10x slower on a
                    # shared 2-core machine where ranks and replicas compete for the cores. A
                    # train job runs with TrainerSpec.cpu_train_threads (rank.main.train_threads).
                    env.setdefault("OMP_NUM_THREADS", "1")
                # the files the rank's last start read, read ahead (art_mega.readahead)
                env.setdefault(
                    READ_AHEAD_ENV,
                    str(listing_path(self._topology.cluster.cache_root, "trainer-rank", python or "")),
                )
                launches.append(TrainerRankLaunch(rank=r.rank, env=env, log_path=log_path))
            request = TrainerStartRequest(
                ranks=tuple(launches), config=config, python=python, sys_path=sys_path
            )
            reply = await self._clients[host].call(TRAINER_START, request)
            if reply.error:
                self.started = True  # the other hosts' ranks may run: `stop` ends them
                self.dirty = True
                raise TrainerJobError(
                    f"the agent of host {host} did not start its trainer ranks: {reply.error}"
                )
        self.started = True
        self.dirty = True  # until every rank is ready
        await self._wait_all(Ready, None, timeout_s)
        self.dirty = False
        return time.monotonic() - started

    async def recover(self, resume_dir: str | Path | None) -> float:
        """After a failed job, restart the ranks from `resume_dir`; returns the seconds it took.

        `resume_dir` is the last committed checkpoint (`checkpoint.step_dir` of the step
        `checkpoint.read_commit` names), or None when nothing is committed (the ranks then start
        as the first `start` did: fresh LoRA or its warm start). Does nothing (returns 0.0) when
        the service is not `dirty`. The ranks afterwards expect the job of the step after
        `resume_dir`'s. See the module docstring for why a restart and not an in-place reload.

        Raises:
            RuntimeError: the service was never started.
            TrainerJobError: a rank failed to start again (the service stays dirty).
        """
        if not self.dirty:
            return 0.0
        if not self._start_args:
            raise RuntimeError("the trainer service was never started, so there is nothing to recover")
        engine = self._engine
        if engine is not None:
            # from the commit: its LoRA and optimizer state replace the first start's warm start
            start = {"resume_dir": None if resume_dir is None else str(resume_dir)}
            if resume_dir is not None:
                start["warm_start"] = None
            engine = EngineConfig.model_validate({**engine.model_dump(), **start})
        await self.stop()
        return await self.start(engine, **self._start_args)

    async def _poll(self, host: str, timeout_s: float = POLL_S) -> list[TrainerEvent]:
        body = TrainerEventsRequest(after=self._next[host], timeout_s=timeout_s)
        reply = await self._clients[host].call(TRAINER_EVENTS, body, timeout_s=timeout_s + 30)
        self._next[host] = reply.next
        return list(reply.events)

    async def _wait_all(
        self, kind: type[Ready] | type[Done], job_id: str | None, timeout_s: float | None
    ) -> tuple[dict[int, Any], list[Any]]:
        done: dict[int, Any] = {}
        others: list[Any] = []
        failed: dict[int, Failed] = {}
        grace_until = 0.0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(done) < self.world_size:
            if failed and (len(done) + len(failed) >= self.world_size or time.monotonic() > grace_until):
                rank, event = next(iter(failed.items()))
                refused = len(failed) == self.world_size and not any(e.dirty for e in failed.values())
                if event.error_type in REFUSALS:
                    raise RankRefusedStepError(
                        f"{event.message} (reported by trainer {self._where(rank)})",
                        event.error_type,
                        rank,
                        self._host_of.get(rank),
                        self._log_of.get(rank),
                        clean=refused,
                    )
                raise TrainerJobError(
                    f"trainer {self._where(rank)} failed: {event.error}",
                    rank,
                    self._host_of.get(rank),
                    self._log_of.get(rank),
                    clean=refused,
                )
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(self._host_of) - set(done))
                raise TrainerJobError(
                    f"trainer ranks {missing} did not report {kind.model_fields['kind'].default} within "
                    f"{timeout_s:g} s; see {self._where(missing[0])}",
                    missing[0],
                    self._host_of.get(missing[0]),
                    self._log_of.get(missing[0]),
                )
            wait_s = max(0.0, min(POLL_S, grace_until - time.monotonic())) if failed else POLL_S
            batches = await asyncio.gather(*(self._poll(h, wait_s) for h in self._hosts))
            for record in (e for batch in batches for e in batch):
                rank, event = record.rank, record.event
                if isinstance(event, Exited):
                    raise TrainerJobError(
                        f"trainer {self._where(rank)} exited with code {event.code}",
                        rank,
                        self._host_of.get(rank),
                        event.log_path or None,
                    )
                if isinstance(event, Failed) and (job_id is None or event.job in (job_id, None)):
                    # A peer's death often reaches the survivors (a gloo "connection reset") before
                    # the agent reports the exit: wait briefly for an `exited` so the error names the
                    # rank that died, not the one that noticed.
                    if not failed:
                        grace_until = time.monotonic() + EXIT_GRACE_S
                    failed.setdefault(rank, event)
                    continue
                of_job = getattr(event, "job", None)  # Starting and Ready belong to no job
                if isinstance(event, kind) and (job_id is None or of_job == job_id):
                    done[rank] = event
                elif job_id is not None and of_job == job_id:
                    others.append(event)
        return done, others

    async def run(self, job: TrainJob, timeout_s: float | None = None) -> JobResult:
        """Send `job` to every rank and wait for every `Done` (or the first failure).

        A failure leaves the service `dirty` unless every rank refused the job untouched.

        Raises:
            RankRefusedStepError: the ranks refused the step over a non-finite number (a
                `TrainerJobError` and a `UserError`; dirty only when it came after the update).
            TrainerJobError: a rank failed or died (named, with its log), or `timeout_s` passed;
                or the service is `dirty` from an earlier failure (call `recover` first).
        """
        if not self.started:
            raise RuntimeError("the trainer service is not started")
        if self.dirty:
            raise TrainerJobError(
                "an earlier trainer job failed, so the ranks may hold an uncommitted step; "
                "call TrainerService.recover(<last committed checkpoint>) before the next job"
            )
        try:
            return await self._run(job, timeout_s)
        except TrainerJobError as exc:
            self.dirty = not exc.clean
            raise
        except BaseException:
            self.dirty = True
            raise

    async def _run(self, job: TrainJob, timeout_s: float | None) -> JobResult:
        request = TrainerJobRequest(id=secrets.token_hex(6), job=job)
        started = time.monotonic()
        replies = await asyncio.gather(*(self._clients[h].call(TRAINER_JOB, request) for h in self._hosts))
        sent = sum(r.sent for r in replies)
        if sent != self.world_size:
            raise TrainerJobError(
                f"the job reached {sent} of {self.world_size} trainer ranks; a rank is gone"
            )
        done, others = await self._wait_all(Done, request.id, timeout_s)
        adapters = [e for e in others if isinstance(e, AdapterReady)]
        return JobResult(request.id, done, time.monotonic() - started, adapters)

    async def stop(self) -> None:
        """Stop every rank on every host (idempotent; a lost host is skipped)."""
        if not self.started:
            return
        self.started = False
        await asyncio.gather(
            *(self._clients[h].call(TRAINER_STOP) for h in self._hosts), return_exceptions=True
        )
