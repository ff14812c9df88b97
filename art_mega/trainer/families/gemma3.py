"""Gemma 3 text decoders (HF `Gemma3ForCausalLM`, model_type "gemma3_text", and the text decoder of
the multimodal `Gemma3ForConditionalGeneration`, model_type "gemma3"): config mapping, Megatron
layer spec, weights and LoRA names (`SPEC`).

The published gemma-3-4b / 12b / 27b checkpoints are the multimodal wrapper (`WRAPPER`): the
trainer reads and trains its text decoder only, exactly as a gemma3_text model (`text_config`,
`_reader`), and exports the adapter under the wrapper's PEFT names (`WRAPPER_LAYER_PREFIX`), which
PEFT loads on the wrapper and vLLM's gemma3_mm serves; vLLM loads the whole wrapper. PEFT's
`target_modules` (module names) also match the vision tower's q/k/v_proj: PEFT gives those the
untrained adapter it initialises (B = 0, no effect), vLLM none. Image inputs are not trained
(trajectories are text: image content parts are refused by `prepare.tokenize`).

A Gemma 3 decoder (transformers `models/gemma3/modeling_gemma3.py`) differs from a Llama decoder in:

- local / global layers: local layers attend within `sliding_window` tokens (`layer_types`, or
  every `sliding_window_pattern`-th layer global), through the trainer's general sliding window
  (`llama.window_config`, `sdpa_attention`);
- RoPE per layer type: global layers use `rope_parameters["full_attention"]` (base 1e6, linear
  scaling 8 on the 27B), local layers `["sliding_attention"]` (`rope_local_base_freq`, 1e4):
  GPTModel's rotary embedding gives the global angles, a pre-hook on each local layer's
  self-attention replaces them with the local ones (`LayerRope`);
- Gemma's RMSNorm, x / rms(x) * (1 + w): the Megatron norm weight is loaded as 1 + w;
- norms around both sublayers: input + post-attention norm, pre- + post-feedforward norm; the
  post norms sit inside the attention / MLP modules (`_post_norm_modules`), after linear_proj /
  linear_fc2 (and their LoRA) and before the residual add, as in HF's decoder layer;
- QK RMSNorm (Megatron's `qk_layernorm`), attention scale `query_pre_attn_scalar`^-0.5
  (`softmax_scale`), GeGLU MLP (gelu_pytorch_tanh = GELU's tanh approximation, gated);
- embeddings multiplied by sqrt(hidden_size) (in the parameter dtype, as HF's
  `Gemma3TextScaledWordEmbedding`), tied to the output layer, which uses them unscaled.

Refused (one sentence each): logit soft-capping (attention or final; the published Gemma 3
configs set neither), bidirectional attention, attention biases, another activation, RoPE types
other than default / linear, and a null `sliding_window`. The layer spec is megatron-core's local
one (torch norms, SDPA attention) on every device: TransformerEngine's fused-norm linears cannot
hold the post norms. In bf16 the shifted norm weight 1 + w is rounded to bf16, where HF adds 1 in
fp32 (a relative error up to 2^-9 of the norm's scale); fp32 is exact.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer.families import llama
from art_mega.trainer.families.spec import FamilySpec, LoraNames, ParallelLayout

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("gemma3_text", "gemma3")
"""HF `model_type` values this family reads: the text decoder (`Gemma3ForCausalLM`, gemma-3-1b /
270m) and the multimodal wrapper (`Gemma3ForConditionalGeneration`, gemma-3-4b / 12b / 27b), whose
text decoder only is trained (`text_config`, `_reader`)."""

WRAPPER = "gemma3"
"""The multimodal wrapper's model_type: its config.json holds the decoder's in `text_config` (sizes
left to Gemma3TextConfig's defaults omitted), its weights the decoder under `model.language_model.`
(transformers >= 4.52) or `language_model.model.` (older saves), beside `vision_tower.` and
`multi_modal_projector.`, which the trainer neither reads nor trains."""

TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
}
"""transformers 5.19's Gemma3TextConfig defaults for the sizes a published `text_config` may omit
(the other fields' defaults are in `model_args`); kept equal to transformers' by
tests/unit/trainer/test_gemma3_wrapper.py. Written here so that reading a config stays torch-free
(importing transformers imports torch)."""

_WRAPPER_PREFIXES = ("model.language_model.", "language_model.model.")
"""Where a wrapper checkpoint keeps HF's text names "model.X" (new, then old naming)."""

_WRAPPER_LM_HEAD = ("lm_head.weight", "language_model.lm_head.weight")
"""An untied wrapper's output layer (new, then old naming)."""

WRAPPER_LAYER_PREFIX = "base_model.model.model.language_model.layers"
"""PEFT's key prefix of the decoder layers on `Gemma3ForConditionalGeneration` (PeftModel ->
LoraModel -> the wrapper's `model.language_model.layers`); vLLM's gemma3_mm maps
"model.language_model." to its "language_model.model." (`hf_to_vllm_mapper`)."""

_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
"""transformers' Gemma3TextConfig.default_theta (global / local RoPE bases)."""

_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
"""HF's four norms of a Gemma 3 decoder layer."""


@dataclass(frozen=True)
class Gemma3Args(llama.DenseArgs):
    """A Gemma 3 text checkpoint's architecture: `llama.DenseArgs` (global RoPE in `rope_theta`,
    `rope_scaling_factor` unused (None), `qk_norm` True, local layers in `window_layers`) plus the
    attention scale's `query_pre_attn_scalar`, the global layers' linear RoPE factor (None:
    default RoPE) and the local layers' RoPE base and linear factor."""

    query_pre_attn_scalar: float = 256.0
    global_rope_factor: float | None = None
    local_rope_theta: float = 10_000.0
    local_rope_factor: float | None = None


def _rope(config: dict[str, Any], layer_type: str) -> tuple[float, float | None]:
    """(base, linear factor or None) of a layer type's RoPE, from transformers 5's per-type
    `rope_parameters` or the older `rope_theta` / `rope_scaling` (global) and
    `rope_local_base_freq` (local) fields (Gemma3TextConfig.convert_rope_params_to_dict).

    Raises:
        UserError: a RoPE type other than default or linear.
    """
    params = config.get("rope_parameters") or {}
    if layer_type in params:
        chosen = dict(params[layer_type] or {})
    elif layer_type == "full_attention":
        chosen = dict(config.get("rope_scaling") or {})
        if "rope_theta" in config:
            chosen["rope_theta"] = config["rope_theta"]
    else:
        chosen = {}
        if "rope_local_base_freq" in config:
            chosen["rope_theta"] = config["rope_local_base_freq"]
    rope_type = chosen.get("rope_type", chosen.get("type", "default"))
    theta = float(chosen.get("rope_theta", _DEFAULT_THETA[layer_type]))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, float(chosen["factor"])
    raise UserError(
        f"rope_type={rope_type!r} on Gemma 3's {layer_type} layers is not supported; use 'default' or 'linear'."
    )


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config of an HF gemma3 / gemma3_text config dict: a wrapper's
    `text_config` over `TEXT_DEFAULTS` (`tie_word_embeddings` falling back to the wrapper's, then
    True), with the wrapper's model_type; a gemma3_text config itself.

    Raises:
        UserError: a wrapper whose text_config is not an object.
    """
    if config.get("model_type") != WRAPPER:
        return config
    inner = config.get("text_config", {})
    if not isinstance(inner, dict):
        raise UserError(
            "text_config of a gemma3 config.json must be an object; use the model's own config.json."
        )
    tied = config.get("tie_word_embeddings", True)
    return {**TEXT_DEFAULTS, "tie_word_embeddings": tied, **inner, "model_type": WRAPPER}


def model_args(config: dict[str, Any]) -> Gemma3Args:
    """Parse an HF gemma3_text config dict, or a gemma3 wrapper's decoder (`text_config`), with
    transformers 5.19's Gemma3TextConfig defaults for absent fields (`TEXT_DEFAULTS`, head_dim
    256, query_pre_attn_scalar 256, sliding_window 4096, pattern 6, tied embeddings,
    max_position_embeddings 131072). A wrapper's arguments keep model_type "gemma3" (its weight
    and PEFT names differ).

    Raises:
        UserError: one sentence naming the field, its value and the fix (see the module docstring).
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a Gemma 3 text model ({', '.join(MODEL_TYPES)}).")
    config = text_config(config)
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UserError(f"hidden_activation={act!r} is not supported; Gemma 3 uses 'gelu_pytorch_tanh'.")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(name) is not None:
            raise UserError(
                f"{name}={config[name]} is not implemented by the Megatron trainer; use a Gemma 3 config with "
                f"{name} null (as the published ones)."
            )
    if config.get("use_bidirectional_attention"):
        raise UserError(
            "use_bidirectional_attention=true is not supported; the trainer's attention is causal."
        )
    if config.get("attention_bias"):
        raise UserError("attention_bias=true is not supported by the Megatron Gemma 3 model.")
    window = config.get("sliding_window", 4096)
    if window is None:
        raise UserError("sliding_window=null is not supported for Gemma 3; use the model's own config.json.")
    num_layers = int(config["num_hidden_layers"])
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    local = llama.sliding_layers(config, window, num_layers, lambda i: bool((i + 1) % pattern))
    global_theta, global_factor = _rope(config, "full_attention")
    local_theta, local_factor = _rope(config, "sliding_attention")
    num_heads = int(config["num_attention_heads"])
    return Gemma3Args(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        ffn_hidden_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_query_groups=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or 256),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=global_theta,
        rope_scaling_factor=None,
        max_position_embeddings=int(config.get("max_position_embeddings") or 131_072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        qkv_bias=False,
        qk_norm=True,
        sliding_window=int(window) if any(local) else None,
        window_layers=local if any(local) else (),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
        global_rope_factor=global_factor,
        local_rope_theta=local_theta,
        local_rope_factor=local_factor,
    )


