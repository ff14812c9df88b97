"""art_mega.trainer.flops: the step's FLOP count by hand on a tiny config, against
torch.utils.flop_counter.FlopCounterMode over a real forward + backward of Hugging Face models with
PEFT LoRA (frozen base), and the MFU / peak-table refusals."""

from __future__ import annotations

import pytest

from art_mega.errors import PeakFlopsError, UserError
from art_mega.trainer.flops import ModelShape, mfu, peak_flops_for, step_flops

TINY = {
    "model_type": "llama",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "vocab_size": 10,
}
"""h 8, 2 layers, 2 query heads and 1 KV head of 4, SwiGLU 16, vocabulary 10."""


def test_tiny_config_by_hand():
    got = step_flops(TINY, [3], lora_rank=2)
    # per layer and token, 2 x in x out: qkv 8 -> 8+4+4, proj 8 -> 8, fc1 8 -> 16+16, fc2 16 -> 8
    qkv, proj, fc1, fc2 = 2 * 8 * 16, 2 * 8 * 8, 2 * 8 * 32, 2 * 16 * 8
    head = 2 * 8 * 10
    layer = qkv + proj + fc1 + fc2
    assert got.tokens == 3
    assert got.base_forward == (2 * layer + head) * 3 == 7392
    # causal: 2 L^2 nh d per layer = 2 * 9 * 8, two layers
    assert got.attention_forward == 2 * 9 * 8 * 2 == 288
    # the first layer's QKV input is the frozen embedding's output: no gradient for it
    assert got.base_input_grads == (2 * layer - qkv + head) * 3 == 6624
    assert got.attention_backward == 2 * 288
    # LoRA r=2, one adapter per fused linear: 2 r (in + out)
    lora = 2 * 2 * ((8 + 16) + (8 + 8) + (8 + 32) + (16 + 8))
    assert got.lora_forward == got.lora_weight_grads == 2 * lora * 3 == 2496
    # d(xA^T) = dy B everywhere (2 r out); dx = d(xA^T) A except the first layer's QKV adapter
    outs, ins = 2 * 2 * (16 + 8 + 32 + 8), 2 * 2 * (8 + 8 + 8 + 16)
    assert got.lora_input_grads == (2 * outs + 2 * ins - 2 * 2 * 8) * 3 == 2400
    assert got.total == 22272 and got.per_token == 22272 / 3
    assert got.attention == 288 * 3


def test_peft_layout_gives_each_hf_module_its_own_a():
    megatron = step_flops(TINY, [3], lora_rank=2)
    peft = step_flops(TINY, [3], lora_rank=2, lora_layout="peft")
    # q/k/v: two more A [2, 8], gate/up: one more, in each of 2 layers, over 3 tokens
    extra_a = 2 * 2 * 8 * 3 * 2 * 3
    assert peft.lora_forward - megatron.lora_forward == extra_a
    assert peft.lora_weight_grads - megatron.lora_weight_grads == extra_a
    assert peft.base_forward == megatron.base_forward and peft.attention == megatron.attention


def test_head_runs_where_the_step_runs_it():
    # the train step's LM head runs at the 2 positions predicting trained tokens, not at all 3
    full = step_flops(TINY, [3], lora_rank=2)
    trained = step_flops(TINY, [3], lora_rank=2, head_tokens=2)
    assert full.base_forward - trained.base_forward == 2 * 8 * 10
    assert full.base_input_grads - trained.base_input_grads == 2 * 8 * 10
    assert full.total - trained.total == 2 * (2 * 8 * 10)


