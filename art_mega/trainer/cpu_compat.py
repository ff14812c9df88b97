"""CPU compatibility layer for megatron-core 0.16.x: the few CUDA assumptions a CPU rank hits.

Applied only to processes whose trainer device is the CPU; each patch is one named function.

megatron-core 0.16.1 runs a dense GPTModel on CPU over gloo once these are worked around
(file:line in megatron/core/, see also shared/FACTS.md):

- `current_device_is_cpu`: `torch.cuda.current_device()` used as an allocation device.
- `cpu_rng_tracker`: the RNG states tracker reads and writes CUDA generator states.
- `cpu_causal_masks`: the default causal and sliding-window masks are built on "cuda".

Not patched yet, because nothing in art-mega runs them on CPU yet: the DDP grad buffers
(`distributed/param_and_grad_buffer.py:800,806`), the optimizer and grad clipping
(`optimizer/optimizer.py:481,485,907`, `optimizer/clip_grads.py:103,167`,
`optimizer/distrib_optimizer.py:361,420,582`), `utils.py:1207`, `pipeline_parallel/schedules.py:596`,
MoE (`moe/router.py:90`, `moe/moe_utils.py:1093,1192`, `moe/token_dispatcher.py:445`), RoPE
utilities (`models/common/embeddings/rope_utils.py:64`), sequence parallel with the torch norm
(`transformer/torch_norm.py:32`) and context parallel (`transformer/dot_product_attention.py:57`,
which needs a CPU core-attention module rather than a patch).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any

from art_mega.errors import UserError

SUPPORTED_MEGATRON_SERIES = "0.16"
"""The megatron-core release series whose CUDA assumptions this layer knows (0.16.x)."""

_UndoLog = list[tuple[Any, str, Any]]
_applied: dict[str, _UndoLog] = {}


def megatron_version() -> str:
    """The installed megatron-core version string, e.g. "0.16.1" (imports `megatron.core`)."""
    from megatron.core.package_info import __version__

    return __version__


def check_megatron_version(version: str | None = None) -> str:
    """Return `version` (default: the installed one) if this layer knows its series.

    Raises `UserError` for any series other than `SUPPORTED_MEGATRON_SERIES`: the patches name
    lines of that release and would silently miss new CUDA assumptions in another one.
    """
    version = version if version is not None else megatron_version()
    if version.split(".")[:2] != SUPPORTED_MEGATRON_SERIES.split("."):
        raise UserError(
            f"megatron-core {version} is installed but art-mega's CPU compatibility layer knows only "
            f"{SUPPORTED_MEGATRON_SERIES}.x; install 'megatron-core>={SUPPORTED_MEGATRON_SERIES},<0.17'."
        )
    return version


def _replace(log: _UndoLog, owner: Any, name: str, value: Any) -> None:
    """Set `owner.name = value`, recording the old value in `log` for `remove_cpu_compat`."""
    log.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _cpu_device() -> str:
    return "cpu"


def current_device_is_cpu(log: _UndoLog) -> None:
    """Make `torch.cuda.current_device()` answer "cpu", so Megatron allocates on the CPU.

    megatron-core passes `torch.cuda.current_device()` as the `device=` of new tensors
    (a CPU-only torch raises "Torch not compiled with CUDA enabled"). Sites a dense GPTModel
    reaches: `models/common/embeddings/rotary_pos_embedding.py:162` (moves `inv_freq` at the
    first forward), `tensor_parallel/mappings.py:91,141,148,181` (TP gather/scatter outputs),
    `tensor_parallel/layers.py:552,597,607` (backward with sequence parallel and weight grads),
    `utils.py:631` (the global memory buffer). It is process-wide: apply it only in a process
    whose trainer device is the CPU, where no CUDA call could succeed anyway.
    """
    import torch

    _replace(log, torch.cuda, "current_device", _cpu_device)


@functools.cache
def _cpu_tracker_class() -> type:
    """`CudaRNGStatesTracker` with CPU generator states (built on first use: imports megatron)."""
    import torch
    from megatron.core.tensor_parallel import random as mcore_random

    base = mcore_random.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's named RNG states (data-, model- and expert-parallel) on the CPU generator.

        `add` seeds a fresh CPU generator state instead of `torch.cuda.manual_seed` +
        `torch.cuda.get_rng_state()` (`tensor_parallel/random.py:235-238`); `fork` swaps the
        CPU default generator's state instead of the CUDA one (`random.py:243-283`).
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    return CpuRNGStatesTracker


def cpu_rng_tracker(log: _UndoLog) -> None:
    """Replace Megatron's CUDA RNG states tracker with one that keeps CPU generator states.

    `model_parallel_cuda_manual_seed` adds named states through `CudaRNGStatesTracker.add`,
    which calls `torch.cuda.get_rng_state()` (`tensor_parallel/random.py:235`), and every
    dropout site forks the tracker (e.g. `transformer/dot_product_attention.py:217`), which reads
    and writes CUDA states (`random.py:55,64,102`). The tracker class is swapped in
    `megatron.core.tensor_parallel.random` (where `initialize_rng_tracker` looks it up) and the
    current tracker is reset, so the next `model_parallel_cuda_manual_seed` seeds CPU states.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    # Recorded first so that undoing restores the class before resetting the tracker.
    log.append((None, "reset_rng_tracker", None))
    _replace(log, mcore_random, "CudaRNGStatesTracker", _cpu_tracker_class())
    mcore_random.initialize_rng_tracker(force_reset=True)


