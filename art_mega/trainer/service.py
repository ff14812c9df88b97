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
from art_mega.topology import CompiledTopology
from art_mega.trainer.protocol import TrainerRankLaunch, TrainerStartRequest

POLL_S = 2.0
EXIT_GRACE_S = 5.0
"""After a rank's `failed` event, how long (seconds) the service waits for a rank's `exited` event
(the likelier cause) while some ranks have not reported yet."""


REFUSALS = ("NonFiniteStepError", "NonFiniteCheckpointError")
"""The `art_mega.errors` exceptions of a rank that `RankRefusedStepError` reports."""


@dataclass
class JobResult:
    """Each rank's `done` event of one job, and the job's wall time in seconds."""

    job_id: str
    events: dict[int, dict[str, Any]]
    seconds: float
    adapter_ready: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rank0(self) -> dict[str, Any]:
        return self.events[0]


class TrainerService:
    """The trainer ranks of a compiled topology, started and driven through the agents."""

    def __init__(
        self, clients: Mapping[str, AgentClient], topology: CompiledTopology, log_dir: str | Path
    ) -> None:
        if not topology.trainer_ranks:
            raise ValueError("the topology has no trainer ranks; compile it with a TrainerSpec")
        self._clients = clients
        self._topology = topology
        self._log_dir = Path(log_dir)
        self._hosts = sorted({r.host_id for r in topology.trainer_ranks}, key=topology.cluster.host_ids.index)
        self._next = {h: 0 for h in self._hosts}
        self._host_of = {r.rank: r.host_id for r in topology.trainer_ranks}
        self._log_of: dict[int, str] = {}
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

    def base_config(self) -> dict[str, Any]:
        topology = self._topology
        rank0 = topology.trainer_ranks[0]
        master = topology.cluster.host(rank0.host_id).worker_address.host
        assert topology.trainer is not None
        return {
            "world_size": self.world_size,
            "master_addr": master,
            "master_port": topology.trainer.master_port,
            "trainer": topology.trainer.model_dump(mode="json"),
            "rank_table": [r.model_dump(mode="json") for r in topology.trainer_ranks],
        }

    async def start(
        self,
        config: Mapping[str, Any],
        python: str | None = None,
        timeout_s: float = 600.0,
        sys_path: tuple[str, ...] = (),
    ) -> float:
        """Start every rank and wait until all report `ready`; returns the seconds it took.

        Raises:
            TrainerJobError: a rank failed to initialise, died, or was not ready in `timeout_s`.
        """
        started = time.monotonic()
        self._start_args = {
            "config": dict(config),
            "python": python,
            "timeout_s": timeout_s,
            "sys_path": sys_path,
        }
        self._next = {h: 0 for h in self._hosts}  # each start restarts the agents' event logs
        merged = {**self.base_config(), **config}
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
                    # one thread per CPU rank: measured ~10x faster than torch's default on a
                    # shared 2-core machine, where ranks and replicas compete for the cores
                    env.setdefault("OMP_NUM_THREADS", "1")
                launches.append(TrainerRankLaunch(rank=r.rank, env=env, log_path=log_path))
            request = TrainerStartRequest(
                ranks=tuple(launches), config=merged, python=python, sys_path=sys_path
            )
            await self._clients[host].trainer_start(request)
        self.started = True
        self.dirty = True  # until every rank is ready
        await self._wait_all("ready", None, timeout_s)
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
        args = dict(self._start_args)
        config = {k: v for k, v in args.pop("config").items() if k != "resume_dir"}
        if resume_dir is not None:
            config.pop("warm_start", None)
            config["resume_dir"] = str(resume_dir)
        await self.stop()
        return await self.start(config, **args)

    async def _poll(self, host: str, timeout_s: float = POLL_S) -> list[dict[str, Any]]:
        reply = await self._clients[host].trainer_events(self._next[host], timeout_s)
        self._next[host] = reply.next
        return list(reply.events)

    async def _wait_all(
        self, kind: str, job_id: str | None, timeout_s: float | None
    ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
        done: dict[int, dict[str, Any]] = {}
        others: list[dict[str, Any]] = []
        failed: dict[int, dict[str, Any]] = {}
        grace_until = 0.0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(done) < self.world_size:
            if failed and (len(done) + len(failed) >= self.world_size or time.monotonic() > grace_until):
                rank, event = next(iter(failed.items()))
                refused = len(failed) == self.world_size and not any(
                    e.get("dirty", True) for e in failed.values()
                )
                if event.get("error_type") in REFUSALS:
                    raise RankRefusedStepError(
                        f"{event.get('message')} (reported by trainer {self._where(rank)})",
                        event["error_type"],
                        rank,
                        self._host_of.get(rank),
                        self._log_of.get(rank),
                        clean=refused,
                    )
                raise TrainerJobError(
                    f"trainer {self._where(rank)} failed: {event.get('error')}",
                    rank,
                    self._host_of.get(rank),
                    self._log_of.get(rank),
                    clean=refused,
                )
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(self._host_of) - set(done))
                raise TrainerJobError(
                    f"trainer ranks {missing} did not report {kind} within {timeout_s:g} s; see {self._where(missing[0])}",
                    missing[0],
                    self._host_of.get(missing[0]),
                    self._log_of.get(missing[0]),
                )
            wait_s = max(0.0, min(POLL_S, grace_until - time.monotonic())) if failed else POLL_S
            batches = await asyncio.gather(*(self._poll(h, wait_s) for h in self._hosts))
            for event in (e for batch in batches for e in batch):
                rank = int(event.get("rank", -1))
                name = event.get("event")
                if name == "exited":
                    raise TrainerJobError(
                        f"trainer {self._where(rank)} exited with code {event.get('code')}",
                        rank,
                        self._host_of.get(rank),
                        event.get("log_path"),
                    )
                if name == "failed" and (job_id is None or event.get("job") in (job_id, None)):
                    # A peer's death often reaches the survivors (a gloo "connection reset") before
                    # the agent reports the exit: wait briefly for an `exited` so the error names the
                    # rank that died, not the one that noticed.
                    if not failed:
                        grace_until = time.monotonic() + EXIT_GRACE_S
                    failed.setdefault(rank, event)
                    continue
                if name == kind and (job_id is None or event.get("job") == job_id):
                    done[rank] = event
                elif job_id is not None and event.get("job") == job_id:
                    others.append(event)
        return done, others

    async def run(self, job: Mapping[str, Any], timeout_s: float | None = None) -> JobResult:
        """Send `job` to every rank and wait for every `done` (or the first failure).

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

    async def _run(self, job: Mapping[str, Any], timeout_s: float | None) -> JobResult:
        job_id = secrets.token_hex(6)
        started = time.monotonic()
        payload = {**job, "id": job_id}
        sent = await asyncio.gather(*(self._clients[h].trainer_job(payload) for h in self._hosts))
        if sum(sent) != self.world_size:
            raise TrainerJobError(
                f"the job reached {sum(sent)} of {self.world_size} trainer ranks; a rank is gone"
            )
        done, others = await self._wait_all("done", job_id, timeout_s)
        adapters = [e for e in others if e.get("event") == "adapter_ready"]
        return JobResult(job_id, done, time.monotonic() - started, adapters)

    async def stop(self) -> None:
        """Stop every rank on every host (idempotent; a lost host is skipped)."""
        if not self.started:
            return
        self.started = False
        await asyncio.gather(*(self._clients[h].trainer_stop() for h in self._hosts), return_exceptions=True)
