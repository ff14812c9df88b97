"""Every message of the trainer service, typed: controller <-> agent (the /trainer/* routes) and
agent <-> rank (newline-delimited JSON on the inherited socket, see `trainer.routes`).

One GRPO step crosses these hops, and each carries one of the models below, built by its sender
(`model_dump_json()`) and validated by its receiver (`model_validate_json()`):

    controller -> agent   TRAINER_START (`TrainerStartRequest`: the ranks and their `RankConfig`),
                          TRAINER_JOB (`TrainerJobRequest`: a job id and one `TrainJob`),
                          TRAINER_EVENTS (`TrainerEventsRequest`), TRAINER_STOP
    agent -> rank         the `RankConfig` (first line on the socket), then each `TrainerJobRequest`
    rank -> agent         `RankEvent` lines (one discriminated union over `kind`)
    agent -> controller   `TrainerEventsResponse`: each event as a `TrainerEvent` (rank, time, event)

Files the controller writes for a rank (each step's batch, `trainer.batch.TrainBatch`) and the
checkpoint manifest (`trainer.checkpoint.Manifest`) have their own checked formats.

Every model refuses unknown fields, so a misspelled option fails where it is received, naming
the field (`describe_invalid`), instead of silently taking its default. Adding a trainer option
is one field here and its use on the rank. The user-facing checks of the hyper-parameters
(`art_mega.hyperparams`, `backend.check_grpo_options`) stay at the edge; the constraints here
hold any sender to the same ranges.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from art_mega.agent.protocol import ShutdownResponse
from art_mega.agent.routes import Route
from art_mega.errors import UserError
from art_mega.topology.compiled import TrainerRank
from art_mega.topology.trainer import TrainerSpec
from art_mega.trainer.families import LORA_NAMES

BODY_LIMIT = 64 * 1024 * 1024
"""Bytes one trainer message may take: a /trainer/start or /trainer/job body, or one line on a
rank's socket (a start's rank table grows with the world size)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Finite = Annotated[float, Field(allow_inf_nan=False)]
Step = Annotated[int, Field(ge=0, strict=True)]


# --- launch config ---------------------------------------------------------------------------


