"""What a trainer rank does for a job: build the engine once, then train, export and checkpoint.

A checkpoint (its layout and files: `art_mega.trainer.checkpoint`) holds the adapter, every
rank's state file and the manifest. Everything is written into its staging folder, fsynced, and
renamed into place by rank 0 after every rank finished: a crash never leaves a half checkpoint
under the final name. The controller moves the commit pointer afterwards.

With a host-local artifact_root (`ClusterSpec.shared_artifact_root=False`) each trainer host has
its own staging folder: the lowest rank of every host makes it, writes the manifest (broadcast
from rank 0) into it and renames it on that host, so each rank's state file and a manifest are
committed where that rank resumes from; the adapter stays on rank 0's host. Hosts whose roots are
in fact one disk (loopback clusters) see each other's marker file in the staging folder, and only
the lowest of them renames it.

Versions are contiguous: a rank refuses an `rl`, `sft` or `export` job whose step is not the one
after the last checkpoint it resumed from or wrote (`check_job_step`), before any collective.
A job that fails after that check (in the step or the save) leaves the rank's weights and
optimizer state ahead of the commit; the rank then refuses training jobs until the controller
restarts it from the commit (`rank.main`, `remote.TrainerService.recover`).

Test hook: when `$ART_MEGA_TEST_SAVE_PAUSE` names a file that exists, every rank waits inside
`write_checkpoint` while it exists, after its adapter and optimizer state are in the staging
folder and before the folder is renamed. Crash tests use it to kill a rank at that exact point
of a save rather than racing a save that takes milliseconds; unset (always, outside tests) it
costs one environment lookup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from art_mega.trainer import checkpoint
from art_mega.trainer.protocol import EngineConfig, RankConfig, RLJob, SFTJob, Step, StepJob

SAVE_PAUSE_ENV = "ART_MEGA_TEST_SAVE_PAUSE"
SAVE_PAUSE_POLL_S = 0.05


class StepOrderError(ValueError):
    """A job named a step other than the one after the last committed step."""


class CommittedAdapter(BaseModel):
    """What `write_checkpoint` hands rank 0's main loop once step `step`'s checkpoint is committed:
    its PEFT adapter folder `path` (in the final checkpoint folder, not the staging one) and the
    sha256 (hex) of its weights file, as the manifest records it. `rank.main` sends it on as the
    job's `AdapterReady`, which the backend publishes from and checks the sha256 against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    step: Step
    sha256: str


def resumed_step(config: EngineConfig) -> int | None:
    """The step of the checkpoint the rank resumed from (its manifest), None when it did not resume."""
    if config.resume_dir is None:
        return None
    return checkpoint.read_manifest(config.resume_dir).step


def check_job_step(kind: str, step: int, last_step: int | None) -> int:
    """`step` (of a `kind` job) when it is `last_step + 1` (0 when nothing is committed).

    Raises:
        StepOrderError: `step` is another one; the message names the expected one.
    """
    expected = 0 if last_step is None else last_step + 1
    if step != expected:
        since = "nothing is committed yet" if last_step is None else f"the last committed step is {last_step}"
        raise StepOrderError(
            f"job step {step!r} refused: {since}, so the next {kind} job must name step {expected}"
        )
    return step


def build_engine(config: EngineConfig, state: Any) -> Any:
    """The rank's TrainerEngine from its `EngineConfig`, resumed or warm-started when it says so."""
    from art_mega.trainer.rank.engine import TrainerEngine

    engine = TrainerEngine(
        config.model_dir,
        state,
        lora=config.lora,
        optimizer=config.optimizer,
        dtype=config.dtype,
        micro_batch_rows=config.micro_batch_rows,
    )
    if config.resume_dir is not None:
        engine.load_state(config.resume_dir)
    elif config.warm_start is not None:
        engine.load_adapter(config.warm_start)
    return engine


def _pause_for_tests() -> None:
    """Wait while the file named by $ART_MEGA_TEST_SAVE_PAUSE exists (see the module docstring)."""
    pause = os.environ.get(SAVE_PAUSE_ENV)
    while pause and os.path.exists(pause):
        time.sleep(SAVE_PAUSE_POLL_S)