def transformer_config(
    args: Gemma3Args, layout: ParallelLayout, *, dtype: str = "float32", device: str = "cpu"
):
    """The Llama family's `TransformerConfig` (RMSNorm, QK norm, the sliding window) with GELU
    (tanh approximation) in the gated MLP and softmax scale `query_pre_attn_scalar`^-0.5."""
    import torch.nn.functional as F

    config = llama.transformer_config(args, layout, dtype=dtype, device=device)
    return dataclasses.replace(
        config,
        activation_func=functools.partial(F.gelu, approximate="tanh"),
        softmax_scale=args.query_pre_attn_scalar**-0.5,
    )


@functools.cache
def _post_norm_modules() -> tuple[type, type]:
    """(attention, MLP) module classes that apply Gemma's post norm to their output (built on first
    use: they subclass megatron-core's SelfAttention and MLP).

    Each adds `post_attention_layernorm` / `post_feedforward_layernorm` (torch RMSNorm over the
    hidden size, weight 1 + HF's) and returns (norm(output), None); the wrapped module must have
    no output bias (Gemma has none).
    """
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def norm(config: Any) -> Any:
        return WrappedTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def normed(output: Any, bias: Any, layer_norm: Any) -> tuple[Any, None]:
        if bias is not None:
            raise ValueError("Gemma 3's post norm needs a sublayer without output bias")
        return layer_norm(output), None

    class Gemma3SelfAttention(SelfAttention):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.post_attention_layernorm = norm(config)

        def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, None]:
            return normed(*super().forward(*args, **kwargs), self.post_attention_layernorm)

    class Gemma3MLP(MLP):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.post_feedforward_layernorm = norm(config)

        def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, None]:
            return normed(*super().forward(*args, **kwargs), self.post_feedforward_layernorm)

    return Gemma3SelfAttention, Gemma3MLP


