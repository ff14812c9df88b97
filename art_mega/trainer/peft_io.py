"""LoRA adapters between Megatron's TP-sharded, fused layout and Hugging Face PEFT's file format.

Export gathers each layer's shards over the TP group and writes `adapter_config.json` and
`adapter_model.safetensors` as `peft.PeftModel.save_pretrained` would (rank 0 writes); import
reads them on every rank and keeps this rank's shards (warm start). The module names and the
fused-layer splits are the model family's (`FamilySpec.lora`, `families/spec.py` LoraNames).

MoE experts are written in the per-expert module names of the Hub checkpoints
(`...mlp.experts.{e}.gate_proj.lora_A.weight`, with gate_proj/up_proj/down_proj in
`target_modules`), the layout vLLM 0.32 reads for its 2-D MoE LoRA models (Qwen3-MoE, DeepSeek-V3,
text-only Qwen3.5 MoE, Gemma 4). PEFT 0.21 converts it onto transformers 5's fused 3-D expert
parameters (`peft/utils/transformers_weight_conversion.py`: gate_proj + up_proj -> a
`target_parameters` LoRA on `mlp.experts.gate_up_proj` of rank 2r with A concatenated and B
block-diagonal, down_proj -> `mlp.experts.down_proj`) only for the model types it maps (qwen3_moe,
deepseek_v3, ...), and there it takes every gate_proj / up_proj / down_proj in `target_modules`
for the experts', so a dense or shared-expert MLP beside them gets no LoRA (DeepSeek-V3's first
layers and shared experts). `write_for_peft` writes what PEFT loads whole (`LoraNames.for_peft`):
for text-only Qwen3.5 MoE, Gemma 4 and DeepSeek-V3 the experts as PEFT's `target_parameters`
tensors (`families/fused_experts.py`), and for DeepSeek-V3 its dense and shared MLPs as 2-D
`target_parameters` (`LoraNames.mlp_parameters`). A model
whose experts vLLM reads only as 3-D tensors (GPT-OSS: gate/up interleaved; the Hub's Qwen3.5 MoE
wrapper, Qwen3_5MoeForConditionalGeneration: gate rows first) writes that layout on disk through
`LoraNames.pack` / `unpack` / `peft_targets` (`families/gpt_oss.py` GptOssLoraNames), which PEFT
loads as it is. Multimodal wrappers (Gemma 3, Qwen3.5) name the decoder layers
`base_model.model.model.language_model.layers` (`FamilySpec.lora_names`).

`adapter_layout` is the same mapping without tensors: every PEFT key the trainer loads for a
model, with its shape, and which lora_A matrices one fused layer shares. The controller checks a
warm-start adapter against it at `register` (`checkpoint.check_warm_start`), so this module
imports torch only inside the functions that move tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError
from art_mega.trainer.checkpoint import atomic_write
from art_mega.trainer.families.spec import LoraNames
from art_mega.trainer.peft_config import ADAPTER_CONFIG, check_adapter_config, read_adapter_config
from art_mega.trainer.protocol import LoraConfig

if TYPE_CHECKING:
    import torch

    from art_mega.trainer.rank.lora import LoraLinear

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterFiles:
    """What `export_adapter` wrote: the directory, the weights' sha256 (hex) and PEFT's target names."""

    path: Path
    sha256: str
    target_modules: tuple[str, ...]


def _tp_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all) in the TP group `group`, in rank order."""
    import torch

    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [tensor]
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def _tp_parts(layer: LoraLinear) -> tuple[int, ...] | None:
    """The full row counts of the parts a column layer's TP shards each hold a slice of (its base
    layer's `tp_parts`, set by the family: Qwen3.5's in_proj_qkv holds (q, k, v) rows), else None."""
    parts = getattr(layer.base, "tp_parts", None)
    return tuple(parts) if parts is not None and layer.kind == "column" else None


def _full_lora(layer: LoraLinear) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(full A [r, in], B shards in TP order) of a column layer, or (full A, [full B]) of a row layer.

    A column layer with `_tp_parts` gives B's pieces part by part (part 0 of every rank, then
    part 1, ...), so that their concatenation is B in the HF module's row order."""
    import torch

    a = layer.lora_A.detach()
    b = layer.lora_B.detach()
    if layer.tp_size == 1:
        return a, [b]
    if layer.kind == "column":
        return a, hf_order(_tp_gather(b, layer.tp_group), _tp_parts(layer))
    return torch.cat(_tp_gather(a, layer.tp_group), dim=1), [b]


