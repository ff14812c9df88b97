"""ART 0.5.23's `art.get_tokenizer`: a base model's Hugging Face tokenizer, found as
`TrainableModel(base_model=...)` finds the model (`art_mega.basemodels.resolve`)."""

from __future__ import annotations

from typing import Any


def get_tokenizer(base_model: str, *, revision: str | None = None, **kwargs: Any) -> Any:
    """The `transformers` tokenizer of `base_model` (an HF directory, a cached name such as
    "SmolLM2-135M-Instruct", a PEFT adapter directory, or a hub id at `revision`), loaded with
    `AutoTokenizer.from_pretrained(model_dir, **kwargs)` from the directory the backend would
    train (cache: `$ART_MEGA_CACHE` or ~/.cache/art-mega, and the HF cache). ART also swaps in
    its own chat templates for a few model families (Kimi, Llama 3 text models); art-mega uses
    the model's own.

    Raises:
        BaseModelError: `base_model` names nothing loadable (`resolve_base_model`).
    """
    from transformers import AutoTokenizer

    from art_mega.basemodels.resolve import resolve_base_model
    from art_mega.launch.context import default_cache_root

    resolved = resolve_base_model(base_model, default_cache_root(), revision=revision)
    return AutoTokenizer.from_pretrained(resolved.model_dir, **kwargs)
