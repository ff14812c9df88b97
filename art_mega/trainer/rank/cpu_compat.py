"""CPU compatibility layer for megatron-core 0.16.x: the few CUDA assumptions a CPU rank hits.

Applied only to processes whose trainer device is the CPU; each patch is one named function.

megatron-core 0.16.1 runs a dense GPTModel, its DDP wrapper, optimizers and schedule on CPU over
gloo once these are worked around (file:line in megatron/core/, see also shared/FACTS.md):

- `current_device_is_cpu`: `torch.cuda.current_device()` used as an allocation device (this also
  covers the DDP grad buffers, `distributed/param_and_grad_buffer.py:783,800,806`).
- `cpu_rng_tracker`: the RNG states tracker reads and writes CUDA generator states.
- `cpu_causal_masks`: the default causal and sliding-window masks are built on "cuda".
- `cpu_optimizer_tensors`: optimizer bookkeeping tensors made with `device='cuda'` and
  parameter-type checks against `torch.cuda.*Tensor` strings (`optimizer/optimizer.py`,
  `optimizer/distrib_optimizer.py`).
- `cpu_grad_norm`: grad-norm, clipping and zero-counting tensors made on "cuda", and a
  `torch.cuda.FloatTensor` assertion (`optimizer/clip_grads.py`, `utils.py:1207`).
- `cpu_schedule_tokens`: the no-pipelining schedule's token counter made on "cuda"
  (`pipeline_parallel/schedules.py:596`).

The last three rewrite a few literal fragments of named megatron-core functions (`_rewrite`):
each fragment must occur exactly as often as expected, or the patch refuses to apply, so a
changed megatron-core fails loudly here rather than silently later.

- `cpu_moe_router_gemm`: the MoE router's GEMM names `te_general_gemm`, which exists only when
  TransformerEngine imports (`transformer/moe/moe_utils.py:1192`). The router's move of its
  weight to `torch.cuda.current_device()` (`moe/router.py:90`) is covered by
  `current_device_is_cpu`.
- `cpu_alltoall_dispatcher`: the alltoall token dispatcher's CUDA side stream
  (`moe/token_dispatcher.py:445,871-895`) and its split sizes, which stay tensors on the CPU
  (`moe/moe_utils.py:1093` moves only CUDA tensors) and which gloo's `all_to_all_single` rejects.
- `cpu_sequence_parallel_norm`: the torch norm refuses sequence parallel
  (`transformer/torch_norm.py:32`), which Megatron's MoE layer requires with TP > 1.

- `cpu_rope_cp_slice`: RoPE's context-parallel slicing moves its index to "cuda"
  (`models/common/embeddings/rope_utils.py:62-64`). Context parallel itself is not a patch: the
  local `DotProductAttention` refuses it (`transformer/dot_product_attention.py:57`) and
  `cp_attention.py` provides the core attention.

- `cpu_pipeline_schedule`: the 1F1B pipeline schedule's token counter made on "cuda"
  (`pipeline_parallel/schedules.py:2138`), the `torch.cuda.synchronize()` after exchanging
  tensor shapes (`pipeline_parallel/p2p_communication.py:242`, variable sequence lengths) and
  the tied output weight moved to CUDA (`models/common/language_module/language_module.py:244`). The
  point-to-point sends themselves are plain `isend` / `irecv`, which gloo runs (the engine sets
  `batch_p2p_comm=False`, so the other `synchronize` at `:398` is never reached).

- `cpu_checkpoint_rng`: activation recomputation's checkpoint saves and restores the CUDA
  generator's state around each recomputed chunk (`tensor_parallel/random.py:444-460`,
  `_get_all_rng_states` / `_set_all_rng_states`, called by `CheckpointFunction`).

Not patched, because nothing in art-mega runs it on CPU: the interleaved (virtual-stage)
pipeline schedule (`pipeline_parallel/schedules.py:983`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import textwrap
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
    from art_mega.trainer.rank.sdpa_attention import sliding_window_causal_mask

    return sliding_window_causal_mask(sq, skv, window_size)


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


Edit = tuple[str, str, int]
"""(fragment of megatron-core source, its CPU replacement, how many times it must occur)."""

_ON_CUDA = ("device='cuda'", "device='cpu'")
_HALF_TYPES = "type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']"
_FLOAT_TYPE = "type() == 'torch.cuda.FloatTensor'"
_HALF_DTYPES = "dtype in (torch.float16, torch.bfloat16)"
_FLOAT_DTYPE = "dtype == torch.float32"


def _plain_function(owner: Any, name: str) -> Any:
    """The undecorated function object behind `owner.name` (method, static/class method, function)."""
    attr = inspect.getattr_static(owner, name)
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    return inspect.unwrap(attr)


def _rewrite(log: _UndoLog, owner: Any, name: str, edits: Iterable[Edit]) -> None:
    """Recompile `owner.name` with textual `edits` and swap in the new code object.

    The function object stays the same (only its `__code__` changes), so every module that
    imported it by name sees the change, and undoing restores the old code. The source is
    compiled under the original file name and line numbers (tracebacks point at megatron-core)
    inside a factory that re-creates its free variables, so closures such as zero-argument
    `super()`'s `__class__` cell keep working. Decorators are left as they are.

    Raises `RuntimeError` naming the function when a fragment does not occur exactly the expected
    number of times (the installed megatron-core differs from the release this layer knows).
    """
    function = _plain_function(owner, name)
    lines, first_line = inspect.getsourcelines(function)
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "async def ")))
    source = textwrap.dedent("".join(lines[start:]))
    where = f"{function.__module__}.{function.__qualname__}"
    for old, new, count in edits:
        found = source.count(old)
        if found != count:
            raise RuntimeError(
                f"{where} contains {old!r} {found} times, expected {count}: megatron-core changed; "
                "update art_mega/trainer/rank/cpu_compat.py"
            )
        source = source.replace(old, new)
    code = function.__code__
    free = ", ".join(code.co_freevars)
    factory = (
        "\n" * (first_line + start - 2)
        + f"def _art_mega_factory({free}):\n"
        + textwrap.indent(source, "    ")
        + f"    return {function.__name__}\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(factory, code.co_filename, "exec"), function.__globals__, namespace)
    rebuilt = namespace["_art_mega_factory"](*([None] * len(code.co_freevars))).__code__
    if rebuilt.co_freevars != code.co_freevars:
        raise RuntimeError(f"{where}: rewritten code has free variables {rebuilt.co_freevars}")
    _replace(log, function, "__code__", rebuilt)


def cpu_optimizer_tensors(log: _UndoLog) -> None:
    """Let Megatron's optimizers wrap CPU parameters and keep their bookkeeping on the CPU.

    `MixedPrecisionOptimizer.__init__` (`optimizer/optimizer.py:473,481,485`) and
    `FP32Optimizer.__init__` (`:907`) make scale and overflow tensors with `device='cuda'`;
    `Float16OptimizerWithFloat16Params.__init__` (`:671,690`) and the distributed optimizer
    (`optimizer/distrib_optimizer.py:361,420` in `_build_model_and_main_param_groups`, `:582` in
    `__init__`) sort parameters by `param.type()` strings that only CUDA tensors have, and
    reject CPU ones. The device becomes "cpu" and the type checks become dtype checks.
    """
    from megatron.core.optimizer import distrib_optimizer, optimizer

    _rewrite(log, optimizer.MixedPrecisionOptimizer, "__init__", [(*_ON_CUDA, 3)])
    _rewrite(log, optimizer.FP32Optimizer, "__init__", [(*_ON_CUDA, 1)])
    _rewrite(
        log,
        optimizer.Float16OptimizerWithFloat16Params,
        "__init__",
        [(_HALF_TYPES, _HALF_DTYPES, 1), (_FLOAT_TYPE, _FLOAT_DTYPE, 1)],
    )
    _rewrite(
        log,
        distrib_optimizer.DistributedOptimizer,
        "_build_model_and_main_param_groups",
        [(_HALF_TYPES, _HALF_DTYPES, 1), (_FLOAT_TYPE, _FLOAT_DTYPE, 1)],
    )
    _rewrite(log, distrib_optimizer.DistributedOptimizer, "__init__", [(_HALF_TYPES, _HALF_DTYPES, 1)])


def cpu_grad_norm(log: _UndoLog) -> None:
    """Compute grad norms, clip and count zeros with CPU tensors.

    `optimizer/clip_grads.py` makes its norm, overflow and count tensors with `device='cuda'`
    (`get_grad_norm_fp32` :90,103,115; `clip_grad_by_total_norm_fp32` :174; `count_zeros_fp32`
    :207) and asserts `param.grad.type() == 'torch.cuda.FloatTensor'` (:167); without apex or
    TE the norm is `utils.local_multi_tensor_l2_norm`, which returns a tensor on "cuda"
    (`utils.py:1207`). The norm is still all-reduced over the model-parallel group as before.
    """
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    _rewrite(log, clip_grads, "get_grad_norm_fp32", [(*_ON_CUDA, 3)])
    _rewrite(
        log,
        clip_grads,
        "clip_grad_by_total_norm_fp32",
        [(*_ON_CUDA, 1), ("grad.type() == 'torch.cuda.FloatTensor'", "grad.dtype == torch.float32", 1)],
    )
    _rewrite(log, clip_grads, "count_zeros_fp32", [(*_ON_CUDA, 1)])
    _rewrite(log, utils, "local_multi_tensor_l2_norm", [('device="cuda"', 'device="cpu"', 1)])


def cpu_schedule_tokens(log: _UndoLog) -> None:
    """Count the no-pipelining schedule's tokens in a CPU tensor.

    `forward_backward_no_pipelining` creates `total_num_tokens` with `device="cuda"`
    (`pipeline_parallel/schedules.py:596`) on every call, forward-only included.
    """
    from megatron.core.pipeline_parallel import schedules

    _rewrite(log, schedules, "forward_backward_no_pipelining", [('device="cuda"', 'device="cpu"', 1)])


def cpu_pipeline_schedule(log: _UndoLog) -> None:
    """Run megatron-core's 1F1B pipeline schedule (`forward_backward_pipelining_without_interleaving`)
    with CPU tensors over gloo.

    Its `total_num_tokens` is made with `device="cuda"` (`pipeline_parallel/schedules.py:2138`);
    `P2PCommunicator._communicate_shapes` (variable sequence lengths) ends with an unconditional
    `torch.cuda.synchronize()` (`pipeline_parallel/p2p_communication.py:242`), not needed on the
    CPU where `req.wait()` has completed the transfer. A model with tied embeddings moves the
    last stage's output weight to CUDA before summing it with the first stage's
    (`models/common/language_module/language_module.py:244`).
    """
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    _rewrite(
        log,
        schedules,
        "forward_backward_pipelining_without_interleaving",
        [('device="cuda"', 'device="cpu"', 1)],
    )
    _rewrite(
        log,
        p2p_communication.P2PCommunicator,
        "_communicate_shapes",
        [("torch.cuda.synchronize()", "None", 1)],
    )
    _rewrite(
        log,
        language_module.LanguageModule,
        "setup_embeddings_and_output_layer",
        [("weight.data.cuda()", "weight.data", 1)],
    )


_ABSENT = object()
"""Recorded as the old value of an attribute a patch adds; undoing deletes the attribute."""


def cpu_moe_router_gemm(log: _UndoLog) -> None:
    """Let the MoE router's GEMM fall back to `torch.mm` without TransformerEngine.

    `RouterGatingLinearFunction.forward/backward` test `te_general_gemm is not None`
    (`transformer/moe/moe_utils.py:1192,1225`), but the name is bound only inside the module's
    `try: import transformer_engine` block (`moe_utils.py:22-39`): without TE the router raises
    `NameError`. The name is bound to None in `moe_utils`, selecting the existing torch path.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        log.append((moe_utils, "te_general_gemm", _ABSENT))
        moe_utils.te_general_gemm = None


