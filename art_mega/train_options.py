"""The options of one training step, each defined once: `GRPOOptions` (the keywords of
`backend.train`: ART's names, defaults and ranges, ART's hints, the cross-field rules) and ART's
`TrainConfig` (read through it). Adding a GRPO option is one field here, its use, its test and
its doc row (docs/art-compatibility.md); a field GRPOLossConfig also has reaches the rank's loss
as it is (`GRPOOptions.loss_fields`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from art_mega.hyperparams import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_FNS,
    Problem,
    between_problem,
    bool_problem,
    check,
    finite_problem,
    nonnegative_problem,
    one_of_problem,
    optional,
    positive_problem,
    pydantic_check,
    whole_problem,
)

DEFAULT_LEARNING_RATE = 5e-6
"""`backend.train`'s learning rate when neither `learning_rate` nor `config` gives one."""

@dataclass(frozen=True)
class Check:
    """A `GRPOOptions` field's range: `problem(value)` is None for a good value, else why not
    (`hyperparams`); `example` is the value the refusal suggests; `convert` turns a good value
    into what the job carries (float for numbers; None: kept as given)."""

    problem: Problem
    example: str
    convert: Callable[[Any], Any] | None = None


def _float(value: Any) -> Any:
    return None if value is None else float(value)


def _int(value: Any) -> Any:
    return None if value is None else int(value)


def _importance_sampling_level(value: Any) -> str | None:
    if value in IMPORTANCE_SAMPLING_LEVELS:
        return None
    return "must be 'token' or 'sequence' (GSPO), or ART's 'average' or 'geometric_average'"


