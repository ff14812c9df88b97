"""The Qwen3.5 / Qwen3.6 dense family (`families/qwen3_5.py`): a tiny Qwen3_5ForCausalLM with both
token mixers (a gated delta-net layer with 2 key heads shared by 4 value heads, then a
full-attention layer with the output gate, RoPE on a quarter of each head and QK norm; Qwen's
1 + w norms; untied LM head) gives Megatron logits equal to transformers' at TP=1 and TP=2, on
whole rows and on rows packed with two documents (the delta rule's state restarts per document).
Its LoRA (as the other families: q/k/v/o on the full-attention layers, gate/up/down on every
layer; q_proj's adapter covers the output gate's rows too; and ART's delta-net targets
in_proj_qkv, in_proj_z, out_proj on the delta-net layers) trains for 3 GRPO steps, exports a PEFT
adapter that transformers + PEFT load with the Megatron logits (TP=1 and TP=2 exports) and
imports back bit-exactly.
The chunked torch delta rule equals the token-by-token recurrence and transformers' own. The
published Qwen3.6-27B config, built on the meta device, maps every HF tensor at TP=8 with
Megatron's shapes and parameter count. Config values the family cannot express are refused with
one sentence each."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from art_mega.errors import UserError
from tests.trainer.common import MetaMapper, RankProcesses, input_ids, megatron_logits, require_trainer_deps
from tests.trainer.qwen3_5_configs import QWEN3_6_27B

require_trainer_deps()

HF_TOLERANCE = 1e-4
TP_TOLERANCE = 1e-5
ADAM_DRIFT_TOLERANCE = 1e-3
"""As tests/trainer: HF vs Megatron logits, TP=2 vs TP=1 logits, TP=2 vs TP=1 trained adapters."""
WORLDS = ("tp1", "tp2")


def _text(**changes) -> dict:
    return {**QWEN3_6_27B, "text_config": {**QWEN3_6_27B["text_config"], **changes}}


REFUSALS = {
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

    from art_mega.trainer.rank.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

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
def test_qwen3_6_27b_maps_on_meta(meta_mapper: MetaMapper) -> None:
    from tests.trainer.test_real_size_mapping import _check

    got = _check("Qwen3.6-27B", meta_mapper, config=QWEN3_6_27B)
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
def qwen35_tp1(qwen35_world, megatron_world, qwen35_dir: Path, tmp_path_factory) -> dict:
    """TP=1 in this process (while the TP=2 world works): whole-row and packed logits, training."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from tests.trainer.engine_scenarios import training
    from tests.trainer.qwen3_5_worker import QWEN3_5_LORA, packed_logits

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
            "training": training(
                megatron_world,
                str(qwen35_dir),
                tmp_path_factory.mktemp("qwen35-tp1"),
                dp_split=False,
                lora=QWEN3_5_LORA,
            ),
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


@pytest.fixture(scope="session")
def qwen35_tp2(qwen35_world) -> list[dict]:
    return qwen35_world.results(timeout=600)


def _runs(qwen35_tp1: dict, qwen35_tp2: list[dict]) -> dict[str, dict]:
    return {"tp1": qwen35_tp1["training"], "tp2": qwen35_tp2[0]["training/q"]}


def test_tp2_matches_tp1(qwen35_tp1: dict, qwen35_tp2: list[dict]) -> None:
    for rank, results in enumerate(qwen35_tp2):
        assert results["state"] == (2, 1, rank, 0)
        diff = (results["logits/q"] - qwen35_tp1["logits"]).abs().max().item()
        packed = (results["packed/q"] - qwen35_tp1["packed"]).abs().max().item()
        print(f"qwen3_5 rank {rank}: max |tp2 - tp1| = {diff:.2e}, packed {packed:.2e}")
        assert diff <= TP_TOLERANCE and packed <= TP_TOLERANCE


def test_grpo_steps_train(qwen35_tp1: dict) -> None:
    import math

    run = qwen35_tp1["training"]
    norms = [m["loss/grad_norm"] for m in run["metrics"]]
    print(f"qwen3_5 GRPO grad norms {norms}, policy losses {[m['loss/policy'] for m in run['metrics']]}")
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert run["resumed_metrics"]["loss/policy"] == pytest.approx(run["metrics"][2]["loss/policy"], abs=1e-6)
    assert (run["logits"] - qwen35_tp1["logits"]).abs().max().item() > 0.05, "the adapter moved the logits"


@pytest.mark.parametrize("world", WORLDS)
def test_peft_logits_match_megatron(world: str, qwen35_tp1, qwen35_tp2, qwen35_dir: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = _runs(qwen35_tp1, qwen35_tp2)[world]
    base = AutoModelForCausalLM.from_pretrained(qwen35_dir, dtype=torch.float32)
    ids = input_ids(base.config.vocab_size)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, run["adapter"])(ids).logits
    diff = (peft_logits - run["logits"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    print(
        f"{world} qwen3_5: max |peft - megatron| = {diff:.2e}; the adapter moves logits by up to {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05


@pytest.mark.parametrize("world", WORLDS)
def test_import_then_export_is_bit_exact(world: str, qwen35_tp1, qwen35_tp2) -> None:
    import torch

    run = _runs(qwen35_tp1, qwen35_tp2)[world]
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (Path(run["adapter"]) / file).read_bytes() == (Path(run["roundtrip"]) / file).read_bytes()
    assert torch.equal(run["imported_logits"], run["logits"])


def test_tp2_export_equals_tp1_export_and_names_every_module(
    qwen35_tp1, qwen35_tp2, qwen35_dir: Path
) -> None:
    from safetensors.torch import load_file

    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.peft_io import adapter_layout

    runs = _runs(qwen35_tp1, qwen35_tp2)
    tp1, tp2 = (load_file(Path(runs[w]["adapter"]) / "adapter_model.safetensors") for w in WORLDS)
    assert tp1.keys() == tp2.keys()
    diff = max((tp1[key] - tp2[key]).abs().max().item() for key in tp1)
    print(f"qwen3_5: max |tp2 adapter - tp1 adapter| = {diff:.1e}")
    assert diff <= ADAM_DRIFT_TOLERANCE
    mlp = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    attention = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    prefix = "base_model.model.model.layers"
    delta = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj")
    expected = {f"{prefix}.0.{module}.lora_{m}.weight" for module in mlp + delta for m in "AB"}
    expected |= {f"{prefix}.1.{module}.lora_{m}.weight" for module in mlp + attention for m in "AB"}
    assert set(tp1) == expected
    assert tuple(tp1[f"{prefix}.1.self_attn.q_proj.lora_B.weight"].shape) == (2 * 4 * 32, 4)
    # in_proj_qkv: [q; k; v] rows of 2 key heads (q, k) and 4 value heads (v) of width 16
    assert tuple(tp1[f"{prefix}.0.linear_attn.in_proj_qkv.lora_B.weight"].shape) == (2 * 32 + 64, 4)
    assert tuple(tp1[f"{prefix}.0.linear_attn.out_proj.lora_A.weight"].shape) == (4, 64)
    layout = adapter_layout(
        read_hf_config(qwen35_dir),
        4,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        + ["in_proj_qkv", "in_proj_z", "out_proj"],
    )
    assert layout.shapes == {key: tuple(tensor.shape) for key, tensor in tp1.items()}
