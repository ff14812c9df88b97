"""Reading a Hugging Face model directory: config.json and (possibly sharded) safetensors.

Tensors are read one at a time, so a rank holds only what it is converting.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from art_mega.errors import UserError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed `config.json` of the HF model directory `model_dir`.

    Raises `UserError` when the directory or its config.json is missing or not JSON.
    """
    path = Path(model_dir) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; pass a Hugging Face model directory.") from None
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}).") from None


class SafetensorsReader:
    """Read tensors by name from a model directory's safetensors file(s).

    Handles a single `model.safetensors` and a sharded checkpoint described by
    `model.safetensors.index.json` (its `weight_map` names the shard of each tensor). Use as a
    context manager; `get(name)` returns a CPU tensor in the stored dtype. Raises `UserError`
    when the directory holds neither, and `KeyError` for a tensor name it does not contain.
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        directory = Path(model_dir)
        index = directory / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: directory / shard for name, shard in weight_map.items()}
        elif (directory / SINGLE_FILE).exists():
            from safetensors import safe_open

            with safe_open(directory / SINGLE_FILE, framework="pt") as handle:
                names = list(handle.keys())
            self._files = dict.fromkeys(names, directory / SINGLE_FILE)
        else:
            raise UserError(
                f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; it holds no HF weights."
            )
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every open shard."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def keys(self) -> list[str]:
        """Every tensor name in the checkpoint, sorted."""
        return sorted(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str):
        """The tensor `name` (a `torch.Tensor` on the CPU, stored shape and dtype)."""
        from safetensors import safe_open

        path = self._files[name]
        if path not in self._handles:
            handle = safe_open(path, framework="pt")
            self._handles[path] = handle.__enter__()
        return self._handles[path].get_tensor(name)