def test_targets_move_the_first_gradient():
    # only linear_fc2 adapted: in the first layer nothing before fc2 needs a gradient
    # (attention included), fc2's own input does not either
    got = step_flops(TINY, [3], lora_rank=2, lora_targets=["down_proj"])
    layer = 2 * 8 * 16 + 2 * 8 * 8 + 2 * 8 * 32 + 2 * 16 * 8
    assert got.base_input_grads == (layer + 2 * 8 * 10) * 3
    assert got.attention_backward == 2 * (288 // 2)
    assert got.lora_input_grads == (2 * 2 * 8 * 2 + 2 * 2 * 16 * 1) * 3


def test_attention_counts_documents_not_rows():
    one = step_flops(TINY, [4, 4], lora_rank=2)
    assert one.attention_forward == 2 * 2 * 16 * 8 * 2
    assert one.attention_forward == step_flops(TINY, [8], lora_rank=2).attention_forward // 2


def test_moe_router_and_top_k_experts():
    moe = {
        **TINY,
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 4,
        "num_experts": 6,
        "num_experts_per_tok": 2,
    }
    shape = ModelShape.from_hf_config(moe)
    assert (shape.num_experts, shape.top_k, shape.expert_ffn_hidden_size) == (6, 2, 4)
    got = step_flops(moe, [5], lora_rank=1)
    # router 8 -> 6; two experts of 8 -> 4+4 and 4 -> 8 per token; the dense intermediate_size is unused
    layer = 2 * 8 * 16 + 2 * 8 * 8 + 2 * 8 * 6 + 2 * (2 * 8 * 8 + 2 * 4 * 8)
    assert got.base_forward == (2 * layer + 2 * 8 * 10) * 5
    # each chosen expert's fc1 / fc2 has its own adapter (r = 1)
    lora = 2 * ((8 + 16) + (8 + 8)) + 2 * 2 * ((8 + 8) + (4 + 8))
    assert got.lora_forward == 2 * lora * 5


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"document_lengths": []}, "document_lengths=[] must list at least one"),
        ({"document_lengths": [3, 0]}, "document_lengths[1]=0 must be a whole number"),
        ({"document_lengths": [2.5]}, "document_lengths[0]=2.5"),
        ({"lora_rank": 0}, "lora_rank=0 must be a whole number of at least 1"),
        ({"lora_targets": []}, "lora_targets=[] must name at least one layer"),
        ({"lora_targets": ["q_proj"]}, "need all of ['q_proj', 'k_proj', 'v_proj']"),
        ({"lora_layout": "fused"}, "lora_layout='fused' must be 'megatron' or 'peft'"),
        ({"head_tokens": 0}, "head_tokens=0 must be a whole number of at least 1"),
        ({"head_tokens": 4}, "head_tokens=4 must be at most the documents' 3 tokens"),
    ],
)
def test_refusals_are_one_sentence(kwargs, fragment):
    arguments = {"document_lengths": [3], "lora_rank": 2, **kwargs}
    with pytest.raises(UserError) as caught:
        step_flops(TINY, arguments.pop("document_lengths"), **arguments)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_unsupported_model_is_the_family_sentence():
    with pytest.raises(UserError, match="model_type='gpt2' is not supported"):
        step_flops({**TINY, "model_type": "gpt2"}, [3], lora_rank=2)


def test_mfu_and_the_peak_table():
    # 34e9 FLOPs per token at 11,640 tokens/s on an H200's 989.4 TFLOP/s: 40%
    assert mfu(34e9, 11_640, peak_flops_for("NVIDIA H200", "bfloat16")) == pytest.approx(0.4, abs=1e-3)
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "float32") == 66.9e12
    with pytest.raises(PeakFlopsError) as caught:
        peak_flops_for("NVIDIA H100 PCIe", "bfloat16")
    assert caught.value.device_name == "NVIDIA H100 PCIe" and caught.value.dtype == "bfloat16"
    assert "no datasheet peak for 'NVIDIA H100 PCIe' in bfloat16" in str(caught.value)
    with pytest.raises(PeakFlopsError, match="in float16"):
        peak_flops_for("NVIDIA H200", "float16")
    for field, args in (
        ("tokens_per_s", (1.0, 0.0, 1.0)),
        ("peak_flops", (1.0, 1.0, float("nan"))),
        ("flops_per_token", (-1.0, 1.0, 1.0)),
    ):
        with pytest.raises(UserError, match=f"^{field}=.* must be a finite number greater than 0.$"):
            mfu(*args)


def test_no_activation_recomputation_in_the_families():
    # the count has no recomputation term: a family turning it on must change flops.py too
    from art_mega.trainer.families import llama, qwen3_moe
    from art_mega.trainer.families.spec import ParallelLayout

    for family, config in (
        (llama, TINY),
        (
            qwen3_moe,
            {
                **TINY,
                "model_type": "qwen3_moe",
                "moe_intermediate_size": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
            },
        ),
    ):
        transformer = family.transformer_config(family.model_args(config), ParallelLayout())
        assert transformer.recompute_granularity is None and transformer.recompute_method is None


