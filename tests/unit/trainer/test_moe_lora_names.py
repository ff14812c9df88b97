"""MoE expert adapters <-> PEFT's per-expert module names (the format PEFT converts onto
transformers 5's fused expert parameters)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from art_mega.trainer.families.qwen3_moe import SPEC  # noqa: E402

megatron_to_hf, hf_to_megatron = SPEC.lora.to_peft, SPEC.lora.from_peft

PREFIX = "base_model.model.model.layers.1.mlp.experts.3"


def test_expert_fc1_and_fc2_map_to_that_experts_hf_modules() -> None:
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, generator=generator), torch.randn(2 * 32, 4, generator=generator)
    hf = megatron_to_hf("decoder.layers.1.mlp.experts.3.linear_fc1", a, [b], 4, 2)
    assert sorted(hf) == [f"{PREFIX}.{m}.lora_{x}.weight" for m in ("gate_proj", "up_proj") for x in "AB"]
    assert torch.equal(hf[f"{PREFIX}.gate_proj.lora_B.weight"], b[:32])
    assert torch.equal(hf[f"{PREFIX}.up_proj.lora_B.weight"], b[32:])
    got_a, got_b = hf_to_megatron("decoder.layers.1.mlp.experts.3.linear_fc1", hf, 4, 2, 1, 0)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)

    a2, b2 = torch.randn(4, 32, generator=generator), torch.randn(64, 4, generator=generator)
    hf = megatron_to_hf("decoder.layers.1.mlp.experts.3.linear_fc2", a2, [b2], 4, 2)
    assert sorted(hf) == [f"{PREFIX}.down_proj.lora_A.weight", f"{PREFIX}.down_proj.lora_B.weight"]
    got_a, got_b = hf_to_megatron("decoder.layers.1.mlp.experts.3.linear_fc2", hf, 4, 2, 1, 0)
    assert torch.equal(got_a, a2) and torch.equal(got_b, b2)


def test_a_missing_expert_is_named() -> None:
    from art_mega.errors import UserError

    with pytest.raises(UserError) as caught:
        hf_to_megatron("decoder.layers.1.mlp.experts.3.linear_fc2", {}, 4, 2, 1, 0)
    assert str(caught.value) == (
        f"the adapter has no tensor {PREFIX}.down_proj.lora_A.weight; it does not cover down_proj of layer 1."
    )
