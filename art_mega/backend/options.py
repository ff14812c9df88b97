"""The options of MegatronBackend and of its steps: ART's names and defaults, their checks
(one sentence naming the field, the value and the fix), ART's optimizer settings."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from art_mega.errors import UserError
from art_mega.hyperparams import (
    between_problem,
    check,
    nonnegative_problem,
    optional,
    positive_problem,
    whole_problem,
)
from art_mega.train_options import (
    ART_OPTION_HINTS,
    DEFAULT_LEARNING_RATE,
    GRPO_OPTIONS,
    Check,
    GRPOOptions,
    RefusedOption,
)
from art_mega.trainer.protocol import (
    OptimizerConfig,
)

__all__ = ["ART_OPTION_HINTS", "DEFAULT_LEARNING_RATE", "GRPO_OPTIONS", "Check", "GRPOOptions", "RefusedOption"]

log = logging.getLogger(__name__)


def check_grpo_options(*, unknown: Mapping[str, Any] = {}, **options: Any) -> tuple[float, dict[str, Any]]:  # noqa: B006
    """Check `backend.train`'s options (`GRPOOptions`, whose fields are the keywords here) before
    anything runs; returns (learning rate, the `GRPOLossConfig` fields of the job). `unknown`
    holds other keywords: an ART option of `ART_OPTION_HINTS` at its off value passes, any other
    is refused. `kl_ref_adapter_path` is the resolved reference folder (`_reference_adapter`).

    Raises:
        HyperParameterError: see `GRPOOptions`.
    """
    checked = GRPOOptions.model_validate({**options, **unknown})
    return checked.learning_rate, checked.loss_fields(checked.kl_ref_adapter_path)


def check_optimizer_snapshots(interval: Any, final_step: Any, config: Any) -> None:
    """ART 0.5.23's `optimizer_save_interval` (whole >= 1, ART's default 5) and
    `final_training_step` (None or whole >= 1), the keywords or `config`'s (a checked
    `TrainConfig` or None). ART snapshots the optimizer state every `interval` steps and at the
    final step (`art/megatron/train.py`); art-mega commits it with every step's checkpoint,
    which covers every choice, so a value other than ART's default is accepted with one logged line.

    Raises:
        HyperParameterError: a value that is not a whole number in range (named).
    """

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
