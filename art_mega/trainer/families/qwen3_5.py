"""Qwen3.5 / Qwen3.6 dense decoders (HF model_type "qwen3_5", text "qwen3_5_text"): config mapping,
Megatron hybrid layer spec, weights and LoRA names (`SPEC`).

A Qwen3.5 decoder (transformers 5.19 `models/qwen3_5/modeling_qwen3_5.py`) interleaves two token
mixers (`layer_types`; by default three "linear_attention" layers then one "full_attention"):

- full attention (`Qwen3_5Attention`): GQA with QK RMSNorm over head_dim, RoPE on the first
  `partial_rotary_factor` of each head (rotate-half within that part), and an output gate:
  q_proj is twice as wide, per head [query; gate], and the attention output is multiplied by
  sigmoid(gate) before o_proj. Megatron-core's `attention_output_gate` computes exactly this; its
  fused linear_qkv holds per query group [queries; gates; key; value] (`layout.fuse_qkv_gate`).
- gated delta-net linear attention (`Qwen3_5GatedDeltaNet`): in_proj_qkv / in_proj_z /
  in_proj_b / in_proj_a, a causal depthwise conv1d (SiLU) over [q; k; v], the gated delta rule
  (`delta_rule.chunk_gated_delta_rule`, a chunked torch implementation), a gated RMSNorm
  (weight * rms_norm(o) * silu(z)) and out_proj. megatron-core 0.16 has a `GatedDeltaNet`
  (`ssm/gated_delta_net.py`) but it needs the CUDA-only `fla` kernels and fuses the four input
  projections; `GatedDeltaNetMixer` here keeps HF's four projections (so LoRA names match PEFT's)
  and runs on any device, and its `delta_rule` attribute is where a GPU kernel replaces the torch
  one.

Every norm but the gated one is zero-centred, x / rms(x) * (1 + w) (`Qwen3_5RMSNorm`): the
Megatron RMSNorm weight is loaded as 1 + w (exact in fp32; in bf16 1 + w is rounded to bf16, where
HF adds 1 in fp32). RoPE is Qwen's multimodal "mrope"; on text every token's three position ids
are equal, so it is plain RoPE on the rotary part whatever `mrope_section` / `mrope_interleaved`
say.

The published checkpoints are `Qwen3_5ForConditionalGeneration` (config.json with a
`text_config`, weights under `model.language_model.`, plus `model.visual.` and `mtp.` that the
trainer does not read); a text-only `Qwen3_5ForCausalLM` save has the text config at the top and
weights under `model.`. Both are read (`_reader`). The LoRA adapter is exported (and imported)
under the class's PEFT names: `base_model.model.model.language_model.layers.` for the wrapper
(`WRAPPER_LORA_NAMES`; PEFT on Qwen3_5ForConditionalGeneration, vLLM 0.32's class of that name),
`base_model.model.model.layers.` for a text-only model (`lora_for`). The MoE variant ("qwen3_5_moe") is
`families/qwen3_5_moe.py`, which reuses this file's mixer, layer spec and weights. Refused (one
sentence each): attention biases, attention without the output gate, another activation, RoPE types other than default,
layer types other than linear_attention / full_attention, and linear-attention value heads that
are not a multiple of its key heads. Context parallelism is refused: the delta rule's state runs
across the whole sequence.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer.families import llama
from art_mega.trainer.families.layout import fc1_shard, fuse_qkv_gate, pad_rows, shard
from art_mega.trainer.families.spec import FamilySpec, LoraNames, ParallelLayout

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
"""HF `model_type` values this family reads: the published multimodal wrapper (its text decoder)
and transformers' text-only config."""

WRAPPER = "qwen3_5"
"""The multimodal wrapper's model_type (`Qwen3_5ForConditionalGeneration`, the Hub checkpoints)."""

WRAPPER_LAYER_PREFIX = "base_model.model.model.language_model.layers"
"""PEFT's key prefix of the wrapper's decoder layers (PeftModel -> LoraModel ->
Qwen3_5ForConditionalGeneration.model (Qwen3_5Model).language_model.layers), which vLLM 0.32's
Qwen3_5ForConditionalGeneration maps to its own (`hf_to_vllm_mapper`: model.language_model. ->
language_model.model.), and ART 0.5.23 publishes (`model.language_model.layers`,
`art/megatron/model_support/handlers/qwen3_5.py` _VLLM_LAYER_PREFIX)."""

