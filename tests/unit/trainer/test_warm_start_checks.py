"""A warm-start adapter (`TrainableModel(base_model=<a PEFT adapter folder>)`) is checked at
`register` before any rank or replica starts (`checkpoint.check_warm_start`): its files, a whole
safetensors file, tensors that match its config and fit the base model, and finite values.
Before, all but the config failed inside a trainer rank's `load_adapter` after vLLM and the ranks
had started, and NaN/inf reached the optimizer. The same one function (`adapter_problem`) checks
a committed step a run resumes from (`read_resume_step`).

Real files: adapters written by `safetensors.numpy.save_file` with the config the trainer writes
(`peft_io.adapter_config`); the base model is the tiny Llama (`basemodels/tiny.py`: hidden 64,
4 heads and 2 KV heads of 32, FFN 256, 2 layers), whose own weights give the expected shapes.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from art_mega.errors import BaseModelError, CheckpointFileError
from art_mega.trainer import checkpoint as ckpt
from art_mega.trainer.peft_io import adapter_config, adapter_layout
from art_mega.trainer.protocol import LoraConfig
from tests.helpers import save_checkpoint_step

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "fc1", "up_proj": "fc1"}
"""The HF modules Megatron fuses into one layer, which share one lora_A."""
PREFIX = "base_model.model.model.layers"


def base_shapes(model_dir: Path) -> dict[str, list[int]]:
    """{`<layer>.<parent>.<module>`: [out_features, in_features]} from the base model's own weights."""
    with safe_open(str(model_dir / "model.safetensors"), "np") as handle:
        return {
            key[len("model.layers.") : -len(".weight")]: handle.get_slice(key).get_shape()
            for key in handle.keys()
            if key.startswith("model.layers.") and key.split(".")[-2] in MODULES
        }


def adapter_tensors(model_dir: Path, rank: int = 4) -> dict[str, np.ndarray]:
    """A LoRA of rank `rank` on every module of every layer, as the trainer exports it: seeded
    values, one lora_A per fused layer (q/k/v, gate/up)."""
    rng = np.random.default_rng(0)
    tensors, shared = {}, {}
    for module, (fan_out, fan_in) in sorted(base_shapes(model_dir).items()):
        layer = module.split(".")[0]
        group = (layer, FUSED.get(module.split(".")[-1], module))
        if group not in shared:
            shared[group] = rng.standard_normal((rank, fan_in)).astype(np.float32)
        tensors[f"{PREFIX}.{module}.lora_A.weight"] = shared[group]
        tensors[f"{PREFIX}.{module}.lora_B.weight"] = rng.standard_normal((fan_out, rank)).astype(np.float32)
    return tensors


def write_adapter(folder: Path, model_dir: Path, tensors: dict[str, np.ndarray], **config: object) -> Path:
    """`folder` as a PEFT adapter of `model_dir` (config as the trainer writes it, `config` keys replaced)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    written = {**adapter_config(LoraConfig(rank=4, alpha=8.0), str(model_dir)), **config}
    (folder / "adapter_config.json").write_text(json.dumps(written))
    return folder


def rehash(step: Path) -> None:
    """Rewrite the manifest of the step folder `step` with its adapter's sha256 (after an edit)."""
    weights = ckpt.adapter_dir(step) / "adapter_model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    manifest = ckpt.read_manifest(step).model_copy(update={"adapter_sha256": digest})
    ckpt.manifest_file(step).write_text(manifest.model_dump_json())


@pytest.fixture
def adapter(tmp_path: Path, tiny_llama_dir: Path) -> Path:
    return write_adapter(tmp_path / "adapter", tiny_llama_dir, adapter_tensors(tiny_llama_dir))


