"""The adapter of a Qwen3.5 / Qwen3.5-MoE multimodal wrapper (the Hub checkpoints' classes,
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`, config model_type
"qwen3_5" / "qwen3_5_moe" with a `text_config`): tiny wrappers around the families' tiny text
models (a 1-layer vision tower of width 32, unused on text) are read by Megatron, their adapter is
written under the wrapper's PEFT names (`base_model.model.model.language_model.layers`; the MoE's
routed experts packed as PEFT's `target_parameters` tensors, gate rows first), and
`PeftModel.from_pretrained` on the wrapper class loads every tensor of it as written, with
Megatron's logits; its keys and shapes are `peft_io.adapter_layout`'s (the torch-free names
`tests/unit/trainer/test_qwen3_5_wrapper_names.py` checks). Importing it and exporting again gives
the same bytes.

One TP=1 engine per family in this process, no training step (the LoRA B factors are seeded
random, so the adapter moves the logits); about 15 s on 2 CPU cores for both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.common import input_ids, megatron_logits, require_trainer_deps

require_trainer_deps()
pytest.importorskip("peft", reason="peft is not installed (the test extra)")

HF_TOLERANCE = 1e-4
"""As tests/trainer: HF vs Megatron logits."""
PREFIX = "base_model.model.model.language_model.layers"
TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
}
"""A 1-block vision tower whose output width is the tiny decoders' hidden size."""
WRAPPERS = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def _wrapper(text_dir: Path, model_type: str, out: Path) -> Path:
    """The tiny text model in `text_dir` as the Hub's wrapper class (`WRAPPERS[model_type]`), its
    decoder and LM head copied from the text model, saved by transformers' `save_pretrained`."""
    import shutil

    import torch
    import transformers

    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    config_class = transformers.Qwen3_5Config if model_type == "qwen3_5" else transformers.Qwen3_5MoeConfig
    text_config = {**text.config.to_dict(), "model_type": f"{model_type}_text"}
    config = config_class(
        text_config=text_config,
        vision_config=TINY_VISION,
        tie_word_embeddings=text.config.tie_word_embeddings,
        architectures=[WRAPPERS[model_type]],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wrapper = getattr(transformers, WRAPPERS[model_type])(config).to(torch.float32)
    wrapper.model.language_model.load_state_dict(text.model.state_dict())
    wrapper.lm_head.load_state_dict(text.lm_head.state_dict())
    wrapper.save_pretrained(out)
    for file in text_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(file, out / file.name)
    return out


@pytest.fixture(scope="module")
def wrapper_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from art_mega.basemodels.tiny import build_tiny_model
    from art_mega.basemodels.tiny_qwen3_5_moe import build_tiny_qwen3_5_moe

    root = tmp_path_factory.mktemp("qwen35-wrappers")
    texts = {
        "qwen3_5": build_tiny_model(root / "text-dense", "qwen3_5"),
        "qwen3_5_moe": build_tiny_qwen3_5_moe(root / "text-moe"),
    }
    return {kind: _wrapper(texts[kind], kind, root / kind) for kind in WRAPPERS}


def _seed_lora_b(module, seed: int) -> None:
    """Fill every LoRA B factor (zero at init) with seeded N(0, 0.05^2) values."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def _check_layout(kind: str, tensors: dict, config: dict) -> None:
    """Every key under the wrapper's prefix; the MoE's routed experts packed (E*r rows of A)."""
    assert all(key.startswith(PREFIX + ".") for key in tensors), sorted(tensors)[:3]
    if kind == "qwen3_5_moe":
        assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        assert not any(".mlp.experts.0." in key for key in tensors)
        # 4 experts of rank 4 over hidden 64; gate_up's B is [2 * 32, 4 * 4], down's A [16, 32]
        assert tuple(tensors[f"{PREFIX}.0.mlp.experts.base_layer.lora_A.weight"].shape) == (16, 64)
        assert tuple(tensors[f"{PREFIX}.0.mlp.experts.base_layer.lora_B.weight"].shape) == (64, 16)
        assert tuple(tensors[f"{PREFIX}.1.mlp.experts.lora_A.weight"].shape) == (16, 32)
        assert f"{PREFIX}.1.mlp.shared_expert.up_proj.lora_B.weight" in tensors
    else:
        assert "target_parameters" not in config or not config["target_parameters"]


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_the_wrapper_adapter_loads_in_peft_with_megatron_logits(
    kind: str, wrapper_dirs, megatron_world, tmp_path: Path
) -> None:
    import torch
    import transformers
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.peft_io import adapter_layout, write_for_peft
    from art_mega.trainer.rank.engine import TrainerEngine
    from tests.trainer.engine_scenarios import OPTIMIZER
    from tests.trainer.qwen3_5_worker import QWEN3_5_LORA

    model_dir = wrapper_dirs[kind]
    assert read_hf_config(model_dir)["model_type"] == kind
    engine = TrainerEngine(model_dir, megatron_world, lora=QWEN3_5_LORA, optimizer=OPTIMIZER)
    _seed_lora_b(engine.model.module, seed=7)
    ids = input_ids(engine.model.vocab_size)
    logits = megatron_logits(engine.model, ids)
    engine.export_adapter(tmp_path / "adapter")
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    _check_layout(kind, tensors, config)
    layout = adapter_layout(
        read_hf_config(model_dir),
        config["r"],
        config["target_modules"],
        config.get("target_parameters") or (),
    )
    assert {key: tuple(value.shape) for key, value in tensors.items()} == layout.shapes
    peft_dir = write_for_peft(tmp_path / "adapter", tmp_path / "peft", read_hf_config(model_dir))
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (peft_dir / file).read_bytes() == (tmp_path / "adapter" / file).read_bytes()

    wrapper_class = getattr(transformers, WRAPPERS[kind])
    base = wrapper_class.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter")
        peft_logits = peft(ids).logits
    loaded = get_peft_model_state_dict(peft)
    missing = sorted(set(tensors) - set(loaded))
    assert not missing, f"PEFT left out {len(missing)} tensors, e.g. {missing[:2]}"
    assert all(torch.equal(loaded[key], tensors[key]) for key in tensors)
    diff = (peft_logits - logits).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    print(
        f"{kind} wrapper: {len(tensors)} adapter tensors, max |PEFT - megatron| = {diff:.2e}; "
        f"the adapter moves logits by up to {effect:.2f}"
    )
    assert diff <= HF_TOLERANCE
    assert effect > 0.05

    _seed_lora_b(engine.model.module, seed=8)
    engine.load_adapter(tmp_path / "adapter")
    engine.export_adapter(tmp_path / "roundtrip")
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "adapter" / file).read_bytes() == (tmp_path / "roundtrip" / file).read_bytes()
