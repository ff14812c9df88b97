"""The multimodal Gemma 3 wrapper's config (model_type "gemma3"): `gemma3.TEXT_DEFAULTS` are
transformers' Gemma3TextConfig defaults, the wrapper reads as its decoder with them, and its LoRA
names sit under the wrapper's decoder (PEFT on Gemma3ForConditionalGeneration, vLLM's gemma3_mm)."""

import dataclasses

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import family_for, gemma3
from tests.real_size_configs import GEMMA3_27B_IT, GEMMA3_27B_TEXT


def test_text_defaults_are_transformers_defaults() -> None:
    transformers = pytest.importorskip("transformers")
    defaults = transformers.Gemma3TextConfig().to_dict()
    assert gemma3.TEXT_DEFAULTS == {name: defaults[name] for name in gemma3.TEXT_DEFAULTS}
    wrapped = transformers.Gemma3Config(text_config=GEMMA3_27B_IT["text_config"]).text_config.to_dict()
    assert gemma3.text_config(GEMMA3_27B_IT) == {
        **{name: wrapped[name] for name in gemma3.TEXT_DEFAULTS},
        **GEMMA3_27B_IT["text_config"],
        "tie_word_embeddings": wrapped["tie_word_embeddings"],
        "model_type": "gemma3",
    }


def test_the_wrapper_reads_as_its_text_config() -> None:
    assert family_for(GEMMA3_27B_IT) is gemma3.SPEC
    args = gemma3.model_args(GEMMA3_27B_IT)
    assert dataclasses.replace(args, model_type="gemma3_text") == gemma3.model_args(GEMMA3_27B_TEXT)
    assert gemma3.SPEC.lora_names(args).layer_prefix == "base_model.model.model.language_model.layers"
    text_args = gemma3.model_args(GEMMA3_27B_TEXT)
    assert gemma3.SPEC.lora_names(text_args).layer_prefix == "base_model.model.model.layers"


def test_a_wrapper_text_config_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(UserError, match="text_config of a gemma3 config.json must be an object"):
        gemma3.model_args({**GEMMA3_27B_IT, "text_config": [1]})


def test_the_replica_sizes_the_wrapper_from_its_filled_decoder_config() -> None:
    """gemma-3-4b-it's text_config omits the head counts (Gemma3TextConfig's 8 heads, 4 KV heads
    of 256): the KV cache per token is read from the filled decoder config, not a KeyError."""
    from art_mega.dev.settings import kv_bytes_per_token
    from art_mega.trainer.families import decoder_config
    from tests.unit.backend.test_register_checks import GEMMA3_4B_IT

    assert decoder_config(GEMMA3_27B_TEXT) is GEMMA3_27B_TEXT
    assert kv_bytes_per_token(decoder_config(GEMMA3_4B_IT), 2) == 2 * 34 * 4 * 256 * 2
