"""The options of MegatronBackend and of its steps: ART's names and defaults, their checks
(one sentence naming the field, the value and the fix), ART's optimizer settings."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_mega.errors import UserError
from art_mega.trainer import checkpoint
from art_mega.trainer.protocol import (
    OptimizerConfig,
)

log = logging.getLogger(__name__)


DEFAULT_LEARNING_RATE = 5e-6
"""`backend.train`'s learning rate when neither `learning_rate` nor `config` gives one."""

GRPO_OPTIONS = (
    "learning_rate",
    "loss_fn",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "kl_beta",
    "tis_cap",
    "scale_rewards",
    "normalize_advantages",
    "advantage_balance",
    "kl_penalty_coef",
    "truncated_importance_sampling",
    "precalculate_logprobs",
    "mask_prob_ratio",
    "max_negative_advantage_importance_sampling_weight",
    "kimi_k2_tau",
    "num_trajectories_learning_rate_multiplier_power",
    "kl_ref_adapter_path",
    "kl_penalty_reference_step",
    "kl_penalty_source",
    "optimizer_save_interval",
    "final_training_step",
    "config",
    "allow_stale",
    "drop_nonfinite_rewards",
    "allow_training_without_logprobs",
    "grad_accumulation_sequences",
    "packed_sequence_length",
    "logprob_calculation_chunk_size",
)
"""The keywords `MegatronBackend.train` takes (ART's `LocalBackend.train` names mean what they
mean there; `kl_beta`, `tis_cap`, `allow_stale` and `drop_nonfinite_rewards` are art-mega's)."""


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


