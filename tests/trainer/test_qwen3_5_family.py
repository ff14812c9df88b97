"""The Qwen3.5 / Qwen3.6 dense family (`families/qwen3_5.py`): a tiny Qwen3_5ForCausalLM with both
token mixers (a gated delta-net layer with 2 key heads shared by 4 value heads, then a
full-attention layer with the output gate, RoPE on a quarter of each head and QK norm; Qwen's
1 + w norms; untied LM head) gives Megatron logits equal to transformers' at TP=1 and TP=2, on
whole rows and on rows packed with two documents (the delta rule's state restarts per document).
The chunked torch delta rule equals the token-by-token recurrence and transformers' own. The
published Qwen3.6-27B config, built on the meta device, maps every HF tensor at TP=8 with
Megatron's shapes and parameter count. Config values the family cannot express are refused with
one sentence each."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from art_mega.errors import UserError
from tests.trainer.common import RankProcesses, input_ids, megatron_logits, require_trainer_deps
from tests.trainer.qwen3_5_configs import QWEN3_6_27B

require_trainer_deps()

HF_TOLERANCE = 1e-4
TP_TOLERANCE = 1e-5
"""As tests/trainer: HF vs Megatron logits, TP=2 vs TP=1 logits."""


def _text(**changes) -> dict:
    return {**QWEN3_6_27B, "text_config": {**QWEN3_6_27B["text_config"], **changes}}


REFUSALS = {
    "moe": (
        {"model_type": "qwen3_5_moe"},
        "model_type='qwen3_5_moe' (Qwen3.5 MoE) is not implemented by the Megatron trainer yet; "
        "use a dense Qwen3.5 / Qwen3.6 model.",
    ),
    "no output gate": (
        _text(attn_output_gate=False),
        "attn_output_gate=false is not supported; Qwen3.5's full-attention layers have the output gate.",
    ),
    "bias": (
        _text(attention_bias=True),
        "attention_bias=true is not supported by the Megatron Qwen3.5 model.",
    ),
    "activation": (_text(hidden_act="gelu"), "hidden_act='gelu' is not supported; Qwen3.5 uses 'silu'."),
    "yarn": (
        _text(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7}),
        "rope_type='yarn' is not supported for Qwen3.5; use the model's own config.json.",
    ),
    "layer types": (
        _text(layer_types=["sliding_attention"] * 64),
        "layer_types=['sliding_attention', "
        + "'sliding_attention', " * 62
        + "'sliding_attention'] must name "
        "64 layers, each one of linear_attention, full_attention; use the model's own config.json.",
    ),
    "value heads": (
        _text(linear_num_value_heads=40),
        "linear_num_value_heads=40 is not a multiple of linear_num_key_heads=16; use the model's own config.json.",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_config_refusals(case: str) -> None:
    from art_mega.trainer.families import family_for

    config, sentence = REFUSALS[case]
    family = family_for({"model_type": "qwen3_5"})
    with pytest.raises(UserError) as caught:
        family.model_args(config)
    assert str(caught.value) == sentence


def test_published_config_arguments_and_tp_limits() -> None:
    from art_mega.trainer.families import family_for
    from art_mega.trainer.families.spec import ParallelLayout

    family = family_for(QWEN3_6_27B)
    args = family.model_args(QWEN3_6_27B)
    assert family.name == "qwen3_5"
    assert sum(args.linear_layers) == 48 and args.linear_layers[:4] == (True, True, True, False)
    assert (args.rope_theta, args.partial_rotary_factor, args.head_dim) == (1e7, 0.25, 256)
    assert (args.linear_num_key_heads, args.linear_num_value_heads, args.tie_word_embeddings) == (
        16,
        48,
        False,
    )
    assert family.valid_tp_sizes(args) == [1, 2, 4, 8]
    with pytest.raises(UserError) as caught:
        family.check_parallel(args, ParallelLayout(tp=3))
    assert str(caught.value) == (
        "tp=3 cannot split this qwen3_5 model (24 attention heads, 4 KV heads, 16 / 48 delta-net key / value "
        "heads, FFN size 17408); use tp in {1, 2, 4, 8}."
    )


def test_chunked_delta_rule_matches_the_recurrence() -> None:
    """37 tokens (chunks of 8: four whole chunks and a padded one; chunks of 64: one padded chunk)."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from art_mega.trainer.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    b, s, h, dk, dv = 2, 37, 3, 16, 8
    q, k = torch.randn(b, s, h, dk, generator=gen), torch.randn(b, s, h, dk, generator=gen)
    v = torch.randn(b, s, h, dv, generator=gen)
    g, beta = -2 * torch.rand(b, s, h, generator=gen), torch.rand(b, s, h, generator=gen)
    reference = recurrent_gated_delta_rule(q, k, v, g, beta)
    hf, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, use_qk_l2norm_in_kernel=True)
    assert reference.shape == (b, s, h, dv) and reference.abs().max() > 0.2
    assert (hf - reference).abs().max().item() <= 1e-6
    for chunk in (8, 64):
        got = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
        assert (got - reference).abs().max().item() <= 1e-6, chunk


