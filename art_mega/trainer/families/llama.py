"""Llama-family dense decoders (Llama 2/3, Qwen2, Qwen3): HF config -> Megatron config and spec,
HF weights -> this rank's Megatron tensor-parallel shard, and the LoRA <-> PEFT names (`SPEC`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer import rope_scaling as scaled_rope
from art_mega.trainer.families.layout import fc1_shard, fuse_qkv, pad_rows, shard
from art_mega.trainer.families.spec import FamilySpec, LoraNames, ParallelLayout

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("llama", "qwen2", "qwen3")
"""HF `model_type` values this family reads."""

TE_NAME_MAP = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
"""Local-spec -> TransformerEngine-spec parameter names, where TE fuses the norm into the next
linear (the local spec's `sharded_state_dict_keys_map` in
`megatron/core/models/gpt/gpt_layer_specs.py` get_gpt_layer_local_spec)."""

_LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""The Llama 3 RoPE scaling constants megatron-core hard-codes
(`models/common/embeddings/rotary_pos_embedding.py` RotaryEmbedding._apply_scaling)."""


@dataclass(frozen=True)
class DenseArgs:
    """The architecture of a Llama-family checkpoint, read from its HF config.json.

    `num_query_groups` is HF's num_key_value_heads; `head_dim` is the per-head width (Qwen3 and
    newer Llama configs give it; otherwise hidden_size / num_heads). `rope_scaling_factor` is
    the Llama 3 factor or None; `rope_scaling` the linear or YaRN scaling or None
    (`trainer/rope_scaling.py`, installed into the built model by `model_builder`).
    `qkv_bias`: q/k/v projections have biases (Qwen2).
    `qk_norm`: RMSNorm over head_dim on queries and keys before RoPE (Qwen3).
    `sliding_window`: HF's window in tokens (a query sees itself and the sliding_window - 1
    tokens before it) on the layers whose `window_layers` entry is True (one per layer), or
    None (every layer attends to the whole causal prefix, `window_layers` empty).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] = ()
    rope_scaling: scaled_rope.RopeScaling | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DenseArgs:
        """Parse an HF config dict; raises `UserError` for a feature Megatron's dense GPT lacks.

        Refused: an activation other than SiLU, MLP biases, an output-projection bias
        (`attention_bias` on Llama/Qwen3 also biases o_proj), `use_sliding_window` on Llama
        (whose HF model has no window), and RoPE scaling other than none, linear, Llama 3's or
        YaRN (dynamic and longrope change with the sequence length).
        Qwen2/Qwen3 `use_sliding_window`: `sliding_window` on the layers `layer_types` names
        "sliding_attention", or without `layer_types` on layers i >= `max_window_layers`
        (transformers' Qwen2Config / Qwen3Config rule).
        """
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise UserError(
                f"model_type={model_type!r} is not a Llama-family model ({', '.join(MODEL_TYPES)})."
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UserError(f"hidden_act={act!r} is not supported; Llama-family models use 'silu'.")
        if config.get("mlp_bias"):
            raise UserError("mlp_bias=true is not supported by the Megatron dense model.")
        if model_type != "qwen2" and config.get("attention_bias"):
            raise UserError(f"attention_bias=true on {model_type} biases o_proj, which is not supported.")
        if model_type == "llama" and config.get("use_sliding_window"):
            raise UserError(
                "use_sliding_window=true is not a Llama setting; use the model's own config.json."
            )
        num_layers = int(config["num_hidden_layers"])
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        max_window_layers = int(config.get("max_window_layers", 28))
        layers = sliding_layers(config, window, num_layers, lambda i: i >= max_window_layers)
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim") if model_type != "qwen2" else None
        scaling = scaled_rope.read(config)
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            ffn_hidden_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_query_groups=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim or hidden // num_heads),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(config),
            rope_scaling_factor=_rope_scaling_factor(config),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if any(layers) else None,
            window_layers=layers if any(layers) else (),
            rope_scaling=scaling,
        )


_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}
"""HF `layer_types` entries: does the layer attend within the sliding window?"""


def sliding_layers(
    config: dict[str, Any], window: Any, num_layers: int, default: Callable[[int], bool]
) -> tuple[bool, ...]:
    """Per layer, whether it attends within `window` (HF `sliding_window`, tokens): all False
    when `window` is None; else the config's `layer_types`, or `default(i)` for layer i (0-based)
    where the config has none.

    Raises:
        UserError: a window below 1, or `layer_types` of the wrong length or with another entry.
    """
    if window is None:
        return (False,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UserError(
            f"sliding_window={window!r} is not a whole number of tokens >= 1; use the model's own config.json."
        )
    types = config.get("layer_types")
    if types is None:
        return tuple(bool(default(i)) for i in range(num_layers))
    if len(types) != num_layers or any(kind not in _LAYER_TYPES for kind in types):
        raise UserError(
            f"layer_types={types!r} must name {num_layers} layers, each one of {', '.join(_LAYER_TYPES)}; "
            "use the model's own config.json."
        )
    return tuple(_LAYER_TYPES[kind] for kind in types)


def window_config(args: DenseArgs) -> dict[str, Any]:
    """megatron-core `TransformerConfig` fields of `args`' sliding window: `window_size` (left, 0)
    with left = sliding_window - 1 (HF's window counts the query itself) and
    `window_attn_skip_freq` one entry per layer (1 = windowed, `transformer/utils.py`
    is_layer_window_attention); empty without a window.

    Raises:
        UserError: a window under context parallelism (`cp_attention` has no window).
    """
    if args.sliding_window is None:
        return {}
    if _context_parallel_size() > 1:
        raise UserError(
            f"sliding_window={args.sliding_window} is not implemented under context parallelism; use cp=1."
        )
    return {
        "window_size": (args.sliding_window - 1, 0),
        "window_attn_skip_freq": [int(layer) for layer in args.window_layers],
    }


def model_args(config: dict[str, Any]) -> DenseArgs:
    """The family's architecture arguments from an HF config dict (`DenseArgs.from_hf_config`)."""
    return DenseArgs.from_hf_config(config)


def _rope_theta(config: dict[str, Any]) -> float:
    return float(scaled_rope.rope_parameters(config).get("rope_theta", config.get("rope_theta", 10000.0)))


def _rope_scaling_factor(config: dict[str, Any]) -> float | None:
    """The Llama 3 factor (megatron-core's `rope_scaling`), None for default, linear and YaRN RoPE
    (`rope_scaling.read`); `UserError` naming any other rope_type."""
    params = scaled_rope.rope_parameters(config)
    rope_type = scaled_rope.rope_type(config)
    if rope_type in ("default", *scaled_rope.SCALED_TYPES):
        return None
    if rope_type != "llama3":
        raise UserError(
            f"rope_type={rope_type!r} is not supported; use 'default', 'linear', 'llama3' or 'yarn'."
        )
    for key, expected in _LLAMA3_ROPE_FIXED.items():
        if float(params.get(key, expected)) != expected:
            raise UserError(
                f"llama3 RoPE {key}={params[key]} is not supported; megatron-core fixes it to {expected}."
            )
    return float(params["factor"])


def _tp_fits(args: DenseArgs, tp: int) -> bool:
    groups_fit = args.num_query_groups % tp == 0 or tp % args.num_query_groups == 0
    qkv_rows = (args.num_heads + 2 * args.num_query_groups) * args.head_dim
    return args.num_heads % tp == 0 and groups_fit and qkv_rows % tp == 0 and args.ffn_hidden_size % tp == 0


def valid_tp_sizes(args: DenseArgs) -> list[int]:
    """Every tensor-parallel size this architecture can be split into, ascending.

    TP must divide the attention heads and the FFN width, and either divide the KV heads
    (query groups) or be a multiple of them (Megatron then all-gathers the shared KV heads,
    `transformer/attention.py` "num_query_groups < world_size").
    """
    return [tp for tp in range(1, args.num_heads + 1) if _tp_fits(args, tp)]


def check_parallel(args: DenseArgs, tp: int) -> None:
    """Raise `UserError` (one sentence naming the valid sizes) when `tp` cannot split `args`.

    Call before allocating anything: the controller can check a topology against a model this
    way without torch.
    """
    if not _tp_fits(args, tp):
        valid = ", ".join(str(size) for size in valid_tp_sizes(args))
        raise UserError(
            f"tp={tp} cannot split this {args.model_type} model ({args.num_heads} attention heads, "
            f"{args.num_query_groups} KV heads, FFN size {args.ffn_hidden_size}); use tp in {{{valid}}}."
        )


def padded_vocab_size(args: DenseArgs, tp: int) -> int:
    """The vocabulary rounded up to a multiple of `tp` (Megatron's vocab-parallel layers need it)."""
    return math.ceil(args.vocab_size / tp) * tp


def transformer_config(
    args: DenseArgs, layout: ParallelLayout, *, dtype: str = "float32", device: str = "cpu"
):
    """The megatron-core `TransformerConfig` of `args` for tensor-parallel size `layout.tp`.

    The context-parallel size is megatron-core's (1 before `init_parallel`).
    `dtype`: "float32" or "bfloat16" (parameters and compute). On "cpu" the parameters are
    allocated on the CPU (`use_cpu_initialization`); Megatron's random init is skipped because
    the HF weights are loaded over it. Dropout is 0 (RL fine-tuning), biases only on q/k/v
    (`add_qkv_bias`, Qwen2), SwiGLU MLP (`gated_linear_unit` with SiLU), RMSNorm; a sliding
    window as `window_config` (`UserError` with context parallelism).
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    params_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return TransformerConfig(
        context_parallel_size=_context_parallel_size(),
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        params_dtype=params_dtype,
        bf16=dtype == "bfloat16",
        use_cpu_initialization=device == "cpu",
        perform_initialization=False,
        **window_config(args),
    )


def _context_parallel_size() -> int:
    """This rank's context-parallel size: megatron-core's, 1 where its parallel state is not set
    up, or not even imported (register's checks, which import no torch: `check_model_fits`)."""
    mpu = sys.modules.get("megatron.core.parallel_state")
    return mpu.get_context_parallel_world_size() if mpu and mpu.model_parallel_is_initialized() else 1


def layer_spec(args: DenseArgs, *, use_te: bool):
    """The GPT decoder layer spec: TransformerEngine modules when `use_te`, else Megatron's local ones.

    The local spec's core attention is `sdpa_attention.SdpaCoreAttention` (PyTorch's fused
    scaled_dot_product_attention instead of Megatron's materialised scores); with context
    parallelism (megatron-core's CP size > 1) it is
    `cp_attention.ContextParallelDotProductAttention` (Megatron's local `DotProductAttention`
    refuses CP, `transformer/dot_product_attention.py:57`); TE's attention does CP itself.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_norm)
    from art_mega.trainer.rank.cp_attention import with_context_parallel_attention
    from art_mega.trainer.rank.sdpa_attention import with_sdpa_attention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=args.qk_norm, normalization="RMSNorm")
    return with_context_parallel_attention(with_sdpa_attention(spec))


def gpt_model_kwargs(args: DenseArgs, *, tp: int) -> dict[str, Any]:
    """Keyword arguments of megatron-core `GPTModel` besides config and spec.

    RoPE is non-interleaved ("rotate half", as HF's Llama), applied to the whole head.
    """
    return {
        "vocab_size": padded_vocab_size(args, tp),
        "max_sequence_length": args.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        "rotary_base": args.rope_theta,
        "rope_scaling": args.rope_scaling_factor is not None,
        "rope_scaling_factor": args.rope_scaling_factor or 8.0,
        "share_embeddings_and_output_weights": args.tie_word_embeddings,
        "parallel_output": True,
    }


def megatron_state_dict(
    args: DenseArgs, read: Callable[[str], Tensor], layout: ParallelLayout
) -> dict[str, Tensor]:
    """This TP rank's Megatron parameters (local-spec names) from HF tensors read by `read(name)`.

    Mapping (HF name under `model.` -> Megatron name, layout):
    embed_tokens -> embedding.word_embeddings (vocab padded with zero rows, then sharded by
    rows); per layer i: input_layernorm -> decoder.layers.i.input_layernorm; q/k/v_proj ->
    self_attention.linear_qkv (`fuse_qkv`, then row shard), with biases likewise for Qwen2;
    q_norm/k_norm -> self_attention.q_layernorm/k_layernorm (Qwen3); o_proj ->
    self_attention.linear_proj (column shard: row-parallel); post_attention_layernorm ->
    pre_mlp_layernorm; gate_proj + up_proj -> mlp.linear_fc1 (`fc1_shard`); down_proj ->
    mlp.linear_fc2 (column shard); norm -> decoder.final_layernorm; lm_head -> output_layer
    (padded and row-sharded; absent when embeddings are tied, Megatron then reuses the
    embedding). Shapes per rank: linear_qkv [(nh + 2*ng)*d/tp, h], linear_proj [h, nh*d/tp],
    linear_fc1 [2*ffn/tp, h], linear_fc2 [h, ffn/tp], embedding [V_padded/tp, h].
    """
    tp_size, tp_rank = layout.tp, layout.tp_rank
    vocab = padded_vocab_size(args, tp_size)
    state: dict[str, Tensor] = {
        "embedding.word_embeddings.weight": shard(
            pad_rows(read("model.embed_tokens.weight"), vocab), 0, tp_size, tp_rank
        ),
        "decoder.final_layernorm.weight": read("model.norm.weight"),
    }
    if not args.tie_word_embeddings:
        state["output_layer.weight"] = shard(pad_rows(read("lm_head.weight"), vocab), 0, tp_size, tp_rank)
    for i in range(args.num_layers):
        hf = f"model.layers.{i}."
        mc = f"decoder.layers.{i}."
        attn = hf + "self_attn."
        state[mc + "input_layernorm.weight"] = read(hf + "input_layernorm.weight")
        kinds = ("weight", "bias") if args.qkv_bias else ("weight",)
        for kind in kinds:
            fused = fuse_qkv(
                read(f"{attn}q_proj.{kind}"),
                read(f"{attn}k_proj.{kind}"),
                read(f"{attn}v_proj.{kind}"),
                args.num_heads,
                args.num_query_groups,
            )
            state[f"{mc}self_attention.linear_qkv.{kind}"] = shard(fused, 0, tp_size, tp_rank)
        if args.qk_norm:
            state[mc + "self_attention.q_layernorm.weight"] = read(attn + "q_norm.weight")
            state[mc + "self_attention.k_layernorm.weight"] = read(attn + "k_norm.weight")
        state[mc + "self_attention.linear_proj.weight"] = shard(
            read(attn + "o_proj.weight"), 1, tp_size, tp_rank
        )
        state[mc + "pre_mlp_layernorm.weight"] = read(hf + "post_attention_layernorm.weight")
        mlp = hf + "mlp."
        state[mc + "mlp.linear_fc1.weight"] = fc1_shard(
            read(mlp + "gate_proj.weight"), read(mlp + "up_proj.weight"), tp_size, tp_rank
        )
        state[mc + "mlp.linear_fc2.weight"] = shard(read(mlp + "down_proj.weight"), 1, tp_size, tp_rank)
    return state


def _check_layout(args: DenseArgs, layout: ParallelLayout) -> None:
    """`check_parallel` on the layout's TP size: a dense model has no experts for EP/ETP to split
    (its EP groups, if any, hold replicas of the same dense weights)."""
    check_parallel(args, layout.tp)


LORA_NAMES = LoraNames(
    modules={
        "linear_qkv": ("q_proj", "k_proj", "v_proj"),
        "linear_proj": ("o_proj",),
        "linear_fc1": ("gate_proj", "up_proj"),
        "linear_fc2": ("down_proj",),
    },
    parents={"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"},
)
"""The Llama-style HF module names of Megatron's dense GPT layer linears (PEFT's target_modules)."""

SPEC: FamilySpec[DenseArgs] = FamilySpec(
    name="llama",
    model_types=MODEL_TYPES,
    model_args=model_args,
    expert_parallel=False,
    valid_tp_sizes=valid_tp_sizes,
    check_parallel=_check_layout,
    transformer_config=transformer_config,
    layer_spec=layer_spec,
    gpt_model_kwargs=gpt_model_kwargs,
    megatron_state_dict=megatron_state_dict,
    te_name_map=TE_NAME_MAP,
    lora=LORA_NAMES,
    pipeline_parallel=True,
)
"""The Llama family (llama, qwen2, qwen3)."""