def check_grpo_options(
    *,
    learning_rate: Any,
    importance_sampling_level: Any,
    epsilon: Any,
    epsilon_high: Any,
    kl_beta: Any,
    tis_cap: Any,
    scale_rewards: Any,
    config: Any,
    allow_stale: Any,
    drop_nonfinite_rewards: Any,
    unknown: Mapping[str, Any],
    allow_training_without_logprobs: Any = False,
    loss_fn: Any = "cispo",
    normalize_advantages: Any = True,
    advantage_balance: Any = 0.0,
    kl_penalty_coef: Any = 0.0,
    truncated_importance_sampling: Any = None,
    precalculate_logprobs: Any = False,
    mask_prob_ratio: Any = False,
    max_negative_advantage_importance_sampling_weight: Any = None,
    kimi_k2_tau: Any = None,
    num_trajectories_learning_rate_multiplier_power: Any = 0.0,
    kl_ref_adapter_path: Any = None,
    logprob_calculation_chunk_size: Any = None,
    kl_penalty_source: Any = "current_learner",
) -> tuple[float, dict[str, Any]]:
    """Check `backend.train`'s options before anything runs; returns (learning rate, the
    `GRPOLossConfig` fields of the job).

    learning_rate: finite > 0; loss_fn: "cispo" (ART's default) or "ppo"; epsilon,
    epsilon_high: None (ART's default for loss_fn: cispo 1.0 and 4.0, ppo 0.2 and epsilon) or
    finite >= 0; importance_sampling_level: token, sequence, average or geometric_average;
    kl_beta, kl_penalty_coef, kimi_k2_tau (or None): finite >= 0; tis_cap,
    truncated_importance_sampling, max_negative_advantage_importance_sampling_weight: None or
    finite > 0 (not tis_cap and truncated_importance_sampling together); advantage_balance:
    in [-1, 1]; num_trajectories_learning_rate_multiplier_power: finite; the flags: bools;
    kl_ref_adapter_path: None or a PEFT adapter folder (or a checkpoint folder holding one in
    `adapter/`) on this host, used as the reference when kl_penalty_coef or kl_beta is > 0;
    logprob_calculation_chunk_size: None (whole rows) or a whole number >= 1 (ART's memory knob:
    the trainer's logprobs over chunks of that many positions, `logprobs.token_logprobs`).
    config: None or a `TrainConfig`, whose learning_rate replaces `learning_rate` (a
    `learning_rate` other than the default must agree with it), whose beta is `kl_beta` and
    whose kl_penalty_coef is `kl_penalty_coef` unless those are non-zero (then they must agree),
    and whose kl_penalty_source is `kl_penalty_source` unless that is not ART's default.
    kl_penalty_source: ART 0.5.23's "current_learner" (the penalty's KL is new - ref) or
    "sample" (sampling logprobs - ref, `loss.grpo_loss`). `unknown` holds the other keywords: an ART option of `ART_OPTION_HINTS` at its off value
    passes, any other is refused.

    Raises:
        HyperParameterError: the first option out of range or of the wrong type, an ART option
            art-mega does not implement (with what to do instead), or an unknown keyword.
    """
    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import (
        IMPORTANCE_SAMPLING_LEVELS,
        LOSS_FNS,
        between_problem,
        bool_problem,
        check,
        finite_problem,
        nonnegative_problem,
        one_of_problem,
        optional,
        positive_problem,
        whole_problem,
    )
    from art_mega.model import TrainConfig

    where = "backend.train"
    for name, value in unknown.items():
        refused = ART_OPTION_HINTS.get(name)
        if refused is None:
            raise HyperParameterError(
                f"{where} got an unknown keyword {name}={value!r}; use one of {', '.join(GRPO_OPTIONS)}",
                name,
                value,
            )
        if not refused.is_off(value):
            raise HyperParameterError(f"{where} got ART's {name}={value!r}; {refused.why}", name, value)
    if config is not None:
        if not isinstance(config, TrainConfig):
            raise HyperParameterError(
                f"{where}(config={config!r}) must be an art_mega.TrainConfig; pass e.g. "
                "config=art.TrainConfig(learning_rate=5e-6)",
                "config",
                config,
            )
        if learning_rate != DEFAULT_LEARNING_RATE and learning_rate != config.learning_rate:
            raise HyperParameterError(
                f"{where}(learning_rate={learning_rate!r}) disagrees with config.learning_rate="
                f"{config.learning_rate!r}; set one of them",
                "learning_rate",
                learning_rate,
            )
        learning_rate = config.learning_rate
        for name, mine, theirs in (
            ("kl_beta", kl_beta, "beta"),
            ("kl_penalty_coef", kl_penalty_coef, "kl_penalty_coef"),
        ):
            given = getattr(config, theirs)
            if given and mine and given != mine:
                raise HyperParameterError(
                    f"{where}({name}={mine!r}) disagrees with config.{theirs}={given!r}; set one of them",
                    name,
                    mine,
                )
        kl_beta = kl_beta or config.beta
        kl_penalty_coef = kl_penalty_coef or config.kl_penalty_coef
        if kl_penalty_source == "current_learner":
            kl_penalty_source = config.kl_penalty_source
        elif config.kl_penalty_source not in ("current_learner", kl_penalty_source):
            raise HyperParameterError(
                f"{where}(kl_penalty_source={kl_penalty_source!r}) disagrees with config.kl_penalty_source="
                f"{config.kl_penalty_source!r}; set one of them",
                "kl_penalty_source",
                kl_penalty_source,
            )
    check(where, "learning_rate", learning_rate, positive_problem, "5e-6")
    check(where, "loss_fn", loss_fn, one_of_problem(*LOSS_FNS), "'cispo'")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise HyperParameterError(
            f"{where}(importance_sampling_level={importance_sampling_level!r}) must be 'token' or "
            "'sequence' (GSPO), or ART's 'average' or 'geometric_average'",
            "importance_sampling_level",
            importance_sampling_level,
        )
    check(where, "epsilon", epsilon, optional(nonnegative_problem), "0.2")
    check(where, "epsilon_high", epsilon_high, optional(nonnegative_problem), "0.28")
    check(where, "kl_beta", kl_beta, nonnegative_problem, "0.04")
    check(where, "kl_penalty_coef", kl_penalty_coef, nonnegative_problem, "0.1")
    check(
        where, "kl_penalty_source", kl_penalty_source, one_of_problem("current_learner", "sample"), "'sample'"
    )
    check(where, "tis_cap", tis_cap, optional(positive_problem), "2.0")
    check(
        where,
        "truncated_importance_sampling",
        truncated_importance_sampling,
        optional(positive_problem),
        "2.0",
    )
    if tis_cap is not None and truncated_importance_sampling is not None:
        raise HyperParameterError(
            f"{where}(tis_cap={tis_cap!r}) and truncated_importance_sampling={truncated_importance_sampling!r} "
            "are two TIS caps; set one (tis_cap=C is truncated_importance_sampling=C with precalculate_logprobs=True)",
            "tis_cap",
            tis_cap,
        )
    check(
        where,
        "max_negative_advantage_importance_sampling_weight",
        max_negative_advantage_importance_sampling_weight,
        optional(positive_problem),
        "2.0",
    )
    check(where, "kimi_k2_tau", kimi_k2_tau, optional(nonnegative_problem), "0.5")
    check(where, "advantage_balance", advantage_balance, between_problem(-1.0, 1.0), "0.0")
    check(
        where,
        "num_trajectories_learning_rate_multiplier_power",
        num_trajectories_learning_rate_multiplier_power,
        finite_problem,
        "0.5",
    )
    for name, value in (
        ("scale_rewards", scale_rewards),
        ("normalize_advantages", normalize_advantages),
        ("precalculate_logprobs", precalculate_logprobs),
        ("mask_prob_ratio", mask_prob_ratio),
        ("allow_stale", allow_stale),
        ("drop_nonfinite_rewards", drop_nonfinite_rewards),
        ("allow_training_without_logprobs", allow_training_without_logprobs),
    ):
        check(where, name, value, bool_problem, "True")
    check(
        where,
        "logprob_calculation_chunk_size",
        logprob_calculation_chunk_size,
        optional(whole_problem(1)),
        "8",
    )
    ppo = loss_fn == "ppo"
    epsilon = (0.2 if ppo else 1.0) if epsilon is None else epsilon
    epsilon_high = (None if ppo else 4.0) if epsilon_high is None else epsilon_high
    loss = {
        "loss_fn": loss_fn,
        "importance_sampling_level": importance_sampling_level,
        "epsilon_low": float(epsilon),
        "epsilon_high": None if epsilon_high is None else float(epsilon_high),
        "kl_beta": float(kl_beta),
        "tis_cap": None if tis_cap is None else float(tis_cap),
        "truncated_importance_sampling": (
            None if truncated_importance_sampling is None else float(truncated_importance_sampling)
        ),
        "mask_prob_ratio": mask_prob_ratio,
        "max_negative_advantage_importance_sampling_weight": (
            None
            if max_negative_advantage_importance_sampling_weight is None
            else float(max_negative_advantage_importance_sampling_weight)
        ),
        "kimi_k2_tau": None if kimi_k2_tau is None else float(kimi_k2_tau),
        "kl_penalty_coef": float(kl_penalty_coef),
        "precalculate_logprobs": precalculate_logprobs,
        "kl_ref_adapter_path": _reference_adapter(kl_ref_adapter_path, kl_penalty_coef or kl_beta),
    }
    if kl_penalty_source != "current_learner":  # absent: GRPOLossConfig's ART default
        loss["kl_penalty_source"] = kl_penalty_source
    if logprob_calculation_chunk_size is not None:  # absent: GRPOLossConfig's None, whole rows
        loss["logprob_calculation_chunk_size"] = int(logprob_calculation_chunk_size)
    return float(learning_rate), loss


