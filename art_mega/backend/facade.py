"""MegatronBackend: the runtime, the Megatron trainer ranks and the vLLM replicas behind ART's API.

`MegatronBackend()` owns a local single-host runtime (one agent on loopback, one trainer rank,
one vLLM replica); `MegatronBackend(runtime=runtime)` uses a multi-host one whose topology names
the trainer and the inference replicas. One training step (`train`) reads top to bottom:
advantages -> tokenize -> pack per DP rank -> write the batch -> one job on every rank ->
checkpoint committed -> adapter published to every replica as `<name>@<step>` -> metrics.
"""

from __future__ import annotations

import asyncio
import logging
import operator
from pathlib import Path
from typing import Any

from art_mega.backend.options import ART_TRAINER_ARGS, check_backend_options
from art_mega.backend.s3 import S3Mixin
from art_mega.backend.serving import ServingMixin, default_vllm_python
from art_mega.backend.step import StepMixin
from art_mega.errors import UserError
from art_mega.hyperparams import fraction_problem
from art_mega.trainer import checkpoint
from art_mega.trainer.behaviour import BehaviourMonitor

log = logging.getLogger(__name__)


class MegatronBackend(ServingMixin, StepMixin, S3Mixin):
    """Trains one `TrainableModel` with Megatron ranks and serves it with vLLM replicas.

    Args:
        runtime: a started multi-host `ArtRuntime` whose topology has a trainer and inference;
            None builds and owns a local one.
        lora_rank, lora_alpha, lora_targets: the LoRA adapter (targets in HF or Megatron names).
        seq_len: packed row length in tokens (a longer trajectory is an error naming it); None
            (default): trajectories up to `max_model_len` tokens, packed into rows of
            `PACKED_ROW_TOKENS` tokens or of the longest trajectory's length when longer.
        max_model_len: the replicas' context length in tokens; None (default): the model's
            context, capped by what the replica's KV cache holds (`dev.settings.default_max_model_len`,
            one logged line when capped).
        keep_adapters: published steps each replica keeps loaded.
        startup_timeout_s: bound on trainer and replica start-up (seconds).
        vllm_python: the interpreter that runs vLLM (default: see `default_vllm_python`).
        gpu_memory_utilization: fraction (0, 1] of each GPU vLLM may take (None: vLLM's 0.9);
            lower it for replicas with `InferenceSpec.shared_gpus=True`, which start after the
            trainer ranks hold their weights and then sleep during each train step
            (`inference.sleep`).
        dtype: the trainer's parameter dtype, "float32", "bfloat16" (Megatron keeps fp32 main
            weights for Adam), or "auto" (default): bfloat16 when the trainer ranks have GPUs,
            float32 on CPU ranks. On one H200 (SmolLM2-135M shape, LoRA r=8, packed 4096-token
            rows) a bf16 step ran 1.4x the tokens/s of fp32 (benchmarks/RESULTS.md).
        micro_batch_rows: packed rows per forward/backward microbatch (Megatron's micro batch
            size); the step's rows are accumulated over microbatches, so this trades memory
            for speed, not results. On one H200 4 rows ran 2.5x the tokens/s of 1 row (the
            step is bound by kernel launches at 1 row); the default 1 suits CPU and big models.

    Raises:
        UserError (HyperParameterError for the numbers): an argument of the wrong type (a bool or
            float where a whole number goes, a string where a number goes), not finite, out of
            range, or an unknown LoRA target, named in one sentence before anything starts.
    """

    def __init__(
        self,
        runtime: Any = None,
        *,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: tuple[str, ...] | None = None,
        seq_len: int | None = None,
        max_model_len: int | None = None,
        keep_adapters: int = 2,
        startup_timeout_s: float = 900.0,
        vllm_python: str | None = None,
        gpu_memory_utilization: float | None = None,
        dtype: str = "auto",
        micro_batch_rows: int = 1,
    ) -> None:
        if dtype not in ("auto", "float32", "bfloat16"):
            raise UserError(
                f"MegatronBackend(dtype={dtype!r}) is not a trainer dtype; use 'auto', 'float32' or 'bfloat16'"
            )
        try:  # any integer type, numpy's too; not a bool and not a float
            rows = None if "bool" in type(micro_batch_rows).__name__ else operator.index(micro_batch_rows)
        except TypeError:
            rows = None
        if rows is None or rows < 1:
            raise UserError(
                f"MegatronBackend(micro_batch_rows={micro_batch_rows!r}) counts packed rows per microbatch; "
                "use a whole number of at least 1, e.g. 1 on CPU or 4 on a GPU with memory to spare"
            )
        if runtime is not None and not all(hasattr(runtime, a) for a in ("topology", "clients", "health")):
            raise UserError(
                f"MegatronBackend(runtime={runtime!r}) must be a started art_mega ArtRuntime "
                "(await ArtRuntime.start(topology)), or None for a local one"
            )
        check_backend_options(
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_targets=lora_targets,
            seq_len=seq_len,
            max_model_len=max_model_len,
            keep_adapters=keep_adapters,
            startup_timeout_s=startup_timeout_s,
            vllm_python=vllm_python,
        )
        if gpu_memory_utilization is not None and (
            fraction_problem(gpu_memory_utilization) is not None or gpu_memory_utilization == 0
        ):
            raise UserError(
                f"MegatronBackend(gpu_memory_utilization={gpu_memory_utilization!r}) is a fraction of "
                "each GPU's memory; use a value in (0, 1], e.g. 0.5, or None for vLLM's default"
            )
        self._runtime = runtime
        self._owns_runtime = runtime is None
        self.lora = {
            "rank": int(lora_rank),
            "alpha": float(lora_alpha),
            "targets": list(lora_targets or []),
        }
        self._given = {"seq_len": seq_len, "max_model_len": max_model_len, "dtype": dtype}
        """The backend's own arguments, before a model's `_internal_config` overrides them."""
        self.seq_len: int | None = None if seq_len is None else int(seq_len)
        """The trainer's sequence limit in tokens (None until `register` without one given)."""
        self._fixed_rows = seq_len is not None
        """Whether `seq_len` is also every packed row's length (set by the user), else rows
        follow the batch (`PACKED_ROW_TOKENS`, `_step_with`)."""
        self.max_model_len: int | None = None if max_model_len is None else int(max_model_len)
        self._engine: Any = None
        """The model's checked `EngineSettings` (`dev.settings`), from `_apply_model_config`."""
        self.keep_adapters = int(keep_adapters)
        self.startup_timeout_s = float(startup_timeout_s)
        self._vllm_python = None if vllm_python is None else str(vllm_python)
        self.gpu_memory_utilization = (
            None if gpu_memory_utilization is None else float(gpu_memory_utilization)
        )
        self.dtype = dtype
        self.micro_batch_rows = int(micro_batch_rows)
        self._placement: dict[str, Any] = {}
        """The GPU placement fields of the model config the owned local runtime was built from."""
        self._shared: Any = None
        self._model: Any = None
        self._model_dir: Path | None = None
        self._run_dir: Path | None = None
        self._service: Any = None
        self._router: Any = None
        self._publisher: Any = None
        self._prefix_cache: dict[str, tuple[float, float]] = {}
        """Each replica's (queried, hit) prefix-cache prompt tokens at the last step's read."""
        self._recovery: Any = None
        self._tokenizer: Any = None
        self._checked_reference: tuple[Any, ...] | None = None
        """What `_check_reference` last accepted: folder, its files' stats, base model, LoRA."""
        self._step = 0
        self._base_is_step0 = True
        self._rl_optimizer = (ART_TRAINER_ARGS["weight_decay"], ART_TRAINER_ARGS["max_grad_norm"])
        self._lock = asyncio.Lock()
        self._behaviour = BehaviourMonitor()
        """Logs the behaviour-policy warning once per run (`trainer.behaviour`)."""

    # ------------------------------------------------------------------ set-up

    async def _local_runtime(self, model: Any) -> Any:
        from art_mega.trainer.checkpoint import root_holding_run

        return await self._start_local(
            model, str(root_holding_run("artifact_root", model.project, model.name))
        )

    async def _start_local(self, model: Any, artifact_root: str) -> Any:
        """Start the loopback runtime `model` trains on, artifacts under `artifact_root`: its
        topology from this host's facts (what its agent reports: GPUs, MIG slices,
        CUDA_VISIBLE_DEVICES) and `model._internal_config` (`launch.local_topology.local_plan`:
        CPU, ART's shared GPUs, or dedicated GPUs from trainer_gpu_ids / inference_gpu_ids).

        Raises:
            HyperParameterError, TopologyError: see `local_plan`; AgentStartError: see
                `ArtRuntime.start_local`.
        """
        from art_mega.launch.context import default_cache_root
        from art_mega.launch.local_topology import local_plan, placement_of
        from art_mega.preflight.host_facts import collect_host_facts
        from art_mega.runtime.runtime import ArtRuntime

        config = getattr(model, "_internal_config", None)
        plan = local_plan(
            collect_host_facts(),
            config,
            artifact_root=artifact_root,
            cache_root=default_cache_root(),
            vllm_python=self._vllm_python or default_vllm_python(),
            startup_timeout_s=self.startup_timeout_s,
        )
        self._placement = placement_of(config)
        return await ArtRuntime.start_local(plan.topology)

    def _apply_model_config(self, model: Any) -> None:
        """Check `model._internal_config` against this backend's runtime and take its
        `init_args.max_seq_length` (the sequence limit, replacing `seq_len`; rows then follow
        the batch, `PACKED_ROW_TOKENS`),
        `engine_args.max_model_len` and `engine_args.gpu_memory_utilization` (replacing the
        backend's) before anything starts.

        Raises:
            HyperParameterError: a value `dev.settings.engine_settings` refuses; a max_lora_rank
                below the backend's lora_rank; GPU
                placement (GPU id lists, tensor_parallel_size, enable_sleep_mode) set for a
                runtime this backend did not build from it, whose topology places the processes.
        """
        from art_mega.dev.settings import engine_settings, log_notes
        from art_mega.errors import HyperParameterError
        from art_mega.launch.local_topology import placement_of

        config = getattr(model, "_internal_config", None) or {}
        settings = engine_settings(config)
        placement = placement_of(config)
        if self._runtime is not None and placement != self._placement:
            name, value = next(iter(placement.items()), next(iter(self._placement.items()), ("", None)))
            if self._owns_runtime:
                where = f"this backend's local runtime was placed for {self._placement or 'ART shared mode'}"
                fix = "close() the backend first or use a new backend for this model"
            else:
                where = "the given runtime's topology places the trainer and replicas"
                fix = "set GPUs in that topology's TrainerSpec/InferenceSpec instead, or leave it out"
            raise HyperParameterError(
                f"TrainableModel(_internal_config=...) sets {name}={value!r}, but {where}; {fix}", name, value
            )
        log_notes(settings)  # one line per setting accepted but done otherwise here
        self._engine = settings
        # init_args.max_seq_length is ART's limit, rows follow the batch; MegatronBackend(seq_len=) fixes them
        self.seq_len = self._given["seq_len"] if settings.max_seq_length is None else settings.max_seq_length
        self._fixed_rows = self._given["seq_len"] is not None and settings.max_seq_length is None
        self.max_model_len = self._given["max_model_len"]
        if settings.max_model_len is not None:
            self.max_model_len = settings.max_model_len
        if settings.gpu_memory_utilization is not None:
            self.gpu_memory_utilization = settings.gpu_memory_utilization
        if self._given["dtype"] == "auto":  # init_args.dtype: the trainer's, unless the backend's is set
            self.dtype = settings.trainer_dtype or "auto"
        if settings.max_lora_rank is not None and settings.max_lora_rank < int(self.lora["rank"]):
            raise HyperParameterError(
                f"TrainableModel(_internal_config=...) sets max_lora_rank={settings.max_lora_rank!r}, below "
                f"the LoRA rank {self.lora['rank']} the replicas must serve; raise it or leave it out",
                "max_lora_rank",
                settings.max_lora_rank,
            )

    def _apply_lora_config(self, model: Any) -> None:
        """Take ART 0.5.23's `model.lora_config` (`rank`, `alpha`, `target_modules`; see
        `dev.lora.lora_settings`) as this backend's LoRA before anything starts. A value the
        backend was given otherwise (not its default) must agree.

        Raises:
            HyperParameterError: a LoRA value out of range, or one that disagrees with the
                backend's `lora_rank` / `lora_alpha` / `lora_targets` (set it once).
            UserError: unknown target modules (`check_backend_options`).
        """
        from art_mega.dev.lora import lora_settings
        from art_mega.errors import HyperParameterError

        wanted = lora_settings(getattr(model, "lora_config", None))
        if not wanted:
            return
        current = {
            "lora_rank": self.lora["rank"],
            "lora_alpha": self.lora["alpha"],
            "lora_targets": tuple(self.lora["targets"]) or None,
        }
        defaults = {"lora_rank": 8, "lora_alpha": 16.0, "lora_targets": None}
        merged = {**current, **wanted}
        check_backend_options(
            **merged,
            seq_len=self.seq_len,
            max_model_len=self.max_model_len,
            keep_adapters=self.keep_adapters,
            startup_timeout_s=self.startup_timeout_s,
            vllm_python=self._vllm_python,
            where="TrainableModel(lora_config=...)",
        )
        for name, value in wanted.items():
            mine = current[name]
            if mine != defaults[name] and mine != (tuple(value) if name == "lora_targets" else value):
                key = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_targets": "target_modules"}[name]
                raise HyperParameterError(
                    f"TrainableModel(lora_config=...) sets {key}={value!r}, but the backend was made with "
                    f"{name}={mine!r}; set the LoRA once",
                    f"lora_config.{key}",
                    value,
                )
        self.lora = {
            "rank": int(merged["lora_rank"]),
            "alpha": float(merged["lora_alpha"]),
            "targets": list(merged["lora_targets"] or []),
        }

    def _checkpoint(self, step: int) -> Path:
        assert self._run_dir is not None
        return checkpoint.step_dir(checkpoint.checkpoints_dir(self._run_dir), step)

    def _require(self, model: Any) -> None:
        if self._model is None or model.name != self._model.name:
            raise UserError(f"model {getattr(model, 'name', model)!r} is not registered with this backend")

    def _template_kwargs(self) -> dict[str, Any]:
        """The registered model's `_internal_config["chat_template_kwargs"]` ({} when unset):
        the replicas render every request with them, so the trainer's tokenization does too."""
        return dict(getattr(self._model, "_internal_config", {}).get("chat_template_kwargs") or {})

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._tokenizer

    # ------------------------------------------------------------------ serving

    def inference_endpoint(self, model: Any) -> tuple[str, str]:
        """(base_url, api_key) of a replica serving `model` (the least-loaded one that is up)."""
        self._require(model)
        return self._router.route().base_url, "art-mega"

    def policy_router(self, model: Any) -> Any:
        """The `PolicyRouter` of `model`'s replicas (what `model.openai_client()` routes with)."""
        self._require(model)
        return self._router

    def inference_name(self, model: Any) -> str:
        """`<name>@<step>` of the served policy."""
        self._require(model)
        return self._router.inference_name()

    async def get_step(self, model: Any) -> int:
        self._require(model)
        return self._step

    async def close(self) -> None:
        """Stop the replicas and trainer ranks this backend started and forget its model (a later
        `register` starts them again); close the runtime when this backend owns it (a later
        `register` starts a new one). Idempotent. A step in flight (`train`, `train_sft`) ends
        first: the ranks and replicas it uses are not stopped under it; a step that waits for
        the backend then finds the model unregistered (UserError)."""
        async with self._lock:
            run_dir = self._run_dir
            await self._stop_serving()
        if run_dir is not None:
            from art_mega.progress import line

            line(f"art-mega: run folder {run_dir}")
        if self._owns_runtime and self._runtime is not None:
            runtime, self._runtime = self._runtime, None
            await runtime.close()

    async def __aenter__(self) -> MegatronBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
