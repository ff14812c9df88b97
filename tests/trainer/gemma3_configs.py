"""Published Gemma 3 configs the tests read (kept in `tests/real_size_configs.py`), and the tiny
multimodal Gemma 3 (`build_tiny_gemma3_wrapper`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.real_size_configs import GEMMA3_27B_IT, GEMMA3_27B_TEXT

__all__ = ["GEMMA3_27B_IT", "GEMMA3_27B_TEXT", "TINY_VISION", "build_tiny_gemma3_wrapper"]

TINY_VISION = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
"""A SigLIP vision tower of 2 x 2 patches (one pooled image token: mm_tokens_per_image 1)."""


def build_tiny_gemma3_wrapper(text_dir: Path, out: Path, *, old_names: bool = False) -> Path:
    """A `Gemma3ForConditionalGeneration` in `out` whose text decoder is the tiny gemma3_text model
    in `text_dir` (`basemodels.tiny`, its weights copied), with a random tiny vision tower and
    projector (`TINY_VISION`) and `text_dir`'s tokenizer files; saved as transformers 5 does
    (`model.language_model.`), or with `old_names` under the pre-4.52 names
    (`language_model.model.`, `vision_tower.`, `multi_modal_projector.`). Returns `out`."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    text_config = text.config.to_dict()
    config = Gemma3Config(text_config=text_config, vision_config=TINY_VISION, mm_tokens_per_image=1)
    torch.manual_seed(0)
    wrapper = Gemma3ForConditionalGeneration(config).eval()
    wrapper.model.language_model.load_state_dict(text.model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    wrapper.save_pretrained(out, safe_serialization=True)
    for file in text_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(file, out / file.name)
    (weights,) = out.glob("*.safetensors")
    old_to_new = {
        "language_model.model.": "model.language_model.",
        "vision_tower.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    renames = {new: old for old, new in old_to_new.items()} if old_names else old_to_new
    tensors = {}
    for name, tensor in load_file(weights).items():  # transformers 5.19 saves either naming
        for prefix, renamed in renames.items():
            if name.startswith(prefix):
                name = renamed + name.removeprefix(prefix)
                break
        tensors[name] = tensor
    save_file(tensors, weights, metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3"
    return out
