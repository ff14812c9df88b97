"""DeepSeek-V3 decoders (HF `DeepseekV3ForCausalLM`, model_type "deepseek_v3", and Kimi-K2's
"kimi_k2"): config mapping, Megatron layer specs, weights and LoRA names (`SPEC`).

Kimi-K2 (moonshotai/Kimi-K2-Instruct) publishes config.json with model_type "kimi_k2",
architectures ["DeepseekV3ForCausalLM"] and DeepSeek-V3's remote modeling code
(`auto_map` -> modeling_deepseek.DeepseekV3ForCausalLM): its fields are DeepSeek-V3's and mean the
same (384 experts, n_group = topk_group = 1, 64 heads, no MTP layer), as vLLM 0.32 reads it
(`vllm/transformers_utils/config.py`: kimi_k2 -> DeepseekV3Config, "Kimi K2 uses same
architecture as DeepSeek V3"); transformers 5 has no kimi_k2 config class, so an HF model of it
is a DeepseekV3ForCausalLM built from the same dict (`TRANSFORMERS_MODEL_TYPES`). Its tokenizer
(tiktoken, remote code) is not the trainer's business.

A DeepSeek-V3 decoder (transformers 5.19 `models/deepseek_v3/modeling_deepseek_v3.py`) is a
pre-norm RMSNorm decoder with:

- multi-head latent attention (`DeepseekV3Attention`, DeepSeek-V2 paper arXiv:2405.04434 section
  2.1): q = q_b_proj(RMSNorm(q_a_proj(x))) per head [nope (qk_nope_head_dim); rope
  (qk_rope_head_dim)]; [c_kv; k_rope] = kv_a_proj_with_mqa(x), k_nope and v per head from
  kv_b_proj(RMSNorm(c_kv)), and one rope key shared by all heads. RoPE rotates only the rope
  parts, in DeepSeek's interleaved pair layout (`rope_interleave`). This is megatron-core's
  `MLASelfAttention` (`transformer/multi_latent_attention.py`) with `MLATransformerConfig`, the
  local layer spec's ColumnParallelLinear down/up projections and its q/kv RMSNorms: the same
  weights one to one (Megatron's unfused RoPE de-interleaves like HF, `rope_utils.py`
  _apply_rotary_pos_emb_bshd with `multi_latent_attention`);
- RoPE: default or YaRN (the published config: factor 40 over 4096 positions, mscale =
  mscale_all_dim = 1). The softmax scale is 1/sqrt(qk_nope + qk_rope) times
  mscale(factor, mscale_all_dim)^2 (HF `yarn_apply_mscale`; Megatron's MultiLatentAttention
  softmax_scale from `rotary_scaling_factor` / `mscale_all_dim`); the angles are transformers'
  inverse frequencies (`trainer/rope_scaling.py`) at each row's position ids and cos/sin carry
  the YaRN attention factor, installed by `finish_model` as forward hooks on every layer's MLA
  rotary module (Megatron's MLA keeps its own rotary embedding per layer, not the GPTModel's);
- dense SwiGLU MLPs on the first `first_k_dense_replace` layers, MoE on the rest
  (`moe_layer_freq`): `n_routed_experts` SwiGLU experts of width `moe_intermediate_size` plus
  `n_shared_experts` always-on experts, one SwiGLU MLP of width n_shared * moe_intermediate_size
  (`mlp.shared_experts`, Megatron's `SharedExpertMLP`, TP-sharded like a dense MLP, no gate);
- the router (`DeepseekV3TopkRouter`): s = sigmoid(x W^T) in fp32; the choice uses s + b with
  b = `e_score_correction_bias` (a fixed buffer here: Megatron's bias update rate is 0), limited
  to the `topk_group` of `n_group` expert groups with the largest sum of their top-2 s + b; the
  top_k weights are the chosen s, divided by their sum (`norm_topk_prob`), times
  `routed_scaling_factor`. Megatron's `topk_routing_with_score_function` (sigmoid, expert bias,
  `group_limited_topk`, `moe_router_topk_scaling_factor`, router in fp32) computes exactly this
  when top_k / topk_group = 2 (its group score sums the top top_k/topk_group of each group).

Multi-token-prediction layers (`num_nextn_predict_layers`, stored as layer index
num_hidden_layers in the published checkpoint) are ignored as transformers ignores them
(`_keys_to_ignore_on_load_unexpected`): the trainer reads only the decoder layers. The published
checkpoint's block-scaled fp8 weights (`quantization_config` fp8 e4m3, 128 x 128 blocks of
`weight_scale_inv`) are dequantized to the trainer's dtype as they are read (`dequantize_fp8`);
other quantizations are refused. Also refused, one sentence each: q_lora_rank null (a query
without its low-rank projection), `rope_interleave` false, attention biases, another activation, RoPE types other than
default / YaRN, norm_topk_prob false with top_k > 1, group routing whose top_k / topk_group is not
2, context parallelism (Megatron's MLA rotary embedding is per layer; not wired to the trainer's
CP attention).

LoRA: ART 0.5.23 adapts q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj, the dense and shared
MLPs and the experts on its MLA models (GLM-5, `art/megatron/model_support/registry.py`
_GLM52_TARGET_MODULES); kv_b_proj is not adapted there, nor by vLLM (its MLA absorbs kv_b_proj into
the query and output). Here the Megatron targets linear_q_down_proj, linear_q_up_proj,
linear_kv_down_proj, linear_proj and linear_fc1 / linear_fc2 of the dense MLPs, the shared experts
(`mlp.shared_experts.*`) and each routed expert; all of them are the default LoRA, as ART's.
The adapter on disk names every module (each expert's too, `...mlp.experts.{e}.gate_proj`: what
vLLM 0.32 reads); PEFT 0.21 loads that without the dense and shared MLPs' LoRA (its MoE
conversion for deepseek_v3 takes every gate/up/down_proj in `target_modules` for the experts'), so
`peft_io.write_for_peft` writes the experts as PEFT's `target_parameters` tensors and the dense
and shared MLPs as 2-D `target_parameters` (`LORA_NAMES`' `fused_experts`, `mlp_parameters`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer import rope_scaling as scaled_rope
from art_mega.trainer.families import llama, qwen3_moe
from art_mega.trainer.families.layout import fc1_shard, pad_rows, shard
from art_mega.trainer.families.spec import FamilySpec, LoraNames, ParallelLayout

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
"""HF `model_type` values this family reads."""

TRANSFORMERS_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}
"""model_type -> the transformers config type that builds its HF model (module docstring)."""


@dataclass(frozen=True)
class DeepseekV3Args:
    """A DeepSeek-V3 checkpoint's architecture, read from its HF config.json (module docstring).

    Attention: `num_heads` heads (`num_query_groups` = num_heads: MLA has no KV-head groups),
    `q_lora_rank` / `kv_lora_rank` the latent widths, per head `qk_nope_head_dim` +
    `qk_rope_head_dim` query/key channels and `v_head_dim` value channels. `rope_scaling` None or
    YaRN; `mscale_all_dim` the softmax-scale term (0: none). MLP: `ffn_hidden_size` of the first
    `first_k_dense` (dense) layers; the MoE layers' `num_experts` experts of width
    `expert_ffn_hidden_size`, top `top_k`, `num_shared_experts` shared ones, router groups
    `n_group` / `topk_group` (1 / 1: no group limit) and `routed_scaling_factor`. `fp8_block`:
    the checkpoint stores its linear weights as e4m3 fp8 with one float32 `weight_scale_inv` per
    block of this (rows, columns) size (the published checkpoint, 128 x 128), or None.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: scaled_rope.RopeScaling | None
    mscale_all_dim: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    first_k_dense: int
    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    fp8_block: tuple[int, int] | None = None
    aux_loss_coeff: float = 0.0

    @property
    def num_query_groups(self) -> int:
        """num_heads: every head has its own key and value (the LoRA export's argument)."""
        return self.num_heads

    @property
    def head_dim(self) -> int:
        """qk_nope + qk_rope, a query/key head's width. With `qkv_bias` / `qk_norm` False this is
        what `trainer.memory_plan` / `trainer.flops` read from every family: their GQA-shaped
        count is an approximation for MLA (the latent projections are not in it)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    qkv_bias = False
    qk_norm = False

    @property
    def shared_expert_ffn_hidden_size(self) -> int:
        """The shared experts' one SwiGLU MLP width, num_shared_experts * expert_ffn_hidden_size
        (0: none; `peft_io.adapter_layout` sizes its LoRA by it)."""
        return self.num_shared_experts * self.expert_ffn_hidden_size

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is the MoE (layers >= first_k_dense)."""
        return tuple(i >= self.first_k_dense for i in range(self.num_layers))


