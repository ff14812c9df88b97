"""Gemma 4 text decoders (HF `Gemma4ForCausalLM`, model_type "gemma4_text"): config mapping,
Megatron layer spec, weights and LoRA names (`SPEC`).

A Gemma 4 decoder (transformers `models/gemma4/modeling_gemma4.py`) keeps Gemma 3's shape
(`gemma3.py`: local / global layers through the trainer's general sliding window, norms around
both sublayers placed by `gemma3._post_norm_modules`, GeGLU, QK norm, sqrt(hidden)-scaled tied
embeddings) and differs in:

- plain RMSNorm, x / rms(x) * w (`Gemma4RMSNorm`, no 1 + w): weights load as they are;
- attention scale 1 (`Gemma4TextAttention.scaling`; the QK norms set the logits' scale);
- a value norm: v / rms(v) over each head, without weight (`v_norm`), on every layer;
- global layers with their own head width and KV heads (config `global_head_dim` /
  `num_global_key_value_heads`, serialised by transformers as `per_layer_config`): each global
  layer's attention is built from a copy of the TransformerConfig with those `kv_channels` /
  `num_query_groups` (`_attention_class`);
- `attention_k_eq_v`: global layers have no v_proj; the values are the raw key projection
  (before k_norm and RoPE) through `v_norm`. Megatron's linear_qkv of such a layer holds
  [q heads of the group; k] per query group (no v rows);
- RoPE per layer type: local layers the default RoPE over the local head (GPTModel's own, base
  `rope_parameters["sliding_attention"]`), global layers "proportional" RoPE over the global
  head (transformers `_compute_proportional_rope_parameters`: the first
  partial_rotary_factor * d / 2 frequencies 1 / base^(2i/d), the rest 0 = no rotation, all
  divided by `factor`) through `gemma3.LayerRope`;
- a learned scalar per layer multiplying the layer's output (`layer_scalar`, a buffer in HF's
  checkpoint, a buffer of `_Gemma4Layer` here);
- final logit soft-capping: logits = cap * tanh(logits / cap) (`final_logit_softcapping`, 30 on
  the published models), a forward hook on the output layer (elementwise, so TP's vocabulary
  shards cap independently).

Every published google/gemma-4-* config.json is the multimodal wrapper (`WRAPPER`, model_type
"gemma4", `Gemma4ForConditionalGeneration`): its decoder's config is `text_config`, its weights the
decoder's under `model.language_model.`; the trainer reads and trains that decoder only, exactly
as a gemma4_text model, and writes the adapter under the wrapper's PEFT names
(`WRAPPER_LAYER_PREFIX`), as Gemma 3's wrapper (`gemma3.py`).

The MoE block (`enable_moe_block`, gemma-4-26B-A4B: a dense MLP and routed experts side by side
with three more norms and a scaled router) is `gemma4_moe.py`'s; its experts split over EP / ETP.

Refused (one sentence each): per-layer input embeddings (`hidden_size_per_layer_input` > 0, the
E2B/E4B models), KV sharing across layers (`num_kv_shared_layers` > 0), bidirectional attention ("all"), attention biases,
another activation, RoPE types other than default / proportional, context parallelism (the
sliding window has no CP path). The layer spec is megatron-core's local one on every device, as
Gemma 3's.

LoRA: ART 0.5.23 adapts q/k/v/o and gate/up/down on Gemma 4 dense, and the experts too on the
MoE model (`art/megatron/model_support/registry.py` GEMMA4_DENSE_SPEC, GEMMA4_MOE_SPEC); an MoE
layer's dense MLP keeps HF's `mlp.gate_proj` names and each expert's adapter is written per
expert under the decoder layer (`layers.{i}.experts.{e}.gate_proj`, `gemma4_moe.parse_lora`),
the names vLLM 0.32's Gemma 4 reads (a 2-D MoE LoRA model; `fused_experts`' module docstring);
PEFT 0.21 loads the experts onto transformers' fused `experts.gate_up_proj` / `down_proj` only as
`target_parameters` tensors, which `LoraNames.for_peft` (`fused_experts` = "experts") makes;
a global layer's linear_qkv
exports to q_proj, k_proj and v_proj with the global head width and KV heads; with
`attention_k_eq_v` its v_proj adapter is a copy of k_proj's, which PEFT does not use (HF has no
v_proj there) and vLLM needs (`Gemma4LoraNames.to_peft`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer.families import gemma3, gemma4_moe, llama
from art_mega.trainer.families.layout import fc1_shard, fuse_qkv, pad_rows, shard, split_qkv
from art_mega.trainer.families.spec import FamilySpec, LoraNames, ParallelLayout

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("gemma4_text", "gemma4")
"""HF `model_type` values this family reads: the text decoder (`Gemma4ForCausalLM`) and the
multimodal wrapper (`Gemma4ForConditionalGeneration`, every published google/gemma-4-* config.json),
whose text decoder only is trained (`text_config`, `_reader`)."""

WRAPPER = "gemma4"
"""The multimodal wrapper's model_type: its config.json holds the decoder's in `text_config`, its
weights the decoder under `model.language_model.` beside `model.vision_tower.` /
`model.embed_vision.` (and the E2B/E4B audio tower), which the trainer neither reads nor trains
(transformers `Gemma4ForConditionalGeneration`, `_tied_weights_keys`)."""

WRAPPER_LAYER_PREFIX = "base_model.model.model.language_model.layers"
"""PEFT's key prefix of the decoder layers on `Gemma4ForConditionalGeneration`; vLLM's gemma4_mm maps
"model.language_model." to its "language_model.model." (`hf_to_vllm_mapper`), as Gemma 3's."""

