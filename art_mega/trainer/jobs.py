"""What a trainer rank does for a job: build the engine once, then train, export and checkpoint.

Checkpoint layout (`<checkpoint_dir>` = `<run>/checkpoints/<step:04d>`): `adapter/` (an HF PEFT
adapter), `rank<r>.pt` per rank (LoRA shards, optimizer state), `manifest.json` (step, adapter
sha256, base model, parallel layout). Everything is written into a hidden staging folder beside
it, fsynced, and renamed into place by rank 0 after every rank finished: a crash never leaves a
half checkpoint under the final name. The controller moves the commit pointer afterwards.

Versions are contiguous: a rank refuses an `rl`, `sft` or `export` job whose step is not the one
after the last checkpoint it resumed from or wrote (`check_job_step`), before any collective.
A job that fails after that check (in the step or the save) leaves the rank's weights and
optimizer state ahead of the commit; the rank then refuses training jobs until the controller
restarts it from the commit (`rank_main`, `service.TrainerService.recover`).

Test hook: when `$ART_MEGA_TEST_SAVE_PAUSE` names a file that exists, every rank waits inside
`write_checkpoint` while it exists, after its adapter and optimizer state are in the staging
folder and before the folder is renamed. Crash tests use it to kill a rank at that exact point
of a save rather than racing a save that takes milliseconds; unset (always, outside tests) it
costs one environment lookup.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

STAGING_PREFIX = ".staging-"
SAVE_PAUSE_ENV = "ART_MEGA_TEST_SAVE_PAUSE"
SAVE_PAUSE_POLL_S = 0.05


class StepOrderError(ValueError):
    """A job named a step other than the one after the last committed step."""


def resumed_step(config: dict[str, Any]) -> int | None:
    """The step of the checkpoint the rank resumed from (its manifest), None when it did not resume."""
    if not config.get("resume_dir"):
        return None
    return int(json.loads((Path(config["resume_dir"]) / "manifest.json").read_text())["step"])


def check_job_step(job: dict[str, Any], last_step: int | None) -> int:
    """The job's step when it is `last_step + 1` (0 when nothing is committed); returns it.

    Raises:
        StepOrderError: the job names another step (or none); the message names the expected one.
    """
    expected = 0 if last_step is None else last_step + 1
    step = job.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step != expected:
        since = "nothing is committed yet" if last_step is None else f"the last committed step is {last_step}"
        raise StepOrderError(
            f"job step {step!r} refused: {since}, so the next {job.get('kind')} job must name step {expected}"
        )
    return step


def build_engine(config: dict[str, Any], state: Any) -> Any:
    """The rank's TrainerEngine from the launch config, resumed or warm-started when asked.

    config keys: model_dir, lora {rank, alpha, targets}, optimizer {lr, weight_decay, clip_grad},
    micro_batch_rows, resume_dir (a committed checkpoint) or warm_start (a PEFT adapter dir).
    """
    from art_mega.trainer.engine import OptimizerSettings, TrainerEngine
    from art_mega.trainer.lora import LoraConfig

    lora = config.get("lora", {})
    lora_config = LoraConfig(
        rank=int(lora.get("rank", 8)),
        alpha=float(lora.get("alpha", 16.0)),
        **({"targets": tuple(lora["targets"])} if lora.get("targets") else {}),
    )
    optimizer = OptimizerSettings(**config.get("optimizer", {}))
    engine = TrainerEngine(
        config["model_dir"],
        state,
        lora=lora_config,
        optimizer=optimizer,
        micro_batch_rows=int(config.get("micro_batch_rows", 1)),
    )
    if config.get("resume_dir"):
        engine.load_state(config["resume_dir"])
    elif config.get("warm_start"):
        engine.load_adapter(config["warm_start"])
    return engine


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _pause_for_tests() -> None:
    """Wait while the file named by $ART_MEGA_TEST_SAVE_PAUSE exists (see the module docstring)."""
    pause = os.environ.get(SAVE_PAUSE_ENV)
    while pause and os.path.exists(pause):
        time.sleep(SAVE_PAUSE_POLL_S)


def write_checkpoint(
    engine: Any, state: Any, step: int, checkpoint_dir: str, timings: dict[str, float] | None = None
) -> dict[str, Any] | None:
    """Collective: export the adapter and every rank's state, then commit the folder (rank 0).

    Returns the adapter_ready event on rank 0 (path, step, sha256), None on other ranks. With
    `timings`, adds this rank's `time/adapter_export_s` and `time/state_save_s` (seconds).
    """
    import torch.distributed as dist

    final = Path(checkpoint_dir)
    staging = final.parent / f"{STAGING_PREFIX}{final.name}"
    if state.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    exported = time.perf_counter()
    files = engine.export_adapter(staging / "adapter")
    saved = time.perf_counter()
    engine.save_state(staging)
    if timings is not None:
        timings["time/adapter_export_s"] = saved - exported
        timings["time/state_save_s"] = time.perf_counter() - saved
    _pause_for_tests()
    dist.barrier()
    if state.rank != 0:
        dist.barrier()
        return None
    manifest = {
        "step": step,
        "adapter_sha256": files.sha256,
        "base_model": engine.model_dir,
        "layout": {"world_size": state.world_size, "tp": state.tp, "dp": state.dp},
        "written_at": time.time(),
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
    _fsync_tree(staging)
    if final.exists():
        # an uncommitted folder of an earlier attempt: moved aside first, so a crash while
        # deleting it never leaves part of it under the final name
        trash = final.parent / f".trash-{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
        shutil.rmtree(trash)
    staging.rename(final)
    dist.barrier()
    return {"event": "adapter_ready", "path": str(final / "adapter"), "step": step, "sha256": files.sha256}


def run_train_job(
    job: dict[str, Any], state: Any, engine: Any, config: dict[str, Any], last_step: int | None = None
) -> dict[str, Any]:
    """Run an `rl`, `sft` or `export` job on this rank; returns {"metrics", "events"}.

    job keys: kind, step (must be `last_step + 1`, see `check_job_step`), checkpoint_dir; for
    rl/sft also batch_dir (holding dp<r>.safetensors), learning_rate and loss (GRPOLossConfig
    fields).

    Metrics, besides the engine's (seconds, this rank): `time/batch_load_s` (reading the batch
    file), `time/megatron_s` (`TrainerEngine.train_step`: forward/backward/optimizer and its DP
    reductions), `time/adapter_export_s`, `time/state_save_s` (LoRA shards + optimizer state),
    `time/checkpoint_s` (the whole save: those two, manifest, fsync, rename, barriers), and the
    older totals `time/rank_compute_s` (load + step) and `time/rank_checkpoint_s` (= checkpoint_s).

    Raises:
        StepOrderError: the job's step is not `last_step + 1` (nothing ran).
    """
    from art_mega.trainer.batch import TrainBatch
    from art_mega.trainer.loss import GRPOLossConfig

    if engine is None:
        raise RuntimeError("this trainer was started without a model_dir")
    step = check_job_step(job, last_step)
    metrics: dict[str, float] = {}
    started = time.perf_counter()
    if job["kind"] in ("rl", "sft"):
        batch = TrainBatch.load(Path(job["batch_dir"]) / f"dp{state.dp_rank}.safetensors")
        loaded = time.perf_counter()
        metrics = engine.train_step(
            batch,
            loss="grpo" if job["kind"] == "rl" else "sft",
            loss_config=GRPOLossConfig(**job.get("loss", {})),
            learning_rate=job.get("learning_rate"),
        )
        metrics["time/batch_load_s"] = loaded - started
        metrics["time/megatron_s"] = time.perf_counter() - loaded
    metrics["time/rank_compute_s"] = time.perf_counter() - started
    saved = time.perf_counter()
    event = write_checkpoint(engine, state, step, job["checkpoint_dir"], metrics)
    metrics["time/checkpoint_s"] = metrics["time/rank_checkpoint_s"] = time.perf_counter() - saved
    return {"metrics": metrics, "events": [event] if event else []}