def _positive(config: dict[str, Any], name: str, default: Any = None) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(
            f"{name}={value!r} must be a whole number of at least 1; use the model's own config.json."
        )
    return value


def _fp8_block(quantization: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) of the FP8 checkpoint's scale blocks (its `weight_block_size`), None
    without quantization; `UserError` for another quantization."""
    method = quantization.get("quant_method")
    if method is None:
        return None
    block = quantization.get("weight_block_size")
    fmt = quantization.get("fmt", "e4m3")
    if method != "fp8" or fmt != "e4m3" or not isinstance(block, list) or len(block) != 2:
        # the fields the config sets (Kimi-K2-Thinking's compressed-tensors int4 has no fmt or block)
        shown = ", ".join(
            f"{key}={quantization[key]!r}"
            for key in ("quant_method", "fmt", "weight_block_size")
            if key in quantization
        )
        raise UserError(
            f"quantization_config ({shown}) is not supported for DeepSeek-V3; use DeepSeek's block-scaled "
            "e4m3 fp8 checkpoint or a bf16 one."
        )
    return int(block[0]), int(block[1])


def model_args(config: dict[str, Any]) -> DeepseekV3Args:
    """Parse an HF deepseek_v3 config dict (transformers 5.19's DeepseekV3Config defaults for absent
    fields: 256 experts of width 2048, top 8 in 4 of 8 groups, 1 shared expert, 3 dense layers,
    scaling 2.5, latent widths 1536 / 512, head dims 128 + 64 / 128).

    Raises:
        UserError: one sentence naming the field, its value and the fix (module docstring).
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a DeepSeek-V3 model ({', '.join(MODEL_TYPES)}).")
    fp8_block = _fp8_block(config.get("quantization_config") or {})
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"hidden_act={act!r} is not supported; DeepSeek-V3 uses 'silu'.")
    if config.get("attention_bias"):
        raise UserError("attention_bias=true is not supported by the Megatron DeepSeek-V3 model; use false.")
    if config.get("rope_interleave", True) is False:
        raise UserError(
            "rope_interleave=false is not supported; Megatron's MLA rotates DeepSeek's interleaved pairs, "
            "so use the model's own config.json (true)."
        )
    if "q_lora_rank" in config and config["q_lora_rank"] is None:
        raise UserError(
            "q_lora_rank=null (a query without its low-rank projection) is not supported; "
            "use a DeepSeek-V3 checkpoint with q_lora_rank set."
        )
    rope_kind = scaled_rope.rope_type(config)
    if rope_kind not in ("default", "yarn"):
        raise UserError(f"rope_type={rope_kind!r} is not supported for DeepSeek-V3; use 'default' or 'yarn'.")
    params = scaled_rope.rope_parameters(config)
    num_experts = _positive(config, "n_routed_experts", config.get("num_local_experts", 256))
    top_k = _positive(config, "num_experts_per_tok", 8)
    if top_k > num_experts:
        raise UserError(f"num_experts_per_tok={top_k} must be between 1 and n_routed_experts={num_experts}.")
    n_group = _positive(config, "n_group", 8)
    topk_group = _positive(config, "topk_group", 4)
    if num_experts % n_group or topk_group > n_group:
        raise UserError(
            f"n_group={n_group} with topk_group={topk_group} cannot group {num_experts} experts; "
            "use the model's own config.json."
        )
    if n_group > 1 and top_k != 2 * topk_group:
        raise UserError(
            f"num_experts_per_tok={top_k} with topk_group={topk_group} is not supported: Megatron scores a "
            "group by its top num_experts_per_tok/topk_group experts and transformers by its top 2, so use "
            "num_experts_per_tok = 2 * topk_group."
        )
    if not config.get("norm_topk_prob", True) and top_k > 1:
        raise UserError(
            "norm_topk_prob=false is not supported with num_experts_per_tok > 1: Megatron's sigmoid router "
            "always normalises the chosen weights; use norm_topk_prob true."
        )
    num_layers = _positive(config, "num_hidden_layers")
    first_k_dense = config.get("first_k_dense_replace", 3)
    if (
        isinstance(first_k_dense, bool)
        or not isinstance(first_k_dense, int)
        or not 0 <= first_k_dense <= num_layers
    ):
        raise UserError(
            f"first_k_dense_replace={first_k_dense!r} must be a whole number from 0 to num_hidden_layers={num_layers}."
        )
    num_heads = _positive(config, "num_attention_heads", 128)
    kv_heads = config.get("num_key_value_heads") or num_heads
    if kv_heads != num_heads:
        raise UserError(
            f"num_key_value_heads={kv_heads} is not supported; DeepSeek-V3's MLA has num_key_value_heads = "
            f"num_attention_heads ({num_heads})."
        )
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    mscale_all_dim = float(params.get("mscale_all_dim") or 0.0) if rope_kind == "yarn" else 0.0
    return DeepseekV3Args(
        model_type=model_type,
        vocab_size=_positive(config, "vocab_size"),
        hidden_size=_positive(config, "hidden_size"),
        ffn_hidden_size=_positive(config, "intermediate_size", 18432),
        num_layers=num_layers,
        num_heads=num_heads,
        q_lora_rank=_positive(config, "q_lora_rank", 1536),
        kv_lora_rank=_positive(config, "kv_lora_rank", 512),
        qk_nope_head_dim=_positive(config, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_positive(config, "qk_rope_head_dim", 64),
        v_head_dim=_positive(config, "v_head_dim", 128),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaled_rope.read(config),
        mscale_all_dim=mscale_all_dim,
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        first_k_dense=first_k_dense,
        num_experts=num_experts,
        top_k=top_k,
        expert_ffn_hidden_size=_positive(config, "moe_intermediate_size", 2048),
        num_shared_experts=int(config.get("n_shared_experts") or 0),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
        fp8_block=fp8_block,
    )


def _tp_problems(args: DeepseekV3Args, tp: int) -> bool:
    """True when TP `tp` cannot split a size: heads, the two latent projections' outputs (the local
    spec's column-parallel q/kv down projections), the dense and shared-expert FFN widths."""
    sizes = [args.num_heads, args.q_lora_rank, args.kv_lora_rank + args.qk_rope_head_dim]
    if args.first_k_dense:
        sizes.append(args.ffn_hidden_size)
    if args.num_shared_experts and args.first_k_dense < args.num_layers:
        sizes.append(args.num_shared_experts * args.expert_ffn_hidden_size)
    return any(size % tp for size in sizes)


def valid_tp_sizes(args: DeepseekV3Args) -> list[int]:
    """Every tensor-parallel size that splits the attention heads, the latent projections and the
    dense / shared-expert FFN widths, ascending."""
    return [tp for tp in range(1, args.num_heads + 1) if not _tp_problems(args, tp)]


def check_parallel(args: DeepseekV3Args, layout: ParallelLayout) -> None:
    """Raise `UserError` (one sentence naming the valid sizes) when the layout's TP, EP or expert-TP
    cannot split `args` (EP divides the routed experts, expert-TP their width)."""
    if _tp_problems(args, layout.tp):
        valid = ", ".join(str(size) for size in valid_tp_sizes(args))
        raise UserError(
            f"tp={layout.tp} cannot split this deepseek_v3 model ({args.num_heads} heads, q_lora_rank "
            f"{args.q_lora_rank}, kv_lora_rank + qk_rope_head_dim {args.kv_lora_rank + args.qk_rope_head_dim}, "
            f"FFN size {args.ffn_hidden_size}); use tp in {{{valid}}}."
        )
    if args.num_experts % layout.ep:
        valid = ", ".join(str(n) for n in range(1, args.num_experts + 1) if args.num_experts % n == 0)
        raise UserError(
            f"ep={layout.ep} cannot split this deepseek_v3 model's {args.num_experts} experts; use ep in {{{valid}}}."
        )
    if args.expert_ffn_hidden_size % layout.etp:
        raise UserError(
            f"etp={layout.etp} cannot split this deepseek_v3 model's expert FFN size "
            f"{args.expert_ffn_hidden_size}; use an etp that divides it."
        )


def transformer_config(
    args: DeepseekV3Args, layout: ParallelLayout, *, dtype: str = "float32", device: str = "cpu"
):
    """megatron-core's `MLATransformerConfig` of `args` for this layout: MLA sizes, RMSNorm, SwiGLU,
    no biases or dropout; the MoE on layers >= first_k_dense (`moe_layer_freq`) with the sigmoid
    router, its fixed expert bias (update rate 0), group limit, scaling factor and fp32 routing,
    shared experts, no token dropping, the alltoall dispatcher and `SequentialMLP` experts, no
    load-balancing loss unless `aux_loss_coeff` > 0; sequence parallel when TP > 1 (Megatron's MoE
    layer needs it). RoPE type "yarn" for YaRN (the rotary module then hands back a cos/sin
    factor), else "rope"; `rotary_scaling_factor` / `mscale_all_dim` give the softmax scale.

    Raises:
        UserError: context parallelism (module docstring).
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if llama._context_parallel_size() > 1:
        raise UserError(
            "DeepSeek-V3's multi-latent attention is not implemented under context parallelism; use cp=1."
        )
    params_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    yarn = args.rope_scaling is not None and args.rope_scaling.rope_type == "yarn"
    has_moe = args.first_k_dense < args.num_layers
    groups = (
        {"moe_router_num_groups": args.n_group, "moe_router_group_topk": args.topk_group}
        if args.n_group > 1
        else {}
    )
    return MLATransformerConfig(
        context_parallel_size=1,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_nope_head_dim,
        qk_pos_emb_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        kv_channels=args.qk_nope_head_dim + args.qk_rope_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=args.rope_theta,
        rotary_scaling_factor=args.rope_scaling.factor if yarn else 1.0,
        original_max_position_embeddings=(
            args.rope_scaling.original_max_position_embeddings if yarn else args.max_position_embeddings
        ),
        mscale=1.0,
        mscale_all_dim=args.mscale_all_dim,
        apply_rope_fusion=False,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.tp > 1 and has_moe,
        params_dtype=params_dtype,
        bf16=dtype == "bfloat16",
        use_cpu_initialization=device == "cpu",
        perform_initialization=False,
        num_moe_experts=args.num_experts if has_moe else None,
        moe_layer_freq=[int(moe) for moe in args.moe_layers],
        moe_router_topk=args.top_k,
        moe_ffn_hidden_size=args.expert_ffn_hidden_size,
        moe_shared_expert_intermediate_size=(
            args.num_shared_experts * args.expert_ffn_hidden_size if args.num_shared_experts else None
        ),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=args.routed_scaling_factor,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if args.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=args.aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        **groups,
    )


@functools.cache
def mla_core_attention() -> type:
    """`sdpa_attention.SdpaCoreAttention` for MLA: megatron-core's MLA builds its core attention with
    `k_channels` (qk_nope + qk_rope) and `v_channels` (v_head_dim), which Megatron's local
    `DotProductAttention` does not take. forward(query, key [s, b, np, dk], value [s, b, np, dv],
    attention_mask) -> [s, b, np*dv], softmax scale as MLA gives it."""
    from art_mega.trainer.rank.sdpa_attention import sdpa_core_attention

    class MlaCoreAttention(sdpa_core_attention()):
        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            k_channels: int | None = None,
            v_channels: int | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
        ) -> None:
            super().__init__(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
            self.head_dim = v_channels  # the output's per-head width

    return MlaCoreAttention


def layer_spec(args: DeepseekV3Args, *, use_te: bool):
    """The decoder block spec: per layer megatron-core's local MLA layer spec (q/kv RMSNorms,
    column-parallel down/up projections) with `mla_core_attention`, a dense MLP on the first
    `first_k_dense` layers and the MoE (SequentialMLP experts, shared experts) after, on every
    device (`use_te` is not used)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if not isinstance(multi_latent_attention.TELinear, type):
        # megatron-core 0.16 sets HAVE_TE when its TE extension module imports, even without
        # TransformerEngine (TELinear is then a MagicMock), and calls isinstance(linear_proj,
        # TELinear): a TypeError in MultiLatentAttention.__init__. Without TE the flag is wrong.
        multi_latent_attention.HAVE_TE = False

    def local(num_experts: int | None):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=True,
            multi_latent_attention=True,
            normalization="RMSNorm",
        )
        spec.submodules.self_attention.submodules.core_attention = mla_core_attention()
        return spec

    dense, moe = local(None), local(args.num_experts)
    return TransformerBlockSubmodules(
        layer_specs=[moe if is_moe else dense for is_moe in args.moe_layers],
        layer_norm=gpt_layer_specs.LNImpl,
    )