WRAPPER_NOT_ADAPTED = r".*\.(vision_tower|embed_vision|audio_tower|embed_audio)\..*"
"""PEFT's `exclude_modules` of a wrapper's adapter (`Gemma4LoraNames.for_peft`): the towers' own
q/k/v/o_proj and MLP linears share the decoder's module names, and PEFT 0.21 cannot wrap their
`Gemma4ClippableLinear` (a Linear inside a module), so it refuses the whole adapter without this."""

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
"""transformers' Gemma4TextConfig default rope_parameters."""


@dataclass(frozen=True)
class Gemma4Args(llama.DenseArgs):
    """A Gemma 4 text checkpoint's architecture: `llama.DenseArgs` for the local layers (head
    width `head_dim`, KV heads `num_query_groups`, RoPE base `rope_theta`, the local layers in
    `window_layers`, `qk_norm` True) plus the global layers' head width, KV heads, whether their
    values are their keys, their proportional RoPE (base, rotated fraction, factor) and the final
    logit cap (None: none); with the MoE block (`gemma4_moe`) `num_experts` routed experts of
    width `expert_ffn_hidden_size`, `top_k` per token, beside the dense MLP of `ffn_hidden_size`
    (0 experts: dense)."""

    global_head_dim: int = 512
    global_query_groups: int = 1
    k_eq_v: bool = False
    global_rope_theta: float = 1_000_000.0
    global_rope_partial: float = 0.25
    global_rope_factor: float = 1.0
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    top_k: int = 0
    expert_ffn_hidden_size: int = 0

    def attention(self, layer: int) -> tuple[int, int, bool]:
        """(head width, KV heads, values are keys) of decoder layer `layer` (0-based)."""
        if self.window_layers[layer]:
            return self.head_dim, self.num_query_groups, False
        return self.global_head_dim, self.global_query_groups, self.k_eq_v