def write_checkpoint(
    engine: Any,
    state: Any,
    step: int,
    checkpoint_dir: str,
    timings: dict[str, float] | None = None,
    host_of: list[str] | None = None,
) -> CommittedAdapter | None:
    """Collective: export the adapter and every rank's state, then commit the folder.

    `host_of` (the host id of each global rank) says the artifact_root is host-local: the lowest
    rank of each host then commits its host's folder (see the module docstring); None (a shared
    root): rank 0 commits the one folder. Returns the `CommittedAdapter` on rank 0 (path, step,
    sha256), None on other ranks. With `timings`, adds this rank's `time/adapter_export_s` and
    `time/state_save_s` (seconds).

    Before anything is written every rank checks its LoRA parameters and optimizer state are
    finite (`TrainerEngine.first_nonfinite_tensor`); the ranks share what they found, so all of
    them refuse alike and no folder is staged or committed.

    Raises:
        NonFiniteCheckpointError: a rank holds a NaN or inf tensor (the lowest such rank's first
            tensor is named).
    """
    import torch.distributed as dist

    from art_mega.errors import NonFiniteCheckpointError

    found: list[str | None] = [None] * state.world_size
    dist.all_gather_object(found, engine.first_nonfinite_tensor())
    for rank, tensor in enumerate(found):
        if tensor is not None:
            raise NonFiniteCheckpointError(f"rank {rank}'s {tensor}", step)
    final = Path(checkpoint_dir)
    staging = checkpoint.staging_dir(final)
    leader = state.rank == 0 if host_of is None else state.rank == host_of.index(host_of[state.rank])
    if leader:
        checkpoint.prepare_staging(final)
    dist.barrier()
    if leader and host_of is not None:
        checkpoint.mark_leader(staging, state.rank)
    exported = time.perf_counter()
    files = engine.export_adapter(checkpoint.adapter_dir(staging))
    saved = time.perf_counter()
    engine.save_state(staging)
    if timings is not None:
        timings["time/adapter_export_s"] = saved - exported
        timings["time/state_save_s"] = time.perf_counter() - saved
    _pause_for_tests()
    dist.barrier()
    manifest = None
    if state.rank == 0:
        manifest = checkpoint.Manifest(
            step=step,
            adapter_sha256=files.sha256,
            base_model=str(engine.model_dir),
            layout=checkpoint.ManifestLayout(world_size=state.world_size, tp=state.tp, dp=state.dp),
            written_at=time.time(),
        )
    if host_of is not None:
        shared = [None if manifest is None else manifest.model_dump()]
        dist.broadcast_object_list(shared, src=0)
        manifest = checkpoint.Manifest.model_validate(shared[0])
        marks = checkpoint.leader_marks(staging) if leader else []
        dist.barrier()  # every leader has seen the marks before one of them deletes them
        # a leader that sees a lower rank's mark shares this folder with it: that one commits it
        leader = leader and min(marks) == state.rank
        if leader:
            checkpoint.clear_leader_marks(staging, marks)
    if not leader:
        dist.barrier()
        return None
    checkpoint.write_manifest(staging, manifest)
    checkpoint.place_folder(staging, final)
    dist.barrier()
    if state.rank != 0:
        return None
    return CommittedAdapter(path=str(checkpoint.adapter_dir(final)), step=step, sha256=files.sha256)


def checkpoint_hosts(config: RankConfig) -> list[str] | None:
    """The host id of each global rank when the launch config says the artifact_root is host-local
    (`host_local_root`), else None: `write_checkpoint`'s `host_of`."""
    if not config.host_local_root:
        return None
    return [r.host_id for r in config.rank_table]  # in rank order (`RankConfig` checks it)