def check_optimizer_snapshots(interval: Any, final_step: Any, config: Any) -> None:
    """ART 0.5.23's `optimizer_save_interval` (whole >= 1, ART's default 5) and
    `final_training_step` (None or whole >= 1), the keywords or `config`'s (a checked
    `TrainConfig` or None). ART snapshots the optimizer state every `interval` steps and at the
    final step (`art/megatron/train.py`); art-mega commits it with every step's checkpoint,
    which covers every choice, so a value other than ART's default is accepted with one logged line.

    Raises:
        HyperParameterError: a value that is not a whole number in range (named).
    """
    from art_mega.hyperparams import check, optional, whole_problem

    where = "backend.train"
    if config is not None:
        interval = config.optimizer_save_interval if interval == 5 else interval
        final_step = config.final_training_step if final_step is None else final_step
    check(where, "optimizer_save_interval", interval, whole_problem(1), "5")
    check(where, "final_training_step", final_step, optional(whole_problem(1)), "100")
    for name, value, default in (
        ("optimizer_save_interval", interval, 5),
        ("final_training_step", final_step, None),
    ):
        if value != default and (name, value) not in _LOGGED_SNAPSHOT_OPTIONS:
            _LOGGED_SNAPSHOT_OPTIONS.add((name, value))
            log.info(
                "%s(%s=%r): art-mega commits the optimizer state with every step's checkpoint, "
                "so every step resumes exactly (ART snapshots it less often)",
                where,
                name,
                value,
            )