def _hf_param_count(text: dict) -> int:
    """Parameters of the text decoder from the architecture (HF's Qwen3_5ForCausalLM)."""
    h, ffn, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    heads, kv, d = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv, kernel = (
        text["linear_key_head_dim"],
        text["linear_value_head_dim"],
        text["linear_conv_kernel_dim"],
    )
    full = h * 2 * heads * d + 2 * h * kv * d + heads * d * h + 2 * d
    conv = 2 * nk * dk + nv * dv
    linear = h * conv + h * nv * dv + 2 * h * nv + conv * kernel + 2 * nv + dv + nv * dv * h
    layers = {"full_attention": full, "linear_attention": linear}
    per_layer = 2 * h + 3 * h * ffn
    return 2 * vocab * h + h + sum(per_layer + layers[kind] for kind in text["layer_types"])


@pytest.mark.timeout(900)
def test_qwen3_6_27b_maps_on_meta(tmp_path: Path) -> None:
    from tests.trainer.test_real_size_mapping import _check

    got = _check("Qwen3.6-27B", tmp_path, config=QWEN3_6_27B)
    print(f"Qwen3.6-27B: {got['hf_names']} HF tensors, {got['megatron_params']:,} parameters")
    assert (got["family"], got["hf_class"], got["hf_names"]) == ("qwen3_5", "Qwen3_5ForCausalLM", 851)
    assert got["unread"] == [] and got["unknown_reads"] == []
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["hf_params"] == got["megatron_params"] == _hf_param_count(QWEN3_6_27B["text_config"])
    assert got["megatron_params"] == 26_895_998_464
    shapes = got["rank0_shapes"]
    layer0 = "decoder.layers.0.self_attention."
    assert shapes[layer0 + "in_proj_qkv.weight"] == [(2 * 16 * 128 + 48 * 128) // 8, 5120]
    assert shapes[layer0 + "conv1d_weight"] == [(2 * 16 * 128 + 48 * 128) // 8, 1, 4]
    assert shapes[layer0 + "in_proj_b.weight"] == [48 // 8, 5120]
    assert shapes[layer0 + "out_proj.weight"] == [5120, 48 * 128 // 8]
    assert shapes["output_layer.weight"] == [248320 // 8, 5120]


@pytest.fixture(scope="session")
def qwen35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 (hidden 64, 4 heads and 2 KV heads of width 32; `basemodels.tiny.QWEN3_5_TINY`)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen35") / "qwen3_5", "qwen3_5")


@pytest.fixture(scope="session")
def qwen35_world(qwen35_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The 2-rank `tests.trainer.qwen3_5_worker` world (TP=2), started (not awaited)."""
    world = RankProcesses(
        "tests.trainer.qwen3_5_worker", tmp_path_factory.mktemp("qwen35-tp2"), {"q": qwen35_dir}
    )
    yield world
    world.kill()


@pytest.fixture(scope="session")
def qwen35_tp1(qwen35_world, megatron_world, qwen35_dir: Path) -> dict:
    """TP=1 in this process (while the TP=2 world works): whole-row and packed logits."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.qwen3_5_worker import packed_logits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = build_megatron_model(qwen35_dir)
        ids = input_ids(built.vocab_size)
        return {
            "family": built.family.name,
            "args": built.args,
            "logits": megatron_logits(built, ids),
            "packed": packed_logits(built, ids),
        }
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_model(qwen35_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen35_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    return model


def test_megatron_matches_transformers(qwen35_tp1: dict, hf_model) -> None:
    import torch

    args = qwen35_tp1["args"]
    assert qwen35_tp1["family"] == "qwen3_5"
    assert (args.linear_layers, args.partial_rotary_factor) == ((True, False), 0.25)
    ids = input_ids(hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids).logits
        documents = torch.cat([hf_model(ids[:, :10]).logits, hf_model(ids[:, 10:]).logits], dim=1)
    diff = (qwen35_tp1["logits"] - expected).abs().max().item()
    packed = (qwen35_tp1["packed"] - documents).abs().max().item()
    print(
        f"qwen3_5: max |megatron - hf| = {diff:.2e}, packed {packed:.2e} (logit std {expected.std().item():.2f})"
    )
    assert qwen35_tp1["logits"].shape == expected.shape == (2, 24, 768)
    assert diff <= HF_TOLERANCE and packed <= HF_TOLERANCE
    assert (documents - expected).abs().max().item() > 0.05, "the second document saw the first"


def test_tp2_matches_tp1(qwen35_tp1: dict, qwen35_world) -> None:
    for rank, results in enumerate(qwen35_world.results(timeout=480)):
        assert results["state"] == (2, 1, rank, 0)
        diff = (results["logits/q"] - qwen35_tp1["logits"]).abs().max().item()
        packed = (results["packed/q"] - qwen35_tp1["packed"]).abs().max().item()
        print(f"qwen3_5 rank {rank}: max |tp2 - tp1| = {diff:.2e}, packed {packed:.2e}")
        assert diff <= TP_TOLERANCE and packed <= TP_TOLERANCE
