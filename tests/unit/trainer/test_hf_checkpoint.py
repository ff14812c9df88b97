"""Reading HF model directories: single and sharded safetensors, and the user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_mega.errors import UserError
from art_mega.trainer.hf_checkpoint import SafetensorsReader, read_hf_config

torch = pytest.importorskip("torch", reason="the cpu extra (torch) is not installed")


def test_sharded_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"c": torch.full((1,), 7.0)}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with SafetensorsReader(tmp_path) as reader:
        assert reader.keys() == ["a", "b", "c"] and "c" in reader
        assert reader.get("c").tolist() == [7.0]
        assert reader.get("b").shape == (3,)
        with pytest.raises(KeyError):
            reader.get("d")


def test_single_file_and_errors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    with pytest.raises(UserError, match="holds no HF weights"):
        SafetensorsReader(tmp_path)
    save_file({"w": torch.eye(2)}, tmp_path / "model.safetensors")
    with SafetensorsReader(tmp_path) as reader:
        assert torch.equal(reader.get("w"), torch.eye(2))
    with pytest.raises(UserError, match="config.json does not exist; pass a Hugging Face model directory"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        read_hf_config(tmp_path)