_LOGGED_SNAPSHOT_OPTIONS: set[tuple[str, Any]] = set()
"""The (option, value) pairs `check_optimizer_snapshots` has logged (once per process)."""


def check_packing(
    grad_accumulation_sequences: Any,
    packed_sequence_length: Any,
    config: Any,
    power: float,
    seq_len: int,
) -> tuple[int | None, int]:
    """ART's `grad_accumulation_sequences` (the keyword, or `config`'s, a checked `TrainConfig`
    or None) and `packed_sequence_length` for `backend.train`; returns (packed rows per
    optimizer step over all DP ranks, None: ART's default, the DP ranks (`rl_step_batches`);
    the row length in tokens).

    grad_accumulation_sequences: None or a whole number >= 1 (a multiple of the DP ranks,
    `check_accumulation`), not with a non-zero `power` (ART's
    num_trajectories_learning_rate_multiplier_power scales a step's rate by the trajectories
    it trains; ART's Megatron trainer, the one that accumulates, does not apply it);
    packed_sequence_length: None (`seq_len`) or a whole number from 2 to `seq_len` (ART refuses
    one above the model's max_seq_length too).

    Raises:
        HyperParameterError: the first of them out of range or of the wrong type, the keyword
            and `config` disagreeing, or accumulation with a non-zero power.
    """
    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import check, optional, whole_problem

    where = "backend.train"
    check(where, "grad_accumulation_sequences", grad_accumulation_sequences, optional(whole_problem(1)), "4")
    check(where, "packed_sequence_length", packed_sequence_length, optional(whole_problem(2)), str(seq_len))
    given = None if config is None else config.grad_accumulation_sequences
    if given is not None and grad_accumulation_sequences is not None and given != grad_accumulation_sequences:
        raise HyperParameterError(
            f"{where}(grad_accumulation_sequences={grad_accumulation_sequences!r}) disagrees with "
            f"config.grad_accumulation_sequences={given!r}; set one of them",
            "grad_accumulation_sequences",
            grad_accumulation_sequences,
        )
    accumulate = grad_accumulation_sequences if grad_accumulation_sequences is not None else given
    if packed_sequence_length is not None and packed_sequence_length > seq_len:
        raise HyperParameterError(
            f"{where}(packed_sequence_length={packed_sequence_length!r}) exceeds the trainer's "
            f"seq_len={seq_len}; pass at most {seq_len} or raise MegatronBackend(seq_len=...) "
            "(init_args.max_seq_length)",
            "packed_sequence_length",
            packed_sequence_length,
        )
    if accumulate is not None and power != 0:
        raise HyperParameterError(
            f"{where}(num_trajectories_learning_rate_multiplier_power={power!r}) scales the rate "
            f"of one step over all the call's trajectories, so it cannot be combined with "
            f"grad_accumulation_sequences={accumulate!r} (ART's Megatron trainer does not apply it "
            "either); set one of them",
            "num_trajectories_learning_rate_multiplier_power",
            power,
        )
    rows = seq_len if packed_sequence_length is None else int(packed_sequence_length)
    return (None if accumulate is None else int(accumulate)), rows