def _rope(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The RoPE parameters of a layer type (`rope_parameters[layer_type]`, transformers' defaults
    where absent).

    Raises:
        UserError: a type other than default (local) or default / proportional (global).
    """
    params = config.get("rope_parameters") or {}
    chosen = dict(params.get(layer_type) or _DEFAULT_ROPE[layer_type])
    rope_type = chosen.get("rope_type", "default")
    allowed = ("default",) if layer_type == "sliding_attention" else ("default", "proportional")
    if rope_type not in allowed:
        raise UserError(
            f"rope_parameters.{layer_type}.rope_type={rope_type!r} is not supported for Gemma 4; "
            f"use {' or '.join(repr(kind) for kind in allowed)}."
        )
    return chosen


def _global_attention(config: dict[str, Any], local: tuple[bool, ...], kv_heads: int) -> tuple[int, int]:
    """(head width, KV heads) of the global layers: `per_layer_config` (transformers' serialised
    form, layer index -> {head_dim, num_key_value_heads}) or `global_head_dim` (512) and, with
    `attention_k_eq_v`, `num_global_key_value_heads` (Gemma4TextConfig.__post_init__).

    Raises:
        UserError: per-layer values that differ between global layers or touch a local layer.
    """
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    head_dim = int(config.get("global_head_dim") or 512)
    groups = config.get("num_global_key_value_heads") if k_eq_v else None
    default = (head_dim, int(groups) if groups is not None else kv_heads)
    per_layer = config.get("per_layer_config")
    if not per_layer:
        return default
    found = set()
    for index, values in per_layer.items():
        layer = int(index)
        if layer >= len(local) or local[layer]:
            raise UserError(
                f"per_layer_config[{index}] sets a local or missing layer; only global layers may differ."
            )
        found.add((int(values.get("head_dim", head_dim)), int(values.get("num_key_value_heads", kv_heads))))
    if len(found) > 1:
        raise UserError(
            f"per_layer_config gives the global layers different shapes {sorted(found)}; use one for all."
        )
    return found.pop() if found else default


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config of an HF gemma4 / gemma4_text config dict: a wrapper's
    `text_config` (`tie_word_embeddings` falling back to the wrapper's, then True) with the
    wrapper's model_type; a gemma4_text config itself.

    Raises:
        UserError: a wrapper whose text_config is not an object.
    """
    if config.get("model_type") != WRAPPER:
        return config
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        raise UserError(
            "text_config of a gemma4 config.json must be an object; use the model's own config.json."
        )
    return {"tie_word_embeddings": config.get("tie_word_embeddings", True), **inner, "model_type": WRAPPER}


def model_args(config: dict[str, Any]) -> Gemma4Args:
    """Parse an HF gemma4_text config dict, or a gemma4 wrapper's decoder (`text_config`), with
    transformers' Gemma4TextConfig defaults for absent fields: head_dim 256, global head 512,
    window 512, every 6th and the last layer global, tied embeddings, per-layer inputs of 256,
    which this trainer refuses. A wrapper's arguments keep model_type "gemma4" (its weight and
    PEFT names differ).

    Raises:
        UserError: one sentence naming the field, its value and the fix (module docstring).
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a Gemma 4 text model ({', '.join(MODEL_TYPES)}).")
    config = text_config(config)
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UserError(f"hidden_activation={act!r} is not supported; Gemma 4 uses 'gelu_pytorch_tanh'.")
    per_layer_input = config.get("hidden_size_per_layer_input", 256)
    if per_layer_input:
        raise UserError(
            f"hidden_size_per_layer_input={per_layer_input} (per-layer input embeddings, Gemma 4 E2B/E4B) is "
            "not implemented by the Megatron trainer; use a Gemma 4 model without them (31B, 0)."
        )
    shared = config.get("num_kv_shared_layers") or 0
    if shared:
        raise UserError(
            f"num_kv_shared_layers={shared} (layers reusing earlier layers' keys and values) is not "
            "implemented by the Megatron trainer; use a Gemma 4 model without KV sharing (31B, 0)."
        )
    if config.get("use_bidirectional_attention") == "all":
        raise UserError(
            "use_bidirectional_attention='all' is not supported; the trainer's attention is causal."
        )
    if config.get("attention_bias"):
        raise UserError("attention_bias=true is not supported by the Megatron Gemma 4 model.")
    window = config.get("sliding_window", 512)
    if window is None:
        raise UserError("sliding_window=null is not supported for Gemma 4; use the model's own config.json.")
    num_layers = int(config["num_hidden_layers"])
    local = llama.sliding_layers(
        config, window, num_layers, lambda i: bool((i + 1) % 6) and i != num_layers - 1
    )
    local = (*local[:-1], False)  # transformers forces the last layer global
    num_heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or num_heads)
    global_head_dim, global_groups = _global_attention(config, local, kv_heads)
    local_rope, global_rope = _rope(config, "sliding_attention"), _rope(config, "full_attention")
    proportional = global_rope.get("rope_type", "default") == "proportional"
    cap = config.get("final_logit_softcapping")
    return Gemma4Args(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        ffn_hidden_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_query_groups=kv_heads,
        head_dim=int(config.get("head_dim") or 256),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(local_rope.get("rope_theta", 10_000.0)),
        rope_scaling_factor=None,
        max_position_embeddings=int(config.get("max_position_embeddings") or 131_072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        qkv_bias=False,
        qk_norm=True,
        sliding_window=int(window) if any(local) else None,
        window_layers=local,
        global_head_dim=global_head_dim,
        global_query_groups=global_groups,
        k_eq_v=bool(config.get("attention_k_eq_v", False)),
        global_rope_theta=float(global_rope.get("rope_theta", 1_000_000.0)),
        global_rope_partial=float(global_rope.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
        global_rope_factor=float(global_rope.get("factor", 1.0)) if proportional else 1.0,
        final_logit_softcapping=float(cap) if cap is not None else None,
        **gemma4_moe.moe_fields(config),
    )


def _global_dense(args: Gemma4Args) -> llama.DenseArgs:
    """`args` with the global layers' head width and KV heads (for the TP checks)."""
    return dataclasses.replace(args, head_dim=args.global_head_dim, num_query_groups=args.global_query_groups)


def valid_tp_sizes(args: Gemma4Args) -> list[int]:
    """TP sizes that split both the local and the global layers (`llama.valid_tp_sizes` of each)."""
    return sorted(set(llama.valid_tp_sizes(args)) & set(llama.valid_tp_sizes(_global_dense(args))))


def _check_layout(args: Gemma4Args, layout: ParallelLayout) -> None:
    """`UserError` (one sentence naming the valid sizes) when `layout.tp` cannot split `args`."""
    gemma4_moe.check_experts(args, layout.ep, layout.etp)
    if layout.tp not in valid_tp_sizes(args):
        valid = ", ".join(str(size) for size in valid_tp_sizes(args))
        raise UserError(
            f"tp={layout.tp} cannot split this gemma4_text model ({args.num_heads} attention heads, "
            f"{args.num_query_groups} local and {args.global_query_groups} global KV heads, FFN size "
            f"{args.ffn_hidden_size}); use tp in {{{valid}}}."
        )


def transformer_config(
    args: Gemma4Args, layout: ParallelLayout, *, dtype: str = "float32", device: str = "cpu"
):
    """The Llama family's `TransformerConfig` (RMSNorm, QK norm, the sliding window; `UserError`
    under CP) with GELU (tanh approximation) in the gated MLP, as Gemma 3's, and softmax scale 1;
    with experts, the MoE block's fields (`gemma4_moe.config_fields`)."""
    import torch.nn.functional as F

    config = llama.transformer_config(args, layout, dtype=dtype, device=device)
    activation = functools.partial(F.gelu, approximate="tanh")
    moe = gemma4_moe.config_fields(args, layout.ep, layout.etp, layout.tp)
    return dataclasses.replace(config, activation_func=activation, softmax_scale=1.0, **moe)


def _value_norm(value: Tensor, eps: float) -> Tensor:
    """v / sqrt(mean(v^2) + eps) over the head width, in float32, back in v's dtype (`Gemma4RMSNorm`
    with_scale=False)."""
    import torch

    x = value.float()
    return (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(value)


@functools.cache
def _attention_class() -> type:
    """Gemma 4's self-attention (built on first use): Gemma 3's post-normed attention with keyword
    parameters `head_dim` / `num_query_groups` (a global layer's; the config's copy is replaced
    before megatron-core sizes anything) and `k_eq_v`, plus the value norm.

    With `k_eq_v` the fused projection has [q; k] per query group (`_KeyValueLinear`) and
    `get_query_key_value_tensors` takes the values from the raw keys; TP over fewer KV heads
    than ranks all-gathers the projection and picks this rank's group, as megatron-core's
    SelfAttention does.
    """
    import torch
    from megatron.core.parallel_state import get_tensor_model_parallel_rank
    from megatron.core.tensor_parallel.mappings import all_gather_last_dim_from_tensor_parallel_region

    attention, _ = gemma3._post_norm_modules()

    class Gemma4SelfAttention(attention):
        def __init__(
            self,
            config: Any,
            submodules: Any,
            *args: Any,
            head_dim: int | None = None,
            num_query_groups: int | None = None,
            k_eq_v: bool = False,
            **kwargs: Any,
        ) -> None:
            if head_dim is not None:
                config = dataclasses.replace(config, kv_channels=head_dim, num_query_groups=num_query_groups)
            if k_eq_v:
                submodules = dataclasses.replace(
                    submodules, linear_qkv=_key_value_linear(submodules.linear_qkv)
                )
            super().__init__(config, submodules, *args, **kwargs)
            self.k_eq_v = k_eq_v

        def get_query_key_value_tensors(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.k_eq_v:
                query, key, value = super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
                return query, key, _value_norm(value, self.config.layernorm_epsilon)
            mixed, _ = self.linear_qkv(hidden_states)
            groups, world = self.config.num_query_groups, self.world_size
            if groups < world:
                mixed = all_gather_last_dim_from_tensor_parallel_region(mixed)
                index = get_tensor_model_parallel_rank() // (world // groups)
                size = mixed.size(-1) // groups
                mixed = mixed[:, :, index * size : (index + 1) * size]
            head = self.hidden_size_per_attention_head
            per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            mixed = mixed.view(*mixed.shape[:2], self.num_query_groups_per_partition, (per_group + 1) * head)
            query, key = torch.split(mixed, [per_group * head, head], dim=3)
            query = query.reshape(*query.shape[:2], -1, head)
            if groups < world:
                index = get_tensor_model_parallel_rank() % (world // groups)
                size = self.num_attention_heads_per_partition // (world // groups)
                query = query[:, :, index * size : (index + 1) * size, :]
            value = _value_norm(key, self.config.layernorm_epsilon)
            return self.q_layernorm(query), self.k_layernorm(key), value

    return Gemma4SelfAttention


def _key_value_linear(linear: type) -> type:
    """`linear` (a column-parallel class) built with the rows of [q; k] per group only: its output
    size minus the value rows, config.kv_channels * config.num_query_groups."""

    class KeyValueLinear(linear):
        def __init__(self, input_size: int, output_size: int, *args: Any, config: Any, **kwargs: Any) -> None:
            values = config.kv_channels * config.num_query_groups
            super().__init__(input_size, output_size - values, *args, config=config, **kwargs)

    return KeyValueLinear


@functools.cache
def _layer_class() -> type:
    """megatron-core's TransformerLayer with HF's `layer_scalar` (a buffer [1], loaded from the
    checkpoint) multiplying its output (built on first use)."""
    import torch
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class Gemma4Layer(TransformerLayer):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.register_buffer("layer_scalar", torch.ones(1, dtype=config.params_dtype))

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            output, context = super().forward(*args, **kwargs)
            return output * self.layer_scalar.to(output.dtype), context

    return Gemma4Layer


def layer_spec(args: Gemma4Args, *, use_te: bool):
    """The decoder block's spec, one layer spec per layer: Gemma 3's local layer (post-norm
    attention and MLP) as `_layer_class`, with `_attention_class` given each layer's head width,
    KV heads and `k_eq_v`, and with experts `gemma4_moe.layer_spec`'s block as its MLP; the
    local spec also when `use_te` (module docstring)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.spec_utils import ModuleSpec

    base = gemma3.layer_spec(args, use_te=False)
    specs = []
    for layer in range(args.num_layers):
        head_dim, groups, k_eq_v = args.attention(layer)
        attention = ModuleSpec(
            module=_attention_class(),
            params={**base.submodules.self_attention.params, "k_eq_v": k_eq_v}
            | ({} if args.window_layers[layer] else {"head_dim": head_dim, "num_query_groups": groups}),
            submodules=base.submodules.self_attention.submodules,
        )
        submodules = dataclasses.replace(base.submodules, self_attention=attention)
        layer_spec = dataclasses.replace(base, module=_layer_class(), submodules=submodules)
        specs.append(gemma4_moe.layer_spec(layer_spec, args) if args.num_experts else layer_spec)
    return transformer_block.TransformerBlockSubmodules(
        layer_specs=specs, layer_norm=transformer_block.LayerNormImpl
    )


def gpt_model_kwargs(args: Gemma4Args, *, tp: int) -> dict[str, Any]:
    """The Llama family's GPTModel arguments: default RoPE over the local head width with the local
    base (the global layers' angles come from `finish_model`)."""
    return {**llama.gpt_model_kwargs(args, tp=tp), "rope_scaling": False}


def megatron_state_dict(
    args: Gemma4Args, read: Callable[[str], Tensor], layout: ParallelLayout
) -> dict[str, Tensor]:
    """This TP rank's Megatron tensors (local-spec names) from HF tensors read by `read(name)`.

    embed_tokens -> embedding.word_embeddings (padded, row shard); norm -> final_layernorm; per
    layer i: input_layernorm -> input_layernorm, q/k/v_proj -> self_attention.linear_qkv
    (`fuse_qkv` with the layer's KV heads; with k_eq_v on a global layer [q; k] per group, no
    v_proj exists), q_norm / k_norm -> q_layernorm / k_layernorm, o_proj -> linear_proj (column
    shard), post_attention_layernorm -> self_attention.post_attention_layernorm,
    pre_feedforward_layernorm -> pre_mlp_layernorm, gate/up_proj -> mlp.linear_fc1
    (`fc1_shard`), down_proj -> mlp.linear_fc2 (column shard), post_feedforward_layernorm ->
    mlp.post_feedforward_layernorm, layer_scalar -> layer_scalar [1]. Norms are replicated and
    loaded as they are (x * w). lm_head only when untied. With experts every layer's MLP is the
    block of `gemma4_moe.block_state` instead.
    """
    tp, rank = layout.tp, layout.tp_rank
    vocab = llama.padded_vocab_size(args, tp)
    if args.model_type == WRAPPER:  # the decoder's "model.X" is the wrapper's "model.language_model.X"
        read = functools.partial(_wrapper_read, read)
    state: dict[str, Tensor] = {
        "embedding.word_embeddings.weight": shard(
            pad_rows(read("model.embed_tokens.weight"), vocab), 0, tp, rank
        ),
        "decoder.final_layernorm.weight": read("model.norm.weight"),
    }
    if not args.tie_word_embeddings:
        state["output_layer.weight"] = shard(pad_rows(read("lm_head.weight"), vocab), 0, tp, rank)
    for i in range(args.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        _, groups, k_eq_v = args.attention(i)
        q, k = read(attn + "q_proj.weight"), read(attn + "k_proj.weight")
        fused = (
            fuse_qk(q, k, args.num_heads, groups)
            if k_eq_v
            else fuse_qkv(q, k, read(attn + "v_proj.weight"), args.num_heads, groups)
        )
        state.update(
            {
                mc + "input_layernorm.weight": read(hf + "input_layernorm.weight"),
                mc + "self_attention.linear_qkv.weight": shard(fused, 0, tp, rank),
                mc + "self_attention.q_layernorm.weight": read(attn + "q_norm.weight"),
                mc + "self_attention.k_layernorm.weight": read(attn + "k_norm.weight"),
                mc + "self_attention.linear_proj.weight": shard(read(attn + "o_proj.weight"), 1, tp, rank),
                mc + "self_attention.post_attention_layernorm.weight": read(
                    hf + "post_attention_layernorm.weight"
                ),
                mc + "pre_mlp_layernorm.weight": read(hf + "pre_feedforward_layernorm.weight"),
                mc + "mlp.linear_fc1.weight": fc1_shard(
                    read(mlp + "gate_proj.weight"), read(mlp + "up_proj.weight"), tp, rank
                ),
                mc + "mlp.linear_fc2.weight": shard(read(mlp + "down_proj.weight"), 1, tp, rank),
                mc + "mlp.post_feedforward_layernorm.weight": read(hf + "post_feedforward_layernorm.weight"),
                mc + "layer_scalar": read(hf + "layer_scalar"),
            }
        )
        if args.num_experts:
            for key in (*gemma4_moe.DENSE_MLP_KEYS, "mlp.post_feedforward_layernorm.weight"):
                del state[mc + key]
            state.update(gemma4_moe.block_state(args, read, layout, i))
    return state


def _wrapper_read(read: Callable[[str], Tensor], name: str) -> Tensor:
    """`read` of a wrapper checkpoint by HF's text names: "model.X" as "model.language_model.X",
    "lm_head.weight" (an untied wrapper's) as it is."""
    return read(name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model."))


def fuse_qk(q: Tensor, k: Tensor, num_heads: int, num_query_groups: int) -> Tensor:
    """[q heads of group 0; k_0; q heads of group 1; k_1; ...] along dim 0 of q [nh*d, ...] and
    k [ng*d, ...] (a k_eq_v layer's fused projection; `layout.fuse_qkv` without v)."""
    import torch

    head_dim = k.shape[0] // num_query_groups
    rest = q.shape[1:]
    q = q.reshape(num_query_groups, num_heads // num_query_groups * head_dim, *rest)
    k = k.reshape(num_query_groups, head_dim, *rest)
    return torch.cat((q, k), dim=1).reshape(-1, *rest)


def split_qk(fused: Tensor, num_heads: int, num_query_groups: int) -> tuple[Tensor, Tensor]:
    """(q [nh*d, ...], k [ng*d, ...]) of `fuse_qk`'s layout."""
    head_dim = fused.shape[0] // (num_heads + num_query_groups)
    per_group = num_heads // num_query_groups
    rest = fused.shape[1:]
    grouped = fused.reshape(num_query_groups, (per_group + 1) * head_dim, *rest)
    q, k = grouped.split([per_group * head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest)


@dataclass(frozen=True)
class Gemma4LoraNames(LoraNames):
    """The Llama LoRA names with a global layer's linear_qkv split by its own KV heads, and, for
    k_eq_v, into q_proj and k_proj only. `global_layers`: the decoder layers (indices) that are
    global; `global_query_groups`; `k_eq_v`; `num_experts` (> 0: every layer has the MoE block,
    whose linear_fc1 / linear_fc2 names are `gemma4_moe.parse_lora`'s). Empty: every layer as
    Llama's."""

    global_layers: frozenset[int] = frozenset()
    global_query_groups: int = 1
    k_eq_v: bool = False
    num_experts: int = 0

    def parse(self, name: str) -> tuple[str, str]:
        """As `LoraNames.parse`; an MoE block's linears as `gemma4_moe.parse_lora`."""
        found = gemma4_moe.parse_lora(name) if self.num_experts else None
        return found if found is not None else super().parse(name)

    def hf_parents(self, layer: int, target: str, num_experts: int) -> list[tuple[str, str]]:
        """As `LoraNames.hf_parents`; an MoE layer's MLP targets as `gemma4_moe.hf_parents`."""
        if self.num_experts and target in self.expert_targets:
            return gemma4_moe.hf_parents(layer, num_experts)
        return super().hf_parents(layer, target, num_experts)

    def _global(self, name: str) -> bool:
        parent, target = self.parse(name)
        return target == "linear_qkv" and int(parent.split(".", 1)[0]) in self.global_layers

    def hf_modules(self, name: str) -> tuple[str, ...]:
        modules = super().hf_modules(name)
        return modules[:2] if self.k_eq_v and self._global(name) else modules

    def for_peft(
        self, tensors: Mapping[str, Tensor], config: Mapping[str, Any]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """As `LoraNames.for_peft`; a wrapper's adapter also excludes the vision and audio towers
        (`WRAPPER_NOT_ADAPTED`), whose module names its target_modules match too."""
        tensors, config = super().for_peft(tensors, config)
        if self.layer_prefix == WRAPPER_LAYER_PREFIX:
            config = {**config, "exclude_modules": WRAPPER_NOT_ADAPTED}
        return tensors, config

    def to_peft(
        self, name: str, a: Tensor, b_shards: list[Tensor], num_heads: int, num_query_groups: int
    ) -> dict[str, Tensor]:
        """As `LoraNames.to_peft`, a global layer's B split by its own KV heads. A k_eq_v layer's
        [q; k] B splits into q_proj and k_proj, and its k_proj adapter is written once more as
        v_proj: HF has no v_proj there (PEFT loads the adapter without using those tensors), but
        vLLM's Gemma 4 loads the keys' weights into both the K and V slots of its fused qkv_proj
        (`vllm/model_executor/models/gemma4.py` _gemma4_layer_weights_mapper) and takes the V
        slot's LoRA from v_proj, so the values get the keys' update only with it."""
        if not self._global(name):
            return super().to_peft(name, a, b_shards, num_heads, num_query_groups)
        import torch

        parent, _ = self.parse(name)
        full_b = torch.cat(b_shards, dim=0)
        if self.k_eq_v:
            q, k = split_qk(full_b, num_heads, self.global_query_groups)
            parts = {"q_proj": q, "k_proj": k, "v_proj": k}
        else:
            parts = dict(
                zip(("q_proj", "k_proj", "v_proj"), split_qkv(full_b, num_heads, self.global_query_groups))
            )
        out = {}
        for hf_module, b in parts.items():
            out[self.peft_key(parent, hf_module, "lora_A")] = a.contiguous().clone()
            out[self.peft_key(parent, hf_module, "lora_B")] = b.contiguous().clone()
        return out

    def from_peft(
        self,
        name: str,
        tensors: Mapping[str, Tensor],
        num_heads: int,
        num_query_groups: int,
        tp_size: int,
        tp_rank: int,
        column_parts: tuple[int, ...] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """As `LoraNames.from_peft` (a global layer's KV heads its own); a k_eq_v layer's B is
        fused from q_proj and k_proj, whose v_proj copy (`to_peft`) must equal k_proj's.

        Raises:
            UserError: a missing tensor, different lora_A matrices, or a v_proj adapter that is
                not the k_proj one on a k_eq_v layer (one sentence each).
        """
        if not self._global(name) or not self.k_eq_v:
            groups = self.global_query_groups if self._global(name) else num_query_groups
            return super().from_peft(
                name, tensors, num_heads, groups, tp_size, tp_rank, column_parts=column_parts
            )
        import torch

        parent, _ = self.parse(name)
        layer = parent.split(".", 1)[0]
        found = {}
        for hf_module in ("q_proj", "k_proj", "v_proj"):
            for matrix in ("lora_A", "lora_B"):
                key = self.peft_key(parent, hf_module, matrix)
                if key not in tensors:
                    raise UserError(
                        f"the adapter has no tensor {key}; it does not cover {hf_module} of layer {layer}."
                    )
                found[hf_module, matrix] = tensors[key]
        if not torch.equal(found["q_proj", "lora_A"], found["k_proj", "lora_A"]):
            raise UserError(
                f"layer {layer}'s q_proj, k_proj have different lora_A matrices; art-mega fuses them into one "
                "linear_qkv adapter and needs them equal."
            )
        for matrix in ("lora_A", "lora_B"):
            if not torch.equal(found["v_proj", matrix], found["k_proj", matrix]):
                raise UserError(
                    f"layer {layer}'s v_proj {matrix} differs from its k_proj {matrix}; its values are its keys "
                    "(attention_k_eq_v), so the two adapters must be equal."
                )
        b = fuse_qk(found["q_proj", "lora_B"], found["k_proj", "lora_B"], num_heads, self.global_query_groups)
        return found["q_proj", "lora_A"], shard(b, 0, tp_size, tp_rank)


def lora_names(args: Gemma4Args) -> Gemma4LoraNames:
    """The LoRA names of this model (`FamilySpec.lora_for`): Llama's with its global layers, under
    `WRAPPER_LAYER_PREFIX` for a wrapper (PEFT on Gemma4ForConditionalGeneration, vLLM's gemma4_mm)."""
    base = llama.LORA_NAMES
    return Gemma4LoraNames(
        modules=base.modules,
        parents=base.parents,
        global_layers=frozenset(i for i, local in enumerate(args.window_layers) if not local),
        global_query_groups=args.global_query_groups,
        k_eq_v=args.k_eq_v,
        expert_targets=("linear_fc1", "linear_fc2") if args.num_experts else (),
        num_experts=args.num_experts,
        fused_experts="experts" if args.num_experts else "",
        layer_prefix=WRAPPER_LAYER_PREFIX if args.model_type == WRAPPER else base.layer_prefix,
    )


def global_inv_freq(args: Gemma4Args) -> Tensor:
    """The global layers' proportional RoPE frequencies [global_head_dim / 2], float32 (transformers
    `_compute_proportional_rope_parameters`)."""
    import torch

    dim = args.global_head_dim
    rotated = int(args.global_rope_partial * dim // 2)
    inv_freq = 1.0 / (args.global_rope_theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float32) / dim))
    return torch.cat((inv_freq, torch.zeros(dim // 2 - rotated))) / args.global_rope_factor


def finish_model(args: Gemma4Args, module: Any) -> None:
    """Hook a built Gemma 4 GPTModel: embeddings times sqrt(hidden_size), the global layers' RoPE
    (`gemma3.LayerRope` with `global_inv_freq`) and the final logit cap on the output layer."""
    gemma3.scale_embeddings(args.hidden_size, module)
    rope = gemma3.LayerRope(global_inv_freq(args), None)
    rope.hook(module, [i for i, local in enumerate(args.window_layers) if not local])
    cap = args.final_logit_softcapping
    if cap is None:
        return
    import torch

    def capped(layer: Any, inputs: tuple, output: tuple) -> tuple:
        logits, bias = output
        return cap * torch.tanh(logits / cap), bias

    module.output_layer.register_forward_hook(capped)


SPEC: FamilySpec[Gemma4Args] = dataclasses.replace(
    llama.SPEC,
    name="gemma4",
    model_types=MODEL_TYPES,
    model_args=model_args,
    valid_tp_sizes=valid_tp_sizes,
    check_parallel=_check_layout,
    transformer_config=transformer_config,
    layer_spec=layer_spec,
    gpt_model_kwargs=gpt_model_kwargs,
    megatron_state_dict=megatron_state_dict,
    te_name_map={},
    expert_parallel=True,
    finish_model=finish_model,
    lora_for=lora_names,
    text_config=text_config,
)
"""The Gemma 4 text family: Llama's LoRA names (per model: `lora_names`), its own config, parallel
limits, layer spec, weights and hooks."""