def layer_spec(args: Gemma3Args, *, use_te: bool):
    """The Llama family's local decoder layer spec (QK norm, SDPA core attention or CP attention)
    with the post-norm attention and MLP modules; the local spec also when `use_te` (see the
    module docstring)."""
    spec = llama.layer_spec(args, use_te=False)
    attention, mlp = _post_norm_modules()
    spec.submodules.self_attention.module = attention
    spec.submodules.mlp.module = mlp
    return spec


def gpt_model_kwargs(args: Gemma3Args, *, tp: int) -> dict[str, Any]:
    """The Llama family's GPTModel arguments with the global layers' RoPE: base `rope_theta`,
    linear factor as megatron-core's `seq_len_interpolation_factor` (position / factor)."""
    return {
        **llama.gpt_model_kwargs(args, tp=tp),
        "rope_scaling": False,
        "seq_len_interpolation_factor": args.global_rope_factor,
    }


def _gemma_norm(weight: Tensor) -> Tensor:
    """Megatron's RMSNorm weight (x / rms(x) * weight) of Gemma's (x / rms(x) * (1 + weight)), fp32."""
    return weight.float() + 1.0


def _reader(args: Gemma3Args, read: Callable[[str], Tensor]) -> Callable[[str], Tensor]:
    """`read` by HF's text names ("model.layers.0...", "lm_head.weight"); for a wrapper, by its
    names in either naming (`_WRAPPER_PREFIXES`, `_WRAPPER_LM_HEAD`; `KeyError` when none exists)."""
    if args.model_type != WRAPPER:
        return read

    def get(name: str) -> Tensor:
        if name == "lm_head.weight":
            candidates = _WRAPPER_LM_HEAD
        else:
            candidates = tuple(prefix + name.removeprefix("model.") for prefix in _WRAPPER_PREFIXES)
        for candidate in candidates[:-1]:
            try:
                return read(candidate)
            except KeyError:
                continue
        return read(candidates[-1])

    return get


