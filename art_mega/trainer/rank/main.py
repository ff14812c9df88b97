"""One trainer rank's process: join the torch.distributed world, build the engine, run jobs.

Started by its host's agent (`trainer.routes`) with its global rank as `--rank` and a socket as
`--fd`, on which it reads newline-delimited JSON (`trainer.protocol`): first its `RankConfig`, then
one `TrainerJobRequest` a line; it answers with `RankEvent` lines: starting, ready, accepted,
adapter_ready, done, failed. End of file on `--fd` ends the rank. A train job runs with the intra-op threads of
`train_threads` (the cores the idle replicas leave), every other moment with the one the rank
started with. A config that is not a `RankConfig` fails the start, and a line that is not a `TrainerJobRequest` fails as a job (its
`Failed` event names the invalid field); neither reaches the engine.
The rank remembers the step of its last checkpoint (the one it resumed from, then each one it
wrote) and fails a training job that names any step but the next (`jobs.check_job_step`).

A training job that fails after that check may have left this rank's LoRA weights and optimizer
state ahead of the last commit (the step ran, its save did not). The rank then marks itself dirty:
every later `failed` event carries `dirty: true` and it refuses training jobs, so a retry can never
apply an update twice; the controller restarts it from the last commit
(`TrainerService.recover`, which explains why a restart and not an in-place reload). A job refused
by the step check, a step aborted for a non-finite loss or gradient norm (before the optimizer
update), or a ping, leaves it clean (`dirty: false`). A `failed` event names the exception's type
(`error_type`) and its message apart, so the controller can tell the user's refusals from faults.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import ValidationError

from art_mega.readahead import READ_AHEAD_ENV, read_ahead, read_ahead_model, record
from art_mega.trainer.protocol import (
    Accepted,
    AdapterReady,
    Done,
    Failed,
    PingJob,
    RankConfig,
    RankEvent,
    Ready,
    Starting,
    StepJob,
    TrainerJobRequest,
    TrainJob,
    describe_invalid,
)


class InvalidMessageError(ValueError):
    """A line on the rank's socket is not the message it must be (named with the field)."""


