"""One step of MegatronBackend: `train` (GRPO) and `train_sft` read top to bottom: advantages ->
tokenize -> pack per DP rank -> write the batch -> one job on every rank -> checkpoint committed ->
adapter published to every replica as `<name>@<step>` -> metrics; checkpoint deletion."""

from __future__ import annotations

import asyncio
import inspect
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from art_mega.backend.batches import checked_groups, packed_row_len, rl_step_batches
from art_mega.backend.options import (
    GRPOOptions,
    check_optimizer_snapshots,
    check_packing,
    trajectories_learning_rate,
)
from art_mega.backend.serving import remote_trainer_hosts
from art_mega.errors import UserError
from art_mega.trainer import checkpoint
from art_mega.trainer.protocol import (
    GRPOLossConfig,
    RLJob,
    SFTJob,
)
from art_mega.types import LocalTrainResult, TrainResult

log = logging.getLogger(__name__)


def published_adapter(result: Any, step: int, checkpoint_dir: Path) -> str:
    """The adapter folder step `step` publishes: the one rank 0's `AdapterReady` of the job names
    (`result`, the job's `JobResult`), which must be step `step`'s and the committed folder's
    (`checkpoint_dir`) adapter, with the sha256 that folder's manifest records where this host
    reads it (a shared artifact_root, or rank 0's host; on other hosts the transfer stage checks
    each file's sha256 as it fetches it).

    Raises:
        CheckpointFileError: the job reported no adapter, or one of another step or folder, or
            a sha256 other than the manifest's (each named).
    """
    from art_mega.errors import CheckpointFileError

    expected = checkpoint.adapter_dir(checkpoint_dir)
    ready = [event for event in result.adapter_ready if event.step == step]
    if len(ready) != 1 or ready[0].path != str(expected):
        named = [(event.step, event.path) for event in result.adapter_ready]
        raise CheckpointFileError(
            expected, f"is step {step}'s adapter, but the trainer's rank 0 reported {named or 'none'}"
        )
    manifest = checkpoint.manifest_file(checkpoint_dir)
    if manifest.is_file():
        recorded = checkpoint.read_manifest(checkpoint_dir).adapter_sha256
        if recorded != ready[0].sha256:
            raise CheckpointFileError(
                manifest, f"records adapter sha256 {recorded}, but rank 0 exported {ready[0].sha256}"
            )
    return ready[0].path


