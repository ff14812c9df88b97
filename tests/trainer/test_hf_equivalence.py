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


def test_bf16_model_keeps_every_parameter_in_bf16_and_tracks_fp32(
    tp1_logits: dict, tiny_dirs: dict[str, Path]
) -> None:
    """bf16 parameters everywhere, the torch norms included (megatron-core builds them fp32, which
    stops torch's fused norm kernel); logits within bf16 rounding of the fp32 model's."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.common import megatron_logits

    built = build_megatron_model(tiny_dirs["qwen3"], dtype="bfloat16")
    norms = [m for m in built.module.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert norms and all(m.weight.dtype == torch.bfloat16 for m in norms)
    assert {p.dtype for p in built.module.parameters()} == {torch.bfloat16}
    got = megatron_logits(built, input_ids(built.vocab_size)).float()
    expected = tp1_logits["qwen3"]
    assert (got - expected).abs().max().item() <= 0.1 * expected.abs().max().item()
