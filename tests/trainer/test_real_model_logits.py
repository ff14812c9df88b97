"""The real model once: SmolLM2-135M-Instruct's Megatron logits equal Hugging Face transformers'
(fp32, TP=1, one forward pass of 1 x 64 tokens)."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.common import megatron_logits, require_trainer_deps

require_trainer_deps()

HF_TOLERANCE = 1e-4
TOKENS = 64


def test_smollm2_megatron_logits_match_transformers(megatron_world, smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from art_mega.trainer.model_builder import build_megatron_model

    built = build_megatron_model(smollm2_dir)
    assert (built.args.num_heads, built.args.num_query_groups, built.vocab_size) == (9, 3, 49152)
    ids = torch.randint(0, built.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(2024))
    got = megatron_logits(built, ids)
    del built
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = hf_model(ids).logits
    diff = (got - expected).abs().max().item()
    print(f"SmolLM2-135M: max |megatron - hf| = {diff:.2e} (logit std {expected.std().item():.2f})")
    assert got.shape == expected.shape == (1, TOKENS, 49152)
    assert diff <= HF_TOLERANCE