class LoraConfig(_Body):
    """The adapter's LoRA, applied on the rank by `trainer.rank.lora.apply_lora`.

    Built in Python (the controller, a `TrainerEngine` user), a rank < 1, no target, an unknown
    target or part of a fused layer's HF names raises `UserError` (one sentence); in a JSON
    message (`model_validate_json`) the same values fail its validation (`ValidationError`,
    which `describe_invalid` names for the rank).
    """

    rank: int = Field(default=8, ge=1, strict=True)
    """r, the adapter's inner width."""
    alpha: Finite = Field(default=16.0, gt=0)
    """The scaling numerator: the update is (alpha / rank) * B A."""
    targets: tuple[str, ...] = LORA_NAMES.default_targets
    """Megatron layer names (linear_qkv, linear_proj, linear_fc1, linear_fc2, and Qwen3.5's
    gated delta-net in_proj_qkv, in_proj_z, out_proj) or HF module names (q_proj, ..., down_proj;
    a fused layer needs all of its HF names), as every family names them (`families.LORA_NAMES`);
    normalised to Megatron names in that order. Default: the first four (`default_targets`),
    which the trainer engine replaces with the model family's default when `targets` is not set
    (as ART 0.5.23 picks per model: Qwen3.5 adds its delta-net projections, DeepSeek-V3 has its
    MLA projections); the backend always sends the model's targets."""
    seed: int = Field(default=0, ge=0, strict=True)
    """Seeds A's initialisation (per layer, independent of the TP layout)."""

    @field_validator("rank", mode="before")
    @classmethod
    def _rank_sentence(cls, value: object, info: ValidationInfo) -> object:
        # a Python caller gets art-mega's sentence; a JSON message the field check below it
        if info.mode == "python" and type(value) is int and value < 1:
            raise UserError(f"LoRA rank={value} must be at least 1.")
        return value

    @field_validator("targets")
    @classmethod
    def _megatron_names(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        try:
            if not value:
                raise UserError("LoRA targets are empty; name at least one layer.")
            return LORA_NAMES.normalise(value)
        except UserError as exc:
            if info.mode == "python":
                raise
            raise ValueError(str(exc)) from None

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor applied to the adapter's output."""
        return self.alpha / self.rank

    def hf_target_modules(self) -> list[str]:
        """The HF module names the adapter covers, sorted (PEFT's `target_modules`)."""
        return LORA_NAMES.hf_target_modules(self.targets)


class OptimizerConfig(_Body):
    """AdamW over the LoRA parameters (Megatron's optimizer; decoupled weight decay), built by
    `trainer.rank.engine.TrainerEngine`. `backend.art_optimizer` sends ART's defaults."""

    lr: Finite = Field(default=1e-5, gt=0)
    """The default learning rate (a `train_step`, so each job, may pass its own)."""
    weight_decay: Finite = Field(default=0.0, ge=0)
    """AdamW's weight decay (Megatron exempts biases and 1-D parameters; LoRA has none)."""
    beta1: Finite = Field(default=0.9, ge=0, lt=1)
    """Adam's first-moment decay."""
    beta2: Finite = Field(default=0.999, ge=0, lt=1)
    """Adam's second-moment decay."""
    eps: Finite = Field(default=1e-8, gt=0)
    """Adam's epsilon."""
    clip_grad: Finite = Field(default=1.0, ge=0)
    """Clip the global gradient norm (over all ranks) to this value; 0 disables it."""
    distributed: bool | None = None
    """Megatron's distributed optimizer (state sharded over DP); None: when dp > 1."""


class EngineConfig(_Body):
    """What the rank's `TrainerEngine` is built from (`jobs.build_engine`).

    model_dir: the base model's HF folder on the rank's host; dtype: the parameters' dtype;
    micro_batch_rows: packed rows per forward/backward microbatch; resume_dir: a committed
    checkpoint (`checkpoint.step_dir`) to load LoRA and optimizer state from, or
    warm_start: a PEFT adapter folder to start the LoRA from (at most one of the two).
    """

    model_dir: str = Field(min_length=1)
    lora: LoraConfig = LoraConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    dtype: Literal["float32", "bfloat16"] = "float32"
    micro_batch_rows: int = Field(default=1, ge=1, strict=True)
    resume_dir: str | None = None
    warm_start: str | None = None

    @model_validator(mode="after")
    def _one_start(self) -> EngineConfig:
        if self.resume_dir is not None and self.warm_start is not None:
            raise ValueError(
                f"resume_dir={self.resume_dir!r} and warm_start={self.warm_start!r} are both set; "
                "a rank resumes a checkpoint or warm-starts an adapter, so set one of them"
            )
        return self


class RankConfig(_Body):
    """Everything a trainer rank needs at start besides its own rank (`--rank`).

    world_size: trainer ranks in all; master_addr, master_port: rank 0's rendezvous address;
    trainer: the parallel sizes; rank_table: every rank's coordinates, in rank order;
    host_local_root: each trainer host commits its own checkpoint folder
    (`ClusterSpec.shared_artifact_root=False`); engine: the model to train (None: a trainer that
    only runs `PingJob`s).
    """

    world_size: int = Field(ge=1, strict=True)
    master_addr: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535, strict=True)
    trainer: TrainerSpec
    rank_table: tuple[TrainerRank, ...]
    host_local_root: bool = False
    engine: EngineConfig | None = None

    @model_validator(mode="after")
    def _table_is_the_world(self) -> RankConfig:
        ranks = [r.rank for r in self.rank_table]
        if ranks != list(range(self.world_size)):
            raise ValueError(
                f"rank_table holds ranks {ranks}; it must list ranks 0..{self.world_size - 1} "
                f"in order, one per rank of world_size={self.world_size}"
            )
        return self


