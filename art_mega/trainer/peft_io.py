"""LoRA adapters between Megatron's TP-sharded, fused layout and Hugging Face PEFT's file format.

Export gathers each layer's shards over the TP group and writes `adapter_config.json` and
`adapter_model.safetensors` as `peft.PeftModel.save_pretrained` would (rank 0 writes); import
reads them on every rank and keeps this rank's shards (warm start).

MoE experts are written in the per-expert module names of the Hub checkpoints
(`...mlp.experts.{e}.gate_proj.lora_A.weight`, with gate_proj/up_proj/down_proj in
`target_modules`). That is the format PEFT 0.21 converts when it loads an adapter onto
transformers 5's fused 3-D expert parameters (`peft/utils/transformers_weight_conversion.py`:
gate_proj + up_proj -> a `target_parameters` LoRA on `mlp.experts.gate_up_proj` of rank 2r with
A concatenated and B block-diagonal, down_proj -> `mlp.experts.down_proj`), and the per-expert
layout vLLM reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from art_mega.errors import UserError
from art_mega.trainer.families.layout import fc1_shard, fuse_qkv, shard, split_qkv, unfuse_fc1
from art_mega.trainer.lora import LoraConfig, LoraLinear, lora_layers
from art_mega.trainer.lora_targets import HF_TARGETS
from art_mega.trainer.peft_config import ADAPTER_CONFIG, check_adapter_config, read_adapter_config

ADAPTER_WEIGHTS = "adapter_model.safetensors"
HF_LAYER_PREFIX = "base_model.model.model.layers"
"""PEFT's key prefix for a causal LM's decoder layers (PeftModel -> LoraModel -> *ForCausalLM.model)."""

_HF_PARENT = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(?:experts\.(\d+)\.)?(\w+)$")


@dataclass(frozen=True)
class AdapterFiles:
    """What `export_adapter` wrote: the directory, the weights' sha256 (hex) and PEFT's target names."""

    path: Path
    sha256: str
    target_modules: tuple[str, ...]


def _parse(name: str) -> tuple[str, str]:
    """(HF module path under the decoder layers, Megatron target) of a LoRA layer name:
    decoder.layers.3.mlp.linear_fc1 -> ("3.mlp", "linear_fc1"),
    decoder.layers.3.mlp.experts.5.linear_fc2 -> ("3.mlp.experts.5", "linear_fc2")."""
    match = _LAYER_NAME.match(name)
    if match is None:
        raise ValueError(f"unexpected LoRA layer name {name!r}")
    layer, expert, target = match.groups()
    parent = f"{layer}.{_HF_PARENT[target]}" + (f".experts.{expert}" if expert is not None else "")
    return parent, target


def _hf_key(parent: str, hf_module: str, matrix: str) -> str:
    return f"{HF_LAYER_PREFIX}.{parent}.{hf_module}.{matrix}.weight"


def _tp_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all) in the TP group `group`, in rank order."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [tensor]
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def _full_lora(layer: LoraLinear) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(full A [r, in], B shards in TP order) of a column layer, or (full A, [full B]) of a row layer."""
    a = layer.lora_A.detach()
    b = layer.lora_B.detach()
    if layer.tp_size == 1:
        return a, [b]
    if layer.kind == "column":
        return a, _tp_gather(b, layer.tp_group)
    return torch.cat(_tp_gather(a, layer.tp_group), dim=1), [b]


def megatron_to_hf(
    name: str, a: torch.Tensor, b_shards: list[torch.Tensor], num_heads: int, num_query_groups: int
) -> dict[str, torch.Tensor]:
    """PEFT tensors of one Megatron LoRA layer from its full A and its B (shards in TP order).

    linear_qkv: B's fused rows are split per query group into q, k, v (`layout.split_qkv`);
    linear_fc1: each rank's B rows are [gate shard; up shard] (`layout.unfuse_fc1`); the shared
    A is written for each of the HF modules (x A^T is the same input to all of them), which is
    exactly the fused layer's update. linear_proj / linear_fc2 map one to one. An expert's
    linear_fc1 / linear_fc2 maps to that expert's gate_proj + up_proj / down_proj.
    """
    parent, target = _parse(name)
    if target == "linear_qkv":
        full_b = torch.cat(b_shards, dim=0)
        bs = dict(zip(HF_TARGETS[target], split_qkv(full_b, num_heads, num_query_groups)))
    elif target == "linear_fc1":
        bs = dict(zip(HF_TARGETS[target], unfuse_fc1(b_shards)))
    else:
        bs = {HF_TARGETS[target][0]: torch.cat(b_shards, dim=0)}
    out = {}
    for hf_module, b in bs.items():
        out[_hf_key(parent, hf_module, "lora_A")] = a.contiguous().clone()
        out[_hf_key(parent, hf_module, "lora_B")] = b.contiguous().clone()
    return out