def hf_order(shards: list[torch.Tensor], parts: tuple[int, ...] | None) -> list[torch.Tensor]:
    """A column layer's B `shards` (TP rank order, each [rows / tp, r]) as `LoraNames.to_peft`
    takes them: as they are without `parts`; with `parts` (the full row counts of the parts
    each shard holds a slice of, `_tp_parts`) piece by piece, part 0 of every rank, then part
    1, ..., so that their concatenation is B in the HF module's row order."""
    if parts is None:
        return shards
    local = [rows // len(shards) for rows in parts]
    split = [shard.split(local, dim=0) for shard in shards]
    return [pieces[i] for i in range(len(local)) for pieces in split]


def column_parts(layer: LoraLinear) -> tuple[int, ...] | None:
    """`LoraNames.from_peft`'s `column_parts` for `layer`: its `_tp_parts`, else its full row
    count for a column layer (B split over TP as one part), None for a row layer."""
    return _tp_parts(layer) or ((layer.out_features,) if layer.kind == "column" else None)


def _ep_gather(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union of every EP rank's expert adapter tensors (CPU copies), on every EP rank.

    Each EP rank holds different experts; an all-gather of the (small) tensor dicts over the
    expert-model-parallel group gives rank 0 all of them. Collective over that group.
    """
    import torch
    from megatron.core import parallel_state as mpu

    group = mpu.get_expert_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return tensors
    gathered: list[Any] = [None] * size
    local = {key: value.cpu() for key, value in tensors.items()}
    torch.distributed.all_gather_object(gathered, local, group=group)
    return {key: value for part in gathered for key, value in part.items()}


def _pp_gather(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union of every pipeline stage's adapter tensors (CPU copies), on every stage.

    Each stage holds the LoRA of its own decoder layers, already named by their global index
    (`lora._adapter_name`); an all-gather of the tensor dicts over the pipeline group gives global
    rank 0 (on the first stage) the whole adapter. Collective over that group.
    """
    import torch
    from megatron.core import parallel_state as mpu

    group = mpu.get_pipeline_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return tensors
    gathered: list[Any] = [None] * size
    local = {key: value.cpu() for key, value in tensors.items()}
    torch.distributed.all_gather_object(gathered, local, group=group)
    return {key: value for part in gathered for key, value in part.items()}


def adapter_config(
    config: LoraConfig, base_model_name_or_path: str, names: LoraNames | None = None
) -> dict[str, Any]:
    """The `adapter_config.json` dict PEFT (and vLLM's PEFT helper) read for this LoRA: its
    targets as the family's `names` write them (`LoraNames.peft_targets`: `target_modules`, and
    `target_parameters` where the family has them), else in the names every family shares
    (`families.LORA_NAMES`)."""
    alpha = int(config.alpha) if float(config.alpha).is_integer() else config.alpha
    targets = names.peft_targets(config.targets) if names else {"target_modules": config.hf_target_modules()}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        **targets,
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


def export_adapter(
    module: Any,
    config: LoraConfig,
    out_dir: str | os.PathLike[str],
    *,
    num_heads: int,
    num_query_groups: int,
    names: LoraNames,
    base_model_name_or_path: str,
) -> AdapterFiles | None:
    """Write the LoRA of `module` (a GPTModel with `apply_lora`) as an HF PEFT adapter in `out_dir`.

    `names` are the model family's LoRA <-> PEFT names (`FamilySpec.lora`), `num_heads` and
    `num_query_groups` its attention heads and KV heads (to split the fused QKV adapter).

    Collective: every rank calls it (each TP group all-gathers its shards, each EP group its
    experts' adapters, `_ep_gather`, each pipeline group its stages' layers, `_pp_gather`);
    global rank 0 writes
    `adapter_config.json` and `adapter_model.safetensors` (keys
    `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, ..., tensors in the
    parameters' dtype, in the family's on-disk format, `LoraNames.pack`), each through `checkpoint.atomic_write` (temp file, fsync, rename);
    `out_dir` is created if needed. DP replicas hold the same adapter, so only one writes. All ranks return after the
    files exist (a barrier). Returns `AdapterFiles` on rank 0 and None elsewhere. Making a
    whole checkpoint directory appear atomically is the caller's job (`checkpoint.place_folder`).
    """
    import torch

    from art_mega.trainer.rank.lora import lora_layers

    tensors: dict[str, torch.Tensor] = {}
    expert_tensors: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(module).items():
        a, b_shards = _full_lora(layer)
        hf = names.to_peft(name, a, b_shards, num_heads, num_query_groups)
        (expert_tensors if layer.is_expert else tensors).update(hf)
    tensors.update(_ep_gather(expert_tensors))
    tensors = _pp_gather(tensors)
    result = None
    if torch.distributed.get_rank() == 0:
        from safetensors.torch import save

        tensors = names.pack(tensors)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        weights = save({key: tensors[key] for key in sorted(tensors)}, metadata={"format": "pt"})
        with atomic_write(out / ADAPTER_WEIGHTS) as handle:
            handle.write(weights)
        text = json.dumps(adapter_config(config, base_model_name_or_path, names), indent=2) + "\n"
        with atomic_write(out / ADAPTER_CONFIG) as handle:
            handle.write(text.encode())
        result = AdapterFiles(
            out, hashlib.sha256(weights).hexdigest(), tuple(names.hf_target_modules(config.targets))
        )
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


def import_adapter(
    module: Any,
    config: LoraConfig,
    adapter_dir: str | os.PathLike[str],
    *,
    num_heads: int,
    num_query_groups: int,
    names: LoraNames,
) -> None:
    """Load a PEFT LoRA adapter into `module`'s LoRA parameters (this rank's shards), in place.

    `names`, `num_heads`, `num_query_groups`: the model family's, as for `export_adapter`.

    Every rank reads the files itself (no communication) and turns them into per-module tensors
    (`LoraNames.unpack`). The adapter must have the trainer's rank, alpha and targets (`AdapterMismatchError` naming each difference otherwise), and equal
    lora_A for the HF modules of a fused layer (see `LoraNames.from_peft`). Call the optimizer's
    `reload_model_params` afterwards where it keeps separate main parameters.
    """
    import torch

    from art_mega.trainer.rank.lora import lora_layers

    directory = Path(adapter_dir)
    found, tensors = read_adapter(directory)
    check_adapter_config(
        found,
        directory,
        rank=config.rank,
        alpha=config.alpha,
        **names.peft_targets(config.targets),
    )
    tensors = names.unpack(tensors, found)
    with torch.no_grad():
        for name, layer in lora_layers(module).items():
            a, b = names.from_peft(
                name,
                tensors,
                num_heads,
                num_query_groups,
                layer.tp_size,
                layer.tp_rank,
                column_parts=column_parts(layer),
            )
            for param, value in ((layer.lora_A, a), (layer.lora_B, b)):
                if param.shape != value.shape:
                    raise UserError(
                        f"{name}: the adapter's shape {tuple(value.shape)} does not fit this model's "
                        f"{tuple(param.shape)} (another base model?)."
                    )
                param.copy_(value.to(param.dtype))


def write_for_peft(
    adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], hf_config: dict[str, Any]
) -> Path:
    """Write the adapter in `adapter_dir` (as `export_adapter` wrote it for the model whose
    config.json is `hf_config`) to `out_dir` (created) as PEFT 0.21's `PeftModel.from_pretrained`
    loads it onto transformers' model: the same factors, in the family's PEFT form
    (`LoraNames.for_peft`: text-only Qwen3.5 MoE's, Gemma 4's and DeepSeek-V3's experts as
    `target_parameters` tensors, DeepSeek-V3's dense and shared MLPs as 2-D `target_parameters`;
    other families' adapters as they are). Returns `out_dir`.

    Raises:
        UserError: `adapter_dir` is not a readable adapter, or the model's family is not
            supported or its config refused (one sentence each).
    """
    from safetensors.torch import save

    from art_mega.trainer.families import lora_names_of

    names = lora_names_of(hf_config)
    config, tensors = read_adapter(adapter_dir)
    tensors, config = names.for_peft(tensors, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = save({key: tensors[key].contiguous() for key in sorted(tensors)}, metadata={"format": "pt"})
    with atomic_write(out / ADAPTER_WEIGHTS) as handle:
        handle.write(weights)
    with atomic_write(out / ADAPTER_CONFIG) as handle:
        handle.write((json.dumps(config, indent=2) + "\n").encode())
    return out


@dataclass(frozen=True)
class AdapterLayout:
    """The PEFT tensors the trainer loads into one model (`import_adapter`, `LoraNames.from_peft`).

    Attributes:
        shapes: tensor key -> its shape: lora_A [r, in_features], lora_B [out_features, r].
        shared_a: per fused Megatron layer of several HF modules (q/k/v_proj, gate/up_proj), the
            keys of their lora_A matrices, which must be equal (one fused adapter has one A).
        num_layers: the model's decoder layers (keys name layers 0 to num_layers - 1).
    """

    shapes: dict[str, tuple[int, int]]
    shared_a: tuple[tuple[str, ...], ...]
    num_layers: int


def adapter_layout(
    hf_config: dict[str, Any], rank: int, target_modules: Sequence[str], target_parameters: Sequence[str] = ()
) -> AdapterLayout:
    """The `AdapterLayout` of a LoRA of rank `rank` on the HF modules `target_modules` (and
    parameters `target_parameters`, adapter_config.json's fields) of the model whose config.json
    is `hf_config`, in its family's on-disk PEFT names (`FamilySpec.lora`, `LoraNames.pack_shapes`).

    Each HF module's (in, out) features are `_features`'. In an MoE family every MoE layer's
    expert targets are per expert (`...mlp.experts.{e}.gate_proj`, ffn = the expert width), plus
    the shared expert's where the family has one (`...mlp.shared_expert.gate_proj`, ffn = its
    width), as `LoraNames.to_peft` names them, then packed as `export_adapter` writes them
    (GPT-OSS: the experts as PEFT's `target_parameters` tensors); a dense layer of an MoE model
    (DeepSeek-V3's first `first_k_dense_replace`, its arguments' `moe_layers`) has the dense
    MLP's (`...mlp.gate_proj`, ffn = the dense width). Torch-free;
    `tests/unit/trainer/test_adapter_layout_hf.py` checks it against transformers' modules.

    Raises:
        UserError: the model's family is not supported or its config is refused
            (`family_for`, the family's `model_args`), or `target_modules` names an unknown
            module or part of a fused layer (`LoraNames.normalise`), or `target_parameters` a
            parameter the family does not adapt (`LoraNames.config_modules`).
    """
    from art_mega.trainer.families import family_for

    spec = family_for(hf_config)
    args = spec.model_args(hf_config)
    names = spec.lora_names(args)
    no_attention = getattr(args, "linear_layers", ())  # Qwen3.5's delta-net layers: no self_attn
    experts = int(getattr(args, "num_experts", 0))  # a dense family's arguments have no experts
    moe_layers = getattr(args, "moe_layers", (True,) * args.num_layers)  # DeepSeek-V3: dense first layers
    shared_ffn = int(getattr(args, "shared_expert_ffn_hidden_size", 0))
    widths = {
        "dense": _features(args, names.output_gate, args.ffn_hidden_size),
        "expert": _features(args, names.output_gate, getattr(args, "expert_ffn_hidden_size", 0)),
        "shared": _features(args, names.output_gate, shared_ffn),
    }
    shapes: dict[str, tuple[int, int]] = {}
    shared: list[tuple[str, ...]] = []
    for layer in range(args.num_layers):
        for target in names.normalise(names.config_modules(target_modules, target_parameters)):
            mixer = names.parents[target] in ("self_attn", "linear_attn")
            if mixer and bool(no_attention and no_attention[layer]) != (
                names.parents[target] == "linear_attn"
            ):
                continue  # self_attn on full-attention layers only, linear_attn on delta-net layers only
            placed = [
                (where, widths[kind][target])
                for where, kind in names.hf_parents(layer, target, experts if moe_layers[layer] else 0)
                if kind != "shared" or shared_ffn  # a shared expert's adapters where it has a width
            ]
            if hasattr(args, "attention") and names.parents[target] == "self_attn":
                placed = [(placed[0][0], _layer_attention(args, layer, target))]  # Gemma 4: per-layer heads
            for where, dims in placed:
                a_keys = []
                for module, (fan_in, fan_out) in zip(names.modules[target], dims, strict=True):
                    a_keys.append(names.peft_key(where, module, "lora_A"))
                    shapes[a_keys[-1]] = (rank, fan_in)
                    shapes[names.peft_key(where, module, "lora_B")] = (fan_out, rank)
                if len(a_keys) > 1:
                    shared.append(tuple(a_keys))
    shapes, shared = names.pack_shapes(shapes, shared, rank)
    return AdapterLayout(shapes, tuple(shared), args.num_layers)


def _features(args: Any, output_gate: bool, ffn: int) -> dict[str, tuple[tuple[int, int], ...]]:
    """(in, out) of the HF modules of each Megatron target (in `LoraNames.modules` order) of the
    model with arguments `args`, its MLP (dense, expert or shared) of width `ffn`. h = hidden
    size, d = head width: linear_qkv h -> q_proj heads*d (2*heads*d with the output gate,
    `output_gate`, Qwen3.5), k_proj / v_proj kv_heads*d; linear_proj (o_proj) heads*d -> h
    (heads * v_head_dim where the arguments have one, MLA); linear_fc1 h -> gate_proj / up_proj
    ffn; linear_fc2 (down_proj) ffn -> h. Qwen3.5's delta-net linear_attn: in_proj_qkv
    h -> 2 * key heads * key width + value heads * value width, in_proj_z h -> value heads *
    value width, out_proj back to h. DeepSeek-V3's MLA (`deepseek_v3.megatron_state_dict`):
    q_a_proj h -> q_lora_rank, q_b_proj q_lora_rank -> heads * (qk_nope + qk_rope) (= heads*d),
    kv_a_proj_with_mqa h -> kv_lora_rank + qk_rope_head_dim. A target the family lacks gets
    sizes from absent arguments (0) and is never asked for."""
    hidden, heads, head_dim = args.hidden_size, args.num_heads, args.head_dim
    kv_out = args.num_query_groups * head_dim
    key = getattr(args, "linear_num_key_heads", 0) * getattr(args, "linear_key_head_dim", 0)
    value = getattr(args, "linear_num_value_heads", 0) * getattr(args, "linear_value_head_dim", 0)
    q_lora = getattr(args, "q_lora_rank", 0)
    kv_latent = getattr(args, "kv_lora_rank", 0) + getattr(args, "qk_rope_head_dim", 0)
    return {
        "linear_qkv": (
            (hidden, heads * head_dim * (2 if output_gate else 1)),
            (hidden, kv_out),
            (hidden, kv_out),
        ),
        "linear_proj": ((heads * getattr(args, "v_head_dim", head_dim), hidden),),
        "linear_fc1": ((hidden, ffn), (hidden, ffn)),
        "linear_fc2": ((ffn, hidden),),
        "in_proj_qkv": ((hidden, 2 * key + value),),
        "in_proj_z": ((hidden, value),),
        "out_proj": ((value, hidden),),
        "linear_q_down_proj": ((hidden, q_lora),),
        "linear_q_up_proj": ((q_lora, heads * head_dim),),
        "linear_kv_down_proj": ((hidden, kv_latent),),
    }


def _layer_attention(args: Any, layer: int, target: str) -> tuple[tuple[int, int], ...]:
    """(in, out) of the HF modules of attention `target` on `layer` of a model whose layers differ
    (`args.attention(layer)` = (head width, KV heads, _): q/k/v_proj, o_proj; Gemma 4 writes a
    v_proj adapter on its k_eq_v layers too, `gemma4.Gemma4LoraNames.to_peft`)."""
    head_dim, groups, _ = args.attention(layer)
    hidden, q = args.hidden_size, args.num_heads * head_dim
    if target == "linear_proj":
        return ((q, hidden),)
    return ((hidden, q), (hidden, groups * head_dim), (hidden, groups * head_dim))
