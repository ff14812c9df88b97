"""GPT-OSS decoders (HF `GptOssForCausalLM`, model_type "gpt_oss"): config mapping, Megatron layer
spec, weights and LoRA names (`SPEC`).

A GPT-OSS decoder (transformers `models/gpt_oss/modeling_gpt_oss.py`) is a Llama-style pre-norm
decoder (RMSNorm, GQA, rotate-half RoPE, untied embeddings) whose every MLP is a mixture of experts,
with:

- attention sinks: a learned logit per head in each query's softmax denominator
  (`GptOssAttention.sinks` -> megatron-core's `softmax_type="learnable"`, computed by
  `sdpa_attention` into the core attention's `softmax_offset`);
- alternating sliding-window / full attention (`layer_types`; HF's default: even layers slide,
  window 128) through the trainer's general sliding window (`llama.window_config`);
- YaRN RoPE (`trainer/rope_scaling.py`; the published configs: factor 32 over 4096 positions,
  truncate false);
- biases on q/k/v and o (`add_bias_linear`), on the router and on every expert's two layers;
- the router `GptOssTopKRouter`: logits x W^T + b, top-k of the logits, softmax over those k
  (megatron-core's default top-k-then-softmax, `moe_router_pre_softmax` False);
- the experts' clamped SwiGLU (`GptOssExperts._apply_gate`): gate = min(g, limit),
  up = clamp(u, -limit, limit), out = (up + 1) * gate * sigmoid(1.702 * gate) with limit 7 ->
  megatron-core's GLU with `activation_func=quick_gelu` (x * sigmoid(1.702 x)),
  `glu_linear_offset=1` and `activation_func_clamp_value=limit` (`transformer/mlp.py` glu);
  HF keeps each expert's gate and up as interleaved columns of `gate_up_proj` [E, h, 2I]
  (gate = [..., ::2], up = [..., 1::2]) and `down_proj` as [E, I, h] (x @ W), Megatron as
  [gate; up] rows of linear_fc1 [2I, h] and linear_fc2 [h, I].

The published checkpoints store the experts' weights in MXFP4 (`gate_up_proj_blocks` /
`_scales`); `read_experts` expands this rank's experts to the parameter values as transformers'
`integrations/mxfp4.py` convert_moe_packed_tensors does. Refused (one sentence each): attention
without biases, a swiglu_limit other than transformers' fixed 7.0, another quantization method,
RoPE other than default / linear / YaRN, attention sinks under context parallelism. The layer
spec is megatron-core's local one on every device (the sinks live in `sdpa_attention`).

LoRA: ART 0.5.23 adapts q/k/v/o_proj and the experts on GPT-OSS
(`art/megatron/model_support/registry.py` _GPT_OSS_MOE_TARGET_MODULES); here the Megatron targets
linear_qkv, linear_proj and each expert's linear_fc1 / linear_fc2 (a GPT-OSS layer has no dense
MLP). The adapter on disk (`GptOssLoraNames`) holds the experts as PEFT 0.21 writes a LoRA on
transformers' fused 3-D parameters (`LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])`, `peft/tuners/lora/layer.py` ParamWrapper), which is also the layout
vLLM 0.32 loads for its 3-D MoE models (`GptOssForCausalLM.is_3d_moe_weight`,
`vllm/lora/model_manager.py`, `vllm/lora/lora_model.py` "experts.base_layer is the gate_up_proj"),
and what ART 0.5.23 publishes to vLLM (`model_support/handlers/gpt_oss.py` _to_vllm_lora_tensors):
one adapter both load, with q/k/v/o_proj as per-module `target_modules`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer import rope_scaling as scaled_rope
from art_mega.trainer.families import fused_experts, llama, qwen3_moe
from art_mega.trainer.families.layout import fc1_shard, shard
from art_mega.trainer.families.spec import FamilySpec, LoraNames, ParallelLayout

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("gpt_oss",)
"""HF `model_type` values this family reads."""

SWIGLU_LIMIT = 7.0
"""The experts' clamp, fixed in transformers' `GptOssExperts` (it does not read `swiglu_limit`)."""

DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""The RoPE GptOssConfig gives a config without rope_parameters / rope_scaling (base 150000)."""

_MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 (e2m1) code -> value (transformers `integrations/mxfp4.py` FP4_VALUES)."""


@dataclass(frozen=True)
class GptOssArgs(qwen3_moe.MoeArgs):
    """A GPT-OSS checkpoint's architecture: `qwen3_moe.MoeArgs` (its `dense` a `llama.DenseArgs`
    with q/k/v biases, no QK norm, the sliding layers and the YaRN scaling; every layer an MoE of
    `num_experts` experts of width `expert_ffn_hidden_size`, top `top_k`, softmax over the top-k
    logits) plus `mxfp4`: the checkpoint stores the experts' weights as MXFP4 blocks and scales."""

    mxfp4: bool = False


def model_args(config: dict[str, Any]) -> GptOssArgs:
    """Parse an HF gpt_oss config dict (transformers 5.19's GptOssConfig defaults for absent
    fields: 128 experts, top 4, head_dim 64, window 128, even layers sliding, untied embeddings,
    attention_bias true, YaRN factor 32 over 4096 positions, RoPE base 150000).

    Raises:
        UserError: one sentence naming the field, its value and the fix (module docstring).
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a GPT-OSS model ({', '.join(MODEL_TYPES)}).")
    if not config.get("attention_bias", True):
        raise UserError(
            "attention_bias=false is not supported for GPT-OSS; use the model's own config.json (attention_bias true)."
        )
    limit = config.get("swiglu_limit", SWIGLU_LIMIT)
    if float(limit) != SWIGLU_LIMIT:
        raise UserError(
            f"swiglu_limit={limit} is not supported; transformers' GPT-OSS experts clamp at {SWIGLU_LIMIT}, so use that."
        )
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method")
    if method not in (None, "mxfp4"):
        raise UserError(
            f"quantization_config.quant_method={method!r} is not supported for GPT-OSS; use the bf16 or mxfp4 checkpoint."
        )
    if not scaled_rope.rope_parameters(config):
        config = {**config, "rope_parameters": DEFAULT_ROPE}
    num_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window", 128)
    layers = llama.sliding_layers(config, window, num_layers, lambda i: (i + 1) % 2 == 1)
    rope_kind = scaled_rope.rope_type(config)
    if rope_kind not in ("default", *scaled_rope.SCALED_TYPES):
        raise UserError(
            f"rope_type={rope_kind!r} is not supported for GPT-OSS; use 'default', 'linear' or 'yarn'."
        )
    theta = scaled_rope.rope_parameters(config).get("rope_theta", config.get("rope_theta", 150000.0))
    num_heads = int(config.get("num_attention_heads", 64))
    num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 128)
    top_k = int(config.get("num_experts_per_tok") or config.get("experts_per_token") or 4)
    if not 1 <= top_k <= num_experts:
        raise UserError(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={num_experts}.")
    dense = llama.DenseArgs(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        ffn_hidden_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_query_groups=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or 64),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_scaling_factor=None,
        max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=True,
        qk_norm=False,
        sliding_window=int(window) if any(layers) else None,
        window_layers=layers if any(layers) else (),
        rope_scaling=scaled_rope.read(config),
    )
    return GptOssArgs(
        dense=dense,
        num_experts=num_experts,
        top_k=top_k,
        expert_ffn_hidden_size=int(config["intermediate_size"]),
        norm_topk_prob=True,
        mxfp4=method == "mxfp4",
    )


def transformer_config(
    args: GptOssArgs, layout: ParallelLayout, *, dtype: str = "float32", device: str = "cpu"
):
    """The Qwen3-MoE family's `TransformerConfig` (`qwen3_moe.transformer_config`: RMSNorm,
    GQA, the sliding window, the softmax router with top-k-then-softmax, SequentialMLP experts,
    EP / ETP) with biases on every linear layer and the router, the clamped SwiGLU (quick_gelu,
    offset 1, clamp `SWIGLU_LIMIT`) and attention sinks (`softmax_type="learnable"`).

    Raises:
        UserError: context parallelism (the sinks' attention has no CP path).
    """
    from megatron.core.activations import quick_gelu

    if llama._context_parallel_size() > 1:
        raise UserError("GPT-OSS's attention sinks are not implemented under context parallelism; use cp=1.")
    base = qwen3_moe.transformer_config(args, layout, dtype=dtype, device=device)
    return dataclasses.replace(
        base,
        add_bias_linear=True,
        add_qkv_bias=True,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=SWIGLU_LIMIT,
        bias_activation_fusion=False,
        softmax_type="learnable",
    )


def layer_spec(args: GptOssArgs, *, use_te: bool):
    """megatron-core's local MoE layer spec (SequentialMLP experts, no QK norm) with the SDPA core
    attention, on every device (`use_te` is not used: the sinks are `sdpa_attention`'s)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from art_mega.trainer.rank.sdpa_attention import with_sdpa_attention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=False, qk_layernorm=False, normalization="RMSNorm"
    )
    return with_sdpa_attention(spec)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """Float32 values of MXFP4 tensors: `blocks` uint8 [..., G, 16] (two FP4 codes per byte, low
    nibble first) and `scales` uint8 [..., G] (exponent + 127 of each group of 32 values) ->
    [..., G * 32], value = FP4(code) * 2^(scale - 127) (transformers `integrations/mxfp4.py`
    convert_moe_packed_tensors, before its final transpose)."""
    import torch

    lut = torch.tensor(_MXFP4_VALUES, dtype=torch.float32)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent[..., None]).flatten(-2)