def check_accumulation(grad_accumulation_sequences: int, dp: int) -> int:
    """`grad_accumulation_sequences` (packed rows per optimizer step, over all DP ranks) when
    it splits evenly over the trainer's `dp` data-parallel ranks (ART's Megatron trainer
    requires it too).

    Raises:
        HyperParameterError: it is not a multiple of `dp` (named, with the nearest ones).
    """
    from art_mega.errors import HyperParameterError

    if grad_accumulation_sequences % dp:
        lower = grad_accumulation_sequences // dp * dp
        nearest = " or ".join(str(n) for n in (lower, lower + dp) if n > 0)
        raise HyperParameterError(
            f"backend.train(grad_accumulation_sequences={grad_accumulation_sequences!r}) does not "
            f"split over the trainer's {dp} data-parallel ranks; pass a multiple of {dp}, e.g. {nearest}",
            "grad_accumulation_sequences",
            grad_accumulation_sequences,
        )
    return grad_accumulation_sequences


def _reference_adapter(path: Any, kl: float) -> str | None:
    """`kl_ref_adapter_path` as the adapter folder the ranks read (a checkpoint's step folder
    is one), or None.

    Raises:
        HyperParameterError: not None, a str or a path; no adapter_config.json there; or no KL
            term reads it (kl_penalty_coef and kl_beta both 0).
    """
    from art_mega.errors import HyperParameterError

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


ART_TRAINER_ARGS = {
    "adam_beta1": 0.9,
    "adam_beta2": 0.99,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.1,
    "max_grad_norm": 0.1,
}
"""ART's optimizer defaults for RL (`art/dev/get_model_config.py` trainer_args: AdamW betas
(0.9, 0.99), HF's epsilon 1e-8, weight decay 0.1, gradient-norm clip 0.1); ART's SFT steps use
weight decay 0 and clip 1.0 (`ART_SFT_OPTIMIZER`) with the same betas and epsilon."""

ART_SFT_OPTIMIZER = {"weight_decay": 0.0, "clip_grad": 1.0}


def art_optimizer(trainer_args: Mapping[str, Any]) -> tuple[Any, float, float]:
    """The trainer ranks' optimizer from ART's `trainer_args` (InternalModelConfig; absent keys:
    `ART_TRAINER_ARGS`): (`OptimizerConfig` with the betas and epsilon and SFT's decay and
    clip, RL's weight decay, RL's clip), as ART trains: RL steps with `weight_decay` and
    `max_grad_norm`, SFT steps with weight decay 0 and clip 1.0.

    Raises:
        HyperParameterError: a value out of its range (names the trainer_args key).
    """
    from art_mega.hyperparams import between_problem, check, nonnegative_problem, positive_problem

    args = {**ART_TRAINER_ARGS, **{k: v for k, v in trainer_args.items() if k in ART_TRAINER_ARGS}}
    where = "TrainableModel(_internal_config=...trainer_args)"
    for name in ("adam_beta1", "adam_beta2"):
        check(where, name, args[name], between_problem(0.0, 0.999999), "0.9")
    check(where, "adam_epsilon", args["adam_epsilon"], positive_problem, "1e-8")
    check(where, "weight_decay", args["weight_decay"], nonnegative_problem, "0.1")
    check(where, "max_grad_norm", args["max_grad_norm"], nonnegative_problem, "0.1")
    optimizer = OptimizerConfig(
        beta1=float(args["adam_beta1"]),
        beta2=float(args["adam_beta2"]),
        eps=float(args["adam_epsilon"]),
        **ART_SFT_OPTIMIZER,
    )
    return optimizer, float(args["weight_decay"]), float(args["max_grad_norm"])