def _counted(model, ids):
    """FlopCounterMode's FLOPs of one forward + backward of `model` on `ids`: (linears, attention),
    i.e. (aten.mm + aten.addmm, aten.bmm: eager attention's Q K^T and P V over the full square)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(input_ids=ids).logits
        # a loss without matmuls: what the counter sees is the model's
        logits.float().logsumexp(dim=-1).mean().backward()
    ops = {str(op).split(".")[1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(ops) <= {"mm", "addmm", "bmm"}, ops
    return ops.get("mm", 0) + ops.get("addmm", 0), ops.get("bmm", 0)


def _peft(model, rank, targets="all-linear"):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    adapted = {name.rsplit(".", 2)[-2] for name, _ in peft_model.named_modules() if name.endswith(".lora_A")}
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if "lora_" not in n)
    return peft_model, adapted


# FlopCounterMode counts what autograd runs, matmul by matmul, so the linears' count must be
# exact (integers, equal) and attention's twice ours: eager attention computes the full L x L
# square where the causal count takes half of it. The one other difference is HF's RoPE angle
# table, a bmm (`_rope_angles`). Norms, softmax and the loss are elementwise, counted by neither.


def _rope_angles(seq: int, head_dim: int) -> int:
    """HF's rotary angles, inv_freq [d/2, 1] @ positions [1, s] (one position row shared by the
    batch), once per forward without gradient: a bmm FlopCounterMode counts and the model count
    leaves out (not a matmul of the model's weights or attention)."""
    return 2 * (head_dim // 2) * seq


def test_against_flop_counter_llama_with_peft():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "vocab_size": 200,
        "tie_word_embeddings": True,
    }
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**sizes, attn_implementation="eager"))
    model, adapted = _peft(model, rank=4)
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    linears, attention = _counted(model, ids)
    expected = step_flops({"model_type": "llama", **sizes}, [40, 40], lora_rank=4, lora_layout="peft")
    assert linears == expected.total - expected.attention
    assert attention == 2 * expected.attention + _rope_angles(40, 24)


def test_against_flop_counter_qwen3_moe_with_peft():
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from art_mega.basemodels.tiny_moe import MOE_SIZES

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**MOE_SIZES, attn_implementation="eager", experts_implementation="eager")
    )
    # the attention projections only: PEFT 0.21's all-linear also wraps the router and the 3-D
    # expert tensors, but as a weight delta W + B A merged per forward (`ParamWrapper`), not the
    # per-token adapter art-mega's experts carry, so its FLOPs are another method's; the experts'
    # adapters are counted by hand in test_moe_router_and_top_k_experts
    model, adapted = _peft(model, rank=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    ids = torch.randint(0, MOE_SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    linears, attention = _counted(model, ids)
    expected = step_flops(
        {"model_type": "qwen3_moe", **MOE_SIZES},
        [24, 24],
        lora_rank=4,
        lora_targets=["linear_qkv", "linear_proj"],
        lora_layout="peft",
    )
    assert linears == expected.total - expected.attention
    assert attention == 2 * expected.attention + _rope_angles(24, MOE_SIZES["head_dim"])


def test_device_check_shapes_in_closed_form():
    # the mfu step's dense shapes (benchmarks/device_check.py): Narayanan et al.'s per-token form,
    # 2N forward + 2N backward input gradients (less the first layer's QKV), causal attention x 3
    # and LoRA's forward, input and weight gradients (less the first QKV adapter's dx)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import device_check

    r, length = device_check.MFU_LORA_RANK, device_check.MFU_DOCUMENT
    for name in ("SmolLM2-135M", "Qwen3-1.7B", "Qwen3-8B"):
        c = device_check.MFU_SHAPES[name]
        h, ffn, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim", h // heads)
        qkv = (heads + 2 * kv) * d
        n = layers * (h * qkv + heads * d * h + 3 * h * ffn) + h * v
        adapters = layers * ((h + qkv) + (heads * d + h) + (h + 2 * ffn) + (ffn + h))
        per_token = 4 * n - 2 * h * qkv + 3 * 2 * length * heads * d * layers + 2 * r * (3 * adapters - h)
        got = step_flops(c, [length] * 16, lora_rank=r)
        assert got.per_token == per_token, name
    assert step_flops(device_check.QWEN3_8B_SHAPE, [2048], lora_rank=16).per_token == pytest.approx(
        32.25e9, rel=1e-3
    )
