"""PEFT's LoRA on transformers' fused 3-D expert parameters, from and to art-mega's per-expert PEFT
tensors. Not a family file (`families/__init__._NOT_FAMILIES`).

transformers 5 keeps an MoE layer's experts as one module with two 3-D parameters, `gate_up_proj`
(E experts' gate and up projections) and `down_proj`. PEFT 0.21 adapts them with
`LoraConfig(target_parameters=[f"{experts}.gate_up_proj", f"{experts}.down_proj"])`
(`peft/tuners/lora/layer.py` ParamWrapper): one wrapper per parameter, nested in that order, so
the last one's tensors are the module's own and each earlier one's sit one `base_layer` deeper
(`wrappers`). Per layer and parameter p: `lora_A` [E * r, in] (expert e's A in rows e*r .. e*r+r-1)
and `lora_B` [out, r * E] (`pack_lora_b`), with expert e's weight W_e += (alpha / r) B_e A_e in
nn.Linear's [out, in] orientation (PEFT transposes for a parameter stored as x @ W, its
`is_transposed`). gate_up_proj's B_e stacks gate_proj's and up_proj's B (gate rows first, or
interleaved row by row where transformers interleaves them: GPT-OSS) over the A they share.

vLLM 0.32 reads the same tensors for its "3-D MoE" model classes (`is_3d_moe_weight`:
GptOssForCausalLM, Qwen3_5MoeForConditionalGeneration; `vllm/lora/model_manager.py`
_stack_moe_lora_weights, "experts.base_layer is the gate_up_proj"), and for any MoE model when
started with `--enable-mixed-moe-lora-format` and the adapter loaded with `is_3d_lora_weight`;
art-mega writes this layout on disk for those two (`gpt_oss.GptOssLoraNames`,
`qwen3_5_moe.WRAPPER_LORA_NAMES`).
Its other MoE classes (Qwen3_5MoeForCausalLM, Gemma4ForCausalLM, Gemma4ForConditionalGeneration,
Qwen3MoeForCausalLM) read only per-expert names (`{experts}.{e}.gate_proj`, what
`LoraNames.to_peft` writes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

V = TypeVar("V")

_FIRST = {"gate_up_proj": "gate_proj", "down_proj": "down_proj"}
"""A fused parameter's name -> the per-expert module whose lora_A it packs (gate_up_proj's A is
the one gate_proj and up_proj share)."""


def parameters(experts: str) -> tuple[str, str]:
    """The fused parameters' paths under a decoder layer, in PEFT's wrapping order:
    (`{experts}.gate_up_proj`, `{experts}.down_proj`)."""
    return f"{experts}.gate_up_proj", f"{experts}.down_proj"


def _per_expert(experts: str) -> re.Pattern[str]:
    """A per-expert PEFT key `{layers prefix}.{i}.{experts}.{e}.{module}.lora_{A,B}.weight`."""
    return re.compile(
        rf"^(?P<layer>.+)\.{re.escape(experts)}\.(?P<expert>\d+)\.(?P<module>gate_proj|up_proj|down_proj)"
        r"\.(?P<matrix>lora_[AB])\.weight$"
    )


def _split(
    values: Mapping[str, V], experts: str
) -> tuple[dict[str, V], dict[str, dict[int, dict[tuple[str, str], V]]]]:
    """`values` (tensors or shapes by PEFT key) split into those not per expert under `experts`
    and the per-expert ones as layer -> expert -> (module, matrix) -> value."""
    out: dict[str, V] = {}
    layers: dict[str, dict[int, dict[tuple[str, str], V]]] = {}
    pattern = _per_expert(experts)
    for key, value in values.items():
        match = pattern.match(key)
        if match is None:
            out[key] = value
            continue
        slot = (match["module"], match["matrix"])
        layers.setdefault(match["layer"], {}).setdefault(int(match["expert"]), {})[slot] = value
    return out, layers


def _packed(experts: str) -> re.Pattern[str]:
    """A key of PEFT's LoRA on the fused experts' parameters (`wrappers`)."""
    return re.compile(rf"^(?P<layer>.+)\.{re.escape(experts)}\.(?:base_layer\.)*lora_[AB]\.weight$")


def wrappers(targeted: Sequence[str]) -> dict[str, str]:
    """Parameter -> the module path (under a decoder layer) of its LoRA tensors in PEFT's keys:
    [x.gate_up_proj, x.down_proj] -> x.base_layer (gate_up_proj), x (down_proj), as PEFT 0.21 saves
    them and vLLM 0.32 reads them (module docstring)."""
    n = len(targeted)
    return {p: p.rsplit(".", 1)[0] + ".base_layer" * (n - 1 - i) for i, p in enumerate(targeted)}


def present(slots: Mapping[tuple[str, str], Any], experts: str) -> list[str]:
    """The fused parameters (in order) whose per-expert lora_A is among one expert's `slots`
    ((module, matrix) -> tensor or shape): gate_up_proj for gate_proj, down_proj for down_proj."""
    return [p for p in parameters(experts) if (_FIRST[p.rsplit(".", 1)[1]], "lora_A") in slots]


def interleave_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """[2I, ...] rows gate 0, up 0, gate 1, up 1, ... of `gate` and `up` [I, ...] (GPT-OSS's
    gate_up_proj order: gate = [..., ::2], up = [..., 1::2])."""
    import torch

    return torch.stack((gate, up), dim=1).flatten(0, 1)


def pack_lora_b(blocks: Sequence[Tensor]) -> Tensor:
    """PEFT's lora_B [out, r * E] of a 3-D parameter from the experts' B blocks (E of [out, r]):
    column k * E + e is expert e's column k (ParamWrapper.get_delta_weight reshapes B to
    (out, r, E); vLLM's 3-D MoE LoRA reads it the same way)."""
    import torch

    stacked = torch.stack(list(blocks))  # [E, out, r]
    return stacked.permute(1, 2, 0).reshape(stacked.shape[1], -1).contiguous()