# --- jobs --------------------------------------------------------------------------------------


class GRPOLossConfig(_Body):
    """The GRPO loss of an `RLJob`: the hyper-parameters of `trainer.rank.loss.grpo_loss`. The defaults
    are the plain clipped-PPO objective; `backend.train` sends ART's defaults (CISPO with epsilon
    1.0 / epsilon_high 4.0).

    Raises `ValidationError` (a `ValueError`) naming the field for a value out of its range, both
    TIS caps set, or a `kl_ref_adapter_path` without a KL term to read it.
    """

    loss_fn: Literal["ppo", "cispo"] = "ppo"
    """"ppo" (clipped surrogate) or "cispo" (ART's default objective, see `grpo_loss`)."""
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"] = "token"
    """"token" (a ratio per token), "sequence" (GSPO: one length-normalised ratio per sequence,
    shared by its tokens), "average" (the mean of the two) or "geometric_average" (their geometric
    mean), as ART computes them."""
    epsilon_low: Finite = Field(default=0.2, ge=0)
    """Clip the ratio below at 1 - epsilon_low (ART's `epsilon`)."""
    epsilon_high: Finite | None = Field(default=None, ge=0)
    """Clip the ratio above at 1 + epsilon_high (None: epsilon_low)."""
    kl_beta: Finite = Field(default=0.0, ge=0)
    """Weight of art-mega's k3 KL loss term against `ref_logprobs` (0 disables it)."""
    tis_cap: Finite | None = Field(default=None, gt=0)
    """Cap C of truncated importance sampling min(pi_old / pi_inference, C) against the trainer's
    own recomputed old logprobs; None disables it. The same as ART's
    `truncated_importance_sampling=C` with `precalculate_logprobs=True`."""
    truncated_importance_sampling: Finite | None = Field(default=None, gt=0)
    """ART's cap C: each token's loss is multiplied by min(r, C), no gradient, where r is
    exp(old - inference) when `inference_logprobs` are given (ART's `precalculate_logprobs`),
    else the loss's own ratio; None disables it."""
    mask_prob_ratio: bool = False
    """Zero the ratio of tokens outside (1 - epsilon_low, 1 + epsilon_high)."""
    max_negative_advantage_importance_sampling_weight: Finite | None = Field(default=None, gt=0)
    """Clamp every token's ratio at this value from above (ART applies it whatever the
    advantage's sign); None disables it."""
    kimi_k2_tau: Finite | None = Field(default=None, ge=0)
    """Tau of Kimi K2's advantage correction A_t - tau (new_t - old_t), no gradient; None
    disables it."""
    kl_penalty_coef: Finite = Field(default=0.0, ge=0)
    """ART's KL-penalised advantages: A_t + coef (mean_kl - kl_t) with kl_t = new_t - ref_t (no
    gradient) and mean_kl its mean over the trained tokens of the packed row (ART: of the packed
    sequence; see `grpo_loss`'s `packed_rows`), so the step does not depend on how rows are split
    into microbatches or DP ranks (0 disables it; needs `ref_logprobs`)."""
    kl_penalty_source: Literal["current_learner", "sample"] = "current_learner"
    """ART 0.5.23's choice of kl_t for `kl_penalty_coef`: "current_learner" new_t - ref_t (ART's
    default), "sample" old_t - ref_t with old the sampling logprobs (`art/loss.py`)."""
    precalculate_logprobs: bool = False
    """The engine recomputes the old logprobs with the policy before the step and passes the
    batch's as `inference_logprobs` (not read by `grpo_loss`)."""
    kl_ref_adapter_path: str | None = Field(default=None, min_length=1)
    """The reference policy is this PEFT adapter on the base model instead of the base model
    alone (read by the engine, not by `grpo_loss`)."""
    logprob_calculation_chunk_size: int | None = Field(default=None, ge=1, strict=True)
    """ART's memory knob: `token_logprobs` computes the cross entropy over chunks of this many
    positions (of this rank's positions under CP), the same values; None: whole rows at once
    (read by the engine, not by `grpo_loss`)."""

    @field_validator("loss_fn", "importance_sampling_level", mode="before")
    @classmethod
    def _known_choice(cls, value: object, info: ValidationInfo) -> object:
        # pydantic's own literal error does not name the field; this sentence does
        choices = get_args(cls.model_fields[str(info.field_name)].annotation)
        if value not in choices:
            raise ValueError(f"{info.field_name}={value!r} must be one of {', '.join(map(repr, choices))}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> GRPOLossConfig:
        if self.tis_cap is not None and self.truncated_importance_sampling is not None:
            raise ValueError("tis_cap and truncated_importance_sampling are two caps; set one of them")
        if self.kl_ref_adapter_path is not None and not self.needs_reference:
            raise ValueError("kl_ref_adapter_path needs kl_penalty_coef > 0 or kl_beta > 0 to be read")
        return self

    @property
    def needs_reference(self) -> bool:
        """True when the loss reads `ref_logprobs` (k3 term or KL-penalised advantages)."""
        return self.kl_beta > 0 or self.kl_penalty_coef > 0

    @property
    def recomputes_old(self) -> bool:
        """True when the engine recomputes the old logprobs and the batch's are the inference
        engine's (`tis_cap`, `precalculate_logprobs`)."""
        return self.tis_cap is not None or self.precalculate_logprobs


class PingJob(_Body):
    """A diagnostic job: the ranks all-reduce rank+1 (checks the ranks and their links); done
    carries metrics `sum` and `world_size`."""

    kind: Literal["ping"] = "ping"


class ExportJob(_Body):
    """Write step `step`'s checkpoint to `checkpoint_dir` without training (step 0: the initial
    adapter). `step` must be the one after the rank's last checkpoint (`jobs.check_job_step`)."""

    kind: Literal["export"] = "export"
    step: Step
    checkpoint_dir: str = Field(min_length=1)


class SFTJob(_Body):
    """ART's `train_sft` on the ranks: one optimizer step per batch k, on
    `sft_batch_file(batch_dir, k, r)` at `learning_rates[k]` (0 where a decaying schedule ends,
    `sft.TrainSFTConfig.learning_rates`), then one checkpoint of `step` in `checkpoint_dir`."""

    kind: Literal["sft"] = "sft"
    step: Step
    batch_dir: str = Field(min_length=1)
    checkpoint_dir: str = Field(min_length=1)
    learning_rates: list[Annotated[Finite, Field(ge=0)]] = Field(min_length=1)


def sft_batch_file(batch_dir: str | Path, index: int, dp_rank: int) -> Path:
    """Where batch `index` (0-based) of an `SFTJob` is for DP rank `dp_rank`:
    `<batch_dir>/<index:04d>/dp<dp_rank>.safetensors`."""
    return Path(batch_dir) / f"{index:04d}" / f"dp{dp_rank}.safetensors"


class RLJob(_Body):
    """GRPO optimizer steps on `batch_dir/dp<r>.safetensors` with `loss` at `learning_rate`,
    then the checkpoint of `step` in `checkpoint_dir`: one step over the whole batch, or with
    `step_rows` one per `step_rows` rows of it (ART's `grad_accumulation_sequences`)."""

    kind: Literal["rl"] = "rl"
    step: Step
    batch_dir: str = Field(min_length=1)
    checkpoint_dir: str = Field(min_length=1)
    learning_rate: Finite = Field(gt=0)
    loss: GRPOLossConfig = GRPOLossConfig()
    weight_decay: Finite | None = Field(default=None, ge=0)
    """AdamW's decoupled weight decay for this step (None: the engine's `OptimizerConfig`)."""
    clip_grad: Finite | None = Field(default=None, ge=0)
    """The global gradient-norm clip for this step, 0 disables it (None: the engine's)."""
    step_rows: int | None = Field(default=None, ge=1, strict=True)
    """Rows of every rank's batch per optimizer step, in order (ART's grad_accumulation_sequences
    / DP ranks; the batch's height a multiple of it, `batch.pack_steps`); None: one step."""


TrainJob = Annotated[PingJob | ExportJob | SFTJob | RLJob, Field(discriminator="kind")]
"""A job for every trainer rank, by `kind`."""
StepJob = ExportJob | SFTJob | RLJob
"""The jobs that write a checkpoint (and so must name the next step)."""


class TrainerJobRequest(_Body):
    """One job for every trainer rank of a host; `id` names it in the ranks' events."""

    id: str = Field(min_length=1)
    job: TrainJob


class TrainerJobResponse(_Body):
    sent: int
    """How many of the host's ranks the job reached."""


# --- events ------------------------------------------------------------------------------------


class Starting(_Body):
    """The rank's process runs (`pid`) and reads its config."""

    kind: Literal["starting"] = "starting"
    pid: int


class Ready(_Body):
    """The rank joined the world and built its engine in `seconds`."""

    kind: Literal["ready"] = "ready"
    seconds: float = Field(ge=0)


class Accepted(_Body):
    """The rank began job `job`."""

    kind: Literal["accepted"] = "accepted"
    job: str


class AdapterReady(_Body):
    """Rank 0 committed step `step`'s checkpoint: its PEFT adapter is at `path` (sha256 of its
    weights file `sha256`)."""

    kind: Literal["adapter_ready"] = "adapter_ready"
    job: str
    path: str
    step: Step
    sha256: str


class Done(_Body):
    """The rank finished job `job`; `metrics` are its numbers (names and units: `jobs.run_train_job`,
    `TrainerEngine.train_step`; a ping's `sum` and `world_size`)."""

    kind: Literal["done"] = "done"
    job: str
    metrics: dict[str, float] = Field(default_factory=dict)


class Failed(_Body):
    """The rank failed to start (`stage` "init") or failed job `job` (None: a message it could not
    read as a job). `error` is "<error_type>: <message>".

    dirty: the rank's weights or optimizer state may be ahead of its last checkpoint, so it
    refuses training jobs until it is restarted (`rank.main`); False when it failed untouched.
    """

    kind: Literal["failed"] = "failed"
    stage: Literal["init", "job"] = "job"
    job: str | None = None
    error: str
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    dirty: bool = True


class Exited(_Body):
    """The rank's process ended with `code` (negative: killed by that signal); written by its
    agent, not the rank."""

    kind: Literal["exited"] = "exited"
    code: int | None
    log_path: str


RankEvent = Annotated[
    Starting | Ready | Accepted | AdapterReady | Done | Failed | Exited, Field(discriminator="kind")
]
"""What a rank (or, for `Exited`, its agent) reports, by `kind`."""
RANK_EVENT: TypeAdapter[RankEvent] = TypeAdapter(RankEvent)


class TrainerEvent(_Body):
    """One event in an agent's log: which rank, when (Unix seconds, the agent's clock), what."""

    rank: int = Field(ge=0)
    time: float
    event: RankEvent


# --- the /trainer/* bodies ----------------------------------------------------------------------


class TrainerRankLaunch(_Body):
    """One trainer rank to start on this host: its global rank, environment and log file."""

    rank: int = Field(ge=0)
    env: dict[str, str]
    log_path: str


class TrainerStartRequest(_Body):
    """Start this host's trainer ranks with `config`: each launch names a distinct rank of its
    `rank_table`."""

    ranks: tuple[TrainerRankLaunch, ...]
    config: RankConfig
    python: str | None = None
    sys_path: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _ranks_of_the_world(self) -> TrainerStartRequest:
        ranks = [launch.rank for launch in self.ranks]
        if len(set(ranks)) != len(ranks) or any(r >= self.config.world_size for r in ranks):
            raise ValueError(
                f"ranks {ranks} must be distinct ranks of the world of {self.config.world_size} "
                f"(0..{self.config.world_size - 1})"
            )
        return self


class TrainerStartResponse(_Body):
    pids: tuple[int, ...] = ()
    error: str = ""


class TrainerEventsRequest(_Body):
    """Long-poll the ranks' events from index `after`, waiting up to `timeout_s` seconds."""

    after: int = Field(ge=0)
    timeout_s: float = Field(default=10.0, ge=0, le=120)


class TrainerEventsResponse(_Body):
    """The host's events from index `after` on; `next` is the index to ask from next."""

    events: tuple[TrainerEvent, ...] = ()
    next: int = 0


TRAINER_START = Route("POST", "/trainer/start", TrainerStartRequest, TrainerStartResponse, BODY_LIMIT)
TRAINER_JOB = Route("POST", "/trainer/job", TrainerJobRequest, TrainerJobResponse, BODY_LIMIT)
TRAINER_EVENTS = Route("POST", "/trainer/events", TrainerEventsRequest, TrainerEventsResponse)
TRAINER_STOP = Route("POST", "/trainer/stop", None, ShutdownResponse)


_MEMBERS: dict[str, type[BaseModel]] = {
    m.model_fields["kind"].default: m
    for m in (
        PingJob,
        ExportJob,
        SFTJob,
        RLJob,
        Starting,
        Ready,
        Accepted,
        AdapterReady,
        Done,
        Failed,
        Exited,
    )
}
"""The members of `TrainJob` and `RankEvent` by `kind`: pydantic puts the member's tag into an
error's location (job.rl.step), and a reader looks for the field's own path (job.step)."""


def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found = [m for a in get_args(annotation) if (m := _model_in(a)) is not None]
    return found[0] if len(found) == 1 else None


def _fields_at(root: type[BaseModel] | None, loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the model at `loc` under `root` (empty where it cannot be told)."""
    current = root
    for part in loc:
        if isinstance(part, str) and part in _MEMBERS:
            current = _MEMBERS[part]
        elif isinstance(part, str) and current is not None:
            field = current.model_fields.get(part)
            current = None if field is None else _model_in(field.annotation)
    return list(current.model_fields) if current is not None else []


def describe_invalid(what: str, exc: ValidationError, root: type[BaseModel] | None = None) -> str:
    """One sentence naming the invalid field of message `what` (e.g. "trainer job"), its value
    and the fix. An unknown field is named before any other error (a misspelling also leaves its
    intended field missing), with the closest field name of its model (`root`: the model that was
    validated; None for `RANK_EVENT`) suggested."""
    errors = exc.errors(include_url=False)
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    path = ".".join(str(p) for p in first["loc"] if p not in _MEMBERS) or "the message"
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    if first["type"] == "union_tag_invalid":
        ctx = first.get("ctx", {})
        noun = "" if path == "the message" else f"{path} "
        return f"{what}: unknown {noun}kind {ctx.get('tag')!r}; use one of {ctx.get('expected_tags')}."
    if first["type"] == "extra_forbidden":
        field = str(first["loc"][-1])
        close = difflib.get_close_matches(field, _fields_at(root, first["loc"][:-1]), n=1)
        fix = f"did you mean {close[0]}?" if close else "remove it or correct its name."
        return f"{what}: {path}={shown} is not a known field; {fix}"
    if first["type"] == "missing":
        return f"{what}: {path} is required; set it."
    message = " ".join(str(first["msg"]).removeprefix("Value error, ").split())
    if first["type"] == "value_error":  # a model's own check: its message names the values
        return f"{what}: {message}" if path == "the message" else f"{what}: {path}: {message}"
    if path == "the message":  # the whole message is wrong (not JSON, not an object)
        return f"{what} {shown} is invalid: {message}."
    return f"{what}: {path}={shown} is invalid: {message}."