class GRPOOptions(BaseModel):
    """The keywords of `MegatronBackend.train` (one GRPO step), each defined once: ART's names and
    defaults (`LocalBackend.train`; `kl_beta`, `tis_cap`, `allow_stale` and
    `drop_nonfinite_rewards` are art-mega's), each field's range (its `Check`), ART's hints for
    the options art-mega does not implement (`ART_OPTION_HINTS`, the pre-validator), `config`
    (ART's `TrainConfig`) merged into the fields it gives, and the cross-field rules.

    A field whose name is a field of `GRPOLossConfig` travels to the rank in the job's loss
    config as it is (`loss_fields`); `epsilon` / `epsilon_high` become `epsilon_low` /
    `epsilon_high` with ART's defaults for `loss_fn` (cispo 1.0 / 4.0, ppo 0.2 / epsilon):
    GRPOLossConfig's own defaults are plain PPO's, and every job sets them from here.
    `packed_sequence_length`, `grad_accumulation_sequences` (their ranges need the trainer's
    seq_len and DP ranks: `check_packing`, `check_accumulation`), `optimizer_save_interval`,
    `final_training_step` (`check_optimizer_snapshots`) and `kl_penalty_reference_step` (a
    committed step of the run: the backend's `_reference_path`) are checked where that is known.

    Raises:
        HyperParameterError: the first option out of range or of the wrong type, an ART option
            art-mega does not implement (with what to do instead), an unknown keyword, `config`
            that is not a TrainConfig or disagrees with a keyword, both TIS caps (named, with
            the fix; never a pydantic ValidationError).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    learning_rate: Annotated[float, Check(positive_problem, "5e-6", float)] = DEFAULT_LEARNING_RATE
    loss_fn: Annotated[str, Check(one_of_problem(*LOSS_FNS), "'cispo'")] = "cispo"
    importance_sampling_level: Annotated[str, Check(_importance_sampling_level, "'token'")] = "token"
    epsilon: Annotated[float | None, Check(optional(nonnegative_problem), "0.2", _float)] = None
    epsilon_high: Annotated[float | None, Check(optional(nonnegative_problem), "0.28", _float)] = None
    kl_beta: Annotated[float, Check(nonnegative_problem, "0.04", float)] = 0.0
    tis_cap: Annotated[float | None, Check(optional(positive_problem), "2.0", _float)] = None
    scale_rewards: Annotated[bool, Check(bool_problem, "True")] = True
    normalize_advantages: Annotated[bool, Check(bool_problem, "True")] = True
    advantage_balance: Annotated[float, Check(between_problem(-1.0, 1.0), "0.0", float)] = 0.0
    kl_penalty_coef: Annotated[float, Check(nonnegative_problem, "0.1", float)] = 0.0
    truncated_importance_sampling: Annotated[float | None, Check(optional(positive_problem), "2.0", _float)] = None
    precalculate_logprobs: Annotated[bool, Check(bool_problem, "True")] = False
    mask_prob_ratio: Annotated[bool, Check(bool_problem, "True")] = False
    max_negative_advantage_importance_sampling_weight: Annotated[
        float | None, Check(optional(positive_problem), "2.0", _float)
    ] = None
    kimi_k2_tau: Annotated[float | None, Check(optional(nonnegative_problem), "0.5", _float)] = None
    num_trajectories_learning_rate_multiplier_power: Annotated[float, Check(finite_problem, "0.5", float)] = 0.0
    kl_ref_adapter_path: Any = None
    kl_penalty_reference_step: Any = None
    kl_penalty_source: Annotated[str, Check(one_of_problem("current_learner", "sample"), "'sample'")] = (
        "current_learner"
    )
    optimizer_save_interval: Any = 5
    final_training_step: Any = None
    config: Any = None
    allow_stale: Annotated[bool, Check(bool_problem, "True")] = False
    drop_nonfinite_rewards: Annotated[bool, Check(bool_problem, "True")] = False
    allow_training_without_logprobs: Annotated[bool, Check(bool_problem, "True")] = False
    grad_accumulation_sequences: Any = None
    packed_sequence_length: Any = None
    logprob_calculation_chunk_size: Annotated[int | None, Check(optional(whole_problem(1)), "8", _int)] = None

    @model_validator(mode="before")
    @classmethod
    def _art_hints_and_config(cls, data: Any) -> Any:
        """ART's options art-mega does not implement pass at their off value (dropped), any other
        unknown keyword is refused; `config` gives learning_rate, kl_beta (its beta),
        kl_penalty_coef and kl_penalty_source where the keyword is at its default, else both
        must agree."""
        from art_mega.errors import HyperParameterError

        where = "backend.train"
        given = dict(data)
        for name in [n for n in given if n not in cls.model_fields]:
            value = given.pop(name)
            refused = ART_OPTION_HINTS.get(name)
            if refused is None:
                raise HyperParameterError(
                    f"{where} got an unknown keyword {name}={value!r}; use one of {', '.join(cls.model_fields)}",
                    name,
                    value,
                )
            if not refused.is_off(value):
                raise HyperParameterError(f"{where} got ART's {name}={value!r}; {refused.why}", name, value)
        config = given.get("config")
        if config is not None:
            given.update(_merged_config(where, config, given, cls))
        return given

    @field_validator("*", mode="before")
    @classmethod
    def _in_range(cls, value: Any, info: ValidationInfo) -> Any:
        name = str(info.field_name)
        for rule in cls.model_fields[name].metadata:
            if isinstance(rule, Check):
                check("backend.train", name, value, rule.problem, rule.example)
                return value if rule.convert is None else rule.convert(value)
        return value

    @model_validator(mode="after")
    def _rules(self) -> GRPOOptions:
        from art_mega.errors import HyperParameterError

        if self.tis_cap is not None and self.truncated_importance_sampling is not None:
            raise HyperParameterError(
                f"backend.train(tis_cap={self.tis_cap!r}) and truncated_importance_sampling="
                f"{self.truncated_importance_sampling!r} are two TIS caps; set one (tis_cap=C is "
                "truncated_importance_sampling=C with precalculate_logprobs=True)",
                "tis_cap",
                self.tis_cap,
            )
        return self

    def loss_fields(self, reference: Any = None) -> dict[str, Any]:
        """The `GRPOLossConfig` fields of the job: every field of this model that GRPOLossConfig
        has, `epsilon_low` / `epsilon_high` with ART's defaults for `loss_fn`, and the KL
        reference adapter `reference` (checked: `_reference_adapter`). `kl_penalty_source` and
        `logprob_calculation_chunk_size` are left out at their defaults (GRPOLossConfig's own).

        Raises:
            HyperParameterError: `reference` is not a PEFT adapter folder, or no KL term reads it.
        """
        from art_mega.trainer import protocol

        art_low, art_high = art_epsilons(self.loss_fn)
        epsilon = art_low if self.epsilon is None else self.epsilon
        epsilon_high = art_high if self.epsilon_high is None else self.epsilon_high
        loss = {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name in protocol.GRPOLossConfig.model_fields and name != "kl_ref_adapter_path"
        }
        loss |= {"epsilon_low": float(epsilon), "epsilon_high": None if epsilon_high is None else float(epsilon_high)}
        loss["kl_ref_adapter_path"] = _reference_adapter(reference, self.kl_penalty_coef or self.kl_beta)
        for name, default in (("kl_penalty_source", "current_learner"), ("logprob_calculation_chunk_size", None)):
            if loss.get(name, default) == default:
                loss.pop(name, None)
        return loss


def art_epsilons(loss_fn: str) -> tuple[float, float | None]:
    """ART's (epsilon, epsilon_high) for `loss_fn` when they are None: CISPO 1.0 and 4.0, PPO 0.2
    and None (= epsilon) (`art/loss.py`)."""
    return (0.2, None) if loss_fn == "ppo" else (1.0, 4.0)


def _merged_config(where: str, config: Any, given: Mapping[str, Any], options: type[BaseModel]) -> dict[str, Any]:
    """The keywords `config` (ART's TrainConfig) sets: learning_rate, kl_beta, kl_penalty_coef,
    kl_penalty_source (see `GRPOOptions`).

    Raises:
        HyperParameterError: `config` is not a TrainConfig, or it disagrees with a keyword.
    """
    from art_mega.errors import HyperParameterError

    if not isinstance(config, TrainConfig):
        raise HyperParameterError(
            f"{where}(config={config!r}) must be an art_mega.TrainConfig; pass e.g. "
            "config=art.TrainConfig(learning_rate=5e-6)",
            "config",
            config,
        )
    default = {name: field.default for name, field in options.model_fields.items()}
    value = {name: given.get(name, default[name]) for name in default}
    learning_rate = value["learning_rate"]
    if learning_rate != DEFAULT_LEARNING_RATE and learning_rate != config.learning_rate:
        raise HyperParameterError(
            f"{where}(learning_rate={learning_rate!r}) disagrees with config.learning_rate="
            f"{config.learning_rate!r}; set one of them",
            "learning_rate",
            learning_rate,
        )
    for name, theirs in (("kl_beta", "beta"), ("kl_penalty_coef", "kl_penalty_coef")):
        mine, given_there = value[name], getattr(config, theirs)
        if given_there and mine and given_there != mine:
            raise HyperParameterError(
                f"{where}({name}={mine!r}) disagrees with config.{theirs}={given_there!r}; set one of them",
                name,
                mine,
            )
    source = value["kl_penalty_source"]
    if source == "current_learner":
        source = config.kl_penalty_source
    elif config.kl_penalty_source not in ("current_learner", source):
        raise HyperParameterError(
            f"{where}(kl_penalty_source={source!r}) disagrees with config.kl_penalty_source="
            f"{config.kl_penalty_source!r}; set one of them",
            "kl_penalty_source",
            source,
        )
    return {
        "learning_rate": config.learning_rate,
        "kl_beta": value["kl_beta"] or config.beta,
        "kl_penalty_coef": value["kl_penalty_coef"] or config.kl_penalty_coef,
        "kl_penalty_source": source,
    }


GRPO_OPTIONS = tuple(GRPOOptions.model_fields)
"""The keywords `MegatronBackend.train` takes, in ART's order (`GRPOOptions`' fields)."""


@dataclass(frozen=True)
class RefusedOption:
    """An ART `train` option art-mega does not implement: accepted only at `off` (where ART does
    nothing either), else refused with `why` (what it does in ART and what to do instead)."""

    off: tuple[Any, ...]
    why: str

    def is_off(self, value: Any) -> bool:
        return any(value is o or (type(value) is type(o) and value == o) for o in self.off)


_NO_MOE = "art-mega neither records nor replays MoE routing, so remove it"
ART_OPTION_HINTS: dict[str, RefusedOption] = {
    "loss_fn_config": RefusedOption(
        (None,), "ART's LocalBackend refuses it too; choose the objective with loss_fn='cispo' or 'ppo'"
    ),
    "adam_params": RefusedOption((None,), "ART's LocalBackend refuses it too; remove it"),
    "scale_learning_rate_by_reward_std_dev": RefusedOption(
        (False,),
        "ART 0.5.18 takes it but no longer applies it (its LocalBackend ignores it); scale "
        "learning_rate yourself",
    ),
    "plot_tensors": RefusedOption((False,), "art-mega does not plot the packed tensors, so remove it"),
    "save_checkpoint": RefusedOption(
        (True,),
        "every art-mega step commits its checkpoint (the served adapter is read from it), so remove it",
    ),
    "verbose": RefusedOption((False,), "art-mega reports each step in its metrics and logs, so remove it"),
    "kl_penalty_step_lag": RefusedOption(
        (None,),
        "art-mega does not keep a lagged KL reference; pass kl_penalty_reference_step=<a committed step> instead",
    ),
    "moe_routing_replay_bundle": RefusedOption((None,), _NO_MOE),
    "moe_routing_replay_path": RefusedOption((None,), _NO_MOE),
    "moe_routing_replay_strict": RefusedOption((False,), _NO_MOE),
    "ppo": RefusedOption(
        (),
        "backend.train takes ART's loss_fn='ppo' or 'cispo' (ppo is the dev.TrainConfig key of model.train(_config=...))",
    ),
}
"""ART `train` options art-mega does not implement, with the value at which each does nothing."""


def _default(name: str) -> Any:
    """`GRPOOptions`' default of the option `name`."""
    return GRPOOptions.model_fields[name].default


def _rule(name: str) -> Check:
    """`GRPOOptions`' range of the option `name`."""
    return next(rule for rule in GRPOOptions.model_fields[name].metadata if isinstance(rule, Check))


class TrainConfig(BaseModel):
    """ART's TrainConfig: the learning rate of one step, ART's `kl_penalty_coef` (KL-penalised
    advantages, see `backend.train`) and `kl_penalty_source` (whose logprobs the penalty
    compares with the reference: "current_learner", ART's default, or "sample"), `beta`
    (art-mega's k3 KL loss term, `kl_beta`), ART's `grad_accumulation_sequences` (packed rows per
    optimizer step, see `backend.train`; None: ART's default, one row per DP rank and step), and
    ART 0.5.23's `optimizer_save_interval` / `final_training_step` (when ART snapshots the
    optimizer: art-mega commits it with every step, which covers both; see `backend.train`).

    Raises:
        pydantic.ValidationError: `learning_rate` is not a finite number > 0 (a string, NaN,
            inf, 0 or a negative value), `beta` or `kl_penalty_coef` is not a finite number
            >= 0, or `grad_accumulation_sequences` is not None or a whole number >= 1.
    """

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = _default("learning_rate")
    beta: float = _default("kl_beta")
    kl_penalty_coef: float = _default("kl_penalty_coef")
    grad_accumulation_sequences: int | None = Field(default=_default("grad_accumulation_sequences"), ge=1, strict=True)
    kl_penalty_source: Literal["current_learner", "sample"] = _default("kl_penalty_source")
    optimizer_save_interval: int = Field(default=_default("optimizer_save_interval"), ge=1, strict=True)
    final_training_step: int | None = Field(default=_default("final_training_step"), ge=1, strict=True)

    @field_validator("learning_rate", mode="before")
    @classmethod
    def _learning_rate(cls, value: Any) -> Any:
        rule = _rule("learning_rate")
        return pydantic_check(value, rule.problem, rule.example)

    @field_validator("beta", "kl_penalty_coef", mode="before")
    @classmethod
    def _beta(cls, value: Any) -> Any:
        rule = _rule("kl_beta")  # beta is backend.train's kl_beta; kl_penalty_coef has its range
        return pydantic_check(value, rule.problem, rule.example)




def _reference_adapter(path: Any, kl: float) -> str | None:
    """`kl_ref_adapter_path` as the adapter folder the ranks read (a checkpoint's step folder
    is one), or None.

    Raises:
        HyperParameterError: not None, a str or a path; no adapter_config.json there; or no KL
            term reads it (kl_penalty_coef and kl_beta both 0).
    """
    from art_mega.errors import HyperParameterError
    from art_mega.trainer import checkpoint

    if path is None:
        return None
    where = f"backend.train(kl_ref_adapter_path={path!r})"
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise HyperParameterError(
            f"{where} must be the path of a PEFT adapter folder; pass e.g. "
            "kl_ref_adapter_path='.art/.../checkpoints/0003'",
            "kl_ref_adapter_path",
            path,
        )
    folder = checkpoint.adapter_dir(Path(path))
    if not (folder / "adapter_config.json").is_file():
        raise HyperParameterError(
            f"{where} holds no adapter_config.json; name a PEFT LoRA adapter folder of this base "
            "model, or a committed checkpoint (step folder) of it",
            "kl_ref_adapter_path",
            path,
        )
    if not kl:
        raise HyperParameterError(
            f"{where} is the KL reference, but no KL term reads it; set kl_penalty_coef (ART's "
            "KL-penalised advantages) or kl_beta above 0, or remove it",
            "kl_ref_adapter_path",
            path,
        )
    return str(folder.resolve())