class Channel:
    """Newline-delimited JSON over the inherited socket (blocking; one job at a time)."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=fd)
        self._reader = self._sock.makefile("rb")

    def send(self, event: RankEvent) -> None:
        self._sock.sendall(event.model_dump_json().encode() + b"\n")

    def config(self) -> RankConfig:
        """The first line: this rank's launch config.

        Raises:
            InvalidMessageError: the line is not a `RankConfig` (or the socket closed first).
        """
        line = self._reader.readline()
        try:
            return RankConfig.model_validate_json(line)
        except ValidationError as exc:
            raise InvalidMessageError(describe_invalid("trainer rank config", exc, RankConfig)) from None

    def jobs(self) -> Iterator[TrainerJobRequest | InvalidMessageError]:
        """Each later line as a job request, or the error saying why it is not one."""
        for line in self._reader:
            if line.strip():
                yield parse_job(line)


def parse_job(line: bytes) -> TrainerJobRequest | InvalidMessageError:
    """`line` as a job request, or an `InvalidMessageError` naming its first invalid field."""
    try:
        return TrainerJobRequest.model_validate_json(line)
    except ValidationError as exc:
        return InvalidMessageError(describe_invalid("trainer job", exc, TrainerJobRequest))


def _init(config: RankConfig, rank: int) -> Any:
    from art_mega.preflight.netif import gloo_interface_for
    from art_mega.trainer.rank.parallel import init_parallel

    if config.world_size > 1:
        gloo_interface_for(config.master_addr)
    return init_parallel(
        config.rank_table[rank],
        config.trainer,
        config.world_size,
        master_addr=config.master_addr,
        master_port=config.master_port,
    )


def train_threads(
    config: RankConfig, rank: int, cores: int | None = None, running: int | None = None
) -> int | None:
    """The intra-op threads this rank's next train job runs with (`TrainerSpec.cpu_train_threads`).

    The set value; or, for a CPU rank without one, its share of `cores` (default: the rank's
    CPU affinity) among the CPU ranks of its host, but no more than the cores not busy at the
    job's start (`cores` minus `running`, the cores other tasks keep busy: default
    `_busy_cores`, measured over 0.1 s), at least 1; None for a GPU rank without one (torch's default stays). In the synchronous
    loop the replicas are idle while the trainer trains, so their cores are the trainer's for
    the job; on a machine others keep busy, more threads than free cores make every OpenMP
    barrier wait for a descheduled thread (measured 1.3-5x slower at 2 threads on 2 loaded
    cores), hence the cap. The busy cores are measured, not read from /proc/loadavg's
    instantaneous runnable count: at the job's start that count also holds the agent and
    controller threads handing the job over, which wait a moment later, and it kept the rank at
    one thread on an otherwise idle 2-core host. The rank gives the threads back after the job
    (`_threads`).

    Raises:
        UserError: the set value is more than the rank's cores.
    """
    me = config.rank_table[rank]
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    wanted = config.trainer.cpu_train_threads
    if wanted is not None:
        if wanted > cores:
            from art_mega.errors import UserError

            raise UserError(
                f"TrainerSpec.cpu_train_threads={wanted} is more than the {cores} cores trainer rank "
                f"{rank} may run on (host {me.host_id}); set at most {cores}, or None for the share "
                "of its host's cores."
            )
        return wanted
    if me.gpu_id is not None:
        return None
    sharing = sum(1 for r in config.rank_table if r.host_id == me.host_id and r.gpu_id is None)
    running = _busy_cores() if running is None else running
    return max(1, min(cores // sharing, cores - running))


def _busy_cores(window_s: float = 0.1) -> int:
    """Cores of this process's CPU affinity that other tasks keep busy: their non-idle time in
    /proc/stat over `window_s` seconds (the caller sleeps meanwhile, so its own time is not in
    it), rounded to whole cores; 0 where /proc/stat cannot be read."""
    cpus = {f"cpu{index}" for index in os.sched_getaffinity(0)}

    def sample() -> dict[str, tuple[int, int]]:
        times = {}
        with open("/proc/stat") as stat:
            for line in stat:
                name, *fields = line.split()
                if name in cpus:
                    values = [int(value) for value in fields[:8]]  # user .. steal, in clock ticks
                    times[name] = (sum(values), values[3] + values[4])  # total, idle + iowait
        return times

    try:
        before = sample()
        time.sleep(window_s)
        after = sample()
    except (OSError, IndexError, ValueError):
        return 0
    total = sum(after[name][0] - before[name][0] for name in after if name in before)
    idle = sum(after[name][1] - before[name][1] for name in after if name in before)
    if total <= 0:
        return 0
    return round(len(after) * (total - idle) / total)


def _ping(state: Any) -> dict[str, float]:
    """A diagnostic job: all-reduce rank+1 over the world (checks the ranks and their links)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(state.rank + 1)])
    dist.all_reduce(value)
    return {"sum": float(value.item()), "world_size": float(state.world_size)}