def unpack_lora_b(packed: Tensor, num_experts: int) -> Tensor:
    """The experts' B blocks [E, out, r] of PEFT's packed lora_B [out, r * E] (`pack_lora_b`)."""
    return packed.reshape(packed.shape[0], -1, num_experts).permute(2, 0, 1)


def pack(tensors: dict[str, Tensor], experts: str, *, interleave: bool) -> dict[str, Tensor]:
    """The per-expert gate_proj / up_proj / down_proj tensors under `experts` of each layer
    (experts 0 .. E-1, all of them) as PEFT's fused-parameter tensors (module docstring; gate and
    up rows interleaved when `interleave`, else gate rows first); other tensors as they are."""
    import torch

    out, layers = _split(tensors, experts)
    for layer, by_expert in layers.items():
        found = [by_expert[e] for e in range(len(by_expert))]
        for parameter, path in wrappers(present(found[0], experts)).items():
            first = _FIRST[parameter.rsplit(".", 1)[1]]
            if first == "gate_proj":
                join = interleave_gate_up if interleave else lambda g, u: torch.cat((g, u))
                blocks = [join(x["gate_proj", "lora_B"], x["up_proj", "lora_B"]) for x in found]
            else:
                blocks = [x["down_proj", "lora_B"] for x in found]
            out[f"{layer}.{path}.lora_A.weight"] = torch.cat([x[first, "lora_A"] for x in found]).contiguous()
            out[f"{layer}.{path}.lora_B.weight"] = pack_lora_b(blocks)
    return out


def unpack(
    tensors: Mapping[str, Tensor], config: Mapping[str, Any], experts: str, *, interleave: bool
) -> dict[str, Tensor]:
    """The per-expert tensors `LoraNames.to_peft` writes from PEFT's fused-parameter tensors
    (inverse of `pack`; rank and parameters from the adapter's `config`, adapter_config.json); a
    missing tensor is left for `LoraNames.from_peft` to name."""
    rank, paths = int(config["r"]), wrappers(list(config.get("target_parameters") or ()))
    pattern = _packed(experts)
    out = {key: value for key, value in tensors.items() if pattern.match(key) is None}
    for layer in sorted({m["layer"] for m in map(pattern.match, tensors) if m is not None}):
        for parameter, path in paths.items():
            a, b = (tensors.get(f"{layer}.{path}.{matrix}.weight") for matrix in ("lora_A", "lora_B"))
            if a is None or b is None:
                continue
            num_experts = a.shape[0] // rank
            blocks = unpack_lora_b(b, num_experts)
            gate_up = parameter.endswith("gate_up_proj")
            for e in range(num_experts):
                a_e = a[e * rank : (e + 1) * rank].contiguous()
                if not gate_up:
                    parts = {"down_proj": blocks[e]}
                elif interleave:
                    parts = {"gate_proj": blocks[e][0::2], "up_proj": blocks[e][1::2]}
                else:
                    parts = dict(zip(("gate_proj", "up_proj"), blocks[e].chunk(2)))
                for module, b_e in parts.items():
                    out[f"{layer}.{experts}.{e}.{module}.lora_A.weight"] = a_e
                    out[f"{layer}.{experts}.{e}.{module}.lora_B.weight"] = b_e.contiguous()
    return out


def pack_shapes(
    shapes: dict[str, tuple[int, int]], shared: list[tuple[str, ...]], rank: int, experts: str
) -> tuple[dict[str, tuple[int, int]], list[tuple[str, ...]]]:
    """`pack` on shapes: each layer's E experts' gate_proj A (r, h) and B (I, r) -> its
    gate_up_proj A (E r, h) and B (2I, E r); down_proj A (r, I), B (h, r) -> (E r, I),
    (h, E r); the experts' shared-A groups go (the packed A is one tensor). Torch-free."""
    out, layers = _split(shapes, experts)
    pattern = _per_expert(experts)
    for layer, by_expert in layers.items():
        n, slots = len(by_expert), next(iter(by_expert.values()))
        for parameter, path in wrappers(present(slots, experts)).items():
            first = _FIRST[parameter.rsplit(".", 1)[1]]
            (_, fan_in), (fan_out, _) = slots[(first, "lora_A")], slots[(first, "lora_B")]
            width = 2 * fan_out if first == "gate_proj" else fan_out
            out[f"{layer}.{path}.lora_A.weight"] = (n * rank, fan_in)
            out[f"{layer}.{path}.lora_B.weight"] = (width, n * rank)
    kept = [group for group in shared if not any(pattern.match(key) for key in group)]
    return out, kept


def peft_form(
    tensors: Mapping[str, Tensor], config: Mapping[str, Any], experts: str
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """An adapter with per-expert tensors under `experts` (gate rows first in HF's gate_up_proj)
    as PEFT 0.21 loads it onto transformers' fused experts: the tensors `pack`ed, and its
    adapter_config.json dict `config` with `target_parameters` naming the packed parameters (in
    wrapping order); `target_modules` stays (the dense or shared MLP's gate/up/down_proj)."""
    pattern = _per_expert(experts)
    slots = {(m["module"], m["matrix"]): None for m in map(pattern.match, tensors) if m is not None}
    targeted = present(slots, experts)
    packed = pack(dict(tensors), experts, interleave=False)
    return packed, {**config, "target_parameters": [*(config.get("target_parameters") or ()), *targeted]}
