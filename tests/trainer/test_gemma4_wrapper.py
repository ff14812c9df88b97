"""The multimodal Gemma 4 wrapper (`Gemma4ForConditionalGeneration`, model_type "gemma4": every
published google/gemma-4-* config.json) trains as its text decoder (`families/gemma4.py` WRAPPER).

A tiny wrapper around the tiny gemma4_text model (`basemodels.tiny`, its weights copied under
`model.language_model.`, a random tiny vision tower beside them): Megatron's logits of the wrapper
equal those of the text model it wraps (bit for bit: the same tensors are read, the vision tower
is not) and transformers' wrapper's on text-only input; PEFT's names of its adapter sit under the
wrapper's decoder, and an adapter in those names loads in PEFT onto transformers' wrapper. The
published gemma-4-31B config.json (the wrapper) maps every text-decoder tensor at TP=8 on the meta
device, and the wrapper of gemma-4-E2B is refused for its per-layer inputs (one sentence)."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_mega.basemodels.tiny import build_tiny_model
from tests.real_size_configs import GEMMA4_31B_IT
from tests.trainer.common import MetaMapper, input_ids, megatron_logits, require_trainer_deps
from tests.trainer.gemma4_configs import build_tiny_gemma4_wrapper

require_trainer_deps()

HF_TOLERANCE = 1e-4
"""As tests/trainer: HF vs Megatron logits."""

@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-gemma4mm")
    text = build_tiny_model(root / "gemma4", "gemma4_text")
    return {"text": text, "wrapper": build_tiny_gemma4_wrapper(text, root / "gemma4mm")}


@pytest.fixture(scope="module")
def logits(megatron_world, dirs: dict[str, Path]) -> dict[str, object]:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, model_dir in dirs.items():
            built = build_megatron_model(model_dir)
            out[name] = megatron_logits(built, input_ids(built.vocab_size))
            out[f"{name}/args"] = built.args
            out[f"{name}/lora"] = built.family.lora_names(built.args)
    finally:
        torch.set_num_threads(threads)
    return out


def test_the_wrapper_trains_its_text_decoder(logits: dict, dirs: dict[str, Path]) -> None:
    import dataclasses

    import torch
    from transformers import AutoModelForImageTextToText

    assert logits["wrapper/args"].model_type == "gemma4"
    assert dataclasses.replace(logits["wrapper/args"], model_type="gemma4_text") == logits["text/args"]
    assert torch.equal(logits["wrapper"], logits["text"])
    hf = AutoModelForImageTextToText.from_pretrained(dirs["wrapper"], dtype=torch.float32)
    assert type(hf).__name__ == "Gemma4ForConditionalGeneration"
    with torch.no_grad():
        expected = hf(input_ids=input_ids(hf.config.text_config.vocab_size)).logits
    diff = (logits["wrapper"] - expected).abs().max().item()
    print(f"gemma4 wrapper: max |megatron - hf| = {diff:.2e}")
    assert diff <= HF_TOLERANCE


def test_an_adapter_in_the_wrappers_names_loads_in_peft(
    logits: dict, dirs: dict[str, Path], tmp_path
) -> None:
    """An adapter of every target in the wrapper's PEFT names, with the adapter_config.json
    art-mega writes (`peft_io.adapter_config`), loads onto transformers' wrapper through
    `write_for_peft` (which excludes the vision tower, whose linears share the decoder's names and
    which PEFT cannot wrap): every lora_A in the file is the one PEFT holds."""
    pytest.importorskip("peft")
    import json

    import torch
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    from art_mega.trainer.peft_io import adapter_config, write_for_peft
    from art_mega.trainer.protocol import LoraConfig

    names = logits["wrapper/lora"]
    assert names.layer_prefix == "base_model.model.model.language_model.layers"
    assert logits["text/lora"].layer_prefix == "base_model.model.model.layers"
    args = logits["wrapper/args"]
    hf = AutoModelForImageTextToText.from_pretrained(dirs["wrapper"], dtype=torch.float32)
    modules = dict(hf.named_modules())
    tensors = {}
    for layer in range(args.num_layers):
        for target in names.targets:
            block = "self_attention" if names.parents[target] == "self_attn" else "mlp"
            name = f"decoder.layers.{layer}.{block}.{target}"
            parent, _ = names.parse(name)
            for hf_module in names.hf_modules(name):
                module = modules[f"model.language_model.layers.{parent}.{hf_module}"]
                tensors[names.peft_key(parent, hf_module, "lora_A")] = torch.ones(2, module.in_features)
                tensors[names.peft_key(parent, hf_module, "lora_B")] = torch.zeros(module.out_features, 2)
    exported = tmp_path / "exported"
    exported.mkdir()
    save_file(tensors, exported / "adapter_model.safetensors")
    lora = LoraConfig(rank=2, alpha=2.0, targets=names.targets)
    (exported / "adapter_config.json").write_text(
        json.dumps(adapter_config(lora, str(dirs["wrapper"]), names))
    )
    wrapper_config = json.loads((dirs["wrapper"] / "config.json").read_text())
    peft = PeftModel.from_pretrained(hf, write_for_peft(exported, tmp_path / "peft", wrapper_config))
    lora_a = {k: v for k, v in peft.state_dict().items() if ".lora_A." in k}
    assert len(lora_a) == len(tensors) // 2 > 0
    assert all(torch.equal(v, torch.ones_like(v)) for v in lora_a.values()), "every lora_A was loaded"


@pytest.mark.timeout(900)
def test_gemma4_31b_wrapper_maps_its_decoder_at_tp8(meta_mapper: MetaMapper) -> None:
    got = meta_mapper.map(GEMMA4_31B_IT, 8, 1)
    assert (got["family"], got["hf_class"]) == ("gemma4", "Gemma4ForConditionalGeneration")
    # every tensor of transformers' wrapper (no vision tower without a vision_config) is read
    assert (
        got["unread"] == []
        and got["unknown_reads"] == []
        and got["missing"] == []
        and got["unexpected"] == []
    )
    assert got["mismatched"] == [] and got["hf_buffers"] == 60
    # the text decoder's, as `test_real_size_mapping`'s of the text config
    assert got["hf_params"] == got["megatron_params"] == 30_697_345_280
    assert got["lora_layers"] == 60 * 4 and got["lora_unmatched"] == []