def _run(
    request: TrainerJobRequest, state: Any, engine: Any, config: RankConfig, last_step: int | None
) -> tuple[dict[str, float], list[RankEvent]]:
    """Run one job; returns its metrics and the events to send before its `Done`."""
    job: TrainJob = request.job
    if isinstance(job, PingJob):
        return _ping(state), []
    from art_mega.trainer.rank.jobs import run_train_job

    metrics, adapter = run_train_job(job, state, engine, config, last_step)
    if adapter is None:
        return metrics, []
    ready = AdapterReady(job=request.id, path=adapter.path, step=adapter.step, sha256=adapter.sha256)
    return metrics, [ready]


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `count` (None: unchanged) for the block, then restored:
    between jobs the rank holds what it started with (one on a CPU host, the service's
    OMP_NUM_THREADS), so the cores go back to the replicas for the rollouts."""
    if count is None:
        yield
        return
    import torch

    idle = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(idle)


def _failed(exc: Exception, job: str | None, dirty: bool, stage: Literal["init", "job"] = "job") -> Failed:
    """The `Failed` event of `exc`; call it where `exc` is being handled (its traceback is sent)."""
    return Failed(
        stage=stage,
        job=job,
        error=f"{type(exc).__name__}: {exc}",
        error_type=type(exc).__name__,
        message=str(exc),
        traceback=traceback.format_exc() if exc.__traceback__ is not None else "",
        dirty=dirty,
    )


NOT_IMPORTED = ("wandb",)
"""Modules a rank never uses that megatron-core imports whenever they are installed (`try: import
wandb` in megatron/core/timers.py and its inference context and engine, for logging the rank
does not do: the controller logs). `main` makes them fail to import (`block_unused_imports`):
importing wandb was 5.8 s of `import megatron.core`'s 9.1 s on this 2-core machine (`python -X
importtime`), and a rank's start to ready fell from 16.9 s to 7.0 s beside a starting replica
(controller-side timing of one start each, not a benchmarks/ row)."""


def block_unused_imports() -> None:
    """Make `import` of each NOT_IMPORTED module raise ImportError in this process (a None entry
    in sys.modules), as when it is not installed; a module already imported is left alone."""
    for name in NOT_IMPORTED:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    block_unused_imports()  # before anything imports megatron-core
    parser = argparse.ArgumentParser(prog="art-mega trainer rank")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    extra = [p for p in os.environ.get("ART_MEGA_SYS_PATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    listing = os.environ.get(READ_AHEAD_ENV)
    read_ahead(listing)  # the files this start will read (art_mega.readahead)
    channel = Channel(args.fd)
    rank = args.rank
    channel.send(Starting(pid=os.getpid()))
    started = time.perf_counter()
    last_step: int | None = None  # the last checkpoint's step: the next job must name the one after
    try:
        config = channel.config()
        read_ahead_model(config.engine.model_dir if config.engine is not None else None)
        train_threads(config, rank)  # a set value above the rank's cores fails the start
        state = _init(config, rank)
        engine = None
        if config.engine is not None:
            from art_mega.trainer.rank.jobs import build_engine, resumed_step

            engine = build_engine(config.engine, state)
            last_step = resumed_step(config.engine)
    except Exception as exc:
        channel.send(_failed(exc, None, dirty=True, stage="init"))
        return 1
    channel.send(Ready(seconds=time.perf_counter() - started))
    record(listing)  # what this start read, for the next one
    dirty = False  # this rank's state may be ahead of its last checkpoint (see the module docstring)
    for request in channel.jobs():
        if isinstance(request, InvalidMessageError):
            channel.send(_failed(request, None, dirty))  # nothing ran: the rank is as it was
            continue
        channel.send(Accepted(job=request.id))
        trains = isinstance(request.job, StepJob)
        try:
            if dirty and trains:
                raise RuntimeError(
                    f"trainer rank {rank} holds the uncommitted state of an earlier failed job; "
                    f"restart the trainer from the last committed checkpoint (step {last_step})"
                )
            with _threads(train_threads(config, rank) if trains else None):
                metrics, events = _run(request, state, engine, config, last_step)
        except Exception as exc:
            from art_mega.errors import NonFiniteStepError
            from art_mega.trainer.rank.jobs import StepOrderError

            # both are raised before the rank's weights or optimizer state change
            untouched = isinstance(exc, (StepOrderError, NonFiniteStepError))
            dirty = dirty or (trains and not untouched)
            channel.send(_failed(exc, request.id, dirty))
            continue
        if isinstance(request.job, StepJob):
            last_step = request.job.step
        for event in events:
            channel.send(event)
        channel.send(Done(job=request.id, metrics=metrics))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