def _average(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per-step metrics averaged over the steps (ART's `average_metric_samples`)."""
    keys = {key for sample in samples for key in sample}
    return {key: sum(s.get(key, 0.0) for s in samples) / len(samples) for key in sorted(keys)}


def _step_failed(exc: Any, k: int, what: str, step: int) -> Exception:
    """The error of optimizer step `k` of job step `step` that aborted over a non-finite value:
    the step's own `NonFiniteStepError` for the first (nothing changed on the rank), else a
    RuntimeError naming `what` k (the earlier steps have updated the rank: it restarts)."""
    if k == 0:
        return exc.at_step(step)
    return RuntimeError(f"{what} {k} of step {step}: {exc.at_step(step)}")


def _sft_steps(job: SFTJob, state: Any, engine: Any, step: int) -> dict[str, float]:
    """One optimizer step per batch of `job` (ART's `train_sft`); their metrics averaged over
    the batches (ART's `average_metric_samples`), `time/batch_load_s` and `time/megatron_s`
    summed, `loss/nothing_trainable` the fraction of batches with nothing to train.

    Raises:
        NonFiniteStepError: the first batch's loss or gradient norm is not finite (nothing
            changed on the rank).
        RuntimeError: a later batch's is (naming batch and step): the earlier batches have
            updated the rank, so it is left dirty and restarts from the last commit.
    """
    from art_mega.errors import NonFiniteStepError
    from art_mega.trainer.batch import TrainBatch
    from art_mega.trainer.protocol import sft_batch_file
    from art_mega.trainer.rank.step_loss import SFT_LOSS

    samples: list[dict[str, float]] = []
    load_s = megatron_s = 0.0
    for k, rate in enumerate(job.learning_rates):
        started = time.perf_counter()
        batch = TrainBatch.load(sft_batch_file(job.batch_dir, k, state.dp_rank))
        loaded = time.perf_counter()
        try:
            samples.append(engine.train_step(batch, loss=SFT_LOSS, learning_rate=rate))
        except NonFiniteStepError as exc:
            raise _step_failed(exc, k, "SFT batch", step) from None
        load_s += loaded - started
        megatron_s += time.perf_counter() - loaded
    metrics = _average(samples)
    metrics["time/batch_load_s"] = load_s
    metrics["time/megatron_s"] = megatron_s
    return metrics


def _rl_steps(job: RLJob, state: Any, engine: Any, step: int) -> dict[str, float]:
    """The optimizer steps of `job` on this rank's batch: one over all of it, or with
    `job.step_rows` one per that many rows, in order (ART's grad accumulation: every step at
    `job.learning_rate`). With several steps and a loss that recomputes the old policy
    (`GRPOLossConfig.recomputes_old`) its logprobs are computed once, before the first step,
    as ART precalculates them per train call. Metrics: the steps' averaged (ART's
    `average_metric_samples`; `loss/nothing_trainable` the fraction of steps with nothing to
    train), `time/batch_load_s`, `time/megatron_s` (every step and the precalculation).

    Raises:
        ValueError: the batch's height is not a multiple of `job.step_rows` (named).
        NonFiniteStepError: the first step's loss or gradient norm is not finite (nothing
            changed on the rank).
        RuntimeError: a later step's is (naming it and the job's step): the earlier steps have
            updated the rank, so it is left dirty and restarts from the last commit.
    """
    from art_mega.errors import NonFiniteStepError
    from art_mega.trainer.batch import DTYPES, TrainBatch

    started = time.perf_counter()
    file = Path(job.batch_dir) / f"dp{state.dp_rank}.safetensors"
    batch = TrainBatch.load(file)
    loaded = time.perf_counter()
    height = batch.shape[0]
    rows = height if job.step_rows is None else job.step_rows
    if height % rows:
        raise ValueError(f"batch file {file} has {height} rows, not a multiple of the job's step_rows={rows}")
    slices = [
        TrainBatch(**{name: getattr(batch, name)[first : first + rows] for name in DTYPES})
        for first in range(0, height, rows)
    ]
    old_policy = None
    if len(slices) > 1 and job.loss.recomputes_old:
        old_policy = engine.logprobs(batch, trained_only=True)
    samples: list[dict[str, float]] = []
    for k, part in enumerate(slices):
        try:
            samples.append(
                engine.train_step(
                    part,
                    loss=job.loss,
                    learning_rate=job.learning_rate,
                    weight_decay=job.weight_decay,
                    clip_grad=job.clip_grad,
                    old_policy_logprobs=None if old_policy is None else old_policy[k * rows : (k + 1) * rows],
                )
            )
        except NonFiniteStepError as exc:
            raise _step_failed(exc, k, "optimizer step", step) from None
    metrics = _average(samples)
    metrics["time/batch_load_s"] = loaded - started
    metrics["time/megatron_s"] = time.perf_counter() - loaded
    return metrics


def run_train_job(
    job: StepJob, state: Any, engine: Any, config: RankConfig, last_step: int | None = None
) -> tuple[dict[str, float], CommittedAdapter | None]:
    """Run an `rl`, `sft` or `export` job on this rank; returns its metrics and, on rank 0,
    `write_checkpoint`'s `CommittedAdapter` (None on other ranks).

    The job's step must be `last_step + 1` (`check_job_step`); an rl job trains on
    `<batch_dir>/dp<r>.safetensors` (r: this rank's DP rank) first, in one or several optimizer
    steps (`_rl_steps`), an sft job on each of its batches in turn (`_sft_steps`).

    Metrics, besides the engine's (seconds, this rank): `time/batch_load_s` (reading the batch
    file), `time/megatron_s` (`TrainerEngine.train_step`: forward/backward/optimizer and its DP
    reductions), `time/adapter_export_s`, `time/state_save_s` (LoRA shards + optimizer state),
    `time/checkpoint_s` (the whole save: those two, manifest, fsync, rename, barriers), and the
    older totals `time/rank_compute_s` (load + step) and `time/rank_checkpoint_s` (= checkpoint_s).

    Raises:
        StepOrderError: the job's step is not `last_step + 1` (nothing ran).
        NonFiniteStepError: the (first optimizer) step's loss or gradient norm is not finite
            (named with the step); aborted before the optimizer update, so the rank's state is
            unchanged.
        RuntimeError: a later optimizer step's is (the rank is ahead of the commit).
        ValueError: an rl batch's height is not a multiple of the job's step_rows.
        NonFiniteCheckpointError: the updated LoRA or optimizer state is not finite; nothing was
            committed, but the rank's state is ahead of the commit (see `rank.main`).
    """
    if engine is None:
        raise RuntimeError("this trainer was started without a model_dir")
    step = check_job_step(job.kind, job.step, last_step)
    metrics: dict[str, float] = {}
    started = time.perf_counter()
    if isinstance(job, RLJob):
        metrics = _rl_steps(job, state, engine, step)
    elif isinstance(job, SFTJob):
        metrics = _sft_steps(job, state, engine, step)
    metrics["time/rank_compute_s"] = time.perf_counter() - started
    saved = time.perf_counter()
    adapter = write_checkpoint(engine, state, step, job.checkpoint_dir, metrics, checkpoint_hosts(config))
    metrics["time/checkpoint_s"] = metrics["time/rank_checkpoint_s"] = time.perf_counter() - saved
    return metrics, adapter