def read_experts(read: Callable[[str], Tensor], name: str, experts: range) -> Tensor:
    """Rows `experts` of the HF experts' parameter `name` (`gate_up_proj` [E, h, 2I] or `down_proj`
    [E, I, h]), read as it is or, when absent, from its MXFP4 `{name}_blocks` / `{name}_scales`,
    which hold the transposed tensor ([E, 2I, h/32, 16] for gate_up_proj); only those experts are
    dequantized (float32). `KeyError` when neither exists."""
    rows = slice(experts.start, experts.stop)
    try:
        return read(name)[rows]
    except KeyError:
        values = dequantize_mxfp4(read(name + "_blocks")[rows], read(name + "_scales")[rows])
        return values.transpose(-1, -2).contiguous()


def megatron_state_dict(
    args: GptOssArgs, read: Callable[[str], Tensor], layout: ParallelLayout
) -> dict[str, Tensor]:
    """This rank's Megatron tensors (local-spec names) from HF tensors read by `read(name)`.

    Embedding, untied output layer, norms, fused QKV weight and bias (TP-sharded rows) and
    o_proj (TP-sharded columns) come from `llama.megatron_state_dict`; besides, per layer i:
    o_proj.bias -> linear_proj.bias [h] (replicated), sinks [nh] ->
    self_attention.core_attention.softmax_offset [nh/tp], post_attention_layernorm ->
    pre_mlp_layernorm, router.weight [E, h] / router.bias [E] -> mlp.router.weight / .bias
    (replicated), and for local expert j of this EP rank (global e, `qwen3_moe.local_experts`):
    gate_up_proj[e] [h, 2I] -> linear_fc1.weight [2I/etp, h] (gate = even columns, up = odd,
    `fc1_shard` over ETP) with gate_up_proj_bias[e] likewise -> linear_fc1.bias,
    down_proj[e] [I, h] -> linear_fc2.weight [h, I/etp] (transposed, column shard over ETP),
    down_proj_bias[e] -> linear_fc2.bias [h].
    """
    import torch

    def read_or_stand_in(name: str) -> Tensor:
        if name.endswith(qwen3_moe._DENSE_MLP):
            return torch.empty(0, 0)
        return read(name)

    state = llama.megatron_state_dict(args.dense, read_or_stand_in, layout)
    tp, tp_rank, etp, etp_rank = layout.tp, layout.tp_rank, layout.etp, layout.etp_rank
    experts = qwen3_moe.local_experts(args, layout.ep, layout.ep_rank)
    for i in range(args.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        del state[mc + "mlp.linear_fc1.weight"], state[mc + "mlp.linear_fc2.weight"]
        state[mc + "self_attention.linear_proj.bias"] = read(hf + "self_attn.o_proj.bias")
        state[mc + "self_attention.core_attention.softmax_offset"] = shard(
            read(hf + "self_attn.sinks"), 0, tp, tp_rank
        )
        state[mc + "mlp.router.weight"] = read(hf + "mlp.router.weight")
        state[mc + "mlp.router.bias"] = read(hf + "mlp.router.bias")
        gate_up = read_experts(read, hf + "mlp.experts.gate_up_proj", experts)
        gate_up_bias = read(hf + "mlp.experts.gate_up_proj_bias")
        down = read_experts(read, hf + "mlp.experts.down_proj", experts)
        down_bias = read(hf + "mlp.experts.down_proj_bias")
        for j, e in enumerate(experts):
            local = f"{mc}mlp.experts.local_experts.{j}."
            weight, bias = gate_up[j].t(), gate_up_bias[e]
            state[local + "linear_fc1.weight"] = fc1_shard(weight[0::2], weight[1::2], etp, etp_rank)
            state[local + "linear_fc1.bias"] = fc1_shard(bias[0::2], bias[1::2], etp, etp_rank)
            state[local + "linear_fc2.weight"] = shard(down[j].t(), 1, etp, etp_rank)
            state[local + "linear_fc2.bias"] = down_bias[e].clone()
    return state


def check_parallel(args: GptOssArgs, layout: ParallelLayout) -> None:
    """Qwen3-MoE's size checks, and etp = 1: megatron-core adds an expert's linear_fc2 bias on
    every expert-TP rank before the token dispatcher sums their partial outputs
    (`transformer/mlp.py` MLP.forward, `moe/token_dispatcher.py` combine), so at etp > 1 the
    down_proj bias would count etp times. Raises `UserError` (one sentence)."""
    qwen3_moe.SPEC.check_parallel(args, layout)
    if layout.etp != 1:
        raise UserError(
            f"etp={layout.etp} cannot split this gpt_oss model: megatron-core would add its experts' "
            "down_proj bias once per expert-TP rank; use etp=1 and split the experts with ep."
        )


EXPERT_PARAMETERS = dict(zip(("linear_fc1", "linear_fc2"), fused_experts.parameters("mlp.experts")))
"""Megatron expert target -> the HF experts' 3-D parameter PEFT adapts (under a decoder layer), in
the order the adapter's `target_parameters` lists them."""


@dataclass(frozen=True)
class GptOssLoraNames(LoraNames):
    """Qwen3-MoE's LoRA names (per-module `to_peft` / `from_peft`) with the experts stored as PEFT's
    LoRA on transformers' fused parameters (`GptOssExperts.gate_up_proj` [E, h, 2I] and
    `down_proj` [E, I, h], both x @ W): per layer, for `EXPERT_PARAMETERS` p wrapped at path w
    (`fused_experts.wrappers`), `{w}.lora_A.weight` [E * r, in] (expert e's A in rows
    e*r .. e*r + r - 1) and `{w}.lora_B.weight` [out, r * E] (`fused_experts.pack_lora_b`), with
    W_e += (alpha / r) (B_e A_e)^T; the gate_up_proj B_e rows interleave gate_proj's and
    up_proj's (`fused_experts.interleave_gate_up`), its A_e is the A they share.

    Also the packed names of another family whose HF experts are fused at `mlp.experts`:
    `interleave` False stacks gate rows before up rows (Qwen3.5 MoE's gate_up_proj), `label`
    names the family in refusals, and a `shared_expert`'s gate/up/down_proj stay per-module
    `target_modules` (`qwen3_5_moe.WRAPPER_LORA_NAMES`)."""

    interleave: bool = True
    label: str = "GPT-OSS"

    def normalise(self, targets: Sequence[str]) -> tuple[str, ...]:
        """`LoraNames.normalise`, and the experts' linear_fc1 and linear_fc2 both or neither:
        vLLM reads a GPT-OSS expert LoRA only as the gate_up_proj / down_proj pair
        (`vllm/lora/model_manager.py`, 3-D MoE). Raises `UserError` (one sentence)."""
        found = super().normalise(targets)
        experts = [target for target in self.expert_targets if target in found]
        if len(experts) == 1:
            raise UserError(
                f"LoRA target {experts[0]} needs linear_fc1 and linear_fc2 together on {self.label} "
                "(vLLM serves its experts' adapter only as the gate_up_proj / down_proj pair); "
                "name both or neither."
            )
        return found

    def peft_targets(self, targets: Sequence[str]) -> dict[str, list[str]]:
        """q/k/v/o_proj (and a `shared_expert`'s gate/up/down_proj) as `target_modules`; the
        expert targets as `target_parameters`."""
        experts = [target for target in self.expert_targets if target in targets]
        modules = targets if self.shared_expert else [t for t in targets if t not in experts]
        fields = {"target_modules": self.hf_target_modules(modules)}
        if experts:
            fields["target_parameters"] = [EXPERT_PARAMETERS[target] for target in experts]
        return fields

    def config_modules(self, target_modules: Sequence[str], target_parameters: Sequence[str]) -> list[str]:
        """`target_modules`, and gate_proj + up_proj / down_proj for the expert parameters.
        Raises `UserError` for a parameter that is not one of `EXPERT_PARAMETERS`."""
        by_parameter = {parameter: target for target, parameter in EXPERT_PARAMETERS.items()}
        modules = list(target_modules)
        for parameter in target_parameters:
            if parameter not in by_parameter:
                raise UserError(
                    f"target_parameters entry {parameter!r} is not a {self.label} expert parameter; "
                    f"art-mega adapts {list(by_parameter)}."
                )
            modules += self.modules[by_parameter[parameter]]
        return modules

    def pack(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """The per-expert gate_proj / up_proj / down_proj tensors of each layer (experts 0 .. E-1,
        all of them) as PEFT's fused-parameter tensors (class docstring; gate and up rows
        interleaved when `interleave`); others, a shared expert's included, as they are."""
        return fused_experts.pack(tensors, "mlp.experts", interleave=self.interleave)

    def unpack(self, tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> Mapping[str, Tensor]:
        """The per-expert tensors `to_peft` writes from PEFT's fused-parameter tensors (inverse of
        `pack`; rank and parameters from the adapter's `config`, adapter_config.json); a missing
        tensor is left for `LoraNames.from_peft` to name."""
        return fused_experts.unpack(tensors, config, "mlp.experts", interleave=self.interleave)

    def pack_shapes(
        self, shapes: dict[str, tuple[int, int]], shared: list[tuple[str, ...]], rank: int
    ) -> tuple[dict[str, tuple[int, int]], list[tuple[str, ...]]]:
        """`pack` on shapes: each layer's E experts' gate_proj A (r, h) and B (I, r) -> its
        gate_up_proj A (E r, h) and B (2I, E r); down_proj A (r, I), B (h, r) -> (E r, I),
        (h, E r); the experts' shared-A groups go (the packed A is one tensor)."""
        return fused_experts.pack_shapes(shapes, shared, rank, "mlp.experts")


SPEC: FamilySpec[GptOssArgs] = dataclasses.replace(
    qwen3_moe.SPEC,
    name="gpt_oss",
    model_types=MODEL_TYPES,
    model_args=model_args,
    check_parallel=check_parallel,
    transformer_config=transformer_config,
    layer_spec=layer_spec,
    megatron_state_dict=megatron_state_dict,
    te_name_map={},
    lora=GptOssLoraNames(
        modules=qwen3_moe.SPEC.lora.modules,
        parents=qwen3_moe.SPEC.lora.parents,
        expert_targets=qwen3_moe.SPEC.lora.expert_targets,
        mlp_is_experts=True,
    ),
)
"""The GPT-OSS family: Qwen3-MoE's parallel limits (TP over heads, EP over experts; etp = 1,
`check_parallel`), GPTModel arguments and LoRA target names; its own config, layer spec, weights
and adapter format (`GptOssLoraNames`)."""
