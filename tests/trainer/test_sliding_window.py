"""Sliding-window attention as a trainer capability: SdpaCoreAttention's per-layer window gives
Megatron's local DotProductAttention's numbers (and keeps the window with a packed-row mask),
and tiny windowed models (Mistral v0.1-style window on every layer; Qwen2 `use_sliding_window`
from `max_window_layers` on) give transformers' logits at TP=1 and TP=2, where the window
changes the logits by more than 1."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps

require_trainer_deps()

HF_TOLERANCE = 1e-4
TP_TOLERANCE = 1e-5
"""As tests/trainer: HF vs Megatron logits, TP=2 vs TP=1 logits."""
WINDOW = 6
"""Tokens a windowed layer sees (HF `sliding_window`), against 24-token test rows."""
WINDOWED = {
    "mistral_window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2_window": ("qwen2", {"sliding_window": WINDOW, "max_window_layers": 1}),
}
"""Test model -> (tiny arch, build arguments); Qwen2's layer 0 is global, layer 1 slides."""
EXPECTED_LAYERS = {"mistral_window": (True, True), "qwen2_window": (False, True)}


@pytest.fixture(scope="session")
def window_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-windows")
    return {name: build_tiny_model(root / name, arch, **sizes) for name, (arch, sizes) in WINDOWED.items()}


@pytest.fixture(scope="session")
def window_world(window_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """`tests.trainer.window_worker` at TP=2 on the windowed models, started (not awaited)."""
    world = RankProcesses("tests.trainer.window_worker", tmp_path_factory.mktemp("window-tp2"), window_dirs)
    yield world
    world.kill()


@pytest.fixture(scope="session")
def window_tp1(window_world, megatron_world, window_dirs: dict[str, Path]) -> dict[str, dict]:
    """TP=1 in this process (while the TP=2 world works): each model's args and logits."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, path in window_dirs.items():
            built = build_megatron_model(path)
            out[name] = {"args": built.args, "logits": megatron_logits(built, input_ids(built.vocab_size))}
        return out
    finally:
        torch.set_num_threads(threads)


def _attention_config(window_attn_skip_freq, window_size=(3, 0)):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        window_size=window_size,
        window_attn_skip_freq=window_attn_skip_freq,
    )


@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_window_matches_megatron_per_layer(megatron_world, packed: bool) -> None:
    """Layer 1 slides (window 4 tokens: (3, 0)), layer 2 is global; forward and gradients equal
    Megatron's DotProductAttention with the same window (with a packed mask Megatron's window
    mask would replace the packed one, so the reference there is Megatron without a window given
    packed | window explicitly)."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from art_mega.trainer.rank.logprobs import packed_attention_mask
    from art_mega.trainer.rank.sdpa_attention import sdpa_core_attention, sliding_window_causal_mask

    config = _attention_config([1, 0])
    seq, batch = 12, 2
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(seq, batch, 4, 8, generator=gen, requires_grad=True)
    key = torch.randn(seq, batch, 2, 8, generator=gen, requires_grad=True)
    value = torch.randn(seq, batch, 2, 8, generator=gen, requires_grad=True)
    segments = torch.tensor([[1] * 7 + [2] * 5, [1] * 12])
    mask = packed_attention_mask(segments) if packed else None
    band = sliding_window_causal_mask(seq, seq, (3, 0))
    outputs = {}
    for layer in (1, 2):
        sdpa = sdpa_core_attention()(config, layer, AttnMaskType.causal, "self")
        assert sdpa.window == ((3, 0) if layer == 1 else None)
        reference = DotProductAttention(config, layer, AttnMaskType.causal, "self")
        ref_mask = mask
        if packed and layer == 1:
            reference = DotProductAttention(_attention_config(None, None), layer, AttnMaskType.causal, "self")
            ref_mask = mask | band
        inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
        mine = [t.detach().clone().requires_grad_() for t in (query, key, value)]
        got = sdpa(*mine, mask)
        expected = reference(*inputs, ref_mask)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        weights = torch.randn(got.shape, generator=gen)
        (got * weights).sum().backward()
        (expected * weights).sum().backward()
        for a, b in zip(mine, inputs):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
        outputs[layer] = got.detach()
    # The window bites: token 11 of row 1 sees tokens 8..11 only, so changing token 2's value
    # moves it in the global layer but not in the windowed one.
    changed = value.detach().clone()
    changed[2, 1] += 1.0
    for layer in (1, 2):
        sdpa = sdpa_core_attention()(config, layer, AttnMaskType.causal, "self")
        again = sdpa(query.detach(), key.detach(), changed, mask)
        same = torch.equal(again[11, 1], outputs[layer][11, 1])
        assert same == (layer == 1)


def test_windowed_models_match_transformers(window_tp1: dict, window_dirs: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    for name, path in window_dirs.items():
        args = window_tp1[name]["args"]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf_layers = tuple(
            kind == "sliding_attention" for kind in getattr(hf.config, "layer_types", None) or ()
        )
        assert args.sliding_window == WINDOW and args.window_layers == EXPECTED_LAYERS[name]
        if name == "qwen2_window":
            assert hf_layers == args.window_layers, "transformers' max_window_layers rule"
        ids = input_ids(hf.config.vocab_size)
        with torch.no_grad():
            expected = hf(ids).logits
            hf.config.sliding_window = 10**6
            for layer in hf.model.layers:
                if getattr(layer.self_attn, "sliding_window", None):
                    layer.self_attn.sliding_window = 10**6
            unwindowed = hf(ids).logits
        diff = (window_tp1[name]["logits"] - expected).abs().max().item()
        effect = (unwindowed - expected).abs().max().item()
        print(f"{name}: max |megatron - hf| = {diff:.2e}; the window moves logits by up to {effect:.2f}")
        assert window_tp1[name]["logits"].shape == (2, 24, 768)
        assert diff <= HF_TOLERANCE
        assert effect > 1.0


def test_tp2_matches_tp1(window_tp1: dict, window_world) -> None:
    for rank, results in enumerate(window_world.results()):
        assert results["state"] == (2, 1, rank, 0)
        for name in WINDOWED:
            diff = (results[f"logits/{name}"] - window_tp1[name]["logits"]).abs().max().item()
            print(f"{name} rank {rank}: max |tp2 - tp1| = {diff:.2e}")
            assert diff <= TP_TOLERANCE


def test_a_window_refuses_context_parallelism(window_tp1: dict, monkeypatch) -> None:
    from art_mega.errors import UserError
    from art_mega.trainer.families import llama

    args = copy.copy(window_tp1["qwen2_window"]["args"])
    assert llama.window_config(args) == {"window_size": (5, 0), "window_attn_skip_freq": [0, 1]}
    monkeypatch.setattr(llama, "_context_parallel_size", lambda: 2)
    with pytest.raises(UserError) as caught:
        llama.window_config(args)
    assert str(caught.value) == "sliding_window=6 is not implemented under context parallelism; use cp=1."