def refusal(adapter: Path, model_dir: Path) -> str:
    """The sentence `check_warm_start` refuses `adapter` with (one line, exit code 2)."""
    with pytest.raises(BaseModelError) as caught:
        ckpt.check_warm_start(adapter, model_dir, str(adapter))
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2 and caught.value.base_model == str(adapter)
    prefix = f"base_model {str(adapter)!r} is a warm-start adapter the trainer cannot load: "
    suffix = f"; warm-start from a whole adapter with finite values trained on {model_dir}"
    assert message.startswith(prefix) and message.endswith(suffix)
    return message[len(prefix) : -len(suffix)]


def test_the_layout_is_the_base_models_own_shapes(tiny_llama_dir: Path) -> None:
    layout = adapter_layout(json.loads((tiny_llama_dir / "config.json").read_text()), 4, list(MODULES))
    expected = {}
    for module, (fan_out, fan_in) in base_shapes(tiny_llama_dir).items():
        expected[f"{PREFIX}.{module}.lora_A.weight"] = (4, fan_in)
        expected[f"{PREFIX}.{module}.lora_B.weight"] = (fan_out, 4)
    assert layout.shapes == expected and len(expected) == 28  # 2 layers x 7 modules x A, B
    assert layout.shapes[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"] == (128, 4)  # 4 heads of 32
    assert layout.shapes[f"{PREFIX}.1.self_attn.k_proj.lora_B.weight"] == (64, 4)  # 2 KV heads
    assert layout.shapes[f"{PREFIX}.0.mlp.down_proj.lora_A.weight"] == (4, 256)
    assert layout.shared_a[:2] == (
        tuple(f"{PREFIX}.0.self_attn.{m}_proj.lora_A.weight" for m in "qkv"),
        tuple(f"{PREFIX}.0.mlp.{m}_proj.lora_A.weight" for m in ("gate", "up")),
    )
    assert adapter_layout(json.loads((tiny_llama_dir / "config.json").read_text()), 2, ["o_proj"]).shapes == {
        f"{PREFIX}.{i}.self_attn.o_proj.lora_{m}.weight": shape
        for i in range(2)
        for m, shape in (("A", (2, 128)), ("B", (64, 2)))
    }


def test_an_moe_models_expert_modules_are_per_expert_of_the_expert_width() -> None:
    """Qwen3-MoE: every layer's MLP is experts only (the Hub's per-expert names, as
    `export_adapter` writes them), of `moe_intermediate_size`, not the unused dense width."""
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    layout = adapter_layout(config, 2, list(MODULES))
    assert len(layout.shapes) == 2 * (4 + 3 * 3) * 2  # layers x (attention + experts x MLP) x A, B
    assert not any(".mlp.gate_proj" in key for key in layout.shapes)
    expert = f"{PREFIX}.1.mlp.experts.2"
    assert layout.shapes[f"{expert}.gate_proj.lora_B.weight"] == (32, 2)
    assert layout.shapes[f"{expert}.down_proj.lora_A.weight"] == (2, 32)
    assert layout.shapes[f"{expert}.down_proj.lora_B.weight"] == (64, 2)
    assert layout.shapes[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"] == (64, 2)  # 4 heads of 16
    assert (f"{expert}.gate_proj.lora_A.weight", f"{expert}.up_proj.lora_A.weight") in layout.shared_a


def test_a_whole_adapter_that_fits_is_accepted_without_torch(adapter: Path, tiny_llama_dir: Path) -> None:
    assert ckpt.adapter_problem(adapter, model_dir=tiny_llama_dir) is None
    code = (
        "import sys\n"
        "from art_mega.trainer import checkpoint\n"
        f"checkpoint.check_warm_start({str(adapter)!r}, {str(tiny_llama_dir)!r}, 'a')\n"
        "assert 'torch' not in sys.modules, 'the check imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_and_truncated_files_are_refused(adapter: Path, tiny_llama_dir: Path) -> None:
    weights = adapter / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-6])
    assert refusal(adapter, tiny_llama_dir) == (
        f"{weights} is {len(whole) - 6} bytes where its header describes {len(whole)}: it is truncated "
        "or was overwritten"
    )
    weights.unlink()
    assert refusal(adapter, tiny_llama_dir) == (
        f"{weights} is missing, so the adapter of {adapter} cannot be loaded (a folder holds both "
        "adapter_config.json and adapter_model.safetensors)"
    )


def test_tensors_unlike_the_config_are_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    tensors = adapter_tensors(tiny_llama_dir)
    folder = write_adapter(tmp_path / "r8", tiny_llama_dir, tensors, r=8)
    assert refusal(folder, tiny_llama_dir) == (
        f"{folder / 'adapter_model.safetensors'} does not match {folder / 'adapter_config.json'}: tensor "
        f"{PREFIX}.0.mlp.down_proj.lora_A.weight of shape [4, 256] has LoRA rank 4, but the config's r is 8"
    )
    targets = [m for m in sorted(MODULES) if m != "o_proj"]
    folder = write_adapter(tmp_path / "modules", tiny_llama_dir, tensors, target_modules=targets)
    assert refusal(folder, tiny_llama_dir).endswith(
        f"tensor {PREFIX}.0.self_attn.o_proj.lora_A.weight adapts 'o_proj', which is not in the config's "
        f"target_modules {targets}"
    )


def test_tensors_that_do_not_fit_the_base_model_are_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    weights = "adapter_model.safetensors"
    tensors = adapter_tensors(tiny_llama_dir)
    key = f"{PREFIX}.1.mlp.gate_proj.lora_A.weight"  # in_features 64 on this model
    folder = write_adapter(
        tmp_path / "shape", tiny_llama_dir, {**tensors, key: np.zeros((4, 48), np.float32)}
    )
    assert refusal(folder, tiny_llama_dir) == (
        f"{folder / weights} tensor {key} has shape [4, 48], where {tiny_llama_dir} takes [4, 64] "
        "(in_features 64): the adapter was trained on another base model"
    )
    b = f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"
    folder = write_adapter(tmp_path / "out", tiny_llama_dir, {**tensors, b: np.zeros((128, 4), np.float32)})
    assert "takes [64, 4] (out_features 64)" in refusal(folder, tiny_llama_dir)
    extra = f"{PREFIX}.2.mlp.up_proj.lora_A.weight"  # a third layer on a 2-layer model
    folder = write_adapter(
        tmp_path / "deep", tiny_llama_dir, {**tensors, extra: np.zeros((4, 64), np.float32)}
    )
    assert refusal(folder, tiny_llama_dir) == (
        f"{folder / weights} tensor {extra} is not one the trainer loads into {tiny_llama_dir} (2 layers, "
        f"LoRA on {sorted(MODULES)}): the adapter was made for another base model, or it is not a plain LoRA"
    )
    gone = f"{PREFIX}.1.mlp.down_proj.lora_B.weight"
    folder = write_adapter(tmp_path / "gone", tiny_llama_dir, {k: v for k, v in tensors.items() if k != gone})
    assert refusal(folder, tiny_llama_dir) == (
        f"{folder / weights} has no tensor {gone} (1 missing), which its config's target_modules "
        f"{sorted(MODULES)} call for on the 2 layers of {tiny_llama_dir}"
    )


@pytest.mark.parametrize(
    ("value", "counts"), [(np.nan, "2 NaN and 0 infinite"), (-np.inf, "0 NaN and 2 infinite")]
)
def test_non_finite_values_are_refused(
    tmp_path: Path, tiny_llama_dir: Path, value: float, counts: str
) -> None:
    tensors = adapter_tensors(tiny_llama_dir)
    key = f"{PREFIX}.1.self_attn.o_proj.lora_B.weight"
    tensors[key] = tensors[key].copy()
    tensors[key][3, 1] = tensors[key][60, 0] = value
    folder = write_adapter(tmp_path / "a", tiny_llama_dir, tensors)
    assert refusal(folder, tiny_llama_dir) == (
        f"{folder / 'adapter_model.safetensors'} tensor {key} holds {counts} values (of 256), which would "
        "reach the optimizer and the served adapter"
    )


def test_bfloat16_and_float16_values_are_read_from_their_bits(tmp_path: Path, tiny_llama_dir: Path) -> None:
    torch = pytest.importorskip("torch", reason="bfloat16 tensors are written by safetensors.torch")
    from safetensors.torch import save_file as save_torch

    tensors = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in adapter_tensors(tiny_llama_dir).items()}
    folder = write_adapter(tmp_path / "bf16", tiny_llama_dir, {})
    save_torch(tensors, str(folder / "adapter_model.safetensors"))
    assert ckpt.adapter_problem(folder, model_dir=tiny_llama_dir) is None  # bf16 values up to 3e38 are finite
    key = f"{PREFIX}.0.mlp.up_proj.lora_B.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][7, 2] = float("inf")
    tensors[key][8, 2] = float("nan")
    save_torch(tensors, str(folder / "adapter_model.safetensors"))
    assert refusal(folder, tiny_llama_dir).endswith(
        f"tensor {key} holds 1 NaN and 1 infinite values (of 1024), "
        "which would reach the optimizer and the served adapter"
    )
    half = {k: v.astype(np.float16) for k, v in adapter_tensors(tiny_llama_dir).items()}
    half[key] = half[key].copy()
    half[key][0, 0] = np.float16(np.inf)
    folder = write_adapter(tmp_path / "f16", tiny_llama_dir, half)
    assert "holds 0 NaN and 1 infinite values (of 1024)" in refusal(folder, tiny_llama_dir)


