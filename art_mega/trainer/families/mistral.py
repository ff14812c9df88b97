"""Mistral dense decoders (HF `MistralForCausalLM`): the Llama family's Megatron model, weights and
LoRA names, with Mistral's config reading (`SPEC`).

A Mistral decoder is a Llama decoder (RMSNorm, GQA attention without biases, RoPE over the whole
head, SwiGLU MLP without biases; HF `modeling_mistral.py`) whose attention may be limited to a
sliding window of the last `sliding_window` tokens. Megatron's attention here attends to the whole
causal prefix, so a window that could take effect is refused rather than trained wrongly.
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
    embeddings, default or Llama 3 RoPE. Refused besides the Llama family's refusals (activation,
    RoPE type): a `sliding_window` smaller than `max_position_embeddings`, the only case where the
    window changes attention (a sequence longer than the window); null or a window at least the
    model's length is full causal attention.

    Raises:
        UserError: one sentence naming the field, its value and the fix.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"model_type={model_type!r} is not a Mistral model ({', '.join(MODEL_TYPES)}).")
    max_positions = int(config.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS)
    window = config.get("sliding_window")
    if window is not None and int(window) < max_positions:
        raise UserError(
            f"sliding_window={window} is smaller than max_position_embeddings={max_positions}, so it would "
            f"limit attention in sequences longer than {window} tokens, which the Megatron trainer does not "
            "implement; use a checkpoint with sliding_window null (Mistral-7B-v0.2 and later)."
        )
    read = {key: value for key, value in config.items() if key not in _LLAMA_ONLY}
    dense = llama.DenseArgs.from_hf_config(
        {**read, "model_type": "llama", "max_position_embeddings": max_positions}
    )
    return dataclasses.replace(dense, model_type=model_type)


SPEC: FamilySpec[llama.DenseArgs] = dataclasses.replace(
    llama.SPEC, name="mistral", model_types=MODEL_TYPES, model_args=model_args
)
"""The Mistral family: Mistral's config reading, everything else the Llama family's."""