def gpt_model_kwargs(args: DeepseekV3Args, *, tp: int) -> dict[str, Any]:
    """GPTModel keyword arguments besides config and spec: no model-level position embedding (each
    MLA layer rotates its rope part itself, `finish_model`), the padded vocabulary."""
    return {
        "vocab_size": math.ceil(args.vocab_size / tp) * tp,
        "max_sequence_length": args.max_position_embeddings,
        "position_embedding_type": "none",
        "share_embeddings_and_output_weights": args.tie_word_embeddings,
        "parallel_output": True,
    }


class MlaRopeFromPositionIds:
    """Make every MLA layer's rotary embedding follow the GPTModel's `position_ids`, with
    transformers' inverse frequencies and YaRN attention factor.

    megatron-core's MLA computes angles for positions 0..s-1 from its own inverse frequencies
    (`MultiLatentAttention.rotary_pos_emb`, called with the sequence length). A forward pre-hook
    on the GPTModel records `position_ids` [b, s]; a forward hook on each layer's rotary module
    replaces its output with the per-row table [s, b, 1, d] (`model_builder.rope_table`, d =
    qk_rope_head_dim) of `inv_freq` (HF's, float32 [d/2]) and, for YaRN (Megatron's
    `YarnRotaryEmbedding` returns (angles, mscale)), the attention factor that multiplies cos and
    sin (`RopeScaling.attention_factor`, transformers' `_compute_yarn_parameters`).
    """

    def __init__(self, inv_freq: Tensor, attention_factor: float | None) -> None:
        self.inv_freq = inv_freq
        self.attention_factor = attention_factor
        self.position_ids = None

    def _record(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

    def _clear(self, module: Any, args: tuple, output: Any) -> None:
        self.position_ids = None

    def _angles(self, rope: Any, args: tuple, output: Any) -> Any:
        from art_mega.trainer.model_builder import rope_table

        positions = self.position_ids
        if positions is None:
            raise RuntimeError("the DeepSeek-V3 GPTModel was called without position_ids")
        table = rope_table(positions, self.inv_freq.to(positions.device), None, False)
        if self.attention_factor is None:
            return table
        return table, self.attention_factor


def finish_model(args: DeepseekV3Args, module: Any) -> None:
    """Install `MlaRopeFromPositionIds` on a built GPTModel `module` (all its MLA layers)."""
    import torch

    if args.rope_scaling is not None:
        inv_freq = args.rope_scaling.inv_freq(args.qk_rope_head_dim, args.rope_theta)
    else:
        dim = args.qk_rope_head_dim
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    yarn = args.rope_scaling is not None and args.rope_scaling.rope_type == "yarn"
    state = MlaRopeFromPositionIds(inv_freq, args.rope_scaling.attention_factor if yarn else None)
    module.register_forward_pre_hook(state._record, with_kwargs=True)
    module.register_forward_hook(state._clear)
    for layer in module.decoder.layers:
        layer.self_attention.rotary_pos_emb.register_forward_hook(state._angles)
    module._mla_rope = state


def dequantize_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """Float32 values of a block-scaled fp8 weight: `weight` float8_e4m3fn [rows, cols] times
    `scale_inv` float32 [ceil(rows / block[0]), ceil(cols / block[1])], each scale covering one
    block (DeepSeek-V3's `inference/kernel.py` weight_dequant, `fp8_cast_bf16.py`)."""
    import torch

    rows, cols = weight.shape
    scale = scale_inv.to(torch.float32).repeat_interleave(block[0], 0)[:rows]
    return weight.to(torch.float32) * scale.repeat_interleave(block[1], 1)[:, :cols]


def _dequantizing(read: Callable[[str], Tensor], block: tuple[int, int]) -> Callable[[str], Tensor]:
    """`read` that hands out an fp8 `*.weight` dequantized with its `*.weight_scale_inv`
    (`dequantize_fp8`) and every other tensor as it is."""
    import torch

    def get(name: str) -> Tensor:
        tensor = read(name)
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor
        return dequantize_fp8(tensor, read(name + "_scale_inv"), block)

    return get


def megatron_state_dict(
    args: DeepseekV3Args, read: Callable[[str], Tensor], layout: ParallelLayout
) -> dict[str, Tensor]:
    """This rank's Megatron tensors (local-spec names) from HF tensors read by `read(name)`.

    embed_tokens / lm_head -> embedding / output_layer (vocab padded, row-sharded), norm ->
    decoder.final_layernorm; per layer i (HF `model.layers.i.`, Megatron `decoder.layers.i.`):
    input_layernorm, post_attention_layernorm -> input_layernorm, pre_mlp_layernorm;
    self_attn.q_a_proj [q_lora, h] -> self_attention.linear_q_down_proj (row shard),
    q_a_layernorm -> q_layernorm, q_b_proj [nh*(nope+rope), q_lora] -> linear_q_up_proj (row
    shard: whole heads), kv_a_proj_with_mqa [kv_lora+rope, h] -> linear_kv_down_proj (row shard),
    kv_a_layernorm -> kv_layernorm, kv_b_proj [nh*(nope+v), kv_lora] -> linear_kv_up_proj (row
    shard), o_proj [h, nh*v] -> linear_proj (column shard). Dense layers: gate/up/down_proj ->
    mlp.linear_fc1 (`fc1_shard`) / linear_fc2 (column shard). MoE layers: mlp.gate.weight [E, h]
    -> mlp.router.weight, mlp.gate.e_score_correction_bias [E] -> mlp.router.expert_bias
    (replicated); this EP rank's experts (`qwen3_moe.read_expert`: per-expert Hub names or
    transformers 5's fused parameters) -> mlp.experts.local_experts.j.linear_fc1 / linear_fc2
    (sharded over expert-TP); shared_experts.gate/up/down_proj -> mlp.shared_experts.linear_fc1 /
    linear_fc2 (sharded over TP). An fp8 checkpoint's weights are dequantized as they are read
    (`fp8_block`, `dequantize_fp8`).
    """
    if args.fp8_block is not None:
        read = _dequantizing(read, args.fp8_block)
    tp, tp_rank = layout.tp, layout.tp_rank
    vocab = math.ceil(args.vocab_size / tp) * tp
    state: dict[str, Tensor] = {
        "embedding.word_embeddings.weight": shard(
            pad_rows(read("model.embed_tokens.weight"), vocab), 0, tp, tp_rank
        ),
        "decoder.final_layernorm.weight": read("model.norm.weight"),
    }
    if not args.tie_word_embeddings:
        state["output_layer.weight"] = shard(pad_rows(read("lm_head.weight"), vocab), 0, tp, tp_rank)
    experts = qwen3_moe.local_experts(args, layout.ep, layout.ep_rank)
    for i, is_moe in enumerate(args.moe_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn, sa = hf + "self_attn.", mc + "self_attention."
        state[mc + "input_layernorm.weight"] = read(hf + "input_layernorm.weight")
        state[mc + "pre_mlp_layernorm.weight"] = read(hf + "post_attention_layernorm.weight")
        for hf_name, mc_name in (
            ("q_a_proj", "linear_q_down_proj"),
            ("q_b_proj", "linear_q_up_proj"),
            ("kv_a_proj_with_mqa", "linear_kv_down_proj"),
            ("kv_b_proj", "linear_kv_up_proj"),
        ):
            state[f"{sa}{mc_name}.weight"] = shard(read(f"{attn}{hf_name}.weight"), 0, tp, tp_rank)
        state[sa + "q_layernorm.weight"] = read(attn + "q_a_layernorm.weight")
        state[sa + "kv_layernorm.weight"] = read(attn + "kv_a_layernorm.weight")
        state[sa + "linear_proj.weight"] = shard(read(attn + "o_proj.weight"), 1, tp, tp_rank)
        mlp = hf + "mlp."
        if not is_moe:
            state[mc + "mlp.linear_fc1.weight"] = fc1_shard(
                read(mlp + "gate_proj.weight"), read(mlp + "up_proj.weight"), tp, tp_rank
            )
            state[mc + "mlp.linear_fc2.weight"] = shard(read(mlp + "down_proj.weight"), 1, tp, tp_rank)
            continue
        state[mc + "mlp.router.weight"] = read(mlp + "gate.weight")
        state[mc + "mlp.router.expert_bias"] = read(mlp + "gate.e_score_correction_bias")
        for j, expert in enumerate(experts):
            gate, up, down = qwen3_moe.read_expert(read, i, expert)
            local = f"{mc}mlp.experts.local_experts.{j}."
            state[local + "linear_fc1.weight"] = fc1_shard(gate, up, layout.etp, layout.etp_rank)
            state[local + "linear_fc2.weight"] = shard(down, 1, layout.etp, layout.etp_rank)
        if args.num_shared_experts:
            shared = mlp + "shared_experts."
            state[mc + "mlp.shared_experts.linear_fc1.weight"] = fc1_shard(
                read(shared + "gate_proj.weight"), read(shared + "up_proj.weight"), tp, tp_rank
            )
            state[mc + "mlp.shared_experts.linear_fc2.weight"] = shard(
                read(shared + "down_proj.weight"), 1, tp, tp_rank
            )
    return state


LORA_NAMES = LoraNames(
    modules={
        "linear_q_down_proj": ("q_a_proj",),
        "linear_q_up_proj": ("q_b_proj",),
        "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
        **{target: hf for target, hf in llama.LORA_NAMES.modules.items() if target != "linear_qkv"},
    },
    parents={
        "linear_q_down_proj": "self_attn",
        "linear_q_up_proj": "self_attn",
        "linear_kv_down_proj": "self_attn",
        **{target: parent for target, parent in llama.LORA_NAMES.parents.items() if target != "linear_qkv"},
    },
    expert_targets=("linear_fc1", "linear_fc2"),
    shared_expert="shared_experts",
    fused_experts="mlp.experts",
    mlp_parameters=("mlp", "mlp.shared_experts"),
)
"""Megatron's MLA and MLP linears <-> DeepSeek-V3's HF modules (module docstring); all of them
are the default LoRA, as ART 0.5.23's on its MLA models. No q_proj / k_proj / v_proj: MLA has
none, so naming them is refused at register (`LoraNames.normalise`), not trained as nothing.
PEFT's form (`LoraNames.for_peft`): the routed experts packed on `mlp.experts`, the dense and
shared MLPs' modules as 2-D `target_parameters` (module docstring)."""

SPEC: FamilySpec[DeepseekV3Args] = FamilySpec(
    name="deepseek_v3",
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
    lora=LORA_NAMES,
    finish_model=finish_model,
)
"""The DeepSeek-V3 family."""
