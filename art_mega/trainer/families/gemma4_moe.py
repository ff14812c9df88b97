"""Gemma 4's MoE block (`enable_moe_block`, gemma-4-26B-A4B) for `gemma4.py`: its Megatron module,
router, config fields, HF -> Megatron weights and the LoRA names of its experts. Not a family file
(no `SPEC`; `families/__init__._NOT_FAMILIES`): the Gemma 4 family reads both kinds of layer.

transformers 5.17 `models/gemma4/modeling_gemma4.py` (`Gemma4TextDecoderLayer.forward` with
`enable_moe_block`, `Gemma4TextRouter`, `Gemma4TextExperts`): on the residual r after attention,

    dense  = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(r)))
    x      = rmsnorm(r) * scale * hidden^-0.5            (router.norm has no weight)
    p      = softmax(x W_router^T) over the experts (float32)
    w, idx = top_k(p); w = w / sum(w); w = w * per_expert_scale[idx]
    moe    = post_feedforward_layernorm_2(sum_k w_k expert_idx_k(pre_feedforward_layernorm_2(r)))
    out    = r + post_feedforward_layernorm(dense + moe)

(then times `layer_scalar`, as on dense layers). The dense MLP and each expert are GeGLU (gate and
up rows of one fused projection, gelu-tanh(gate) * up, then down); norms are x / rms(x) * w.

Megatron (`block_class`): megatron-core's `MoELayer` with its alltoall token dispatcher and
`SequentialMLP` experts, whose shared expert (`SharedExpertMLP`, no gate) is the dense MLP; its
forward gives the router the raw residual, the shared expert and the experts their own norms, and
sums as above. The layer's `pre_mlp_layernorm` is the identity (the block norms its inputs). The
router (`router_class`) subclasses `TopKRouter`: same weight [E, h], plus `scale` [h] and
`per_expert_scale` [E]; probabilities are zero outside the top k.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer.families.layout import fc1_shard, shard

if TYPE_CHECKING:
    from torch import Tensor

NORMS = (
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2",
    "post_feedforward_layernorm",
)
"""The block's norms, under HF's names (a decoder layer's) and Megatron's (`mlp.<name>`)."""

_EXPERT_NAME = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.(?:experts\.(\d+)|shared_experts)\.(linear_fc[12])$"
)
"""A LoRA layer of the block: an expert's or the dense MLP's (Megatron's shared expert) linear."""


def moe_fields(config: dict[str, Any]) -> dict[str, int]:
    """`Gemma4Args`' MoE fields of an HF gemma4_text config: num_experts, top_k
    (`top_k_experts`), expert_ffn_hidden_size (`moe_intermediate_size`); all 0 without
    `enable_moe_block`.

    Raises:
        UserError: a missing MoE size, or top_k outside 1..num_experts (one sentence each).
    """
    if not config.get("enable_moe_block"):
        return {"num_experts": 0, "top_k": 0, "expert_ffn_hidden_size": 0}
    sizes = {}
    for field in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not config.get(field):
            raise UserError(f"enable_moe_block=true needs {field}; use the model's own config.json.")
        sizes[field] = int(config[field])
    experts, top_k = sizes["num_experts"], sizes["top_k_experts"]
    if not 1 <= top_k <= experts:
        raise UserError(f"top_k_experts={top_k} must be between 1 and num_experts={experts}.")
    return {"num_experts": experts, "top_k": top_k, "expert_ffn_hidden_size": sizes["moe_intermediate_size"]}


def check_experts(args: Any, ep: int, etp: int) -> None:
    """`UserError` (one sentence naming the valid sizes) when EP does not divide the experts or
    expert-TP their width; on a dense model (no experts) when either is above 1."""
    if not args.num_experts:
        if ep > 1 or etp > 1:
            raise UserError(f"ep={ep}, etp={etp}: this gemma4_text model has no experts; use ep=1 and etp=1.")
        return
    if args.num_experts % ep:
        valid = ", ".join(str(n) for n in range(1, args.num_experts + 1) if args.num_experts % n == 0)
        raise UserError(
            f"ep={ep} cannot split this gemma4_text model's {args.num_experts} experts; use ep in {{{valid}}}."
        )
    if args.expert_ffn_hidden_size % etp:
        raise UserError(
            f"etp={etp} cannot split this gemma4_text model's expert FFN size "
            f"{args.expert_ffn_hidden_size}; use an etp that divides it."
        )


def config_fields(args: Any, ep: int, etp: int, tp: int) -> dict[str, Any]:
    """The `TransformerConfig` fields of the block (empty for a dense model): experts, top k and
    width; the dense MLP as the shared expert (no gate, not overlapped); the alltoall dispatcher
    with `SequentialMLP` experts; no load-balancing loss (HF has none in its forward); no token
    dropping; EP / ETP; sequence parallel when TP > 1 (megatron-core's MoE layer refuses TP
    without it while training, `moe/moe_layer.py`)."""
    if not args.num_experts:
        return {}
    return {
        "num_moe_experts": args.num_experts,
        "moe_router_topk": args.top_k,
        "moe_ffn_hidden_size": args.expert_ffn_hidden_size,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_shared_expert_intermediate_size": args.ffn_hidden_size,
        "moe_shared_expert_gate": False,
        "moe_shared_expert_overlap": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "sequence_parallel": tp > 1,
    }


@functools.cache
def router_class() -> type:
    """Gemma 4's router (built on first use): `TopKRouter`'s weight [E, h] plus `scale` [h] and
    `per_expert_scale` [E]; forward(r [s, b, h]) -> (probs [s*b, E] float32, zero outside each
    token's top k; routing map [s*b, E] bool), the maths of the module docstring."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    class Gemma4Router(TopKRouter):
        def __init__(self, config: Any, pg_collection: Any = None) -> None:
            super().__init__(config=config, pg_collection=pg_collection)
            dtype = config.params_dtype
            self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=dtype))
            self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=dtype))
            for param in (self.scale, self.per_expert_scale):
                param.sequence_parallel = config.sequence_parallel

        def forward(self, input: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
            x = input.float()
            x = (
                x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.config.layernorm_epsilon, -0.5)
            ).type_as(input)
            x = x * self.scale * self.config.hidden_size**-0.5
            logits = torch.nn.functional.linear(x, self.weight.to(x.dtype)).view(
                -1, self.config.num_moe_experts
            )
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            top, index = torch.topk(probs, self.topk, dim=-1)
            top = top / top.sum(dim=-1, keepdim=True) * self.per_expert_scale[index].float()
            routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(1, index, True)
            return torch.zeros_like(probs).scatter(1, index, top), routing_map

    return Gemma4Router


@functools.cache
def block_class() -> type:
    """Gemma 4's MLP-plus-experts block (built on first use): megatron-core's `MoELayer` with the
    norms of `NORMS` (torch RMSNorm, x / rms(x) * w) and the forward of the module docstring;
    returns (output [s, b, h], None) like an MLP."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class Gemma4MoeBlock(MoELayer):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            for name in NORMS:
                setattr(
                    self, name, WrappedTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
                )

        def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
            if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
                raise ValueError("Gemma 4's MoE block under tensor parallelism needs sequence parallelism")
            dense = self.post_feedforward_layernorm_1(
                self.shared_experts(self.pre_feedforward_layernorm(hidden_states))
            )
            probs, routing_map = self.route(hidden_states)
            tokens, probs = self.preprocess(
                self.pre_feedforward_layernorm_2(hidden_states), probs, routing_map
            )
            tokens, probs = self.dispatch(tokens, probs)
            output, _ = self.routed_experts_compute(tokens, probs)
            routed = self.post_feedforward_layernorm_2(self.postprocess(self.combine(output), None))
            return self.post_feedforward_layernorm(dense + routed), None

    return Gemma4MoeBlock


def layer_spec(dense_layer: Any, args: Any) -> Any:
    """`dense_layer` (a Gemma 4 layer's ModuleSpec) with its MLP replaced by `block_class` (the
    local MoE spec's `SequentialMLP` experts and shared expert, `router_class`) and no
    pre-MLP norm (the block norms its own inputs)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    moe = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    ).submodules.mlp
    submodules = dataclasses.replace(moe.submodules, router=router_class())
    mlp = ModuleSpec(module=block_class(), params=dict(moe.params or {}), submodules=submodules)
    layer = dataclasses.replace(dense_layer.submodules, mlp=mlp, pre_mlp_layernorm=IdentityOp)
    return dataclasses.replace(dense_layer, submodules=layer)


def local_experts(args: Any, ep: int, ep_rank: int) -> range:
    """The global expert indices EP rank `ep_rank` holds, in local order (Megatron's contiguous
    split, `moe/moe_layer.py` local_expert_indices)."""
    per_rank = args.num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def block_state(args: Any, read: Callable[[str], Tensor], layout: Any, layer: int) -> dict[str, Tensor]:
    """One layer's block tensors (Megatron local-spec names) for this TP / EP / ETP rank.

    router.proj.weight -> mlp.router.weight [E, h], router.scale -> mlp.router.scale [h],
    router.per_expert_scale -> mlp.router.per_expert_scale [E] (replicated); mlp.gate_proj +
    up_proj -> mlp.shared_experts.linear_fc1 (`fc1_shard` over TP), down_proj ->
    mlp.shared_experts.linear_fc2 (column shard over TP); the `NORMS` -> mlp.<name>.weight
    (as they are); for local expert j (`local_experts`): experts.gate_up_proj[e] [2I, h] (gate
    rows first) -> mlp.experts.local_experts.j.linear_fc1 (`fc1_shard` over ETP),
    experts.down_proj[e] [h, I] -> linear_fc2 (column shard over ETP).
    """
    hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}.mlp."
    tp, rank = layout.tp, layout.tp_rank
    state = {
        mc + "router.weight": read(hf + "router.proj.weight"),
        mc + "router.scale": read(hf + "router.scale"),
        mc + "router.per_expert_scale": read(hf + "router.per_expert_scale"),
        mc + "shared_experts.linear_fc1.weight": fc1_shard(
            read(hf + "mlp.gate_proj.weight"), read(hf + "mlp.up_proj.weight"), tp, rank
        ),
        mc + "shared_experts.linear_fc2.weight": shard(read(hf + "mlp.down_proj.weight"), 1, tp, rank),
    }
    state.update({f"{mc}{name}.weight": read(f"{hf}{name}.weight") for name in NORMS})
    gate_up, down = read(hf + "experts.gate_up_proj"), read(hf + "experts.down_proj")
    for j, expert in enumerate(local_experts(args, layout.ep, layout.ep_rank)):
        gate, up = gate_up[expert].chunk(2, dim=0)
        local = f"{mc}experts.local_experts.{j}."
        state[local + "linear_fc1.weight"] = fc1_shard(gate.clone(), up.clone(), layout.etp, layout.etp_rank)
        state[local + "linear_fc2.weight"] = shard(down[expert].clone(), 1, layout.etp, layout.etp_rank)
    return state


DENSE_MLP_KEYS = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
"""A dense layer's MLP tensors (`gemma4.megatron_state_dict`) that an MoE layer has in its block."""


def parse_lora(name: str) -> tuple[str, str] | None:
    """(HF module path under the decoder layers, Megatron target) of a LoRA layer of the block, or
    None for another layer: an expert's linear_fc1 / linear_fc2 -> ("{i}.experts.{e}", target)
    (HF's experts sit on the decoder layer, beside its mlp); the dense MLP's (Megatron's shared
    expert) -> ("{i}.mlp", target)."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    layer, expert, target = match.groups()
    return (f"{layer}.mlp" if expert is None else f"{layer}.experts.{expert}"), target


def hf_parents(layer: int, num_experts: int) -> list[tuple[str, str]]:
    """(HF parent, width kind) of an MoE layer's linear_fc1 / linear_fc2 adapters (`parse_lora`):
    every expert's ("expert") and the dense MLP's ("dense")."""
    return [(f"{layer}.experts.{e}", "expert") for e in range(num_experts)] + [(f"{layer}.mlp", "dense")]
