"""`train_options`: GRPOOptions is the one definition of backend.train's keywords, and ART's
TrainConfig and dev.TrainConfig are read through it (issue 35)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from art_mega.backend import MegatronBackend
from art_mega.dev.train import TRAIN_CONFIG_KEYS
from art_mega.errors import HyperParameterError
from art_mega.model import dev_train_options
from art_mega.train_options import ART_OPTION_HINTS, GRPO_OPTIONS, GRPOOptions, TrainConfig, art_epsilons
from art_mega.trainer.protocol import GRPOLossConfig


def test_backend_train_takes_the_models_fields_with_their_defaults():
    params = inspect.signature(MegatronBackend.train).parameters
    keywords = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == {name: field.default for name, field in GRPOOptions.model_fields.items()}
    assert tuple(keywords) == GRPO_OPTIONS and list(params)[:3] == ["self", "model", "trajectory_groups"]
    assert keywords["learning_rate"] == 5e-6 and keywords["loss_fn"] == "cispo"


def test_every_dev_train_config_key_is_an_option_or_an_art_hint():
    keys = {"loss_fn" if key == "ppo" else key for key in TRAIN_CONFIG_KEYS}
    assert keys - set(GRPO_OPTIONS) - set(ART_OPTION_HINTS) == set()


def test_train_config_takes_the_options_defaults_and_ranges():
    config = TrainConfig()
    fields = GRPOOptions.model_fields
    assert config.learning_rate == fields["learning_rate"].default == 5e-6
    assert config.beta == fields["kl_beta"].default == 0.0
    assert config.kl_penalty_source == fields["kl_penalty_source"].default == "current_learner"
    assert (config.optimizer_save_interval, config.final_training_step) == (5, None)
    with pytest.raises(ValueError, match=r"must be a finite number greater than 0 \(not above 0\); use e.g. 5e-6"):
        TrainConfig(learning_rate=0)
    with pytest.raises(ValueError, match=r"must be a finite number of at least 0 \(negative\); use e.g. 0.04"):
        TrainConfig(beta=-1)


def test_numbers_become_floats_and_the_loss_takes_arts_epsilons():
    options = GRPOOptions.model_validate({"learning_rate": np.float32(1e-4), "kl_beta": 1, "loss_fn": "ppo"})
    assert type(options.learning_rate) is float and type(options.kl_beta) is float
    fields = options.loss_fields()
    assert (fields["epsilon_low"], fields["epsilon_high"]) == art_epsilons("ppo") == (0.2, None)
    assert GRPOLossConfig(**fields).kl_beta == 1.0
    assert art_epsilons("cispo") == (1.0, 4.0)
    assert dev_train_options({"ppo": True, "epsilon_high": None}, {}) == {"loss_fn": "ppo", "epsilon_high": 0.2}


def test_the_cross_field_rule_and_arts_hints_are_one_sentence_each():
    with pytest.raises(HyperParameterError) as both:
        GRPOOptions.model_validate({"tis_cap": 2.0, "truncated_importance_sampling": 3.0})
    assert str(both.value).startswith("backend.train(tis_cap=2.0) and truncated_importance_sampling=3.0 are two TIS caps")
    assert GRPOOptions.model_validate({"save_checkpoint": True}) == GRPOOptions()  # ART's off value
    with pytest.raises(HyperParameterError, match=r"^backend.train got ART's save_checkpoint=False; every"):
        GRPOOptions.model_validate({"save_checkpoint": False})
