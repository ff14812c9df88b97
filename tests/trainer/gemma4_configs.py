"""The tiny multimodal Gemma 4 (`Gemma4ForConditionalGeneration`, model_type "gemma4", the form of
every published google/gemma-4-* checkpoint) around the tiny gemma4_text model: built by
tests/trainer/test_gemma4_wrapper.py and the device check's `gemma4_mm` step
(benchmarks/device_check.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

TINY_VISION = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "patch_size": 4,
    "position_embedding_size": 64,
}
"""A Gemma 4 vision tower of one 16-wide layer (text-only input never runs it)."""


def build_tiny_gemma4_wrapper(text_dir: Path, out: Path) -> Path:
    """A `Gemma4ForConditionalGeneration` in `out` whose text decoder is the tiny gemma4_text model
    in `text_dir` (its weights copied), with a random tiny vision tower (`TINY_VISION`) and
    `text_dir`'s tokenizer files, saved as transformers 5 saves it. Returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration

    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    config = Gemma4Config(text_config=text.config.to_dict(), vision_config=TINY_VISION, audio_config=None)
    torch.manual_seed(0)
    wrapper = Gemma4ForConditionalGeneration(config).eval()
    wrapper.model.language_model.load_state_dict(text.model.state_dict())
    wrapper.save_pretrained(out, safe_serialization=True)
    for file in text_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(file, out / file.name)
    return out