def trajectories_learning_rate(learning_rate: float, documents: int, power: float) -> float:
    """ART's `num_trajectories_learning_rate_multiplier_power`: `learning_rate` * documents **
    power, where `documents` is the number of tokenized trajectories (histories) the call
    trains; every optimizer step of the call takes that rate (ART's LocalBackend counts those
    packed into each step's sequence; its MegatronBackend does not apply the power). A call
    with no document keeps `learning_rate` (it trains nothing).

    Raises:
        HyperParameterError: the product is not a float32 learning rate > 0 (named, with the count).
    """
    import math

    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import positive_problem

    if documents == 0 or power == 0:
        return learning_rate
    try:
        scaled = learning_rate * float(documents) ** power
    except OverflowError:
        scaled = math.inf
    why = positive_problem(scaled)
    if why is not None:
        raise HyperParameterError(
            f"backend.train(num_trajectories_learning_rate_multiplier_power={power!r}) makes the "
            f"learning rate {learning_rate!r} * {documents} ** {power!r} = {scaled!r}, which {why}; "
            "use a smaller power",
            "num_trajectories_learning_rate_multiplier_power",
            power,
        )
    return scaled


BACKEND_WHOLE_NUMBERS = {
    "lora_rank": (1, "8"),
    "seq_len": (2, "1024"),
    "max_model_len": (2, "1024"),
    "keep_adapters": (1, "2"),
}
"""`MegatronBackend`'s integer arguments: (minimum, example). A row of one token trains nothing
(the loss predicts each token from the ones before it); the served step stays loaded, so at
least one adapter is kept."""


def check_backend_options(
    *,
    lora_rank: Any,
    lora_alpha: Any,
    lora_targets: Any,
    seq_len: Any,
    max_model_len: Any,
    keep_adapters: Any,
    startup_timeout_s: Any,
    vllm_python: Any,
    where: str = "MegatronBackend",
) -> None:
    """Refuse `MegatronBackend`'s arguments before anything starts (see `BACKEND_WHOLE_NUMBERS`;
    lora_rank at most vLLM's largest slot; lora_alpha and startup_timeout_s: finite > 0; lora_targets: None or a list or tuple of known
    target names, not one string; vllm_python: None or a non-empty path string).

    Raises:
        HyperParameterError: a number of the wrong type or out of range (named, with an example).
        UserError: lora_targets or vllm_python of the wrong type, or an unknown LoRA target.
    """
    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import check, positive_problem, whole_problem
    from art_mega.inference.protocol import VLLM_LORA_RANKS
    from art_mega.trainer.families import LORA_NAMES

    values = {
        "lora_rank": lora_rank,
        "seq_len": seq_len,
        "max_model_len": max_model_len,
        "keep_adapters": keep_adapters,
    }
    for name, (minimum, example) in BACKEND_WHOLE_NUMBERS.items():
        if values[name] is not None or name not in ("seq_len", "max_model_len"):  # None: the model's
            check(where, name, values[name], whole_problem(minimum), example)
    if lora_rank > VLLM_LORA_RANKS[-1]:
        raise HyperParameterError(
            f"{where}(lora_rank={lora_rank!r}) is above {VLLM_LORA_RANKS[-1]}, the largest LoRA rank "
            "vLLM serves; pass e.g. lora_rank=8",
            "lora_rank",
            lora_rank,
        )
    check(where, "lora_alpha", lora_alpha, positive_problem, "16.0")
    check(where, "startup_timeout_s", startup_timeout_s, positive_problem, "900.0")
    if lora_targets is not None:
        if (
            not isinstance(lora_targets, (list, tuple))
            or not lora_targets
            or not all(isinstance(t, str) for t in lora_targets)
        ):
            raise UserError(
                f"{where}(lora_targets={lora_targets!r}) must be a non-empty list or tuple of module names, "
                "e.g. lora_targets=('q_proj', 'k_proj', 'v_proj', 'o_proj'), or None for the default"
            )
        LORA_NAMES.normalise(tuple(lora_targets))
    if vllm_python is not None and (not isinstance(vllm_python, (str, os.PathLike)) or not str(vllm_python)):
        raise UserError(
            f"{where}(vllm_python={vllm_python!r}) must be the path of a Python interpreter with vLLM, "
            "e.g. vllm_python='/opt/venv-vllm/bin/python', or None for the default"
        )