_LAYER_TYPES = {"linear_attention": True, "full_attention": False}
"""HF `layer_types` entries: is the layer a gated delta-net (linear attention) layer?"""

_LANGUAGE_PREFIX = "model.language_model."
"""Where `Qwen3_5ForConditionalGeneration` checkpoints keep the text decoder (HF's text names
start with "model.")."""


@dataclass(frozen=True)
class Qwen35Args(llama.DenseArgs):
    """A Qwen3.5 dense checkpoint's architecture: `llama.DenseArgs` for the full-attention layers
    and the MLP (`qk_norm` True, no biases, no window) plus, per layer, whether it is a gated
    delta-net layer (`linear_layers`), the delta-net sizes (key heads and value heads with their
    head widths, conv kernel width in tokens) and the fraction of each attention head RoPE rotates.
    """

    linear_layers: tuple[bool, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config of an HF config dict: its `text_config` where it has one (the
    multimodal wrapper; `tie_word_embeddings` falls back to the wrapper's), else itself."""
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        return config
    return {"tie_word_embeddings": config.get("tie_word_embeddings", False), **inner}


def _rope(text: dict[str, Any]) -> tuple[float, float]:
    """(base, partial rotary factor) from `rope_parameters` or the older top-level fields.

    Raises:
        UserError: a rope_type other than "default" (plain RoPE / text mrope).
    """
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise UserError(
            f"rope_type={rope_type!r} is not supported for Qwen3.5; use the model's own config.json."
        )
    theta = float(params.get("rope_theta", text.get("rope_theta", 10_000.0)))
    factor = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    return theta, factor


def model_args(config: dict[str, Any]) -> Qwen35Args:
    """Parse an HF qwen3_5 / qwen3_5_text config dict (transformers 5.19's Qwen3_5TextConfig
    defaults for absent fields: head_dim 256, partial_rotary_factor 0.25, full_attention_interval
    4, delta-net 16 key / 32 value heads of width 128, conv kernel 4).

    Raises:
        UserError: one sentence naming the field, its value and the fix (module docstring).
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a Qwen3.5 model ({', '.join(MODEL_TYPES)}).")
    text = text_config(config)
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"hidden_act={act!r} is not supported; Qwen3.5 uses 'silu'.")
    if text.get("attn_output_gate") is False:
        raise UserError(
            "attn_output_gate=false is not supported; Qwen3.5's full-attention layers have the output gate."
        )
    if text.get("attention_bias"):
        raise UserError("attention_bias=true is not supported by the Megatron Qwen3.5 model.")
    num_layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        linear = tuple(bool((i + 1) % interval) for i in range(num_layers))
    else:
        if len(types) != num_layers or any(kind not in _LAYER_TYPES for kind in types):
            raise UserError(
                f"layer_types={types!r} must name {num_layers} layers, each one of "
                f"{', '.join(_LAYER_TYPES)}; use the model's own config.json."
            )
        linear = tuple(_LAYER_TYPES[kind] for kind in types)
    key_heads = int(text.get("linear_num_key_heads", 16))
    value_heads = int(text.get("linear_num_value_heads", 32))
    if value_heads % key_heads:
        raise UserError(
            f"linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads={key_heads}; "
            "use the model's own config.json."
        )
    theta, partial = _rope(text)
    num_heads = int(text["num_attention_heads"])
    return Qwen35Args(
        model_type=str(model_type),
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        ffn_hidden_size=int(text["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_query_groups=int(text.get("num_key_value_heads") or num_heads),
        head_dim=int(text.get("head_dim") or 256),
        norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling_factor=None,
        max_position_embeddings=int(text.get("max_position_embeddings") or 32768),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=True,
        linear_layers=linear,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        partial_rotary_factor=partial,
    )


def _tp_fits(args: Qwen35Args, tp: int) -> bool:
    delta_fits = args.linear_num_key_heads % tp == 0 and args.linear_num_value_heads % tp == 0
    return llama._tp_fits(args, tp) and (delta_fits or not any(args.linear_layers))


def valid_tp_sizes(args: Qwen35Args) -> list[int]:
    """TP sizes that split the attention (`llama.valid_tp_sizes`) and the delta-net key and value
    heads (each rank holds whole delta-net heads), ascending."""
    return [tp for tp in range(1, args.num_heads + 1) if _tp_fits(args, tp)]


def check_parallel(args: Qwen35Args, layout: ParallelLayout) -> None:
    """Raise `UserError` (one sentence naming the valid sizes) when `layout.tp` cannot split `args`,
    or when context parallelism is on (the delta rule's recurrent state spans the sequence)."""
    if llama._context_parallel_size() > 1:
        raise UserError(
            "context parallelism is not implemented for Qwen3.5's gated delta-net layers; use cp=1."
        )
    if not _tp_fits(args, layout.tp):
        valid = ", ".join(str(size) for size in valid_tp_sizes(args))
        raise UserError(
            f"tp={layout.tp} cannot split this {args.model_type} model ({args.num_heads} attention heads, "
            f"{args.num_query_groups} KV heads, {args.linear_num_key_heads} / {args.linear_num_value_heads} "
            f"delta-net key / value heads, FFN size {args.ffn_hidden_size}); use tp in {{{valid}}}."
        )


def transformer_config(
    args: Qwen35Args, layout: ParallelLayout, *, dtype: str = "float32", device: str = "cpu"
):
    """The Llama family's `TransformerConfig` (RMSNorm, QK norm, SwiGLU, no biases) with the
    attention output gate and the delta-net sizes (`linear_*` fields, read by `GatedDeltaNetMixer`)."""
    config = llama.transformer_config(args, layout, dtype=dtype, device=device)
    return dataclasses.replace(
        config,
        attention_output_gate=True,
        linear_conv_kernel_dim=args.linear_conv_kernel_dim,
        linear_key_head_dim=args.linear_key_head_dim,
        linear_value_head_dim=args.linear_value_head_dim,
        linear_num_key_heads=args.linear_num_key_heads,
        linear_num_value_heads=args.linear_num_value_heads,
    )


@functools.cache
def _mixer_class() -> type:
    """`GatedDeltaNetMixer`, built on first use (it subclasses megatron-core's MegatronModule)."""
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    from art_mega.trainer.rank.delta_rule import chunk_gated_delta_rule

    class GatedDeltaNetMixer(MegatronModule):
        """A gated delta-net token mixer in a Megatron TransformerLayer's self-attention slot.

        forward(hidden_states [s, b, h], attention_mask None (one sequence per row) or bool
        [b, 1, s, s] (True = masked; packed rows: a token that cannot see the token before it
        starts a new document, whose conv window and recurrent state start from zero)) ->
        (output [s, b, h], None), in the parameter dtype. Parameters of a TP rank (t = TP size;
        qk = key heads * key width, vd = value heads * value width): in_proj_qkv [(2 qk + vd)/t, h]
        (column-parallel, rows [q; k; v] of its heads), in_proj_z [vd/t, h], in_proj_b and
        in_proj_a [value heads/t, h], conv1d_weight [(2 qk + vd)/t, 1, kernel], dt_bias and A_log
        [value heads/t], norm_weight [value width], out_proj [h, vd/t] (row-parallel).

        Maths (HF `Qwen3_5GatedDeltaNet.forward`): [q; k; v] = silu(causal depthwise conv of
        in_proj_qkv(x)); beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) +
        dt_bias) (fp32); o = delta_rule(q, k, v, g, beta) with each key head shared by
        value heads / key heads value heads; y = norm_weight * rms_norm(o) * silu(in_proj_z(x))
        per value head; out_proj(y).
        """

        delta_rule: Callable[..., Any] = staticmethod(chunk_gated_delta_rule)
        """(q, k, v [b, s, heads, d], g, beta [b, s, heads]) -> o [b, s, heads, d_v]; the torch
        implementation, which a GPU kernel (fla's `chunk_gated_delta_rule`) can replace."""

        def __init__(self, config: Any, submodules: Any = None, layer_number: int = 1, **kwargs: Any):
            super().__init__(config)
            tp_group = kwargs["pg_collection"].tp if kwargs.get("pg_collection") is not None else None
            tp = tp_group.size() if tp_group is not None else 1
            self.layer_number = layer_number
            self.key_dim = config.linear_key_head_dim
            self.value_dim = config.linear_value_head_dim
            self.key_heads = config.linear_num_key_heads // tp
            self.value_heads = config.linear_num_value_heads // tp
            self.kernel = config.linear_conv_kernel_dim
            self.norm_eps = config.layernorm_epsilon
            _add_mixer_parameters(self, config, tp_group, tp)

        def _conv(self, qkv: Tensor) -> Tensor:
            """silu(causal depthwise conv1d) of qkv [n, s, c] -> [n, s, c] (HF `causal_conv1d_fn`)."""
            length = qkv.shape[1]
            out = F.conv1d(
                qkv.transpose(1, 2), self.conv1d_weight, padding=self.kernel - 1, groups=qkv.shape[-1]
            )[..., :length]
            return F.silu(out).transpose(1, 2)

        def _mix(self, qkv: Tensor, g: Tensor, beta: Tensor) -> Tensor:
            """The delta rule over whole sequences: qkv [n, s, c], g / beta [n, s, value heads]
            -> o [n, s, value heads, value width]."""
            n, length, _ = qkv.shape
            qk = self.key_heads * self.key_dim
            q, k, v = self._conv(qkv).split([qk, qk, self.value_heads * self.value_dim], dim=-1)
            q = q.reshape(n, length, self.key_heads, self.key_dim)
            k = k.reshape(n, length, self.key_heads, self.key_dim)
            v = v.reshape(n, length, self.value_heads, self.value_dim)
            share = self.value_heads // self.key_heads
            if share > 1:
                q, k = q.repeat_interleave(share, dim=2), k.repeat_interleave(share, dim=2)
            return self.delta_rule(q, k, v, g, beta)

        def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any):
            # [s, b, h] (under sequence parallelism [s/t, b, h]: the projections all-gather the
            # sequence, out_proj reduce-scatters it back); the mixing runs on [b, s, ...]
            def project(layer: Any) -> Tensor:
                return layer(hidden_states)[0].transpose(0, 1)

            qkv = project(self.in_proj_qkv)
            z = project(self.in_proj_z)
            beta = project(self.in_proj_b).sigmoid()
            g = -self.A_log.float().exp() * F.softplus(project(self.in_proj_a).float() + self.dt_bias)
            batch, length, _ = qkv.shape
            if attention_mask is None:
                o = self._mix(qkv, g, beta)
            else:
                o = qkv.new_empty(batch, length, self.value_heads, self.value_dim)
                for row, (start, end) in _documents(attention_mask):
                    o[row, start:end] = self._mix(
                        qkv[row : row + 1, start:end],
                        g[row : row + 1, start:end],
                        beta[row : row + 1, start:end],
                    )[0]
            y = _gated_norm(
                o, z.reshape(batch, length, self.value_heads, self.value_dim), self.norm_weight, self.norm_eps
            )
            out, _ = self.out_proj(y.reshape(batch, length, -1).transpose(0, 1).contiguous())
            return out, None

    return GatedDeltaNetMixer


def _add_mixer_parameters(mixer: Any, config: Any, tp_group: Any, tp: int) -> None:
    """Give `GatedDeltaNetMixer` `mixer` (its `key_heads`, `value_heads` (this TP rank's), `key_dim`,
    `value_dim` and `kernel` set) its linears and parameters on this TP rank of `tp`, in
    `config.params_dtype`: the shapes of the class docstring, TP-split as HF's heads are."""
    import torch
    from megatron.core import tensor_parallel

    qk, vd = mixer.key_heads * mixer.key_dim, mixer.value_heads * mixer.value_dim
    hidden = config.hidden_size
    common = dict(
        config=config,
        init_method=config.init_method,
        bias=False,
        gather_output=False,
        skip_bias_add=True,
        is_expert=False,
        tp_group=tp_group,
    )
    mixer.in_proj_qkv = tensor_parallel.ColumnParallelLinear(hidden, (2 * qk + vd) * tp, **common)
    # TP splits q, k and v one by one: rank r holds [q_r; k_r; v_r] (LoRA export reads this)
    mixer.in_proj_qkv.tp_parts = (qk * tp, qk * tp, vd * tp)
    mixer.in_proj_z = tensor_parallel.ColumnParallelLinear(hidden, vd * tp, **common)
    mixer.in_proj_b = tensor_parallel.ColumnParallelLinear(hidden, mixer.value_heads * tp, **common)
    mixer.in_proj_a = tensor_parallel.ColumnParallelLinear(hidden, mixer.value_heads * tp, **common)
    device = None if config.use_cpu_initialization else torch.cuda.current_device()
    dtype = config.params_dtype
    mixer.conv1d_weight = torch.nn.Parameter(
        torch.zeros(2 * qk + vd, 1, mixer.kernel, device=device, dtype=dtype)
    )
    mixer.dt_bias = torch.nn.Parameter(torch.ones(mixer.value_heads, device=device, dtype=dtype))
    mixer.A_log = torch.nn.Parameter(torch.zeros(mixer.value_heads, device=device, dtype=dtype))
    mixer.norm_weight = torch.nn.Parameter(torch.ones(mixer.value_dim, device=device, dtype=dtype))
    for param in (mixer.conv1d_weight, mixer.dt_bias, mixer.A_log):
        param.tensor_model_parallel = True
    mixer.out_proj = tensor_parallel.RowParallelLinear(
        vd * tp,
        hidden,
        config=config,
        init_method=config.output_layer_init_method,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=True,
        is_expert=False,
        tp_group=tp_group,
    )


def _gated_norm(o: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * rms_norm(o) * silu(z) over each value head: o, z [b, s, value heads, value width],
    weight [value width] (HF `Qwen3_5RMSNormGated`: the norm in fp32, cast back to o's dtype
    before the weight, the gate in fp32); returns o's shape and dtype."""
    import torch
    import torch.nn.functional as F

    dtype = o.dtype
    normed = o.float() * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + eps)
    y = weight * normed.to(dtype)
    return (y * F.silu(z.float())).to(dtype)


def _documents(attention_mask: Tensor) -> list[tuple[int, tuple[int, int]]]:
    """(row, (start, end)) of each document of packed rows, from a bool [b, 1, s, s] mask (True =
    masked): token t > 0 starts a document when it cannot see token t - 1 (padding, its own
    segment seen by no real token, becomes documents of its own)."""
    import torch

    length = attention_mask.shape[-1]
    cut = torch.diagonal(attention_mask[:, 0], offset=-1, dim1=-2, dim2=-1)  # [b, s-1]: t sees t-1?
    out = []
    for row in range(attention_mask.shape[0]):
        starts = [0, *(torch.nonzero(cut[row]).flatten() + 1).tolist(), length]
        out.extend((row, (a, b)) for a, b in zip(starts, starts[1:]) if b > a)
    return out


def layer_spec(args: Qwen35Args, *, use_te: bool):
    """The decoder block's spec, one layer spec per layer: full-attention layers are the Llama
    family's local layer (QK norm, SDPA core attention; the output gate comes from the config),
    gated delta-net layers the same layer with `GatedDeltaNetMixer` in the self-attention slot;
    the local spec also when `use_te` (TE's fused-norm linears would take the shifted norm)."""
    return hybrid_layer_spec(args, llama.layer_spec(args, use_te=False))


def hybrid_layer_spec(args: Qwen35Args, full: Any):
    """The decoder block's spec from the full-attention layer's spec `full` (a local-spec
    TransformerLayer): per layer, `full` itself or, on delta-net layers, `full` with
    `GatedDeltaNetMixer` in its self-attention slot (the MLP, dense or MoE, is `full`'s)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.spec_utils import ModuleSpec

    linear = dataclasses.replace(
        full,
        submodules=dataclasses.replace(full.submodules, self_attention=ModuleSpec(module=_mixer_class())),
    )
    return transformer_block.TransformerBlockSubmodules(
        layer_specs=[linear if is_linear else full for is_linear in args.linear_layers],
        layer_norm=transformer_block.LayerNormImpl,
    )


def gpt_model_kwargs(args: Qwen35Args, *, tp: int) -> dict[str, Any]:
    """The Llama family's GPTModel arguments with RoPE on the first `partial_rotary_factor` of
    each head (megatron-core's `rotary_percent`)."""
    return {**llama.gpt_model_kwargs(args, tp=tp), "rotary_percent": args.partial_rotary_factor}


def _shifted(weight: Tensor) -> Tensor:
    """Megatron's RMSNorm weight (x / rms(x) * weight) of HF's zero-centred one (* (1 + weight)), fp32."""
    return weight.float() + 1.0


def _reader(read: Callable[[str], Tensor]) -> Callable[[str], Tensor]:
    """`read` by HF's text names ("model.layers.0...", "lm_head.weight"), falling back to the
    multimodal checkpoint's "model.language_model." names (`KeyError` when neither exists)."""

    def get(name: str) -> Tensor:
        try:
            return read(name)
        except KeyError:
            if not name.startswith("model."):
                raise
            return read(_LANGUAGE_PREFIX + name.removeprefix("model."))

    return get


def _parts_shard(tensor: Tensor, sizes: list[int], tp_size: int, tp_rank: int) -> Tensor:
    """A column-parallel shard of a tensor whose rows are consecutive parts of `sizes` rows, each
    split across TP: this rank's rows of every part, concatenated (in_proj_qkv's [q; k; v])."""
    import torch

    return torch.cat([shard(part, 0, tp_size, tp_rank) for part in tensor.split(sizes, dim=0)], dim=0)


def megatron_state_dict(
    args: Qwen35Args, read: Callable[[str], Tensor], layout: ParallelLayout
) -> dict[str, Tensor]:
    """This TP rank's Megatron tensors from the HF text decoder's (`_reader`).

    Every layer: input_layernorm -> input_layernorm, post_attention_layernorm ->
    pre_mlp_layernorm (both 1 + w), gate/up/down_proj -> mlp.linear_fc1 (`fc1_shard`) /
    linear_fc2 (column shard). Full-attention layers: q/k/v_proj -> self_attention.linear_qkv
    (`layout.fuse_qkv_gate`, row shard), q_norm / k_norm -> q_layernorm / k_layernorm (1 + w), o_proj
    -> linear_proj (column shard). Delta-net layers (`linear_attn.` -> `self_attention.`):
    in_proj_qkv (each of q, k, v row-sharded), in_proj_z / in_proj_b / in_proj_a (row shard),
    conv1d.weight -> conv1d_weight (as in_proj_qkv), dt_bias, A_log (shard), norm.weight ->
    norm_weight (plain weight, replicated), out_proj (column shard). Embedding, final norm
    (1 + w) and lm_head as the Llama family.
    """
    read = _reader(read)
    tp_size, tp_rank = layout.tp, layout.tp_rank
    vocab = llama.padded_vocab_size(args, tp_size)
    state: dict[str, Tensor] = {
        "embedding.word_embeddings.weight": shard(
            pad_rows(read("model.embed_tokens.weight"), vocab), 0, tp_size, tp_rank
        ),
        "decoder.final_layernorm.weight": _shifted(read("model.norm.weight")),
    }
    if not args.tie_word_embeddings:
        state["output_layer.weight"] = shard(pad_rows(read("lm_head.weight"), vocab), 0, tp_size, tp_rank)
    qk = args.linear_num_key_heads * args.linear_key_head_dim
    qkv_sizes = [qk, qk, args.linear_num_value_heads * args.linear_value_head_dim]
    for i, is_linear in enumerate(args.linear_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        state[mc + "input_layernorm.weight"] = _shifted(read(hf + "input_layernorm.weight"))
        state[mc + "pre_mlp_layernorm.weight"] = _shifted(read(hf + "post_attention_layernorm.weight"))
        state[mc + "mlp.linear_fc1.weight"] = fc1_shard(
            read(hf + "mlp.gate_proj.weight"), read(hf + "mlp.up_proj.weight"), tp_size, tp_rank
        )
        state[mc + "mlp.linear_fc2.weight"] = shard(read(hf + "mlp.down_proj.weight"), 1, tp_size, tp_rank)
        if is_linear:
            src, dst = hf + "linear_attn.", mc + "self_attention."
            state[dst + "in_proj_qkv.weight"] = _parts_shard(
                read(src + "in_proj_qkv.weight"), qkv_sizes, tp_size, tp_rank
            )
            state[dst + "conv1d_weight"] = _parts_shard(
                read(src + "conv1d.weight"), qkv_sizes, tp_size, tp_rank
            )
            for name in ("in_proj_z", "in_proj_b", "in_proj_a"):
                state[f"{dst}{name}.weight"] = shard(read(f"{src}{name}.weight"), 0, tp_size, tp_rank)
            for name in ("dt_bias", "A_log"):
                state[dst + name] = shard(read(src + name), 0, tp_size, tp_rank)
            state[dst + "norm_weight"] = read(src + "norm.weight")
            state[dst + "out_proj.weight"] = shard(read(src + "out_proj.weight"), 1, tp_size, tp_rank)
            continue
        attn = hf + "self_attn."
        fused = fuse_qkv_gate(
            read(attn + "q_proj.weight"),
            read(attn + "k_proj.weight"),
            read(attn + "v_proj.weight"),
            args.num_heads,
            args.num_query_groups,
        )
        state[mc + "self_attention.linear_qkv.weight"] = shard(fused, 0, tp_size, tp_rank)
        state[mc + "self_attention.q_layernorm.weight"] = _shifted(read(attn + "q_norm.weight"))
        state[mc + "self_attention.k_layernorm.weight"] = _shifted(read(attn + "k_norm.weight"))
        state[mc + "self_attention.linear_proj.weight"] = shard(
            read(attn + "o_proj.weight"), 1, tp_size, tp_rank
        )
    return state


LORA_NAMES = dataclasses.replace(
    llama.LORA_NAMES,
    modules={
        **llama.LORA_NAMES.modules,
        "in_proj_qkv": ("in_proj_qkv",),
        "in_proj_z": ("in_proj_z",),
        "out_proj": ("out_proj",),
    },
    parents={
        **llama.LORA_NAMES.parents,
        "in_proj_qkv": "linear_attn",
        "in_proj_z": "linear_attn",
        "out_proj": "linear_attn",
    },
    output_gate=True,
)
"""The Llama family's LoRA targets (q_proj's adapter also covers the output gate's rows) and the
gated delta-net's in_proj_qkv and in_proj_z (column-parallel; in_proj_qkv's TP shards hold q, k, v
parts, `tp_parts`) and out_proj (row-parallel), all of them the default: the modules ART 0.5.23
adapts for Qwen3.5 by default (`art/megatron/model_support/registry.py`
_QWEN3_5_DENSE_TARGET_MODULES; it leaves in_proj_b / in_proj_a alone, as here)."""


WRAPPER_LORA_NAMES = dataclasses.replace(LORA_NAMES, layer_prefix=WRAPPER_LAYER_PREFIX)
"""`LORA_NAMES` under the wrapper's decoder (`WRAPPER_LAYER_PREFIX`)."""


def lora_for(args: Qwen35Args) -> LoraNames:
    """The LoRA <-> PEFT names of a Qwen3.5 model: `LORA_NAMES` (PEFT on Qwen3_5ForCausalLM, vLLM's
    Qwen3_5ForCausalLM), under `WRAPPER_LAYER_PREFIX` for the wrapper (model_type "qwen3_5")."""
    return WRAPPER_LORA_NAMES if args.model_type == WRAPPER else LORA_NAMES


SPEC: FamilySpec[Qwen35Args] = FamilySpec(
    name="qwen3_5",
    model_types=MODEL_TYPES,
    model_args=model_args,
    expert_parallel=False,
    valid_tp_sizes=valid_tp_sizes,
    check_parallel=check_parallel,
    transformer_config=transformer_config,
    layer_spec=layer_spec,
    gpt_model_kwargs=gpt_model_kwargs,
    megatron_state_dict=megatron_state_dict,
    te_name_map={},
    lora=LORA_NAMES,
    lora_for=lora_for,
)
"""The Qwen3.5 / Qwen3.6 dense family."""