def test_unequal_fused_lora_a_and_integer_tensors_are_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    tensors = adapter_tensors(tiny_llama_dir)
    k = f"{PREFIX}.1.self_attn.k_proj.lora_A.weight"  # PEFT trains one lora_A per module
    folder = write_adapter(tmp_path / "peft", tiny_llama_dir, {**tensors, k: tensors[k] + 1})
    assert refusal(folder, tiny_llama_dir).endswith(
        f"tensors {PREFIX}.1.self_attn.q_proj.lora_A.weight and {k} differ, but the trainer fuses their "
        "modules into one layer with one lora_A and needs them equal (a PEFT adapter trained apart from "
        "art-mega has one lora_A per module)"
    )
    d = f"{PREFIX}.0.mlp.down_proj.lora_A.weight"
    folder = write_adapter(tmp_path / "int", tiny_llama_dir, {**tensors, d: tensors[d].astype(np.int32)})
    assert refusal(folder, tiny_llama_dir).endswith(
        f"tensor {d} has dtype I32; LoRA tensors are floats (F64, F32, F16, BF16)"
    )


def test_fused_lora_a_are_compared_as_numbers(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """-0.0 equals 0.0, and a BF16 lora_A equals an F32 one of the same values, as in the trainer."""
    torch = pytest.importorskip("torch", reason="bfloat16 tensors are written by safetensors.torch")
    from safetensors.torch import save_file as save_torch

    tensors = adapter_tensors(tiny_llama_dir)
    q, k, v = (f"{PREFIX}.1.self_attn.{m}_proj.lora_A.weight" for m in ("q", "k", "v"))
    signed = {**tensors, q: tensors[q].copy(), k: tensors[k].copy(), v: tensors[v].copy()}
    signed[q][0, 0], signed[k][0, 0], signed[v][0, 0] = 0.0, -0.0, 0.0
    folder = write_adapter(tmp_path / "signed", tiny_llama_dir, signed)
    assert ckpt.adapter_problem(folder, model_dir=tiny_llama_dir) is None
    mixed = {key: torch.from_numpy(value.copy()) for key, value in tensors.items()}
    fused = mixed[q].to(torch.bfloat16)  # values a bfloat16 holds exactly
    mixed[q], mixed[k], mixed[v] = fused.float(), fused, fused.clone()
    folder = write_adapter(tmp_path / "mixed", tiny_llama_dir, {})
    save_torch(mixed, str(folder / "adapter_model.safetensors"))
    assert ckpt.adapter_problem(folder, model_dir=tiny_llama_dir) is None
    mixed[k] = fused.clone()
    mixed[k][0, 0] = fused[0, 0] + 1
    save_torch(mixed, str(folder / "adapter_model.safetensors"))
    assert refusal(folder, tiny_llama_dir).endswith(
        f"tensors {q} and {k} differ, but the trainer fuses their modules into one layer with one lora_A "
        "and needs them equal (a PEFT adapter trained apart from art-mega has one lora_A per module)"
    )


def test_a_committed_step_is_checked_for_finite_values_and_against_the_model(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """A NaN saved before the trainer refused non-finite steps, or a file edited by hand: refused
    at resume. With the base model (what `register` passes) a step of another model's shapes too."""
    pytest.importorskip("torch", reason="the step's weights are written by safetensors.torch")
    from safetensors.torch import load_file
    from safetensors.torch import save_file as save_torch

    save_checkpoint_step(tmp_path, 0)  # layer 0 of a 16-wide model
    assert ckpt.read_resume_step(tmp_path) == 0
    with pytest.raises(CheckpointFileError) as caught:
        ckpt.read_resume_step(tmp_path, tiny_llama_dir)
    assert caught.value.problem.startswith(
        f"tensor {PREFIX}.0.mlp.down_proj.lora_A.weight has shape [4, 16], where"
    )
    folder = save_checkpoint_step(tmp_path, 1)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"
    tensors[key][0, 0] = float("nan")
    save_torch(tensors, str(weights), metadata={"format": "pt"})
    rehash(folder)  # a file edited by hand, its manifest with it
    with pytest.raises(CheckpointFileError) as caught:
        ckpt.read_resume_step(tmp_path)
    assert str(caught.value) == (
        f"{weights} tensor {key} holds 1 NaN and 0 infinite values (of 64), which would reach the optimizer "
        "and the served adapter; restore it from a copy, or give the model another name to start a new run"
    )


def test_a_local_fork_refuses_a_source_step_holding_nan(tmp_path: Path) -> None:
    """The fork's copy is what the forked run's register resumes from: refused at the source."""
    import asyncio

    pytest.importorskip("torch", reason="the step's weights are written by safetensors.torch")
    from safetensors.torch import load_file
    from safetensors.torch import save_file as save_torch

    from art_mega.local import LocalBackend

    class Model:
        name, project = "fork", "proj"

    source = ckpt.checkpoints_dir(ckpt.run_dir(tmp_path, "proj", "base"))
    source.mkdir(parents=True)
    weights = save_checkpoint_step(source, 0) / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = f"{PREFIX}.0.mlp.up_proj.lora_A.weight"
    tensors[key][1, 2] = float("inf")
    save_torch(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointFileError) as caught:  # sha256 first: the manifest names the old file
        asyncio.run(
            LocalBackend(path=str(tmp_path))._experimental_fork_checkpoint(Model(), from_model="base")
        )
    assert caught.value.problem.startswith("has sha256 ")
    rehash(weights.parent)
    with pytest.raises(CheckpointFileError) as caught:
        asyncio.run(
            LocalBackend(path=str(tmp_path))._experimental_fork_checkpoint(Model(), from_model="base")
        )
    assert caught.value.path == str(weights)
    assert caught.value.problem == (
        f"tensor {key} holds 0 NaN and 1 infinite values (of 64), which would reach the optimizer and the "
        "served adapter"
    )
    fork = ckpt.checkpoints_dir(ckpt.run_dir(tmp_path, "proj", "fork"))
    assert not fork.exists() or ckpt.step_folders(fork) == []  # nothing copied