def megatron_state_dict(
    args: Gemma3Args, read: Callable[[str], Tensor], layout: ParallelLayout
) -> dict[str, Tensor]:
    """This TP rank's Megatron tensors: the Llama family's mapping (embedding, fused QKV, q/k norms,
    o_proj, fused gate/up, down_proj, final norm, lm_head when untied), with every norm weight
    shifted by 1 (`_gemma_norm`) and the layer norms mapped as input_layernorm ->
    input_layernorm, post_attention_layernorm -> self_attention.post_attention_layernorm,
    pre_feedforward_layernorm -> pre_mlp_layernorm, post_feedforward_layernorm ->
    mlp.post_feedforward_layernorm (norms are replicated over TP). A wrapper's decoder is read
    under its prefix (`_reader`); its vision tower and projector are not read."""
    read = _reader(args, read)
    state = llama.megatron_state_dict(args, read, layout)
    for i in range(args.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        state[mc + "pre_mlp_layernorm.weight"] = read(hf + "pre_feedforward_layernorm.weight")
        state[mc + "self_attention.post_attention_layernorm.weight"] = read(
            hf + "post_attention_layernorm.weight"
        )
        state[mc + "mlp.post_feedforward_layernorm.weight"] = read(hf + "post_feedforward_layernorm.weight")
    return {name: _gemma_norm(t) if "layernorm" in name else t for name, t in state.items()}


class LayerRope:
    """Per-layer RoPE angles: a forward pre-hook on the GPTModel records `position_ids`; a forward
    pre-hook on a layer's self-attention replaces its `rotary_pos_emb` (GPTModel's angles) with
    `model_builder.rope_table` of the same positions, `inv_freq` [d/2] float32 and linear
    `factor` (None: none), positions 0..s-1 when the model was called without position_ids.
    Gemma 3's local layers (their own base), Gemma 4's global layers (their own head width)."""

    def __init__(self, inv_freq: Tensor, factor: float | None) -> None:
        self.inv_freq = inv_freq
        self.factor = factor
        self.position_ids: Any = None

    def record(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

    def replace(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        import torch

        from art_mega.trainer.model_builder import rope_table

        model_angles = kwargs["rotary_pos_emb"]
        positions = self.position_ids
        if positions is None:
            positions = torch.arange(model_angles.shape[0], device=model_angles.device)[None]
        inv_freq = self.inv_freq.to(model_angles.device)
        table = rope_table(positions, inv_freq, self.factor, False).to(model_angles.dtype)
        return args, {**kwargs, "rotary_pos_emb": table}

    def hook(self, module: Any, layers: list[int]) -> None:
        """Install the hooks on GPTModel `module` for decoder `layers` (indices)."""
        if not layers:
            return
        module.register_forward_pre_hook(self.record, with_kwargs=True)
        for i in layers:
            module.decoder.layers[i].self_attention.register_forward_pre_hook(self.replace, with_kwargs=True)


def default_inv_freq(theta: float, dim: int) -> Tensor:
    """1 / theta^(2i / dim) for i < dim / 2, float32 (HF's default RoPE)."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def scale_embeddings(hidden_size: int, module: Any) -> None:
    """Multiply GPTModel `module`'s embeddings by sqrt(hidden_size), rounded to the parameters'
    dtype first (HF's Gemma*TextScaledWordEmbedding), through a forward hook on `module.embedding`."""
    import torch

    scale = torch.tensor(hidden_size**0.5, dtype=next(module.parameters()).dtype)

    def scaled(embedding: Any, inputs: tuple, output: Tensor) -> Tensor:
        return output * scale.to(device=output.device, dtype=output.dtype)

    module.embedding.register_forward_hook(scaled)


def finish_model(args: Gemma3Args, module: Any) -> None:
    """Hook a built Gemma 3 GPTModel: embeddings times sqrt(hidden_size) (`scale_embeddings`), and
    the local layers' RoPE (`LayerRope` with the local base and factor)."""
    scale_embeddings(args.hidden_size, module)
    local = [i for i, windowed in enumerate(args.window_layers) if windowed]
    rope = LayerRope(default_inv_freq(args.local_rope_theta, args.head_dim), args.local_rope_factor)
    rope.hook(module, local)


WRAPPER_LORA_NAMES = dataclasses.replace(llama.SPEC.lora, layer_prefix=WRAPPER_LAYER_PREFIX)
"""The Llama family's LoRA names under the wrapper's decoder (`WRAPPER_LAYER_PREFIX`)."""


def lora_for(args: Gemma3Args) -> LoraNames:
    """The LoRA <-> PEFT names of a Gemma 3 model: the Llama family's, under
    `WRAPPER_LAYER_PREFIX` for a wrapper (PEFT on Gemma3ForConditionalGeneration, vLLM's gemma3_mm)."""
    return WRAPPER_LORA_NAMES if args.model_type == WRAPPER else llama.SPEC.lora


SPEC: FamilySpec[Gemma3Args] = dataclasses.replace(
    llama.SPEC,
    name="gemma3",
    model_types=MODEL_TYPES,
    model_args=model_args,
    transformer_config=transformer_config,
    layer_spec=layer_spec,
    gpt_model_kwargs=gpt_model_kwargs,
    megatron_state_dict=megatron_state_dict,
    te_name_map={},
    finish_model=finish_model,
    lora_for=lora_for,
    text_config=text_config,
)
"""The Gemma 3 text family: Llama's parallel limits and LoRA names (q/k/v/o_proj, gate/up/down_proj,
ART's Gemma targets), its own config, layer spec, weights and hooks."""
