"""Qwen3.5 / Qwen3.6 MoE decoders (HF model_type "qwen3_5_moe", text "qwen3_5_moe_text"): config
mapping, Megatron hybrid MoE layer spec, weights per TP / EP rank and LoRA names (`SPEC`).

A separate file from `qwen3_5.py` because it is a separate HF model type with its own config
class, weights and parallel limits (as `qwen3_moe.py` is to `llama.py`); the token mixers, norms
and RoPE are the dense family's and are imported from it, the experts' weight reading from
`qwen3_moe.py`.

transformers 5.19 `models/qwen3_5_moe/modeling_qwen3_5_moe.py`: the dense Qwen3.5 decoder (gated
delta-net and gated full-attention layers per `layer_types`, 1 + w norms, partial rotary) with
every MLP replaced by `Qwen3_5MoeSparseMoeBlock`:

    p = softmax(x W_r^T) over `num_experts` (fp32); the top `num_experts_per_tok` of p,
        renormalised to sum 1 (always: the config has no `norm_topk_prob`);
    y = sum_k p_k expert_k(x) + sigmoid(x w_g^T) * shared_expert(x)

with SwiGLU experts of width `moe_intermediate_size`, a SwiGLU shared expert of width
`shared_expert_intermediate_size` and its gate w_g [1, h] (`mlp.shared_expert_gate`).
Megatron-core's MoE layer computes the same: softmax top-k router (top-k then softmax over the
top-k logits = the renormalised top-k of the full softmax), `SequentialMLP` experts, and
`SharedExpertMLP` with `moe_shared_expert_gate` (output * sigmoid(x gate_weight^T),
`transformer/moe/shared_experts.py`).

Checkpoints: the Hub's `Qwen3_5MoeForConditionalGeneration` (weights under
`model.language_model.`) or a text-only `Qwen3_5MoeForCausalLM`, experts per expert
(`mlp.experts.{e}.gate_proj.weight`, what transformers' save_pretrained writes) or fused 3-D
(`mlp.experts.gate_up_proj` [E, 2I, h], `down_proj` [E, h, I]); all four are read. HF's
`router_aux_loss_coef` is not used (no load-balancing loss in the RL loss), as in `qwen3_moe.py`.

LoRA adapter (`lora_for`), by the checkpoint's class:

- the wrapper (model_type "qwen3_5_moe", the Hub checkpoints; `WRAPPER_LORA_NAMES`): under
  `base_model.model.model.language_model.layers` (`qwen3_5.WRAPPER_LAYER_PREFIX`), the routed
  experts packed as PEFT's LoRA on the fused 3-D parameters (`target_parameters`
  `mlp.experts.gate_up_proj`, gate rows first, and `mlp.experts.down_proj`;
  `gpt_oss.GptOssLoraNames` with `interleave` False), the shared expert per module. That is the
  only expert layout vLLM 0.32's `Qwen3_5MoeForConditionalGeneration` reads (a 3-D MoE LoRA model,
  `is_3d_moe_weight`) without `--enable-mixed-moe-lora-format`, and what PEFT 0.21 loads on the
  wrapper, so one adapter serves both (`for_peft` leaves it as it is). ART 0.5.23 publishes the
  same (`art/megatron/model_support/handlers/qwen3_5.py` _to_vllm_lora_tensors).
- a text-only model (model_type "qwen3_5_moe_text"; `TEXT_LORA_NAMES`): under
  `base_model.model.model.layers`, the routed experts per expert (`mlp.experts.{e}.gate_proj`), the
  names vLLM 0.32's `Qwen3_5MoeForCausalLM` reads (a 2-D MoE LoRA model). PEFT 0.21 drops those
  names on transformers' fused experts (qwen3_5_moe_text converts as qwen3_5_text, which its
  `_MOE_TARGET_MODULE_MAPPING` lacks); `LoraNames.for_peft` (`fused_experts` = "mlp.experts")
  writes them as the `target_parameters` tensors it loads.

Refused besides the dense family's refusals: top-k outside 1..num_experts. Context parallelism
is refused as for the dense family (the delta rule's state spans the sequence).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer.families import gpt_oss, qwen3_5, qwen3_moe
from art_mega.trainer.families.layout import fc1_shard, shard
from art_mega.trainer.families.spec import FamilySpec, LoraNames, ParallelLayout

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
"""HF `model_type` values this family reads: the published multimodal wrapper (its text decoder)
and transformers' text-only config."""


