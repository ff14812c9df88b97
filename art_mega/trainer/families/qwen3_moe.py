"""Qwen3-MoE decoders: HF config -> Megatron MoE config and spec, HF weights -> this rank's
tensor- and expert-parallel shard (router, per-expert SwiGLU experts; attention as dense Qwen3),
and the LoRA <-> PEFT names with the experts' (`SPEC`).

Attention, norms, embeddings and RoPE are those of the dense Qwen3 family (`families/llama.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer.families import llama
from art_mega.trainer.families.layout import fc1_shard, shard
from art_mega.trainer.families.spec import FamilySpec, LoraNames, ParallelLayout

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("qwen3_moe",)
"""HF `model_type` values this family reads."""

TE_NAME_MAP = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
"""Local-spec -> TransformerEngine-spec names. The MoE layer keeps its own pre-MLP norm in the
TE spec (`gpt_layer_specs.py` get_gpt_layer_with_transformer_engine_spec with num_experts)."""

_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class MoeArgs:
    """The architecture of a Qwen3-MoE checkpoint, read from its HF config.json.

    `dense` holds everything but the MLP (attention with q/k norm, embeddings, RoPE; its
    `ffn_hidden_size` is HF's unused dense `intermediate_size`). Every layer is an MoE layer of
    `num_experts` SwiGLU experts of width `expert_ffn_hidden_size`, `top_k` of them per token.
    Router (HF `Qwen3MoeTopKRouter`): p = softmax(x W_r^T) over experts, the top_k of p, and with
    `norm_topk_prob` those renormalised to sum 1. `aux_loss_coeff` is the load-balancing loss
    weight of the trainer (0: none; HF's `router_aux_loss_coef` is not used, so the aux loss
    never changes the RL loss unless asked for).
    """

    dense: llama.DenseArgs
    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    norm_topk_prob: bool
    aux_loss_coeff: float = 0.0

    def __getattr__(self, name: str) -> Any:
        # The dense fields (num_heads, vocab_size, ...) read like this object's own.
        if name == "dense":
            raise AttributeError(name)
        return getattr(self.dense, name)


def model_args(config: dict[str, Any]) -> MoeArgs:
    """Parse an HF Qwen3-MoE config dict; `UserError` for what the Megatron MoE model lacks.

    Refused besides the dense family's refusals: dense MLP layers between MoE layers
    (`mlp_only_layers`, `decoder_sparse_step` != 1) and top_k outside 1..num_experts.
    Accepts `num_experts` or transformers 5's `num_local_experts`.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a Qwen3-MoE model ({', '.join(MODEL_TYPES)}).")
    if config.get("mlp_only_layers"):
        raise UserError(
            f"mlp_only_layers={config['mlp_only_layers']} is not supported; use a checkpoint whose "
            "layers are all MoE layers."
        )
    if int(config.get("decoder_sparse_step", 1)) != 1:
        raise UserError(
            f"decoder_sparse_step={config['decoder_sparse_step']} is not supported; use 1 (every layer MoE)."
        )
    num_experts = int(config.get("num_experts") or config["num_local_experts"])
    top_k = int(config["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise UserError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}.")
    dense = llama.DenseArgs.from_hf_config({**config, "model_type": "qwen3"})
    return MoeArgs(
        dense=dataclasses.replace(dense, model_type=model_type),
        num_experts=num_experts,
        top_k=top_k,
        expert_ffn_hidden_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
    )


def valid_tp_sizes(args: MoeArgs) -> list[int]:
    """Tensor-parallel sizes of the attention (see `llama.valid_tp_sizes`)."""
    return llama.valid_tp_sizes(args.dense)


def check_parallel(args: MoeArgs, tp: int, *, ep: int = 1, etp: int = 1) -> None:
    """Raise `UserError` (one sentence) when `tp`, `ep` or `etp` cannot split `args`.

    TP splits the attention like the dense family; EP must divide the experts (each EP rank
    holds num_experts / ep whole experts) and ETP the expert FFN width.
    """
    llama.check_parallel(args.dense, tp)
    if args.num_experts % ep:
        valid = ", ".join(str(n) for n in range(1, args.num_experts + 1) if args.num_experts % n == 0)
        raise UserError(
            f"ep={ep} cannot split this {args.model_type} model's {args.num_experts} experts; "
            f"use ep in {{{valid}}}."
        )
    if args.expert_ffn_hidden_size % etp:
        raise UserError(
            f"etp={etp} cannot split this {args.model_type} model's expert FFN size "
            f"{args.expert_ffn_hidden_size}; use an etp that divides it."
        )


def transformer_config(args: MoeArgs, layout: ParallelLayout, *, dtype: str = "float32", device: str = "cpu"):
    """The megatron-core `TransformerConfig`: the dense Qwen3 one (`llama.transformer_config`)
    plus the MoE layer.

    Router: `moe_router_score_function="softmax"`; with `norm_topk_prob` Megatron's default
    top-k-then-softmax (`moe/moe_utils.py` topk_softmax_with_capacity: softmax over the top-k
    logits = HF's renormalised top-k of the full softmax), otherwise `moe_router_pre_softmax`
    (softmax over all experts, then top-k, as HF without renormalising). No token dropping
    (capacity None), the alltoall token dispatcher, experts as a `SequentialMLP` (no grouped
    GEMM), and no load-balancing loss unless `aux_loss_coeff` > 0. Sequence parallel is on when
    `layout.tp` > 1 (Megatron's MoE layer refuses TP without it while training,
    `moe/moe_layer.py:379`). EP and ETP sizes are the layout's.
    """
    base = llama.transformer_config(args.dense, layout, dtype=dtype, device=device)
    balancing = "aux_loss" if args.aux_loss_coeff > 0 else "none"
    return dataclasses.replace(
        base,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.top_k,
        moe_ffn_hidden_size=args.expert_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not args.norm_topk_prob,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=args.aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.tp > 1,
    )


def layer_spec(args: MoeArgs, *, use_te: bool):
    """The MoE decoder layer spec (experts as `SequentialMLP`): TE modules when `use_te`, else local
    (with our context-parallel core attention when CP > 1, as in the dense family)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from art_mega.trainer.rank.cp_attention import with_context_parallel_attention
    from art_mega.trainer.rank.sdpa_attention import with_sdpa_attention

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts, moe_grouped_gemm=False, qk_layernorm=True
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    return with_context_parallel_attention(with_sdpa_attention(spec))


def gpt_model_kwargs(args: MoeArgs, *, tp: int) -> dict[str, Any]:
    """GPTModel keyword arguments besides config and spec (those of the dense family)."""
    return llama.gpt_model_kwargs(args.dense, tp=tp)


def local_experts(args: MoeArgs, ep: int, ep_rank: int) -> range:
    """The global expert indices EP rank `ep_rank` holds, in local order (Megatron's contiguous
    split, `moe/moe_layer.py` local_expert_indices)."""
    per_rank = args.num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def read_expert(read: Callable[[str], Tensor], layer: int, expert: int) -> tuple[Tensor, Tensor, Tensor]:
    """HF (gate [I, h], up [I, h], down [h, I]) weights of one expert of one layer.

    Reads the per-expert names `model.layers.{l}.mlp.experts.{e}.gate_proj.weight` (what
    transformers 5 `save_pretrained` writes and the Hub holds) or, when those are absent, the
    fused 3-D parameters `mlp.experts.gate_up_proj` [E, 2I, h] (gate rows first, HF
    `Qwen3MoeExperts.forward` chunk(2)) and `mlp.experts.down_proj` [E, h, I] of
    transformers 5's in-memory module. Raises `KeyError` when neither exists.
    """
    prefix = f"model.layers.{layer}.mlp.experts."
    try:
        return tuple(
            read(f"{prefix}{expert}.{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")
        )
    except KeyError:
        gate, up = read(prefix + "gate_up_proj")[expert].chunk(2, dim=0)
        return gate.clone(), up.clone(), read(prefix + "down_proj")[expert].clone()


def megatron_state_dict(
    args: MoeArgs, read: Callable[[str], Tensor], layout: ParallelLayout
) -> dict[str, Tensor]:
    """This rank's Megatron parameters (local-spec names) from HF tensors read by `read(name)`.

    Everything but the MLP comes from `llama.megatron_state_dict` (the dense family's mapping,
    given empty stand-ins for the dense MLP weights an MoE checkpoint lacks). Per layer i:
    mlp.gate -> decoder.layers.i.mlp.router.weight [E, h] (replicated); for local expert j of
    this EP rank (global expert `local_experts(args, layout.ep, layout.ep_rank)[j]`): gate_proj + up_proj ->
    mlp.experts.local_experts.j.linear_fc1.weight [2*I/etp, h] (`fc1_shard` over ETP),
    down_proj -> ...linear_fc2.weight [h, I/etp] (column shard over ETP).
    """
    import torch

    def read_or_stand_in(name: str) -> Tensor:
        if name.endswith(_DENSE_MLP):
            return torch.empty(0, 0)
        return read(name)

    state = llama.megatron_state_dict(args.dense, read_or_stand_in, layout)
    for i in range(args.num_layers):
        mc = f"decoder.layers.{i}.mlp."
        del state[mc + "linear_fc1.weight"], state[mc + "linear_fc2.weight"]
        state[mc + "router.weight"] = read(f"model.layers.{i}.mlp.gate.weight")
        for j, expert in enumerate(local_experts(args, layout.ep, layout.ep_rank)):
            gate, up, down = read_expert(read, i, expert)
            local = f"{mc}experts.local_experts.{j}."
            state[local + "linear_fc1.weight"] = fc1_shard(gate, up, layout.etp, layout.etp_rank)
            state[local + "linear_fc2.weight"] = shard(down, 1, layout.etp, layout.etp_rank)
    return state


def _check_layout(args: MoeArgs, layout: ParallelLayout) -> None:
    """`check_parallel` on the layout's TP, EP and expert-TP sizes."""
    check_parallel(args, layout.tp, ep=layout.ep, etp=layout.etp)


SPEC: FamilySpec[MoeArgs] = FamilySpec(
    name="qwen3_moe",
    model_types=MODEL_TYPES,
    model_args=model_args,
    expert_parallel=True,
    valid_tp_sizes=valid_tp_sizes,
    check_parallel=_check_layout,
    transformer_config=transformer_config,
    layer_spec=layer_spec,
    gpt_model_kwargs=gpt_model_kwargs,
    megatron_state_dict=megatron_state_dict,
    te_name_map=TE_NAME_MAP,
    # The experts' linear_fc1 / linear_fc2 are named like the dense MLP's, per expert.
    lora=LoraNames(
        modules=llama.LORA_NAMES.modules,
        parents=llama.LORA_NAMES.parents,
        expert_targets=("linear_fc1", "linear_fc2"),
        mlp_is_experts=True,
    ),
    pipeline_parallel=True,
)
"""The Qwen3-MoE family."""
