"""The tiny HF model builder: loads offline with transformers, same bytes on every build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_mega.basemodels.tiny import IM_END, PAD_TOKEN, build_tiny_model, tiny_spec
from art_mega.errors import UserError

pytest.importorskip("transformers", reason="the cpu extra (transformers) is not installed")


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_builds_and_reloads_offline(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = build_tiny_model(tmp_path / arch, arch)
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads) == (arch, 2, 4)
    assert (config.num_key_value_heads, config.vocab_size) == (2, 768)
    assert config.hidden_size == (128 if arch == "qwen2" else 64)
    assert getattr(config, "head_dim", config.hidden_size // config.num_attention_heads) == 32
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 768
    assert (tokenizer.eos_token, tokenizer.pad_token) == (IM_END, PAD_TOKEN)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 plus 4?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt)["input_ids"]
    assert tokenizer.decode(ids) == prompt
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    # Any id sequence decodes (vLLM samples arbitrary tokens from a random model).
    assert isinstance(tokenizer.decode(list(range(768))), str)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 768)
    assert 0.5 < logits.std().item() < 5, "logits should be O(1) so that weight-mapping errors show"


def test_same_bytes_and_idempotent(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", "qwen3", seed=3)
    second = build_tiny_model(tmp_path / "b", "qwen3", seed=3)
    assert file_bytes(first) == file_bytes(second)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(first, "qwen3", seed=3) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = build_tiny_model(first, "qwen3", seed=4)
    assert (other / "model.safetensors").read_bytes() != file_bytes(second)["model.safetensors"]
    assert json.loads((other / "art_mega_tiny.json").read_text())["spec"]["seed"] == 4
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_invalid_sizes_are_user_errors() -> None:
    with pytest.raises(UserError, match="arch='gpt2' is not a tiny model family"):
        tiny_spec("gpt2")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        tiny_spec("llama", num_kv_heads=3)
    with pytest.raises(UserError, match="hidden_size=64 must equal"):
        tiny_spec("qwen2", hidden_size=64)