class StepMixin:
    """`train`, `train_sft`, `delete_checkpoints` and what a step sends to the trainer hosts (part of
    `MegatronBackend`)."""

    # ------------------------------------------------------------------ training

    async def train(self, model: Any, trajectory_groups: Any, **options: Any) -> TrainResult:
        """GRPO on these groups, one new step (one checkpoint); returns it and its metrics.

        ART's options (`LocalBackend.train`) mean what they mean in ART (`trainer.rank.loss.grpo_loss`
        gives each term): `loss_fn` "cispo" (ART's default, epsilon 1.0 / epsilon_high 4.0) or
        "ppo" (clipped, epsilon 0.2, epsilon_high = epsilon); `importance_sampling_level`,
        `mask_prob_ratio`, `max_negative_advantage_importance_sampling_weight`, `kimi_k2_tau`,
        `truncated_importance_sampling`, `precalculate_logprobs` (the trainer recomputes the
        old logprobs; the sampled ones are then TIS's), `kl_penalty_coef` (KL-penalised
        advantages against the base model, or the adapter of `kl_ref_adapter_path` or of the
        committed checkpoint `kl_penalty_reference_step`); `scale_rewards` / `normalize_advantages` (False:
        centred, not divided by the group's std); `advantage_balance` (then every advantage is
        divided by their mean magnitude, as ART's packing does: `tokenize.balance_advantages`);
        `num_trajectories_learning_rate_multiplier_power` (`trajectories_learning_rate`);
        `logprob_calculation_chunk_size` (the trainer's logprobs over chunks of that many
        positions, a memory knob: same values, `logprobs.token_logprobs`); ART 0.5.23's
        `kl_penalty_source` ("current_learner" or "sample": whose logprobs the KL penalty
        compares with the reference) and `optimizer_save_interval` / `final_training_step` (how
        often ART snapshots the optimizer; art-mega commits it with every step, which covers
        any interval: a value other than ART's default is accepted with one logged line). The
        ART options art-mega does not implement (`ART_OPTION_HINTS`) pass only at the value
        where they do nothing, else each is refused with what to use. art-mega's own: `kl_beta`
        (a k3 KL loss term), `tis_cap` (= truncated_importance_sampling with
        precalculate_logprobs), `allow_stale`, `drop_nonfinite_rewards`.

        Optimizer steps: the trajectories' token sequences are packed into rows of
        `packed_sequence_length` tokens (None: `seq_len`; a longer sequence is refused, ART
        drops it with a warning). With `grad_accumulation_sequences` G (the keyword or
        `config`'s, a multiple of the trainer's DP ranks; None: the DP ranks, as ART's
        MegatronBackend, so on one DP rank one step per packed row, as ART's LocalBackend) the
        call takes ceil(rows / G) optimizer steps of G rows each, in packing order
        (`batch.pack_steps`; ART takes ceil(packed sequences / G), in an unseeded shuffled
        order), every one at the learning rate, the old policy of a recomputing loss
        (`precalculate_logprobs`, `tis_cap`) computed once before the first; the metrics are
        the steps' means, and `data/step_num_gradient_steps` counts them.

        Every choice sampled through `model.openai_client()` carries the policy step that served
        it. The step is on-policy for the current step only; `allow_stale=True` trains on older
        (or newer) ones too, off-policy: the loss weighs each token by the ratio of the current
        policy to the logprobs it was sampled with (the PPO ratio; add `tis_cap` for truncated
        importance sampling against the trainer's own recomputation). `data/stale_trajectories`
        counts them either way.

        As in ART, only sampled Choices (with their logprobs) are trained; a plain assistant
        message (a dict) is context, unless `allow_training_without_logprobs=True`: then it is
        trained with the current policy as its sampling policy (ratio 1, see `loss.grpo_loss`).
        A trajectory left with nothing to train counts in
        `data/trajectories_dropped_no_assistant_tokens`; a step with nothing to train at all
        still runs and commits, with `loss/nothing_trainable` = 1 (ART also advances the step).

        Everything is checked before anything is tokenized or sent to a rank: the options (see
        `check_grpo_options`; `config`, a `TrainConfig`, gives `learning_rate`, and `beta` as
        `kl_beta` unless `kl_beta` is set), the groups (`trajectories.check_train_groups`) and
        the rewards: a NaN or +-inf reward is refused, or with `drop_nonfinite_rewards=True`
        its trajectory is left out and counted in `data/trajectories_dropped_nonfinite_reward`.
        Inside the ranks a non-finite loss or gradient norm aborts the step before the optimizer
        update, and a checkpoint whose LoRA or optimizer tensors are not finite is never
        committed: either way the commit and the served step stay where they were.

        Raises:
            UserError: unregistered model, a trajectory longer than `seq_len` (or
                `packed_sequence_length`), or (without `allow_stale`) a trajectory served by a
                step other than the current one.
            HyperParameterError: an option out of range or of the wrong type
                (`check_grpo_options`, `check_packing`, `check_accumulation`), an unknown
                keyword (named), or a KL reference adapter that is not whole, does not fit the
                base model or holds NaN or inf (`_check_reference`).
            AdapterMismatchError: the KL reference adapter has another LoRA rank, alpha or
                targets than the backend.
            TrainInputError: `trajectory_groups` is not a non-empty list of TrajectoryGroup, or
                a message has an unknown role or a bad content (group and trajectory named).
            NonFiniteValueError: a NaN or inf reward (without `drop_nonfinite_rewards`), sampling
                logprob, or an advantage that overflows (group and trajectory named).
            RankRefusedStepError: the ranks refused the step over a non-finite loss, gradient
                norm or checkpoint tensor (a UserError naming the step and the quantity; see above).
            TrainerJobError: a rank failed or died (named); the last commit stays usable, and the
                next call retries the same step on ranks restarted from it.
        """
        from art_mega.metrics import step_data_metrics
        from art_mega.trainer.prepare.tokenize import balance_advantages, grpo_documents

        self._require(model)
        given = GRPOOptions.model_validate(options)  # every option checked, `config` merged
        # a user's adapter is checked below; a kl_penalty_reference_step is this run's own commit
        outside_reference = given.kl_ref_adapter_path is not None
        loss = given.loss_fields(self._reference_path(given.kl_ref_adapter_path, given.kl_penalty_reference_step))
        learning_rate = given.learning_rate
        check_optimizer_snapshots(given.optimizer_save_interval, given.final_training_step, given.config)
        accumulate, row_len = check_packing(
            given.grad_accumulation_sequences,
            given.packed_sequence_length,
            given.config,
            given.num_trajectories_learning_rate_multiplier_power,
            self.seq_len,
        )
        scale_rewards = given.scale_rewards and given.normalize_advantages  # ART: False centres only
        groups, dropped = checked_groups(trajectory_groups, given.drop_nonfinite_rewards, scale_rewards)
        checked = outside_reference and loss.get("kl_ref_adapter_path") is not None
        checked_dir = self._model_dir
        if checked:  # reads tensors: off the loop
            await asyncio.to_thread(self._check_reference, loss["kl_ref_adapter_path"], checked_dir)
        async with self._lock:
            self._require(model)  # a close() that ran while this call waited
            if checked and self._model_dir != checked_dir:  # ... and a register of another model
                await asyncio.to_thread(self._check_reference, loss["kl_ref_adapter_path"], self._model_dir)
            started = time.perf_counter()
            stale = self._check_policy_steps(groups, given.allow_stale)
            documents, stats = grpo_documents(
                self.tokenizer(),
                groups,
                scale_rewards,
                given.allow_training_without_logprobs,
                template_kwargs=self._template_kwargs(),
            )
            documents = balance_advantages(documents, given.advantage_balance)
            learning_rate = trajectories_learning_rate(
                learning_rate, len(documents), given.num_trajectories_learning_rate_multiplier_power
            )
            metrics = {
                **stats.as_metrics(),
                **step_data_metrics(groups, trainable=True),
                "data/stale_trajectories": float(stale),
                "data/trajectories_dropped_nonfinite_reward": float(dropped),
            }
            return await self._step_with(
                [documents],
                metrics,
                "rl",
                [learning_rate],
                loss,
                started,
                seq_len=None if given.packed_sequence_length is None else row_len,
                rows_per_step=accumulate,
            )

    def _check_reference(self, folder: str, model_dir: Path) -> None:
        """Refuse a KL reference adapter (`kl_ref_adapter_path` as `_reference_adapter` resolved
        it) that the trainer ranks could not load into this backend's LoRA, before the step is
        sent: the checks of a warm start (`checkpoint.adapter_problem` against the registered base
        model's folder `model_dir`, read by the caller on the event loop: whole files, tensors fitting its config and the model, finite values) and its
        config against the backend's rank, alpha and targets. A folder whose two files have not
        changed since its last check (inode, size, mtime, ctime), for the same base model and
        LoRA, is not read again; the folder of the last accepted reference is refused once its
        files changed, since the ranks read a reference once per folder (a new reference belongs
        in a new folder).

        Raises:
            HyperParameterError: naming kl_ref_adapter_path, the file and what is wrong with it,
                or that the last reference's folder changed in place.
            AdapterMismatchError: another LoRA rank, alpha or targets than the backend's.
        """
        from art_mega.errors import HyperParameterError
        from art_mega.trainer.peft_config import check_adapter_config, read_adapter_config

        lora = self._lora_settings(model_dir)
        try:
            stats = tuple(
                (s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                for s in (Path(folder, name).stat() for name in checkpoint.ADAPTER_FILES)
            )
            key: tuple[Any, ...] | None = (folder, stats, str(model_dir), repr(lora))
        except OSError:
            key = None  # adapter_problem names the missing file
        if key is not None and key == self._checked_reference:
            return
        where = f"backend.train(kl_ref_adapter_path={folder!r})"
        if self._checked_reference is not None and self._checked_reference[0] == folder:
            raise HyperParameterError(
                f"{where} changed since an earlier step used it as the KL reference, and the trainer "
                "ranks keep the reference they loaded from a folder; write the new reference into a "
                "new folder and pass that",
                "kl_ref_adapter_path",
                folder,
            )
        found = checkpoint.adapter_problem(folder, model_dir=model_dir)
        if found is not None:
            path, problem = found
            raise HyperParameterError(
                f"{where} cannot be the KL reference: {path} {problem}; name a whole adapter with "
                f"finite values trained on {model_dir}",
                "kl_ref_adapter_path",
                folder,
            )
        check_adapter_config(
            read_adapter_config(folder),
            folder,
            **lora,
            what="the KL reference adapter (kl_ref_adapter_path) at",
            otherwise="or name a reference adapter trained with the backend's settings",
        )
        self._checked_reference = key

    def _reference_path(self, path: Any, step: Any) -> Any:
        """`kl_ref_adapter_path`, or the committed checkpoint folder of ART's
        `kl_penalty_reference_step` (a step of this run, at most the current one).

        Raises:
            HyperParameterError: both given; the step not a whole number from 0 to the current
                step; its checkpoint folder gone (`delete_checkpoints`).
        """
        from art_mega.errors import HyperParameterError
        from art_mega.hyperparams import check, whole_problem

        if step is None:
            return path
        where = "backend.train"
        if path is not None:
            raise HyperParameterError(
                f"{where}(kl_penalty_reference_step={step!r}) and kl_ref_adapter_path={path!r} both "
                "name the KL reference; set one of them",
                "kl_penalty_reference_step",
                step,
            )
        check(where, "kl_penalty_reference_step", step, whole_problem(0), "0")
        root = None if self._run_dir is None else checkpoint.checkpoints_dir(self._run_dir)
        folder = None if root is None else checkpoint.step_dir(root, step)
        if step > self._step or folder is None or not folder.is_dir():
            raise HyperParameterError(
                f"{where}(kl_penalty_reference_step={step!r}) names no committed checkpoint of this "
                f"run (the current step is {self._step}, and deleted checkpoints are gone); pass a "
                "kept step from 0 to the current one",
                "kl_penalty_reference_step",
                step,
            )
        return str(folder)

    def _check_policy_steps(self, groups: list[Any], allow_stale: bool) -> int:
        """How many trajectories were served by a step other than the current one; raises
        `UserError` naming the first (group, index, expected and found steps) unless `allow_stale`."""
        from art_mega.trajectories import off_policy

        # a fresh LoRA's step 0 has B = 0 (`trainer.rank.lora`): the base model is that policy
        stale = off_policy(groups, self._step, base_is_expected=self._step == 0 and self._base_is_step0)
        if stale and not allow_stale:
            group, index, steps = stale[0]
            found = " and ".join("the base model" if s is None else f"policy step {s}" for s in steps)
            raise UserError(
                f"trajectory {index} of group {group} was sampled by {found}, but "
                f"backend.train expects step {self._step} ({len(stale)} stale trajectories); sample "
                "with the current model.get_inference_name() or pass allow_stale=True to train off-policy."
            )
        return len(stale)

    async def train_sft(
        self,
        model: Any,
        trajectories: Any,
        config: Any = None,
        _config: Any = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> TrainResult:
        """ART's `train_sft`: the trajectories in batches of `config.batch_size` (in order), one
        optimizer step per batch at its learning rate (`TrainSFTConfig.learning_rates`), then
        one checkpoint: the model's step moves by 1, as in ART.

        Each batch's loss is ART's: the cross-entropy summed over the batch's trained
        (assistant) tokens divided by their number, so every trained token of a batch weighs
        the same (`tokenize.sft_documents`). `config` is a `TrainSFTConfig`; without it `kwargs`
        are its fields (not both). `_config` is ART's `dev.TrainSFTConfig` (a dict without
        keys). `verbose` prints the batches and rates.

        Returns the new step and its metrics: ART's `loss/train`, `loss/learning_rate`,
        `loss/grad_norm` (each the mean over the batches), `data/step_num_trajectories`,
        `data/step_trainer_tokens`, `data/step_num_gradient_steps` (batches),
        `data/step_num_dropped_trajectories` (0: a trajectory longer than `seq_len` is refused,
        not dropped), `time/step_trainer_s`, and art-mega's `data/*` and `time/*` rows.

        Raises:
            UserError: unregistered model, a trajectory longer than `seq_len`.
            HyperParameterError: `config` is not a TrainSFTConfig or comes with `kwargs`, a
                keyword that is not a TrainSFTConfig field, `_config` not an empty dict,
                `verbose` not a bool, or a list of learning rates that is not one per batch.
            pydantic.ValidationError: `kwargs` are not valid TrainSFTConfig values (names the field).
            TrainInputError: `trajectories` is not a non-empty iterable of Trajectory, or a
                message has an unknown role or a bad content (trajectory and message named).
            NonFiniteValueError: a sampled Choice holds a NaN or inf logprob.
            RankRefusedStepError, TrainerJobError: as for `train` (a batch after the first
                with a non-finite loss fails the job: the ranks restart from the last commit).
        """
        from art_mega.errors import HyperParameterError
        from art_mega.hyperparams import bool_problem, check
        from art_mega.metrics import art_train_metrics
        from art_mega.sft import TrainSFTConfig
        from art_mega.trainer.prepare.tokenize import BatchStats, sft_documents
        from art_mega.trajectories import check_sft_trajectories

        self._require(model)
        if config is not None and not isinstance(config, TrainSFTConfig):
            raise HyperParameterError(
                f"train_sft(config={config!r}) must be an art_mega.TrainSFTConfig; pass e.g. "
                "config=art.TrainSFTConfig(learning_rate=5e-5)",
                "config",
                config,
            )
        for name, value in kwargs.items():
            if name not in TrainSFTConfig.model_fields:
                raise HyperParameterError(
                    f"train_sft got the unknown keyword {name}={value!r}; use config=TrainSFTConfig"
                    f"({', '.join(TrainSFTConfig.model_fields)}), _config or verbose",
                    name,
                    value,
                )
            if config is not None:
                raise HyperParameterError(
                    f"train_sft got config= and {name}= together; set {name} in the TrainSFTConfig",
                    name,
                    value,
                )
        if _config is not None and (not isinstance(_config, dict) or set(_config) - {"metric_logging"}):
            raise HyperParameterError(
                f"train_sft(_config={_config!r}) must be ART's dev.TrainSFTConfig, whose one key is "
                "metric_logging; leave the others out",
                "_config",
                _config,
            )
        if _config and _config.get("metric_logging") is not None:
            log.info(
                "train_sft(_config={'metric_logging': %r}): art-mega logs every train_sft call's metrics "
                "(model.train_sft(log_metrics=False) turns that off)",
                _config["metric_logging"],
            )
        check("train_sft", "verbose", verbose, bool_problem, "True")
        config = config or TrainSFTConfig(**kwargs)
        trajectories = check_sft_trajectories(trajectories)
        size = config.resolved_batch_size()
        rates = config.learning_rates(config.batch_count(len(trajectories)))
        async with self._lock:
            self._require(model)  # a close() that ran while this call waited
            started = time.perf_counter()
            steps, total = [], BatchStats()
            for k in range(len(rates)):
                documents, stats = sft_documents(
                    self.tokenizer(),
                    trajectories[k * size : (k + 1) * size],
                    config.assistant_turns,
                    k * size,
                    template_kwargs=self._template_kwargs(),
                )
                steps.append(documents)
                for name, value in stats.__dict__.items():
                    setattr(total, name, getattr(total, name) + value)
                if verbose:
                    print(f"train_sft batch {k}: {len(documents)} sequences, lr {rates[k]:.3g}")
            result = await self._step_with(steps, total.as_metrics(), "sft", rates, {}, started)
        metrics = result.metrics
        renamed = art_train_metrics(metrics, kl_loss=False)
        metrics.clear()
        metrics.update(renamed)
        metrics.update(
            {
                "data/step_num_trajectories": float(len(trajectories)),
                "data/step_trainer_tokens": float(total.trained_tokens),
                "data/step_num_dropped_trajectories": 0.0,
                "data/step_num_gradient_steps": float(len(rates)),
            }
        )
        if verbose:
            print(f"train_sft: step {result.step}, loss/train {metrics['loss/train']:.4f}")
        return result

    async def _step_with(
        self,
        steps: list[list[Any]],
        metrics: dict[str, float],
        kind: str,
        learning_rates: list[float],
        loss: dict[str, Any],
        started: float,
        *,
        seq_len: int | None = None,
        rows_per_step: int | None = None,
    ) -> TrainResult:
        """One job on the ranks and its commit: an rl job (`steps` = [its documents], one rate;
        one optimizer step per `rows_per_step` packed rows over all DP ranks,
        `check_accumulation`; None: the DP ranks, one row per rank and step, ART's
        MegatronBackend default) or an sft job (one document list and one rate per optimizer
        step); rows of `seq_len` tokens (None: `self.seq_len`, else it is `backend.train`'s
        packed_sequence_length); returns the new step."""
        from art_mega.metrics import art_train_metrics
        from art_mega.trainer.batch import pack
        from art_mega.trainer.protocol import sft_batch_file
        from art_mega.transfer.remote import transfer_metrics

        assert self._run_dir is not None
        step = self._step + 1
        dp = max(r.dp_rank for r in self._runtime.topology.trainer_ranks) + 1
        row_len = self.seq_len if seq_len is None else seq_len
        if seq_len is None and not self._fixed_rows:  # rows as long as the batch needs, up to the limit
            row_len = packed_row_len(
                row_len, max((len(d) for documents in steps for d in documents), default=0)
            )
        step_rows: int | None = None  # rl only
        try:
            if kind == "rl":
                batches, step_rows = rl_step_batches(steps[0], row_len, dp, rows_per_step)
                packed = [batches]
            else:
                packed = [pack(documents, row_len, dp) for documents in steps]
        except ValueError as exc:
            where = (
                "backend.train(packed_sequence_length=...)"
                if seq_len is not None
                else "MegatronBackend(seq_len=...)"
                if self._fixed_rows
                else "init_args.max_seq_length, or engine_args.max_model_len by default"
            )
            raise UserError(f"{exc} ({where})") from None
        if step_rows is not None:
            metrics["data/step_num_gradient_steps"] = float(packed[0][0].shape[0] // step_rows)
        batch_dir = self._run_dir / "batches" / f"{step:04d}"
        for k, batches in enumerate(packed):
            for rank, batch in enumerate(batches):
                file = (
                    batch_dir / f"dp{rank}.safetensors"
                    if kind == "rl"
                    else sft_batch_file(batch_dir, k, rank)
                )
                file.parent.mkdir(parents=True, exist_ok=True)
                batch.save(file)
        await self._send_batches(batch_dir)
        prepared = time.perf_counter()
        where = {"step": step, "batch_dir": str(batch_dir), "checkpoint_dir": str(self._checkpoint(step))}
        job = (
            RLJob(
                **where,
                learning_rate=learning_rates[0],
                loss=GRPOLossConfig(**loss),
                weight_decay=self._rl_optimizer[0],
                clip_grad=self._rl_optimizer[1],
                step_rows=step_rows,
            )
            if kind == "rl"
            else SFTJob(**where, learning_rates=learning_rates)
        )
        result = await self._run_and_commit(job, metrics)
        trained = time.perf_counter()
        report = await self._publisher.publish(step, published_adapter(result, step, self._checkpoint(step)))
        published = time.perf_counter()
        shutil.rmtree(batch_dir, ignore_errors=True)
        await self._remove_on_trainer_hosts(batch_dir, best_effort=True)  # as the rmtree above
        metrics.update(result.rank0.metrics)
        self._behaviour.check(metrics)
        metrics.update(
            {
                "time/prepare_s": prepared - started,
                "time/train_s": trained - prepared,
                "time/publish_s": published - trained,
                "time/adapter_load_s": max(report.load_s.values(), default=0.0),
                **transfer_metrics(self._publisher.stage, step),
            }
        )
        metrics = art_train_metrics(metrics, kl_loss=float(loss.get("kl_beta", 0.0)) > 0)
        return LocalTrainResult(step=step, metrics=metrics, checkpoint_path=str(self._checkpoint(step)))

    async def _run_and_commit(self, job: RLJob | SFTJob, metrics: dict[str, float]) -> Any:
        """Run `job` on the ranks and commit its step: recover the ranks from the last commit
        (after a failed step they may be one update ahead), run the job with the shared-GPU
        replicas asleep, write the commit pointer (the controller owns it, not the ranks) and
        advance `self._step`. Returns the service's `trainer.remote.JobResult` (each rank's `Done`,
        rank 0's `AdapterReady`).

        The replicas' prefix-cache counters of this step's rollouts (`_prefix_cache_metrics`) are
        read in a background task started before the sleep, off the step's critical path, and
        added to `metrics` once the step is committed (with `time/sleep_s` and `time/wake_s`
        from `asleep`); a failed step cancels the read.

        Raises:
            whatever the job, the sleep or wake (`ReplicaSleepError`) or the commit raised; a failed
            commit marks the service dirty (the ranks hold a step the commit does not name).
        """
        step = job.step
        cache_read = asyncio.create_task(self._prefix_cache_metrics())
        try:
            async with self._shared.asleep(metrics):  # replicas on the trainer's GPUs free them
                await self._service.recover(self._checkpoint(self._step))
                result = await self._service.run(job)
        except BaseException:
            cache_read.cancel()
            raise
        try:
            checkpoint.write_commit(checkpoint.checkpoints_dir(self._run_dir), step)
        except BaseException:
            cache_read.cancel()
            self._service.dirty = True  # the ranks hold step `step`, the commit says `self._step`
            raise
        self._step = step
        metrics.update(await cache_read)  # long arrived: the step took longer than one GET
        return result

    async def _prefix_cache_metrics(self) -> dict[str, float]:
        """`inference/prefix_cache_hit_rate`: the share (0..1) of the prompt tokens the replicas
        were sent since the last step's read (the first: since they started) that their prefix
        caches held, from each replica's /metrics; left out when none were sent. A replica that
        is down (out of routing) or whose /metrics does not answer is left out of it and counted in
        `inference/prefix_cache_unread_replicas` (the step itself does not depend on it)."""
        from art_mega.errors import ReplicaHTTPError
        from art_mega.inference.server_api import ReplicaClient

        async def read(replica: Any) -> tuple[float, float] | None:
            async with ReplicaClient(replica.name, replica.url, 10.0) as client:
                try:
                    return await client.prefix_cache_counts()
                except ReplicaHTTPError:
                    return None

        replicas = self._router.replicas if self._router is not None else ()
        up = {r.name for r in self._router.up()} if self._router is not None else set()

        async def read_up(replica: Any) -> tuple[float, float] | None:
            return await read(replica) if replica.name in up else None  # down: not waited for

        counts = await asyncio.gather(*(read_up(r) for r in replicas))
        queried = hit = 0.0
        for replica, now in zip(replicas, counts):
            if now is None:
                continue
            before = self._prefix_cache.get(replica.name, (0.0, 0.0))
            if now[0] < before[0]:  # restarted since: its counters began again at 0
                before = (0.0, 0.0)
            queried, hit = queried + now[0] - before[0], hit + now[1] - before[1]
            self._prefix_cache[replica.name] = now
        out = {"inference/prefix_cache_hit_rate": hit / queried} if queried > 0 else {}
        unread = sum(now is None for now in counts)
        return {**out, "inference/prefix_cache_unread_replicas": float(unread)} if unread else out

    async def delete_checkpoints(self, model: Any, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Delete every committed checkpoint but the latest and the best by `best_checkpoint_metric`,
        ART's rule (`checkpoint.best_step`: the step of the highest mean of the metric in
        history.jsonl; none logged: the latest only). A step the replicas still load (the
        `keep_adapters` window) is unloaded from them first (`AdapterPublisher.unload`), so no
        replica serves a deleted step; only the step the replicas serve as the policy stays
        while it is served (its publication failed and a newer one did not happen: the
        latest step is newer than it), with one logged line. Returns the deleted steps.

        Raises:
            ReplicaHTTPError: a replica could not unload a step (the first such answer); that
                step's files stay, the other steps are deleted.
        """
        import logging

        from art_mega.metrics import read_history

        self._require(model)
        assert self._run_dir is not None
        checkpoints = checkpoint.checkpoints_dir(self._run_dir)
        best = checkpoint.best_step(read_history(self._run_dir / "history.jsonl"), best_checkpoint_metric)
        deleted = checkpoint.deletable_steps(checkpoint.step_folders(checkpoints), self._step, best)
        failures: dict[int, list[Any]] = {}
        if self._publisher is not None:
            served = self._publisher.router.served_step
            if served in deleted:
                logging.getLogger(__name__).warning(
                    "delete_checkpoints keeps step %s: the replicas serve it as the policy (step %s was "
                    "not published); it goes at the next call after a publication",
                    served,
                    self._step,
                )
                deleted.remove(served)
            failures = await self._publisher.unload(deleted)
        deleted = [s for s in deleted if s not in failures]
        for s in deleted:
            await self._remove_on_trainer_hosts(checkpoint.delete_step(checkpoints, s))
        if failures:
            raise next(iter(failures.values()))[0]
        return deleted

    async def _send_batches(self, batch_dir: Path) -> None:
        """With a host-local artifact_root, write each `dp<r>.safetensors` under `batch_dir` (an
        sft job's are in one folder per batch) on every other trainer host whose ranks read DP
        rank r's batches, through its agent (same path under its root); nothing with a shared root.

        Raises:
            ArtifactFileError, AgentError: an agent could not write it (named).
        """
        from art_mega.transfer.files import send_file

        root = self._runtime.topology.cluster.artifact_root
        sends = [
            send_file(self._runtime.clients[host], root, str(file.relative_to(root)), file.read_bytes())
            for host, dp_ranks in remote_trainer_hosts(self._runtime.topology).items()
            for dp in dp_ranks
            for file in sorted(batch_dir.rglob(f"dp{dp}.safetensors"))
        ]
        await asyncio.gather(*sends)

    async def _remove_on_trainer_hosts(self, folder: Path, best_effort: bool = False) -> None:
        """With a host-local artifact_root, remove `folder` (under the root) on every other trainer
        host through its agent; nothing with a shared root.

        Raises:
            ArtifactFileError, AgentError: an agent could not remove it (named); never with
                `best_effort`.
        """
        from art_mega.transfer.files import remove_remote

        root = self._runtime.topology.cluster.artifact_root
        relative = str(folder.relative_to(root))
        hosts = remote_trainer_hosts(self._runtime.topology)
        await asyncio.gather(
            *(remove_remote(self._runtime.clients[h], root, relative) for h in hosts),
            return_exceptions=best_effort,
        )


def _train_signature() -> inspect.Signature:
    """`train(self, model, trajectory_groups, *, <GRPOOptions' fields with their defaults>,
    **unknown)`: what `inspect.signature` (and ART's signature tests) read."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Any),
            inspect.Parameter("trajectory_groups", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Any),
            *(
                inspect.Parameter(name, keyword, default=field.default, annotation=field.annotation)
                for name, field in GRPOOptions.model_fields.items()
            ),
            inspect.Parameter("unknown", inspect.Parameter.VAR_KEYWORD, annotation=Any),
        ],
        return_annotation=TrainResult,
    )


StepMixin.train.__signature__ = _train_signature()  # type: ignore[attr-defined]