def _default_causal_mask(sq: int):
    import torch

    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]):
    import torch

    mask = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(mask, diagonal=skv - sq - window_size[0])
    lower = torch.tril(upper, diagonal=skv - sq + window_size[1])
    return ~lower


def cpu_causal_masks(log: _UndoLog) -> None:
    """Build the local attention's default causal masks on the CPU.

    When no attention mask is passed, `fusions/fused_softmax.py:322,327` calls
    `get_sliding_window_causal_mask` / `get_default_causal_mask`, which allocate on "cuda"
    (`transformer/utils.py:35,40`). Both names are replaced where `fused_softmax` looks them
    up, with the same masks (True = masked out) on the CPU.
    """
    from megatron.core.fusions import fused_softmax

    _replace(log, fused_softmax, "get_default_causal_mask", _default_causal_mask)
    _replace(log, fused_softmax, "get_sliding_window_causal_mask", _sliding_window_causal_mask)


PATCHES: dict[str, Callable[[_UndoLog], None]] = {
    "current_device_is_cpu": current_device_is_cpu,
    "cpu_rng_tracker": cpu_rng_tracker,
    "cpu_causal_masks": cpu_causal_masks,
}
"""Every patch by name, in the order `apply_cpu_compat` applies them."""


def needs_cpu_compat(device: Any) -> bool:
    """True when `device` (a `torch.device` or a string such as "cpu", "cuda:0") is the CPU."""
    return str(device).split(":")[0] == "cpu"


def apply_cpu_compat(names: Iterable[str] | None = None) -> tuple[str, ...]:
    """Apply the named patches (default: all of `PATCHES`) once each; return those now applied.

    Checks the megatron-core version first (`UserError` for an unknown series) and raises
    `KeyError` for an unknown patch name. Idempotent. Call it only in a process whose trainer
    device is the CPU (see `needs_cpu_compat`), before building the model and seeding.
    """
    check_megatron_version()
    selected = list(PATCHES) if names is None else list(names)
    for name in selected:
        if name not in PATCHES:
            raise KeyError(f"unknown CPU patch {name!r}; known: {', '.join(PATCHES)}")
    for name in selected:
        if name not in _applied:
            log: _UndoLog = []
            PATCHES[name](log)
            _applied[name] = log
    return applied_patches()


def applied_patches() -> tuple[str, ...]:
    """Names of the patches applied in this process, in `PATCHES` order."""
    return tuple(name for name in PATCHES if name in _applied)


def remove_cpu_compat() -> None:
    """Undo every applied patch (for tests that compare behaviour with and without a patch)."""
    for name in reversed(list(_applied)):
        for owner, attr, original in reversed(_applied.pop(name)):
            if attr == "reset_rng_tracker":
                from megatron.core.tensor_parallel import random as mcore_random

                mcore_random.initialize_rng_tracker(force_reset=True)
            else:
                setattr(owner, attr, original)
