"""Hyper-parameters are refused, never replaced by a default, before any job is sent:
`backend.train`'s options and unknown keywords, `TrainConfig`, `TrainSFTConfig`, `iterate_dataset`."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

import art_mega as art
from art_mega.backend import MegatronBackend, check_grpo_options
from art_mega.errors import HyperParameterError, format_validation_error
from art_mega.sft import TrainSFTConfig, iterate_dataset

NAN, INF = float("nan"), float("inf")
DEFAULTS = dict(
    learning_rate=5e-6,
    importance_sampling_level="token",
    epsilon=0.2,
    epsilon_high=None,
    kl_beta=0.0,
    tis_cap=None,
    scale_rewards=True,
    config=None,
    allow_stale=False,
    drop_nonfinite_rewards=False,
    unknown={},
)


def options(**changes: Any) -> tuple[float, dict[str, Any]]:
    return check_grpo_options(**{**DEFAULTS, **changes})


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("learning_rate", "1e-5", "must be a finite number greater than 0 (a str)"),
        ("learning_rate", NAN, "must be a finite number greater than 0 (not finite)"),
        ("learning_rate", INF, "must be a finite number greater than 0 (not finite)"),
        ("learning_rate", 0.0, "must be a finite number greater than 0 (not above 0)"),
        ("learning_rate", -1e-5, "must be a finite number greater than 0 (not above 0)"),
        ("learning_rate", None, "must be a finite number greater than 0 (a NoneType)"),
        ("learning_rate", True, "must be a finite number greater than 0 (a bool)"),
        ("epsilon", -0.1, "must be a finite number of at least 0 (negative)"),
        ("epsilon_high", NAN, "must be a finite number of at least 0 (not finite)"),
        ("kl_beta", -0.5, "must be a finite number of at least 0 (negative)"),
        ("kl_beta", INF, "must be a finite number of at least 0 (not finite)"),
        ("tis_cap", 0.0, "must be a finite number greater than 0 (not above 0)"),
        ("tis_cap", INF, "must be a finite number greater than 0 (not finite)"),
        ("scale_rewards", "false", "must be True or False (a str)"),
        ("allow_stale", 1, "must be True or False (a int)"),
    ],
)
def test_bad_train_options_are_refused_naming_field_and_value(name: str, value: Any, why: str) -> None:
    with pytest.raises(HyperParameterError) as info:
        options(**{name: value})
    assert str(info.value).startswith(f"backend.train({name}={value!r}) {why}; pass e.g. {name}=")
    assert info.value.name == name


def test_good_train_options_reach_the_job_as_floats() -> None:
    lr, loss = options(learning_rate=np.float32(1e-4), epsilon=0, epsilon_high=0.28, kl_beta=1, tis_cap=2)
    assert lr == pytest.approx(1e-4) and type(lr) is float
    assert loss == {
        "importance_sampling_level": "token",
        "epsilon_low": 0.0,
        "epsilon_high": 0.28,
        "kl_beta": 1.0,
        "tis_cap": 2.0,
        "loss_fn": "cispo",
        "truncated_importance_sampling": None,
        "mask_prob_ratio": False,
        "max_negative_advantage_importance_sampling_weight": None,
        "kimi_k2_tau": None,
        "kl_penalty_coef": 0.0,
        "precalculate_logprobs": False,
        "kl_ref_adapter_path": None,
    }
    with pytest.raises(
        HyperParameterError, match=r"importance_sampling_level='seq'\) must be 'token' or 'sequence'"
    ):
        options(importance_sampling_level="seq")


def test_train_config_gives_learning_rate_and_beta() -> None:
    lr, loss = options(config=art.TrainConfig(learning_rate=1e-4, beta=0.1))
    assert (lr, loss["kl_beta"]) == (1e-4, 0.1)
    with pytest.raises(HyperParameterError, match=r"kl_beta=0.2\) disagrees with config.beta=0.1"):
        options(config=art.TrainConfig(beta=0.1), kl_beta=0.2)
    with pytest.raises(
        HyperParameterError, match=r"config=\{'learning_rate': 0.001\}\) must be an art_mega.TrainConfig"
    ):
        options(config={"learning_rate": 1e-3})


def test_unknown_keywords_are_refused_by_backend_train() -> None:
    backend = MegatronBackend()
    backend._model = art.TrainableModel(name="m", project="p", base_model="tiny")

    def train(**kwargs: Any) -> Any:
        return asyncio.run(backend.train(backend._model, [], **kwargs))

    with pytest.raises(HyperParameterError) as info:
        train(learning_rat=1e-5)
    assert str(info.value) == (
        "backend.train got an unknown keyword learning_rat=1e-05; use one of learning_rate, loss_fn, "
        "importance_sampling_level, epsilon, epsilon_high, kl_beta, tis_cap, scale_rewards, "
        "normalize_advantages, advantage_balance, kl_penalty_coef, truncated_importance_sampling, "
        "precalculate_logprobs, mask_prob_ratio, max_negative_advantage_importance_sampling_weight, "
        "kimi_k2_tau, num_trajectories_learning_rate_multiplier_power, kl_ref_adapter_path, "
        "kl_penalty_reference_step, kl_penalty_source, optimizer_save_interval, final_training_step, config, "
        "allow_stale, drop_nonfinite_rewards, allow_training_without_logprobs, "
        "grad_accumulation_sequences, packed_sequence_length, logprob_calculation_chunk_size"
    )
    with pytest.raises(HyperParameterError, match="ppo=True; backend.train takes ART's loss_fn='ppo'"):
        train(ppo=True)
    with pytest.raises(
        HyperParameterError,
        match=r"logprob_calculation_chunk_size=8.0\) must be a whole number of at least 1",
    ):
        train(logprob_calculation_chunk_size=8.0)
    with pytest.raises(HyperParameterError, match=r"backend.train\(learning_rate='3e-4'\)"):
        train(learning_rate="3e-4")  # refused before the (empty) groups are looked at


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"learning_rate": "1e-5"},
            "TrainConfig.learning_rate: '1e-5' must be a finite number greater than 0 (a str); use e.g. 5e-6.",
        ),
        (
            {"learning_rate": NAN},
            "TrainConfig.learning_rate: nan must be a finite number greater than 0 (not finite)",
        ),
        (
            {"learning_rate": 0},
            "TrainConfig.learning_rate: 0 must be a finite number greater than 0 (not above 0)",
        ),
        (
            {"learning_rate": -3e-4},
            "TrainConfig.learning_rate: -0.0003 must be a finite number greater than 0",
        ),
        ({"beta": -0.1}, "TrainConfig.beta: -0.1 must be a finite number of at least 0 (negative)"),
        ({"beta": INF}, "TrainConfig.beta: inf must be a finite number of at least 0 (not finite)"),
    ],
)
def test_train_config_refuses_bad_values(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValidationError) as info:
        art.TrainConfig(**fields)
    assert format_validation_error(info.value).startswith(expected)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"learning_rate": "fast"},
            "TrainSFTConfig.learning_rate: 'fast' must be a finite number of at least 0 (a str)",
        ),
        (
            {"learning_rate": INF},
            "TrainSFTConfig.learning_rate: inf must be a finite number of at least 0 (not finite)",
        ),
        (
            {"learning_rate": -1e-4},
            "TrainSFTConfig.learning_rate: -0.0001 must be a finite number of at least 0 (negative)",
        ),
        (
            {"batch_size": 1.5},
            "TrainSFTConfig.batch_size: 1.5 must be a whole number of at least 1 (a float); use e.g. 2 or 'auto'.",
        ),
        ({"batch_size": 0}, "TrainSFTConfig.batch_size: 0 must be a whole number of at least 1 (below 1)"),
        ({"batch_size": True}, "TrainSFTConfig.batch_size: True must be a whole number of at least 1 (a bool)"),
    ],
)
def test_sft_config_refuses_bad_values(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValidationError) as info:
        TrainSFTConfig(**fields)
    assert format_validation_error(info.value).startswith(expected)
    assert TrainSFTConfig(batch_size=np.int64(4)).batch_size == 4
    assert TrainSFTConfig(learning_rate=0).learning_rate == 0.0  # the last step of a schedule decaying to 0


def test_train_sft_refuses_a_config_that_is_not_one_or_comes_with_keywords() -> None:
    backend = MegatronBackend()
    backend._model = art.TrainableModel(name="m", project="p", base_model="tiny")
    with pytest.raises(
        HyperParameterError,
        match=r"train_sft\(config=\{'learning_rate': 1\}\) must be an art_mega.TrainSFTConfig",
    ):
        asyncio.run(backend.train_sft(backend._model, [], {"learning_rate": 1}))
    with pytest.raises(HyperParameterError, match="train_sft got config= and learning_rate= together"):
        asyncio.run(backend.train_sft(backend._model, [], TrainSFTConfig(), learning_rate=1e-3))
    with pytest.raises(ValidationError):
        asyncio.run(backend.train_sft(backend._model, [], learning_rate=NAN))


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("groups_per_step", 1.5, "must be a whole number of at least 1 (a float)"),
        ("groups_per_step", 0, "must be a whole number of at least 1 (below 1)"),
        ("groups_per_step", True, "must be a whole number of at least 1 (a bool)"),
        ("num_epochs", 2.0, "must be a whole number of at least 1 (a float)"),
        ("initial_step", -1, "must be a whole number of at least 0 (below 0)"),
        ("initial_step", "3", "must be a whole number of at least 0 (a str)"),
    ],
)
def test_iterate_dataset_refuses_bad_counts(name: str, value: Any, why: str) -> None:
    with pytest.raises(HyperParameterError) as info:
        list(iterate_dataset(list(range(5)), **{name: value}))
    assert str(info.value).startswith(f"iterate_dataset({name}={value!r}) {why}; pass e.g. {name}=")


def test_iterate_dataset_takes_numpy_integers() -> None:
    batches = list(iterate_dataset(list(range(5)), groups_per_step=np.int64(2), shuffle=False))
    assert [b.items for b in batches] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("batch_size", 1.5, "must be a whole number of at least 1 (a float)"),
        ("epochs", 0, "must be a whole number of at least 1 (below 1)"),
        ("peak_lr", NAN, "must be a finite number greater than 0 (not finite)"),
        ("warmup_ratio", 2, "must be a number from 0 to 1 (outside [0, 1])"),
    ],
)
def test_the_sft_dataset_iterator_refuses_bad_counts_and_rates(name: str, value: Any, why: str) -> None:
    from art_mega.sft import create_sft_dataset_iterator

    with pytest.raises(HyperParameterError) as info:
        list(create_sft_dataset_iterator([art.Trajectory()] * 3, **{name: value}))
    assert str(info.value).startswith(
        f"create_sft_dataset_iterator({name}={value!r}) {why}; pass e.g. {name}="
    )


def test_model_train_takes_a_train_config_only() -> None:
    from art_mega.errors import TrainInputError

    backend = MegatronBackend()
    model = art.TrainableModel(name="m", project="p", base_model="tiny")
    backend._model, model._backend = model, backend
    with pytest.raises(
        HyperParameterError,
        match=r"model.train\(config=\{'learning_rate': 0.001\}\) must be an art_mega.TrainConfig",
    ):
        asyncio.run(model.train([], config={"learning_rate": 1e-3}))
    # a good config passes the option checks and reaches the check of the (empty) groups
    with pytest.raises(TrainInputError, match="got an empty list"):
        asyncio.run(model.train([], config=art.TrainConfig(learning_rate=1e-4, beta=0.1)))