@dataclass(frozen=True)
class Qwen35MoeArgs(qwen3_5.Qwen35Args):
    """A Qwen3.5 MoE checkpoint's architecture: `qwen3_5.Qwen35Args` (its `ffn_hidden_size` is
    the shared expert's width, the only dense FFN) plus `num_experts` routed SwiGLU experts of
    width `expert_ffn_hidden_size`, `top_k` per token, the shared expert's width
    `shared_expert_ffn_hidden_size`, and the trainer's load-balancing loss weight
    `aux_loss_coeff` (0: none)."""

    num_experts: int = 256
    top_k: int = 8
    expert_ffn_hidden_size: int = 512
    shared_expert_ffn_hidden_size: int = 512
    aux_loss_coeff: float = 0.0


def model_args(config: dict[str, Any]) -> Qwen35MoeArgs:
    """Parse an HF qwen3_5_moe / qwen3_5_moe_text config dict (transformers 5.19's
    Qwen3_5MoeTextConfig defaults for absent fields: 256 experts, top 8, expert and shared expert
    widths 512; the rest as `qwen3_5.model_args`).

    Raises:
        UserError: one sentence naming the field, its value and the fix.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a Qwen3.5 MoE model ({', '.join(MODEL_TYPES)}).")
    text = qwen3_5.text_config(config)
    shared = int(text.get("shared_expert_intermediate_size", 512))
    num_experts = int(text.get("num_experts", 256))
    top_k = int(text.get("num_experts_per_tok", 8))
    if not 1 <= top_k <= num_experts:
        raise UserError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}.")
    dense = qwen3_5.model_args(
        {**text, "model_type": "qwen3_5_text", "intermediate_size": shared, "text_config": None}
    )
    fields = {field.name: getattr(dense, field.name) for field in dataclasses.fields(dense)}
    return Qwen35MoeArgs(
        **{**fields, "model_type": str(model_type)},
        num_experts=num_experts,
        top_k=top_k,
        expert_ffn_hidden_size=int(text.get("moe_intermediate_size", 512)),
        shared_expert_ffn_hidden_size=shared,
    )


def valid_tp_sizes(args: Qwen35MoeArgs) -> list[int]:
    """TP sizes of the dense family (attention, delta-net heads, and the shared expert's width)."""
    return qwen3_5.valid_tp_sizes(args)


def check_parallel(args: Qwen35MoeArgs, layout: ParallelLayout) -> None:
    """The dense family's check (TP, no CP), then EP must divide the experts and expert-TP their
    width; `UserError` (one sentence naming the valid sizes) otherwise."""
    qwen3_5.check_parallel(args, layout)
    if args.num_experts % layout.ep:
        valid = ", ".join(str(n) for n in range(1, args.num_experts + 1) if args.num_experts % n == 0)
        raise UserError(
            f"ep={layout.ep} cannot split this {args.model_type} model's {args.num_experts} experts; "
            f"use ep in {{{valid}}}."
        )
    if args.expert_ffn_hidden_size % layout.etp:
        raise UserError(
            f"etp={layout.etp} cannot split this {args.model_type} model's expert FFN size "
            f"{args.expert_ffn_hidden_size}; use an etp that divides it."
        )


def transformer_config(
    args: Qwen35MoeArgs, layout: ParallelLayout, *, dtype: str = "float32", device: str = "cpu"
):
    """The dense family's `TransformerConfig` (output gate, delta-net sizes) with the MoE layer of
    `qwen3_moe.transformer_config` (softmax router, top-k then softmax = HF's renormalised top-k,
    no token dropping, alltoall dispatcher, `SequentialMLP` experts, sequence parallel when
    TP > 1) and the gated shared expert (`moe_shared_expert_intermediate_size`,
    `moe_shared_expert_gate`; not overlapped with the dispatch)."""
    base = qwen3_5.transformer_config(args, layout, dtype=dtype, device=device)
    balancing = "aux_loss" if args.aux_loss_coeff > 0 else "none"
    return dataclasses.replace(
        base,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.top_k,
        moe_ffn_hidden_size=args.expert_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=args.aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=args.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=True,
        moe_shared_expert_overlap=False,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.tp > 1,
    )


def layer_spec(args: Qwen35MoeArgs, *, use_te: bool):
    """`qwen3_5.hybrid_layer_spec` over the local MoE layer of `qwen3_moe.layer_spec` (QK norm,
    SDPA core attention, `SequentialMLP` experts, the shared expert built from the config); the
    local spec also when `use_te`, as the dense family."""
    return qwen3_5.hybrid_layer_spec(args, qwen3_moe.layer_spec(args, use_te=False))


def gpt_model_kwargs(args: Qwen35MoeArgs, *, tp: int) -> dict[str, Any]:
    """The dense family's GPTModel arguments (partial rotary)."""
    return qwen3_5.gpt_model_kwargs(args, tp=tp)


def megatron_state_dict(
    args: Qwen35MoeArgs, read: Callable[[str], Tensor], layout: ParallelLayout
) -> dict[str, Tensor]:
    """This rank's Megatron tensors (local-spec names) from the HF text decoder's
    (`qwen3_5._reader`: text-only or multimodal names).

    Everything but the MLP from `qwen3_5.megatron_state_dict` (given stand-ins for the dense MLP
    an MoE checkpoint lacks). Per layer i: mlp.gate -> mlp.router.weight [E, h] (replicated);
    shared_expert gate/up/down_proj -> mlp.shared_experts.linear_fc1 (`fc1_shard` over TP) /
    linear_fc2 (column shard over TP); shared_expert_gate [1, h] -> shared_experts.gate_weight
    (replicated); for local expert j of this EP rank (`qwen3_moe.local_experts`): gate + up ->
    mlp.experts.local_experts.j.linear_fc1 [2I/etp, h], down -> linear_fc2 [h, I/etp]
    (`qwen3_moe.read_expert`: per-expert or fused names).
    """
    import torch

    read = qwen3_5._reader(read)

    def read_or_stand_in(name: str) -> Tensor:
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")):
            return torch.empty(0, 0)
        return read(name)

    state = qwen3_5.megatron_state_dict(args, read_or_stand_in, layout)
    tp_size, tp_rank = layout.tp, layout.tp_rank
    for i in range(args.num_layers):
        hf, mc = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        del state[mc + "linear_fc1.weight"], state[mc + "linear_fc2.weight"]
        state[mc + "router.weight"] = read(hf + "gate.weight")
        shared = mc + "shared_experts."
        state[shared + "linear_fc1.weight"] = fc1_shard(
            read(hf + "shared_expert.gate_proj.weight"),
            read(hf + "shared_expert.up_proj.weight"),
            tp_size,
            tp_rank,
        )
        state[shared + "linear_fc2.weight"] = shard(
            read(hf + "shared_expert.down_proj.weight"), 1, tp_size, tp_rank
        )
        state[shared + "gate_weight"] = read(hf + "shared_expert_gate.weight")
        for j, expert in enumerate(qwen3_moe.local_experts(args, layout.ep, layout.ep_rank)):
            gate, up, down = qwen3_moe.read_expert(read, i, expert)
            local = f"{mc}experts.local_experts.{j}."
            state[local + "linear_fc1.weight"] = fc1_shard(gate, up, layout.etp, layout.etp_rank)
            state[local + "linear_fc2.weight"] = shard(down, 1, layout.etp, layout.etp_rank)
    return state


WRAPPER = "qwen3_5_moe"
"""The multimodal wrapper's model_type (`Qwen3_5MoeForConditionalGeneration`, the Hub checkpoints)."""

TEXT_LORA_NAMES = dataclasses.replace(
    qwen3_5.LORA_NAMES,
    expert_targets=("linear_fc1", "linear_fc2"),
    shared_expert="shared_expert",
    fused_experts="mlp.experts",
)
"""A text-only model's names: the dense family's, with linear_fc1 / linear_fc2 per routed expert
(per-module on disk, packed by `for_peft` for PEFT) and on the shared expert."""

WRAPPER_LORA_NAMES = gpt_oss.GptOssLoraNames(
    **{
        field.name: getattr(TEXT_LORA_NAMES, field.name)
        for field in dataclasses.fields(LoraNames)
        if field.name not in ("layer_prefix", "fused_experts")
    },
    layer_prefix=qwen3_5.WRAPPER_LAYER_PREFIX,
    interleave=False,
    label="Qwen3.5 MoE",
)
"""The wrapper's names: `TEXT_LORA_NAMES` under `qwen3_5.WRAPPER_LAYER_PREFIX` with the routed
experts packed on disk (gate rows first; module docstring); no `fused_experts`, as the adapter on
disk is already PEFT's form."""


def lora_for(args: Qwen35MoeArgs) -> LoraNames:
    """The LoRA <-> PEFT names of a Qwen3.5 MoE model: `WRAPPER_LORA_NAMES` for the wrapper
    (model_type "qwen3_5_moe"), `TEXT_LORA_NAMES` for a text-only model (module docstring)."""
    return WRAPPER_LORA_NAMES if args.model_type == WRAPPER else TEXT_LORA_NAMES


SPEC: FamilySpec[Qwen35MoeArgs] = FamilySpec(
    name="qwen3_5_moe",
    model_types=MODEL_TYPES,
    model_args=model_args,
    expert_parallel=True,
    valid_tp_sizes=valid_tp_sizes,
    check_parallel=check_parallel,
    transformer_config=transformer_config,
    layer_spec=layer_spec,
    gpt_model_kwargs=gpt_model_kwargs,
    megatron_state_dict=megatron_state_dict,
    te_name_map={},
    lora=TEXT_LORA_NAMES,
    lora_for=lora_for,
)
"""The Qwen3.5 / Qwen3.6 MoE family."""
