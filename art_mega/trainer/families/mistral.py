"""Mistral dense decoders (HF `MistralForCausalLM`): the Llama family's Megatron model, weights and
LoRA names, with Mistral's config reading (`SPEC`).

A Mistral decoder is a Llama decoder (RMSNorm, GQA attention without biases, RoPE over the whole
head, SwiGLU MLP without biases; HF `modeling_mistral.py`) whose attention may be limited to a
sliding window of the last `sliding_window` tokens on every layer (Mistral-7B-v0.1: 4096).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from art_mega.errors import UserError
from art_mega.trainer.families import llama
from art_mega.trainer.families.spec import FamilySpec

MODEL_TYPES = ("mistral",)
"""HF `model_type` values this family reads."""

_DEFAULT_MAX_POSITIONS = 4096 * 32
"""HF `MistralConfig`'s default max_position_embeddings."""

_LLAMA_ONLY = ("attention_bias", "mlp_bias", "use_sliding_window")
"""Llama / Qwen2 config fields that HF's Mistral model does not read (its projections never have
biases, its window is `sliding_window` alone); the Llama reader must not act on stray copies."""


def model_args(config: dict[str, Any]) -> llama.DenseArgs:
    """Parse an HF Mistral config dict into the Llama family's `DenseArgs` (model_type "mistral").

    Accepted: `head_dim` (Mistral NeMo's differs from hidden_size / heads), tied or untied
    embeddings, default or Llama 3 RoPE, `sliding_window` (null: full causal attention; else the
    window on every layer, as HF's Mistral masks every layer with it). Refused: the Llama
    family's refusals (activation, RoPE type).

    Raises:
        UserError: one sentence naming the field, its value and the fix.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a Mistral model ({', '.join(MODEL_TYPES)}).")
    max_positions = int(config.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS)
    window = config.get("sliding_window")
    read = {key: value for key, value in config.items() if key not in _LLAMA_ONLY}
    dense = llama.DenseArgs.from_hf_config(
        {**read, "model_type": "llama", "max_position_embeddings": max_positions}
    )
    layers = llama.sliding_layers({}, window, dense.num_layers, lambda i: True)
    return dataclasses.replace(
        dense,
        model_type=model_type,
        sliding_window=None if window is None else int(window),
        window_layers=layers if window is not None else (),
    )


SPEC: FamilySpec[llama.DenseArgs] = dataclasses.replace(
    llama.SPEC, name="mistral", model_types=MODEL_TYPES, model_args=model_args, pipeline_parallel=False
)
"""The Mistral family: Mistral's config reading, everything else the Llama family's."""
