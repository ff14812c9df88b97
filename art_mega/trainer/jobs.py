"""What a trainer rank does for a job: build the engine once, then train, export and checkpoint.

Checkpoint layout (`<checkpoint_dir>` = `<run>/checkpoints/<step:04d>`): `adapter/` (an HF PEFT
adapter), `rank<r>.pt` per rank (LoRA shards, optimizer state), `manifest.json` (step, adapter
sha256, base model, parallel layout). Everything is written into a hidden staging folder beside
it, fsynced, and renamed into place by rank 0 after every rank finished: a crash never leaves a
half checkpoint under the final name. The controller moves the commit pointer afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

STAGING_PREFIX = ".staging-"


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


def write_checkpoint(engine: Any, state: Any, step: int, checkpoint_dir: str) -> dict[str, Any] | None:
    """Collective: export the adapter and every rank's state, then commit the folder (rank 0).

    Returns the adapter_ready event on rank 0 (path, step, sha256), None on other ranks.
    """
    import torch.distributed as dist

    final = Path(checkpoint_dir)
    staging = final.parent / f"{STAGING_PREFIX}{final.name}"
    if state.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    files = engine.export_adapter(staging / "adapter")
    engine.save_state(staging)
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
        shutil.rmtree(final)
    staging.rename(final)
    dist.barrier()
    return {"event": "adapter_ready", "path": str(final / "adapter"), "step": step, "sha256": files.sha256}


def run_train_job(job: dict[str, Any], state: Any, engine: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Run an `rl`, `sft` or `export` job on this rank; returns {"metrics", "events"}.

    job keys: kind, step, checkpoint_dir; for rl/sft also batch_dir (holding dp<r>.safetensors),
    learning_rate and loss (GRPOLossConfig fields).
    """
    from art_mega.trainer.batch import TrainBatch
    from art_mega.trainer.loss import GRPOLossConfig

    if engine is None:
        raise RuntimeError("this trainer was started without a model_dir")
    metrics: dict[str, float] = {}
    started = time.perf_counter()
    if job["kind"] in ("rl", "sft"):
        batch = TrainBatch.load(Path(job["batch_dir"]) / f"dp{state.dp_rank}.safetensors")
        metrics = engine.train_step(
            batch,
            loss="grpo" if job["kind"] == "rl" else "sft",
            loss_config=GRPOLossConfig(**job.get("loss", {})),
            learning_rate=job.get("learning_rate"),
        )
    metrics["time/rank_compute_s"] = time.perf_counter() - started
    saved = time.perf_counter()
    event = write_checkpoint(engine, state, int(job["step"]), job["checkpoint_dir"])
    metrics["time/rank_checkpoint_s"] = time.perf_counter() - saved
    return {"metrics": metrics, "events": [event] if event else []}
