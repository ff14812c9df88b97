"""One trainer rank's process: join the torch.distributed world, build the engine, run jobs.

Started by its host's agent (`trainer.host`) with RANK/WORLD_SIZE/MASTER_* in the
environment and the launch config as JSON. Jobs arrive as JSON lines on `--fd`; events go back
the same way: ready, accepted, adapter_ready, done, failed. End of file on `--fd` ends the rank.
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
import json
import os
import socket
import sys
import time
import traceback
from typing import Any

TRAIN_KINDS = ("rl", "sft", "export")


class Channel:
    """Newline-delimited JSON over the inherited socket (blocking; one job at a time)."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=fd)
        self._reader = self._sock.makefile("rb")

    def send(self, event: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(event, separators=(",", ":")).encode() + b"\n")

    def jobs(self):  # type: ignore[no-untyped-def]
        for line in self._reader:
            if line.strip():
                yield json.loads(line)


def _init(config: dict[str, Any]) -> Any:
    from art_mega.preflight.netif import gloo_interface_for
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.parallel import init_parallel

    rank = int(config["rank"])
    world = int(config["world_size"])
    if world > 1:
        gloo_interface_for(config["master_addr"])
    entry = TrainerRank.model_validate(config["rank_table"][rank])
    return init_parallel(
        entry,
        TrainerSpec.model_validate(config["trainer"]),
        world,
        master_addr=config["master_addr"],
        master_port=int(config["master_port"]),
    )


def _ping(state: Any, job: dict[str, Any]) -> dict[str, float]:
    """A diagnostic job: all-reduce rank+1 over the world (checks the ranks and their links)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(state.rank + 1)])
    dist.all_reduce(value)
    return {"sum": float(value.item()), "world_size": float(state.world_size)}


def _run(
    job: dict[str, Any], state: Any, engine: Any, config: dict[str, Any], last_step: int | None
) -> dict[str, Any]:
    kind = job.get("kind")
    if kind == "ping":
        return {"metrics": _ping(state, job)}
    if kind in TRAIN_KINDS:
        from art_mega.trainer.jobs import run_train_job

        return run_train_job(job, state, engine, config, last_step)
    raise ValueError(f"unknown job kind {kind!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="art-mega trainer rank")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    extra = [p for p in os.environ.get("ART_MEGA_SYS_PATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    config = json.loads(args.config)
    channel = Channel(args.fd)
    rank = int(config["rank"])
    channel.send({"event": "starting", "pid": os.getpid()})
    started = time.perf_counter()
    last_step: int | None = None  # the last checkpoint's step: the next job must name the one after
    try:
        state = _init(config)
        engine = None
        if config.get("model_dir"):
            from art_mega.trainer.jobs import build_engine, resumed_step

            engine = build_engine(config, state)
            last_step = resumed_step(config)
    except Exception as exc:
        channel.send(
            {
                "event": "failed",
                "stage": "init",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        )
        return 1
    channel.send({"event": "ready", "seconds": time.perf_counter() - started})
    dirty = False  # this rank's state may be ahead of its last checkpoint (see the module docstring)
    for job in channel.jobs():
        job_id = job.get("id")
        channel.send({"event": "accepted", "job": job_id})
        try:
            if dirty and job.get("kind") in TRAIN_KINDS:
                raise RuntimeError(
                    f"trainer rank {rank} holds the uncommitted state of an earlier failed job; "
                    f"restart the trainer from the last committed checkpoint (step {last_step})"
                )
            result = _run(job, state, engine, config, last_step)
        except Exception as exc:
            from art_mega.errors import NonFiniteStepError
            from art_mega.trainer.jobs import StepOrderError

            # both are raised before the rank's weights or optimizer state change
            untouched = isinstance(exc, (StepOrderError, NonFiniteStepError))
            dirty = dirty or (job.get("kind") in TRAIN_KINDS and not untouched)
            channel.send(
                {
                    "event": "failed",
                    "job": job_id,
                    "error": f"{type(exc).__name__}: {exc}",
                    "error_type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": traceback.format_exc(),
                    "dirty": dirty,
                }
            )
            continue
        if job.get("kind") in TRAIN_KINDS:
            last_step = int(job["step"])
        for event in result.pop("events", []):
            channel.send({**event, "job": job_id})
        channel.send({"event": "done", "job": job_id, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
