"""TP=1 Megatron logits equal Hugging Face transformers' logits for the same tiny checkpoints (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_mega.errors import UserError
from art_mega.trainer.model_builder import check_model_fits
from tests.trainer.common import EQUIVALENCE_MODELS, input_ids, require_trainer_deps

require_trainer_deps()

HF_TOLERANCE = 1e-4


@pytest.mark.parametrize("name", EQUIVALENCE_MODELS)
def test_megatron_matches_transformers(name: str, tp1_logits: dict, tiny_dirs: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32)
    ids = input_ids(hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids).logits
    got = tp1_logits[name]
    diff = (got - expected).abs().max().item()
    print(f"{name}: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert got.shape == expected.shape
    assert diff <= HF_TOLERANCE


def test_divisibility_is_checked_from_config_alone(tiny_dirs: dict[str, Path]) -> None:
    check_model_fits(tiny_dirs["llama"], 4)
    with pytest.raises(UserError) as caught:
        check_model_fits(tiny_dirs["llama"], 3)
    assert str(caught.value) == (
        "tp=3 cannot split this llama model (4 attention heads, 2 KV heads, FFN size 256); use tp in {1, 2, 4}."
    )