def hf_to_megatron(
    name: str,
    tensors: dict[str, torch.Tensor],
    num_heads: int,
    num_query_groups: int,
    tp_size: int,
    tp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's (A, B) of the Megatron LoRA layer `name` from PEFT tensors (inverse of
    `megatron_to_hf`). Raises `UserError` when a tensor is missing, or when the HF modules of a
    fused layer have different A matrices (one fused adapter cannot express them)."""
    parent, target = _parse(name)
    layer = parent.split(".", 1)[0]
    a_list, b_list = [], []
    for hf_module in HF_TARGETS[target]:
        keys = [_hf_key(parent, hf_module, matrix) for matrix in ("lora_A", "lora_B")]
        for key in keys:
            if key not in tensors:
                raise UserError(
                    f"the adapter has no tensor {key}; it does not cover {hf_module} of layer {layer}."
                )
        a_list.append(tensors[keys[0]])
        b_list.append(tensors[keys[1]])
    if any(not torch.equal(a_list[0], other) for other in a_list[1:]):
        raise UserError(
            f"layer {layer}'s {', '.join(HF_TARGETS[target])} have different lora_A matrices; "
            f"art-mega fuses them into one {target} adapter and needs them equal."
        )
    a = a_list[0]
    if target == "linear_qkv":
        b = shard(fuse_qkv(*b_list, num_heads, num_query_groups), 0, tp_size, tp_rank)
    elif target == "linear_fc1":
        b = fc1_shard(b_list[0], b_list[1], tp_size, tp_rank)
    else:
        a = shard(a, 1, tp_size, tp_rank)
        b = b_list[0]
    return a, b


def _ep_gather(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union of every EP rank's expert adapter tensors (CPU copies), on every EP rank.

    Each EP rank holds different experts; an all-gather of the (small) tensor dicts over the
    expert-model-parallel group gives rank 0 all of them. Collective over that group.
    """
    from megatron.core import parallel_state as mpu

    group = mpu.get_expert_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return tensors
    gathered: list[Any] = [None] * size
    local = {key: value.cpu() for key, value in tensors.items()}
    torch.distributed.all_gather_object(gathered, local, group=group)
    return {key: value for part in gathered for key, value in part.items()}


def adapter_config(config: LoraConfig, base_model_name_or_path: str) -> dict[str, Any]:
    """The `adapter_config.json` dict PEFT (and vLLM's PEFT helper) read for this LoRA."""
    alpha = int(config.alpha) if float(config.alpha).is_integer() else config.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": config.hf_target_modules(),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def export_adapter(
    module: Any,
    config: LoraConfig,
    out_dir: str | os.PathLike[str],
    *,
    num_heads: int,
    num_query_groups: int,
    base_model_name_or_path: str,
) -> AdapterFiles | None:
    """Write the LoRA of `module` (a GPTModel with `apply_lora`) as an HF PEFT adapter in `out_dir`.

    Collective: every rank calls it (each TP group all-gathers its shards, each EP group its
    experts' adapters, `_ep_gather`); global rank 0 writes
    `adapter_config.json` and `adapter_model.safetensors` (keys
    `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, ..., tensors in the
    parameters' dtype), each through a temp file, fsync and rename; `out_dir` is created if
    needed. DP replicas hold the same adapter, so only one writes. All ranks return after the
    files exist (a barrier). Returns `AdapterFiles` on rank 0 and None elsewhere. Making a
    whole checkpoint directory appear atomically is the caller's job (write here, then rename).
    """
    tensors: dict[str, torch.Tensor] = {}
    expert_tensors: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(module).items():
        a, b_shards = _full_lora(layer)
        hf = megatron_to_hf(name, a, b_shards, num_heads, num_query_groups)
        (expert_tensors if layer.is_expert else tensors).update(hf)
    tensors.update(_ep_gather(expert_tensors))
    result = None
    if torch.distributed.get_rank() == 0:
        from safetensors.torch import save

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        weights = save({key: tensors[key] for key in sorted(tensors)}, metadata={"format": "pt"})
        _write_atomically(out / ADAPTER_WEIGHTS, weights)
        text = json.dumps(adapter_config(config, base_model_name_or_path), indent=2) + "\n"
        _write_atomically(out / ADAPTER_CONFIG, text.encode())
        result = AdapterFiles(out, hashlib.sha256(weights).hexdigest(), tuple(config.hf_target_modules()))
    torch.distributed.barrier()
    return result


def read_adapter(adapter_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json dict, tensors by key) of a PEFT LoRA directory; `UserError` if unreadable."""
    from safetensors.torch import load_file

    directory = Path(adapter_dir)
    config = read_adapter_config(directory)
    try:
        tensors = load_file(directory / ADAPTER_WEIGHTS)
    except FileNotFoundError as exc:
        raise UserError(f"{directory} is not a PEFT adapter directory ({exc.filename} is missing).") from None
    return config, tensors


@torch.no_grad()
def import_adapter(
    module: Any,
    config: LoraConfig,
    adapter_dir: str | os.PathLike[str],
    *,
    num_heads: int,
    num_query_groups: int,
) -> None:
    """Load a PEFT LoRA adapter into `module`'s LoRA parameters (this rank's shards), in place.

    Every rank reads the files itself (no communication). The adapter must have the trainer's
    rank, alpha and target modules (`AdapterMismatchError` naming each difference otherwise), and equal
    lora_A for the HF modules of a fused layer (see `hf_to_megatron`). Call the optimizer's
    `reload_model_params` afterwards where it keeps separate main parameters.
    """
    directory = Path(adapter_dir)
    found, tensors = read_adapter(directory)
    check_adapter_config(
        found, directory, rank=config.rank, alpha=config.alpha, target_modules=config.hf_target_modules()
    )
    for name, layer in lora_layers(module).items():
        a, b = hf_to_megatron(name, tensors, num_heads, num_query_groups, layer.tp_size, layer.tp_rank)
        for param, value in ((layer.lora_A, a), (layer.lora_B, b)):
            if param.shape != value.shape:
                raise UserError(
                    f"{name}: the adapter's shape {tuple(value.shape)} does not fit this model's "
                    f"{tuple(param.shape)} (another base model?)."
                )
            param.copy_(value.to(param.dtype))
