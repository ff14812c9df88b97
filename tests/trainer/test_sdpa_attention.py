"""SdpaCoreAttention gives Megatron's local DotProductAttention's numbers (fp32, CPU): packed
rows with a block-diagonal causal mask, plain causal, GQA, gradients; and refuses what it lacks."""

import copy

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the trainer-cpu extra)")


def _config(heads: int, groups: int, head_dim: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def _pair(config):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from art_mega.trainer.rank.sdpa_attention import sdpa_core_attention

    reference = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    return sdpa_core_attention()(config, 1, AttnMaskType.causal, "self"), reference


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("packed", [True, False])
def test_matches_megatron_dot_product_attention(megatron_world, heads, groups, packed):
    from art_mega.trainer.rank.logprobs import packed_attention_mask

    seq, batch, head_dim = 12, 2, 8
    sdpa, reference = _pair(_config(heads, groups, head_dim))
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    query = torch.randn(seq, batch, heads, head_dim, generator=gen, requires_grad=True)
    key = torch.randn(seq, batch, groups, head_dim, generator=gen, requires_grad=True)
    value = torch.randn(seq, batch, groups, head_dim, generator=gen, requires_grad=True)
    mask = None
    if packed:  # two documents and padding in row 0, one document in row 1
        segments = torch.tensor([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12])
        mask = packed_attention_mask(segments)
        assert mask.shape == (batch, 1, seq, seq) and mask.dtype == torch.bool

    got = sdpa(query, key, value, mask)
    inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    expected = reference(*inputs, mask)
    assert got.shape == expected.shape == (seq, batch, heads * head_dim)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn(got.shape, generator=gen)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    for mine, theirs in zip((query, key, value), inputs):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    if packed:  # a token of document 2 does not see document 1: changing document 1 keeps it
        changed = value.detach().clone()
        changed[:5, 0] += 1.0
        again = sdpa(query.detach(), key.detach(), changed, mask)
        torch.testing.assert_close(again[5:10, 0], got.detach()[5:10, 0])
        assert not torch.allclose(again[:5, 0], got.detach()[:5, 0])


def test_refuses_what_it_does_not_implement(megatron_world):
    from megatron.core.transformer.enums import AttnMaskType

    from art_mega.trainer.rank.sdpa_attention import sdpa_core_attention

    config = _config(4, 2, 8)
    windowed = copy.copy(config)
    windowed.window_size = (4, 2)
    with pytest.raises(ValueError, match="sliding window is causal"):
        sdpa_core_attention()(windowed, 1, AttnMaskType.causal, "self")
    sdpa = sdpa_core_attention()(config, 1, AttnMaskType.causal, "self")
    q = torch.zeros(3, 1, 4, 8)
    kv = torch.zeros(3, 1, 2, 8)
    with pytest.raises(ValueError, match="attention_bias"):
        sdpa(q, kv, kv, None, attention_bias=torch.zeros(1))


def test_the_local_spec_uses_it(megatron_world, tiny_dirs):
    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.sdpa_attention import sdpa_core_attention

    built = build_megatron_model(tiny_dirs["qwen3"], device="cpu", dtype="float32", use_te=False)
    cores = [m for m in built.module.modules() if isinstance(m, sdpa_core_attention())]
    assert len(cores) == built.module.config.num_layers
