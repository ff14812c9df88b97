"""ART's `art.dev.TrainConfig`: the experimental per-call training options of
`model.train(groups, config=..., _config=art.dev.TrainConfig(...))`, keyed as openpipe-art 0.5.23
keys them (0.5.18's keys and `kl_penalty_reference_step`, `kl_penalty_source`, `kl_penalty_step_lag`) (`art/dev/train.py`). `TrainableModel.train` maps each key to the `backend.train`
keyword of that name (`model.dev_train_options`), where it acts as in ART or is refused."""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import TypedDict


class TrainConfig(TypedDict, total=False):
    """ART's dev.TrainConfig (every key optional; see `MegatronBackend.train` for each one)."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float | None
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    kimi_k2_tau: float | None
    kl_penalty_coef: float
    kl_penalty_reference_step: int | None
    kl_penalty_source: Literal["current_learner", "sample"]
    kl_penalty_step_lag: int | None
    kl_ref_adapter_path: str | None
    logprob_calculation_chunk_size: int
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float
    moe_routing_replay_bundle: Any
    moe_routing_replay_path: str | None
    moe_routing_replay_strict: bool
    num_trajectories_learning_rate_multiplier_power: float
    packed_sequence_length: int | None
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float | None


TRAIN_CONFIG_KEYS = tuple(TrainConfig.__annotations__)
"""The keys of `TrainConfig`, in ART's order."""