def _cpu_dtoh_and_synchronize(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` for CPU tensors: no side stream;
    at the device-to-host point the split sizes become numpy arrays, as the CUDA path makes them
    (`maybe_move_tensor_to_cpu(..., as_numpy=True)`), which `all_to_all_single` takes."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if value is not None and hasattr(value, "numpy"):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def cpu_alltoall_dispatcher(log: _UndoLog) -> None:
    """Run Megatron's alltoall MoE token dispatcher without CUDA streams, with list-like splits.

    `MoEAlltoAllTokenDispatcher.__init__` creates a `torch.cuda.Stream()` once per process
    (`transformer/moe/token_dispatcher.py:445`), and `_maybe_dtoh_and_synchronize` (`:862-899`)
    copies the split sizes to the host on that stream and records and waits for a CUDA event.
    On the CPU the split sizes would stay tensors (`moe/moe_utils.py:1093` only moves CUDA
    tensors), which gloo's `all_to_all_single` rejects. The stream becomes a plain object and
    the method is replaced by `_cpu_dtoh_and_synchronize`.
    """
    from megatron.core.transformer.moe import token_dispatcher

    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    _rewrite(log, cls, "__init__", [("torch.cuda.Stream()", "object()", 1)])
    _replace(log, cls, "_maybe_dtoh_and_synchronize", _cpu_dtoh_and_synchronize)


def _uneven(sizes: Any) -> list[int] | None:
    """Split sizes as ints when they differ (None for None or equal sizes: megatron's own path)."""
    if sizes is None:
        return None
    sizes = [int(size) for size in sizes]
    return sizes if len(set(sizes)) > 1 else None


def _cpu_gather_along_first_dim(input_: Any, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
    """`mappings._gather_along_first_dim` with uneven `output_split_sizes` on gloo: each rank's
    block [n_r, ...] padded to the largest n, gathered as equal blocks, then cut back; the result
    is [sum n_r, ...] as megatron's list `all_gather` (which gloo refuses for unequal tensors)."""
    import torch

    sizes = _uneven(output_split_sizes)
    if sizes is None:
        return _MEGATRON_GATHER[0](input_, group, output_split_sizes, use_global_buffer)
    padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    blocks = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(blocks, padded.contiguous(), group=group)
    return torch.cat([block[:size] for block, size in zip(blocks, sizes, strict=True)], dim=0)


def _cpu_reduce_scatter_along_first_dim(
    input_: Any, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False
) -> Any:
    """`mappings._reduce_scatter_along_first_dim` with uneven `input_split_sizes` on gloo: the
    whole [sum n_r, ...] input summed over the group (all-reduce), then this rank's rows
    [n_rank, ...] — the values of megatron's list `reduce_scatter`, which gloo lacks."""
    import torch

    sizes = _uneven(input_split_sizes)
    if sizes is None:
        return _MEGATRON_REDUCE_SCATTER[0](input_, group, input_split_sizes, use_global_buffer)
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    start = sum(sizes[: torch.distributed.get_rank(group)])
    return total[start : start + sizes[torch.distributed.get_rank(group)]].contiguous()


_MEGATRON_GATHER: list[Any] = []
_MEGATRON_REDUCE_SCATTER: list[Any] = []


def cpu_uneven_gather(log: _UndoLog) -> None:
    """Let megatron's uneven sequence-parallel gather / reduce-scatter run on gloo.

    With expert-tensor parallelism beside EP or across DP ranks, the all-to-all dispatcher gathers
    the routed tokens over the expert-TP group with per-rank `output_splits_tp`
    (`transformer/moe/token_dispatcher.py` dispatch_postprocess -> `tensor_parallel/mappings.py`
    `_gather_along_first_dim`, a list `all_gather` of unequal tensors) and reduce-scatters them back
    the same way; gloo refuses unequal tensors ("invalid tensor size") and has no list
    reduce-scatter. NCCL does both; on gloo the uneven cases take the padded gather and the
    all-reduce-then-slice above, equal or absent sizes megatron's own code.
    """
    from megatron.core.tensor_parallel import mappings

    if not _MEGATRON_GATHER:
        _MEGATRON_GATHER.append(mappings._gather_along_first_dim)
        _MEGATRON_REDUCE_SCATTER.append(mappings._reduce_scatter_along_first_dim)
    _replace(log, mappings, "_gather_along_first_dim", _cpu_gather_along_first_dim)
    _replace(log, mappings, "_reduce_scatter_along_first_dim", _cpu_reduce_scatter_along_first_dim)


def cpu_sequence_parallel_norm(log: _UndoLog) -> None:
    """Let Megatron's torch norm (local spec) run under sequence parallelism.

    `WrappedTorchNorm.__new__` asserts `not config.sequence_parallel`
    (`transformer/torch_norm.py:32`), but Megatron's MoE layer requires sequence parallel with
    TP > 1 while training (`transformer/moe/moe_layer.py:379`). A norm is per token, so it is
    exact on a sequence shard; its weight gets the `sequence_parallel` attribute that
    `finalize_model_grads` reads to all-reduce the grads of such replicated weights over TP
    (`distributed/finalize_model_grads.py` _allreduce_layernorm_grads), as TE's norms get it.
    """
    import copy

    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original_new = cls.__new__

    def new(cls_: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls_, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm

    log.append((cls, "__new__", inspect.getattr_static(cls, "__new__")))
    cls.__new__ = staticmethod(new)


def _cpu_rng_states() -> tuple[Any, None, Any]:
    import torch
    from megatron.core.tensor_parallel import random as mcore_random

    return torch.get_rng_state(), None, mcore_random.get_cuda_rng_tracker().get_states()


def _set_cpu_rng_states(cpu_rng_state: Any, _cuda_rng_state: Any, tracker_states: Any) -> None:
    import torch
    from megatron.core.tensor_parallel import random as mcore_random

    torch.set_rng_state(cpu_rng_state)
    mcore_random.get_cuda_rng_tracker().set_states(tracker_states)


def cpu_checkpoint_rng(log: _UndoLog) -> None:
    """Let activation recomputation's checkpoint run on the CPU.

    `CheckpointFunction` (full recomputation, selective `core_attn` / `mlp`) saves every RNG
    state before the forward and restores it around the recomputation, the CUDA generator's
    included (`tensor_parallel/random.py:444-460`: `torch.cuda.random.get_rng_state`). The two
    helpers are replaced where `CheckpointFunction` and `_fork_rng` look them up with versions
    that keep the CPU generator's state and the tracker's (CPU states, `cpu_rng_tracker`).
    """
    from megatron.core.tensor_parallel import random as mcore_random

    _replace(log, mcore_random, "_get_all_rng_states", _cpu_rng_states)
    _replace(log, mcore_random, "_set_all_rng_states", _set_cpu_rng_states)


def cpu_rope_cp_slice(log: _UndoLog) -> None:
    """Select this CP rank's RoPE angles with an index on the angles' own device.

    `get_pos_emb_on_this_cp_rank` builds its chunk index in pinned host memory and moves it with
    `.cuda()` (`models/common/embeddings/rope_utils.py:62-64`); `RotaryEmbedding.forward` calls
    it whenever the CP group has more than one rank (`rotary_pos_embedding.py:201-204`). The
    index is made on `pos_emb.device` instead; the selection is unchanged.
    """
    from megatron.core.models.common.embeddings import rope_utils

    _rewrite(
        log,
        rope_utils,
        "get_pos_emb_on_this_cp_rank",
        [('device="cpu", pin_memory=True', "device=pos_emb.device", 1), (".cuda(non_blocking=True)", "", 1)],
    )


PATCHES: dict[str, Callable[[_UndoLog], None]] = {
    "current_device_is_cpu": current_device_is_cpu,
    "cpu_rng_tracker": cpu_rng_tracker,
    "cpu_causal_masks": cpu_causal_masks,
    "cpu_optimizer_tensors": cpu_optimizer_tensors,
    "cpu_grad_norm": cpu_grad_norm,
    "cpu_schedule_tokens": cpu_schedule_tokens,
    "cpu_pipeline_schedule": cpu_pipeline_schedule,
    "cpu_moe_router_gemm": cpu_moe_router_gemm,
    "cpu_alltoall_dispatcher": cpu_alltoall_dispatcher,
    "cpu_uneven_gather": cpu_uneven_gather,
    "cpu_sequence_parallel_norm": cpu_sequence_parallel_norm,
    "cpu_rope_cp_slice": cpu_rope_cp_slice,
    "cpu_checkpoint_rng": cpu_checkpoint_rng,
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
            elif original is _ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
