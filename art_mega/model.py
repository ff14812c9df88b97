"""Model and TrainableModel: the names a program trains and serves (ART's client API).

They are plain serializable descriptions until registered with a backend: nothing is loaded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator

from art_mega.dev.train import TRAIN_CONFIG_KEYS
from art_mega.errors import HyperParameterError, UserError
from art_mega.train_options import TrainConfig, art_epsilons
from art_mega.types import TrainResult


def _check_name(value: str, field: str) -> str:
    if not value or not value.strip() or value != value.strip():
        raise ValueError(f"{field} {value!r} must be a non-empty name without surrounding spaces")
    if any(c in value for c in "/\\@\0\n\r"):
        raise ValueError(f"{field} {value!r} must not contain '/', '\\\\', '@', NUL or line breaks")
    return value


ModelConfig = TypeVar("ModelConfig", bound="BaseModel | None")
"""The type of a model's `config` (`TrainableModel[MyConfig]`): a pydantic model the rollout reads."""

REPORT_TARGETS = ("wandb",)
"""The names `report_metrics` may hold (ART's: where `model.log` rows go besides history.jsonl)."""


class Model(BaseModel, Generic[ModelConfig]):
    """A model a rollout calls, as ART's `art.Model`: `name` within `project`.

    A prompted model (`art.Model(name=, project=, inference_base_url=, inference_api_key=,
    inference_model_name=)`) is any OpenAI-compatible endpoint: `openai_client()` and
    `litellm_completion_params()` point at it, so the rollout that samples a `TrainableModel`
    evaluates it unchanged. `entity`, `id` and `run_id` are ART's W&B / server identifiers (kept
    on the model, None by default); `config` is the program's own pydantic model (`Model[Cfg]`
    types it); `base_path` is where an unregistered model's history goes
    (`<base_path>/<project>/models/<name>`; default `.art`, as ART's; left at its default, a run
    that exists only under art-mega's earlier `.art-mega` is read there, with one logged line);
    `report_metrics`: None = W&B when WANDB_API_KEY is set (ART's default), [] = history.jsonl only,
    ["wandb"] = W&B too.

    Raises:
        pydantic.ValidationError: a name that is empty or holds '/', '\\', '@', NUL or a line break;
            `config` that is not a pydantic model (a dict is refused: ART's config is a model) or
            not JSON-serializable; a `report_metrics` name other than "wandb"; an unknown field.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    project: str
    entity: str | None = None
    id: str | None = None
    run_id: str | None = None
    run_name: str | None = None
    config: ModelConfig | None = None
    trainable: bool = False
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None
    base_path: str = ".art"
    report_metrics: list[str] | None = None
    _openai_client: Any = PrivateAttr(default=None)
    _backend: Any = PrivateAttr(default=None)
    _output_dir: str | None = PrivateAttr(default=None)
    _wandb: Any = PrivateAttr(default=None)
    _builder: Any = PrivateAttr(default=None)
    _wandb_config: dict[str, Any] = PrivateAttr(default_factory=dict)
    # ART's time/wall_clock_sec counts from the model's creation; time/step_wall_s between train rows
    _run_started: float = PrivateAttr(default_factory=time.time)
    _last_train_log: float = PrivateAttr(default_factory=time.monotonic)
    _last_train_step: int | None = PrivateAttr(default=None)

    @field_validator("name", "project")
    @classmethod
    def _names(cls, value: str, info: Any) -> str:
        return _check_name(value, info.field_name)

    @field_validator("config", mode="before")
    @classmethod
    def _config(cls, value: Any) -> Any:
        if value is None:
            return value
        # Model[Cfg] validates a dict (e.g. a dumped model) into Cfg; a bare Model has no class for it
        typed = bool(cls.__pydantic_generic_metadata__["args"])
        if not isinstance(value, BaseModel) and not (typed and isinstance(value, dict)):
            raise ValueError(
                f"config must be a pydantic model instance (ART: config=MyConfig(...) with "
                f"`class MyConfig(pydantic.BaseModel)`), not a {type(value).__name__}; a dumped config "
                "(e.g. a model sent to a rollout worker) validates back when the class is typed, "
                "art.TrainableModel[MyConfig](...)"
            )
        if isinstance(value, BaseModel):  # a dict is validated (and so checked) by Cfg itself
            try:
                value.model_dump_json()
            except Exception as exc:  # pydantic's PydanticSerializationError, or a field's own error
                raise ValueError(
                    f"config {type(value).__name__} cannot be serialized to JSON ({exc})"
                ) from None
        return value

    @field_validator("report_metrics")
    @classmethod
    def _report_metrics(cls, value: list[str] | None) -> list[str] | None:
        unknown = [name for name in value or [] if name not in REPORT_TARGETS]
        if unknown:
            raise ValueError(
                f"report_metrics names {unknown!r}, which art-mega does not report to; use ['wandb'], "
                "[] (history.jsonl only) or None (W&B when WANDB_API_KEY is set)"
            )
        return value

    @field_validator("base_path")
    @classmethod
    def _base_path(cls, value: str) -> str:
        if not value.strip() or "\0" in value:
            raise ValueError(f"base_path {value!r} must be a directory path, e.g. '.art'")
        return value

    @property
    def output_dir(self) -> Path:
        """Where this model's history (and, once registered, checkpoints and report) go:
        `<base_path>/<project>/models/<name>`, or the backend's run directory after `register`."""
        if self._output_dir is not None:
            return Path(self._output_dir)
        from art_mega.trainer.checkpoint import root_holding_run, run_dir

        if "base_path" in self.model_fields_set:
            return run_dir(Path(self.base_path).resolve(), self.project, self.name)
        return run_dir(root_holding_run("base_path", self.project, self.name), self.project, self.name)

    def metrics_builder(self, cost_context: str | None = None) -> Any:
        """ART's `model.metrics_builder()`: the model's `art_mega.metrics.MetricsBuilder` (cost
        context "train"), or one for `cost_context` ("eval", ...) sharing its state. What it
        holds goes into the next `model.log` row of its split (train -> "train", val/test ->
        "eval"); its running totals persist in `<output_dir>/state.json` as ART's.

        Raises:
            HyperParameterError: an empty `cost_context`.
            UserError: state.json is not a JSON object, or its builder state is malformed.
        """
        builder = self._metrics()
        return builder if cost_context is None else builder.for_cost_context(cost_context)

    def activate_metrics_context(self, cost_context: str) -> Any:
        """`metrics_builder(cost_context).activate()`: the token to reset (ART's)."""
        return self.metrics_builder(cost_context).activate()

    def _metrics(self) -> Any:
        """The model's builder, its totals loaded from state.json the first time."""
        from art_mega.metrics import BUILDER_STATE_KEY, MetricsBuilder, read_state

        if self._builder is None:
            builder = MetricsBuilder("train")
            saved = read_state(self.output_dir).get(BUILDER_STATE_KEY)
            if saved is not None:
                builder.load_state_dict(saved)
            self._builder = builder
        return self._builder

    def _save_metrics_state(self) -> None:
        from art_mega.metrics import BUILDER_STATE_KEY, read_state, write_state

        state = read_state(self.output_dir)
        state[BUILDER_STATE_KEY] = self._builder.state_dict()
        write_state(self.output_dir, state)

    def _automatic_metrics(self, split: str, step: int) -> dict[str, float]:
        """ART's LocalBackend step metrics for a registered model's train rows:
        `time/step_wall_s`, the seconds since the previous train row of another step (or since
        the model was made), and, on a `LocalBackend` with a GPU price
        (`LocalBackend.automatic_gpu_cost_per_hour_usd`), `costs/gpu` = that wall time * the
        price in USD per hour / 3600; {} for other splits, unregistered models and a repeated
        step."""
        if split != "train" or self._backend is None or self._last_train_step == step:
            return {}
        now = time.monotonic()
        wall = max(0.0, now - self._last_train_log)
        self._last_train_log, self._last_train_step = now, step
        automatic = {"time/step_wall_s": wall}
        # ART's duck-typed hook (only LocalBackend has it); the model never imports a backend.
        price = getattr(self._backend, "automatic_gpu_cost_per_hour_usd", None)
        if price is not None:
            per_hour = price(self)
            if per_hour is not None:
                automatic["costs/gpu"] = wall * per_hour / 3600.0
        return automatic

    async def log(
        self,
        trajectories: Any = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, Any]:
        """ART's `model.log`: one history.jsonl row in `output_dir` (and on W&B as
        `report_metrics` says), for a prompted model too (ART compares them so); the groups
        also go to `<output_dir>/trajectories/<split>/<step:04d>.parquet` (ART's file,
        `art_mega.metrics_files`).

        `trajectories` (ART's name): None (metrics only), a list of TrajectoryGroup, or a list of
        Trajectory (and exceptions) logged as one group, as in ART (whose argument order this
        follows: split second, metrics and step by name). `split`: "val" unless given, as in
        ART, so training groups are logged with split="train". `metrics`: names -> numbers (a NaN
        would be left out of the row, so it is refused; +-inf is logged as is); `costs/*`,
        `time/step_*`, `data/step_*` and `throughput/step_*` keys join the metrics builder's step
        (`metrics_builder()`). `step`: None = the model's current step (0 unregistered). Returns
        the row written (see `art_mega.metrics` for the names); {} and nothing written when there
        is nothing to log (no groups and no metrics: the builder's pending step waits, as in ART).

        Raises:
            HyperParameterError: a split that is not a non-empty name, a step that is not a
                whole number >= 0, metrics that are not a dict of numbers or hold a NaN, a legacy
                `costs_*` key, or groups that are not one of the forms above (named, one sentence).
            UserError: report_metrics=['wandb'] without WANDB_API_KEY; pyarrow (the trajectories
                extra) or, when reporting to W&B, wandb (the wandb extra) not installed.
        """
        from art_mega.metrics import WandbRun, append_history, history_row
        from art_mega.metrics_files import trajectory_file, write_trajectory_groups

        groups = _log_groups(trajectories)
        _check_log_options(split, metrics, step)
        if groups is None and metrics is None:
            return {}  # as ART: nothing to log, and the builder keeps its pending step
        wandb = self._reports_to_wandb()
        if step is None:
            step = await self.get_step() if self._backend is not None else 0
        builder = self._metrics()
        if wandb and self._wandb is None:  # opened first: a missing wandb refuses before anything is written
            config = {} if self.config is None else self.config.model_dump(mode="json")
            config = _merge_wandb_config(config, self._wandb_config, "")
            self._wandb = WandbRun(self.project, self.name, self.entity, config, self.run_name)
        if groups is not None:
            write_trajectory_groups(groups, trajectory_file(self.output_dir, split, step))
        automatic = self._automatic_metrics(split, step) if groups is not None or metrics is not None else {}
        row = history_row(
            groups,
            split=split,
            step=step,
            metrics=metrics,
            builder=builder,
            automatic=automatic,
            wall_clock_sec=time.time() - self._run_started,
        )
        if not row:
            return row
        append_history(self.output_dir / "history.jsonl", row)
        self._save_metrics_state()
        if wandb:
            self._wandb.log(row)
        if split == "train" and self._backend is not None:
            from art_mega.progress import PLANNED_STEPS, line

            line(step_line(row, PLANNED_STEPS["last"]))
        return row

    def _reports_to_wandb(self) -> bool:
        """ART's rule: report_metrics None -> W&B when WANDB_API_KEY is set; ['wandb'] -> W&B,
        which needs the key unless WANDB_MODE is offline (or dryrun, disabled): an offline run
        is written under WANDB_DIR without any account.

        Raises:
            UserError: ['wandb'] without WANDB_API_KEY and not offline (ART would log nothing to
                W&B in silence).
        """
        key = bool(os.environ.get("WANDB_API_KEY"))
        if self.report_metrics is None:
            return key
        offline = os.environ.get("WANDB_MODE", "").strip().lower() in ("offline", "dryrun", "disabled")
        if "wandb" in self.report_metrics and not key and not offline:
            raise UserError(
                f"model {self.name!r} has report_metrics={self.report_metrics!r} but WANDB_API_KEY is not "
                "set; set it, set WANDB_MODE=offline to write the W&B run locally, or pass "
                "report_metrics=None (W&B only when the key is set) or []"
            )
        return "wandb" in self.report_metrics

    def read_state(self) -> dict[str, Any] | None:
        """ART's persistent run state: `<output_dir>/state.json` (None when there is none).

        Raises:
            UserError: the file is not a JSON object.
        """
        from art_mega.metrics import STATE_FILE, read_state

        return read_state(self.output_dir) if (self.output_dir / STATE_FILE).exists() else None

    def overwrite_state(self, state: dict[str, Any]) -> None:
        """Replace state.json with `state` (ART's; the metrics builder's totals are written back
        at the next `log`).

        Raises:
            HyperParameterError: `state` is not a dict that JSON can hold.
        """
        from art_mega.metrics import write_state

        write_state(self.output_dir, _json_state("overwrite_state", state))

    def write_state(self, state: dict[str, Any]) -> None:
        """ART's deprecated name of `overwrite_state` (warns as ART does)."""
        import warnings

        warnings.warn(
            "write_state() is deprecated. Use overwrite_state() or merge_state() instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        self.overwrite_state(state)

    def merge_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Deep-merge `state` into state.json (nested dicts merge, other values replace, as in
        ART) and return the merged state.

        Raises:
            HyperParameterError: `state` is not a dict that JSON can hold.
            UserError: the existing file is not a JSON object.
        """
        from art_mega.metrics import write_state

        merged = _deep_merge(self.read_state() or {}, _json_state("merge_state", state))
        write_state(self.output_dir, merged)
        return merged

    def update_wandb_config(self, config: dict[str, Any]) -> None:
        """Merge `config` into the W&B run's config (ART's: given to `wandb.init` when the run
        opens, or updated on the open run). A key already set keeps its value: W&B config is
        immutable, as in ART.

        Raises:
            HyperParameterError: `config` is not a dict, or changes a value already set (named by
                its dotted path).
        """
        if not isinstance(config, dict):
            raise HyperParameterError(
                f"update_wandb_config(config={config!r}) must be a dict of names to values",
                "config",
                config,
            )
        self._wandb_config = _merge_wandb_config(self._wandb_config, config, "")
        if self._wandb is not None:  # the merge kept every set leaf: a nested dict may only grow
            self._wandb.run.config.update(self._wandb_config, allow_val_change=True)

    def get_inference_name(self, step: int | None = None) -> str:
        """The name requests send as `model=`: `inference_model_name` (else `name`), with
        `@<step>` appended when `step` is given (ART's checkpoint naming).

        Raises:
            HyperParameterError: `step` is not None or a whole number >= 0.
        """
        from art_mega.hyperparams import check, optional, whole_problem

        check("get_inference_name", "step", step, optional(whole_problem(0)), "3")
        base = self.inference_model_name or self.name
        return base if step is None else f"{base}@{step}"

    def _endpoint(self) -> tuple[str, str]:
        if self.inference_base_url is None or self.inference_api_key is None:
            raise UserError(
                f"model {self.name!r} has no inference endpoint: pass art.Model(..., inference_base_url="
                "'http://host:port/v1', inference_api_key='...') (any non-empty key for a server without one)"
            )
        return self.inference_base_url, self.inference_api_key

    def openai_client(self) -> Any:
        """An `openai.AsyncOpenAI` client of `inference_base_url` with `inference_api_key` (made once).

        Raises:
            UserError: the base URL or the API key is not set.
        """
        if self._openai_client is None:
            from openai import AsyncOpenAI

            base_url, api_key = self._endpoint()
            self._openai_client = AsyncOpenAI(base_url=base_url, api_key=api_key)
        return self._openai_client

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """`litellm.completion(**params, messages=...)` keywords for this model, as ART's:
        `model` (`get_inference_name(step)`, prefixed `hosted_vllm/` for a trainable model),
        `base_url`, `api_key` and `temperature` 1.

        Raises:
            UserError: the endpoint is not set (a trainable model before `register`).
            HyperParameterError: `step` is not None or a whole number >= 0.
        """
        name = self.get_inference_name(step)
        base_url, api_key = self._endpoint()
        return {
            "model": f"hosted_vllm/{name}" if self.trainable else name,
            "base_url": base_url,
            "api_key": api_key,
            "temperature": 1,
        }

    def safe_model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`model_dump(*args, **kwargs)` with `config` set to None (ART's: a dump that needs
        no config class to serialize or load, e.g. for a backend or a rollout worker)."""
        data = self.model_dump(*args, **kwargs)
        data["config"] = None
        return data

    def backend(self) -> Any:
        """The backend `register` attached the model to (ART's accessor).

        Raises:
            UserError: the model is not registered.
        """
        if self._backend is None:
            raise UserError(
                f"model {self.name!r} is not registered with a backend; call "
                "`await model.register(backend)` first"
            )
        return self._backend

    async def register(self, backend: Any) -> None:
        """Attach a prompted model to `backend`, as ART's programs do to compare it with the
        trained one: its `log` rows then go to the backend's run folder
        `<artifact_root>/<project>/models/<name>` (a `LocalBackend(path=)`'s `<path>/...`, as in
        ART), beside the trained model's, and `backend()` returns it. Nothing starts: requests
        still go to `inference_base_url`.

        Raises:
            UserError: `backend` is not an art-mega backend (`MegatronBackend`, `LocalBackend`).
        """
        from art_mega.trainer.checkpoint import run_dir

        # Duck-typed: the model never imports the backend (it sits below it, see
        # tests/unit/project/test_import_graph.py); every art-mega backend has `_artifact_root()`.
        artifact_root = getattr(backend, "_artifact_root", None)
        if not callable(artifact_root):
            raise UserError(
                f"model.register(backend={type(backend).__name__}) needs an art-mega backend; "
                "pass a LocalBackend() or a MegatronBackend(runtime=...)"
            )
        self._backend = backend
        self._output_dir = str(run_dir(artifact_root(), self.project, self.name))

    async def get_step(self) -> int:
        """The model's training step: always 0 for a prompted model (ART's; it has no
        checkpoints), so `model.log` rows of an evaluation land at step 0."""
        return 0


class TrainableModel(Model[ModelConfig], Generic[ModelConfig]):
    """A model that art-mega trains: `base_model` is an HF directory, a cached name, an adapter, or a
    Hugging Face repo id ("Qwen/Qwen3-0.6B", from the HF cache or downloaded into it).

    Serializable without loading anything; the backend resolves `base_model` on `register`.
    Until registered, `log` writes to `<base_path>/<project>/models/<name>/history.jsonl`
    (`./.art/...` by default, as ART's). `_internal_config` is ART's `art.dev.InternalModelConfig`:
    checked by `art_mega.dev.check_internal_config` (fields art-mega does not read are refused)
    and kept as `model._internal_config` ({} when not given) for the backend. `register` fills
    `inference_base_url`, `inference_api_key` and `inference_model_name` from the backend.

    Raises:
        HyperParameterError: an `_internal_config` field art-mega does not read, or of a wrong
            type; a `lora_config` key art-mega's LoRA cannot train (`dev.lora.lora_settings`).
        pydantic.ValidationError: see `Model`; an empty `base_model`.
    """

    base_model: str
    lora_config: dict[str, Any] | None = None
    """ART 0.5.23's `art.dev.LoRAConfig` (None: the backend's LoRA); `rank`, `alpha` and
    `target_modules` set the adapter the backend trains (`art_mega.dev.lora.lora_settings`)."""
    trainable: bool = True
    _internal_config: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, *, _internal_config: Any = None, **fields: Any) -> None:
        from art_mega.dev.lora import lora_settings
        from art_mega.dev.model import check_internal_config

        checked = {} if _internal_config is None else check_internal_config(_internal_config)
        lora_settings(fields.get("lora_config"))
        super().__init__(**fields)
        self._internal_config = checked

    def _require_backend(self) -> Any:
        if self._backend is None:
            raise RuntimeError(
                f"model {self.name!r} is not registered; call `await model.register(backend)` first"
            )
        return self._backend

    async def register(self, backend: Any) -> None:
        """Attach to `backend`: it resolves the base model, sets the output dir, serves the
        current step; then `inference_base_url` / `inference_api_key` are one replica's and
        `inference_model_name` is the served `<name>@<step>` (as ART sets them)."""
        self._backend = backend
        self._output_dir = str(await backend.register(self))
        self.inference_base_url, self.inference_api_key = backend.inference_endpoint(self)
        self.inference_model_name = backend.inference_name(self)
        from art_mega.metrics import LAUNCH_RESTARTS, record_restarts

        if LAUNCH_RESTARTS:  # this program is a rerun after a lost host: say so in the history
            record_restarts(self._output_dir, await self.get_step())
        from art_mega.progress import line

        line(f"art-mega: run folder {self._output_dir}")

    def openai_client(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` client over the backend's replicas (`kwargs`: its options).

        Every request goes to a replica that is up (the one holding its prompt prefix, else
        the least-loaded: `inference.fleet`); each choice of a reply is
        tagged with the policy step that served it (`choice.policy_step`, kept by `Trajectory`);
        a request that fails raises `ReplicaRequestError` naming the replica. Chat completions
        ask for what training needs unless the caller says otherwise: `logprobs=True` and
        `extra_body={"return_token_ids": True}` (the sampled token ids, so training never
        re-tokenizes sampled text). See `art_mega.inference.policy_client`.
        """
        from art_mega.inference.policy_client import policy_client

        return policy_client(self._require_backend().policy_router(self), **kwargs)

    def get_inference_name(self, step: int | None = None) -> str:
        """The served model name: `<name>@<step>` of the latest published policy, or of `step`
        (ART's naming; the replicas serve the newest `MegatronBackend(keep_adapters=)` steps,
        a request for an older one fails with the replica's 404).

        Raises:
            RuntimeError: the model is not registered.
            HyperParameterError: `step` is not None or a whole number >= 0.
        """
        from art_mega.hyperparams import check, optional, whole_problem
        from art_mega.inference.router import inference_name

        check("get_inference_name", "step", step, optional(whole_problem(0)), "3")
        backend = self._require_backend()
        return backend.inference_name(self) if step is None else inference_name(self.name, step)

    async def get_step(self) -> int:
        """The latest committed training step (0 before any training)."""
        return int(await self._require_backend().get_step(self))

    async def train(
        self, trajectory_groups: Any, config: Any = None, _config: Any = None, **kwargs: Any
    ) -> Any:
        """ART's `model.train(groups, config=TrainConfig(...), _config=dev.TrainConfig(...))`:
        one GRPO step through the backend, then the groups and the step's metrics logged in one
        `model.log(groups, metrics=result.metrics, split="train")` row at the step that sampled
        them (the step before this one), as ART's `model.train` did (`LocalBackend._train_model`
        logged the train batch and, after the step, the trainer's metrics at that same step), so
        ART's example programs, which log only their val groups, get their train reward curve; a
        program that also logs the train groups itself gets two rows for the step, as in ART.
        (ART 0.5.x replaced `model.train` by `backend.train` and `model.log(groups,
        metrics=result.metrics, step=result.step, split="train")`.) Returns `backend.train`'s
        `TrainResult`.

        `config`'s learning rate, `kl_penalty_coef` and `beta` (as `kl_beta`) apply; a
        `learning_rate`, `kl_penalty_coef` or `kl_beta` in `kwargs` must agree with them (see
        `backend.check_grpo_options`). `_config` is ART's `dev.TrainConfig` (a dict): each key
        becomes the `backend.train` keyword of that name, except `ppo` (True: `loss_fn="ppo"`,
        False: "cispo") and `epsilon_high: None` (ART's "the same as epsilon"); a key of
        `art_mega.dev.TrainConfig` that art-mega does not implement is refused by the backend with its
        sentence unless at its off value.

        Raises:
            HyperParameterError: `config` is not a `TrainConfig`; `_config` is not a dict, has a
                key that is not ART's, a non-bool `ppo`, or a key also given as a keyword; and
                what `backend.train` raises.
        """
        if config is not None:
            if not isinstance(config, TrainConfig):
                raise HyperParameterError(
                    f"model.train(config={config!r}) must be an art_mega.TrainConfig; pass e.g. "
                    "config=art.TrainConfig(learning_rate=5e-6)",
                    "config",
                    config,
                )
            kwargs["config"] = config  # the backend checks it against learning_rate / kl_beta
        if _config is not None:
            kwargs.update(dev_train_options(_config, kwargs))
        if isinstance(trajectory_groups, Iterator):  # a generator is read twice: to train, to log
            trajectory_groups = list(trajectory_groups)
        sampled_at = await self.get_step()
        result = await self._require_backend().train(self, trajectory_groups, **kwargs)
        if isinstance(result, TrainResult):
            await self.log(trajectory_groups, split="train", metrics=result.metrics, step=sampled_at)
        return result

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Delete every checkpoint but the latest and the best by `best_checkpoint_metric`.

        Returns the deleted steps.
        """
        return list(await self._require_backend().delete_checkpoints(self, best_checkpoint_metric))

    async def train_sft(
        self,
        trajectories: Any,
        config: Any = None,
        _config: Any = None,
        verbose: bool = False,
        log_metrics: bool = True,
        **kwargs: Any,
    ) -> Any:
        """ART's `model.train_sft(trajectories, config=TrainSFTConfig(...), _config=, verbose=)`:
        one optimizer step per batch, one new step (see `MegatronBackend.train_sft`), then, as
        ART, one history row at the new step with the batches' mean metrics (`loss/train`,
        `loss/learning_rate`, `loss/grad_norm`, `data/step_*`, `time/step_trainer_s`).

        Returns the backend's TrainResult (ART returns None). `kwargs` are TrainSFTConfig fields.
        `log_metrics` (ART 0.5.23's): False writes no history row.

        Raises:
            What `MegatronBackend.train_sft` raises (nothing is logged then).
        """
        backend = self._require_backend()
        if not isinstance(log_metrics, bool):
            raise HyperParameterError(
                f"model.train_sft(log_metrics={log_metrics!r}) must be True or False",
                "log_metrics",
                log_metrics,
            )
        result = await backend.train_sft(self, trajectories, config, _config, verbose, **kwargs)
        if log_metrics:
            await self.log(None, split="train", metrics=result.metrics, step=result.step)
        return result

    @field_validator("base_model")
    @classmethod
    def _base(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "base_model must name an HF directory, a cached model, a PEFT adapter or a Hugging Face repo id"
            )
        return value


def dev_train_options(dev_config: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """ART's `dev.TrainConfig` dict as `backend.train` keywords (see `TrainableModel.train`).

    ART reads absent keys as their defaults and `epsilon_high: None` as "epsilon"; its `ppo`
    picks the objective, the rest keep their names. A key whose value ART treats as "off" (a
    None `epsilon`, `kimi_k2_tau`, `truncated_importance_sampling`,
    `max_negative_advantage_importance_sampling_weight`) is passed as None, which the backend
    reads the same way.

    Raises:
        HyperParameterError: `dev_config` is not a dict, a key is not one of
            `TRAIN_CONFIG_KEYS`, `ppo` is not a bool, or a key is also in `given` (the keywords).
    """
    where = "model.train(_config)"
    if not isinstance(dev_config, dict):
        raise HyperParameterError(
            f"model.train(_config={dev_config!r}) must be ART's dev.TrainConfig (a dict); pass e.g. "
            "_config=art.dev.TrainConfig(ppo=True)",
            "_config",
            dev_config,
        )
    options: dict[str, Any] = {}
    for key, value in dev_config.items():
        if key not in TRAIN_CONFIG_KEYS:
            raise HyperParameterError(
                f"{where} has the key {key!r}, which ART's dev.TrainConfig does not have; use one of "
                f"{', '.join(TRAIN_CONFIG_KEYS)}",
                str(key),
                value,
            )
        name = "loss_fn" if key == "ppo" else key
        if name in given:
            raise HyperParameterError(
                f"{where} sets {key!r} and model.train got {name}= too; set it once",
                name,
                value,
            )
        if key == "ppo":
            if not isinstance(value, bool):
                raise HyperParameterError(
                    f"{where}['ppo']={value!r} must be True or False; pass e.g. {{'ppo': True}}", "ppo", value
                )
            value = "ppo" if value else "cispo"
        options[name] = value
    if "epsilon_high" in options and options["epsilon_high"] is None:
        epsilon = options.get("epsilon", given.get("epsilon"))
        if epsilon is None:
            epsilon = art_epsilons(options.get("loss_fn", given.get("loss_fn", "cispo")))[0]
        options["epsilon_high"] = epsilon
    return options


def _json_state(where: str, state: Any) -> dict[str, Any]:
    """`state` when it is a dict JSON can hold.

    Raises:
        HyperParameterError: it is not (names the call).
    """
    import json

    try:
        if not isinstance(state, dict):
            raise TypeError
        json.dumps(state)
    except (TypeError, ValueError):
        raise HyperParameterError(
            f"model.{where}(state=...) must be a dict of JSON values (str keys; str, numbers, bools, "
            f"None, lists, dicts), not {_shown(state)}",
            "state",
            None,
        ) from None
    return state


def _deep_merge(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in updates.items():
        both = isinstance(merged.get(key), dict) and isinstance(value, dict)
        merged[key] = _deep_merge(merged[key], value) if both else value
    return merged


def _merge_wandb_config(existing: dict[str, Any], updates: dict[str, Any], path: str) -> dict[str, Any]:
    """ART's rule: new keys are added, dicts merge, and a set value may not change.

    Raises:
        HyperParameterError: a value already set changes (its dotted path named).
    """
    merged = dict(existing)
    for key, value in updates.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in merged:
            merged[key] = value
        elif isinstance(merged[key], dict) and isinstance(value, dict):
            merged[key] = _merge_wandb_config(merged[key], value, where)
        elif merged[key] != value:
            raise HyperParameterError(
                f"update_wandb_config sets {where!r} to {value!r}, but it is already {merged[key]!r}; W&B "
                "config is immutable once set (as in ART): use another key",
                where,
                value,
            )
    return merged


def step_line(row: dict[str, Any], planned: int = 0) -> str:
    """The one line a person reads per training step, from its history row: "step 3/6" (of
    `planned`, the dataset iteration's steps, when known), the train reward, the loss, the
    trained tokens and the step's wall time (`time/step_wall_s`), each when the row has it."""
    parts = [f"step {row['step']}" + (f"/{planned}" if planned else "")]
    for label, key, fmt in (
        ("reward", "train/reward", ".3f"),
        ("loss", "loss/train", ".4g"),
        ("trained tokens", "data/step_trainer_tokens", ".0f"),
        ("rollouts", "time/step_actor_s", ".1f"),
        ("step", "time/step_wall_s", ".1f"),
    ):
        if isinstance(row.get(key), (int, float)):
            parts.append(f"{label} {row[key]:{fmt}}" + (" s" if key.startswith("time/") else ""))
    return "art-mega: " + ", ".join(parts)


def _log_groups(value: Any) -> list[Any] | None:
    """`model.log`'s groups: None as None (metrics only); a list of TrajectoryGroup as given;
    Trajectory items (and exceptions, counted as such) as one group, as ART does."""
    from art_mega.trajectories import Trajectory, TrajectoryGroup

    if value is None:
        return None
    if isinstance(value, TrajectoryGroup):
        return [value]
    items = None if isinstance(value, (str, bytes, dict)) else _as_list(value)
    if items is not None and all(isinstance(i, TrajectoryGroup) for i in items):
        return items
    if items is not None and all(isinstance(i, (Trajectory, BaseException)) for i in items):
        return [TrajectoryGroup(items)]  # exceptions become the group's exception records
    raise HyperParameterError(
        f"model.log(trajectories) got {_shown(value)}; pass a list of art.TrajectoryGroup, a "
        "list of art.Trajectory, or None to log only metrics",
        "trajectories",
        None,
    )


def _as_list(value: Any) -> list[Any] | None:
    try:
        return list(value)
    except TypeError:
        return None


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds)}"
    return f"a {type(value).__name__}"


def _check_log_options(split: Any, metrics: Any, step: Any) -> None:
    """Refuse `model.log`'s split, metrics and step unless they are what the row needs.

    Raises:
        HyperParameterError: the argument (and metric name), its value and the fix.
    """
    from art_mega.hyperparams import check, optional, whole_problem

    if not isinstance(split, str) or not split or "/" in split or split != split.strip():
        raise HyperParameterError(
            f"model.log(split={split!r}) must be a name without '/' such as 'train' or 'val'",
            "split",
            split,
        )
    check("model.log", "step", step, optional(whole_problem(0)), "3")
    if metrics is None:
        return
    if not isinstance(metrics, dict):
        raise HyperParameterError(
            f"model.log(metrics={metrics!r}) must be a dict of names to numbers, e.g. "
            "metrics={'loss/train': 0.1}",
            "metrics",
            metrics,
        )
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise HyperParameterError(
                f"model.log(metrics=...) has the key {name!r}; metric names are non-empty strings",
                "metrics",
                name,
            )
        why = _metric_problem(value)
        if why is not None:
            raise HyperParameterError(
                f"model.log(metrics=...) has {name!r}: {value!r}, {why}; "
                "log numbers (leave the metric out when it has no value)",
                name,
                value,
            )


def _metric_problem(value: Any) -> str | None:
    """None for a real number other than NaN (a bool counts as 0 or 1), else why it is not one."""
    import math
    import numbers

    if not isinstance(value, numbers.Real) and not (
        type(value).__module__ == "numpy" and type(value).__name__ == "bool"
    ):
        return f"a {type(value).__name__}, not a number"
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        return "an int too large for a float"
    # history_row leaves NaN out of the row; +-inf is written as is (a ratio that overflowed)
    return "which the history row cannot hold" if math.isnan(number) else None
