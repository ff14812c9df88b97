"""LoRA adapters on megatron-core's tensor-parallel linear layers, correct under tensor parallelism.

Megatron has no PEFT module (shared/FACTS.md); this one wraps each targeted linear layer in place.

For a linear layer y = x W^T, LoRA adds (alpha / r) * (x A^T) B^T with A [r, in] and B [out, r]
(Hu et al. 2021, "LoRA", eq. 3). Under TP (Shoeybi et al. 2019, "Megatron-LM", section 3):

- column-parallel (linear_qkv, linear_fc1; W sharded by output rows): B is sharded by rows like W,
  A is replicated. x A^T is computed on every rank; its gradient is summed over TP (each rank
  only sees its own output rows), as the base layer sums the gradient of x.
- row-parallel (linear_proj, linear_fc2; W sharded by input columns, output summed over TP): A is
  sharded by columns like W, B is replicated. The partial x_rank A_rank^T are summed over TP
  (an all-reduce of r numbers per token, not `out`), then every rank applies the same B.
- with sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation", section
  4.2.2; Megatron's MoE models with TP), activations outside the linears are sharded by sequence:
  column-parallel all-gathers x A^T over the sequence (backward: reduce-scatter), row-parallel
  reduce-scatters the partial x_rank A_rank^T instead of all-reducing it. The replicated factor
  (column A, row B) then sees one sequence shard per rank, so its gradient is summed over TP by
  `finalize_model_grads` (the `sequence_parallel` parameter attribute, as for the norms).

Step 0 is the identity: B = 0, and A is drawn once per layer from a generator seeded by
(`LoraConfig.seed`, layer name) over the full, unsharded shape, then sharded. Every TP layout of
the same model therefore starts from the same adapter.

MoE experts (Megatron's `SequentialMLP`, local spec): each expert's linear_fc1 / linear_fc2 gets
its own adapter, named by the layer and the expert's global index
(`decoder.layers.{i}.mlp.experts.{e}.linear_fc1`), so every EP layout draws the same A for the
same expert. Under expert parallelism each rank holds the adapters of its own experts only; they
carry `allreduce = False`, so Megatron's DDP reduces their gradients over the expert
data-parallel group and its optimizer keeps them in the expert parameter group (as Megatron
marks expert weights, `tensor_parallel/layers.py:886`).

Expert tensor parallelism (etp > 1, megatron-core's `expert_tensor_parallel_size`): each expert's
linear_fc1 is column-parallel and linear_fc2 row-parallel over the expert-TP group, and the
linears leave all communication to the alltoall token dispatcher (`explicit_expert_comm`,
`tensor_parallel/layers.py:841`): it all-gathers the expert's tokens over the group before fc1
(backward: reduce-scatter, summing each rank's partial input gradient) and reduce-scatters fc2's
partial outputs after it (`moe/token_dispatcher.py:696,779`). The adapter is split to match
(fc1: B [2I/etp, r] rows as `fc1_shard` splits the weight, A replicated; fc2: A [r, I/etp]
columns, B replicated) and adds no communication of its own to the forward: fc1's x A^T is
computed whole on every rank, fc2's partial x_rank A_rank^T B^T is summed by the dispatcher
with the base output. The replicated factor's gradient is then a partial sum on each rank (fc1:
dL/dA from this rank's B rows; fc2: dL/dB from this rank's input columns), all-reduced over the
expert-TP group in the backward (`_EtpReplicatedLinear`). In the grad norm it counts once: on
expert-TP rank 0 only (the other ranks mark their copy `shared`, as megatron-core marks a tied
embedding, `transformer/module.py` param_is_not_shared).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F

from art_mega.trainer.protocol import LoraConfig

ParallelKind = Literal["column", "row"]
"""How a Megatron linear is split over TP: by output rows (column) or by input columns (row)."""


def _layer_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_lora_a(seed: int, name: str, rank: int, in_features: int) -> torch.Tensor:
    """The full (unsharded) initial A [rank, in_features] (float32) of the layer called `name`.

    U(-1/sqrt(in), 1/sqrt(in)): PEFT's default, kaiming_uniform_(a=sqrt(5)), drawn from a CPU
    generator seeded by (`seed`, `name`) so every rank and every TP layout draws the same matrix.
    """
    generator = torch.Generator().manual_seed(_layer_seed(seed, name))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=generator, dtype=torch.float32) * 2 - 1) * bound


def _kind_of(layer: Any) -> ParallelKind:
    """'column' or 'row' for a Megatron (local or TE) parallel linear; `NotImplementedError` else."""
    names = [cls.__name__ for cls in type(layer).__mro__]
    if "TELayerNormColumnParallelLinear" in names:
        raise NotImplementedError(
            "LoRA on TransformerEngine layers with a fused input norm (TELayerNormColumnParallelLinear) "
            "is not implemented yet: build the model with the local layer spec (use_te=False)."
        )
    if "ColumnParallelLinear" in names or "TEColumnParallelLinear" in names:
        return "column"
    if "RowParallelLinear" in names or "TERowParallelLinear" in names:
        return "row"
    raise NotImplementedError(f"LoRA does not know how to wrap {type(layer).__name__}")


class LoraLinear(torch.nn.Module):
    """A Megatron parallel linear layer plus a TP-sharded LoRA adapter; same call convention.

    `forward(x, *args, **kwargs)` returns `(output, bias)` like the wrapped layer (bias is None
    unless the base layer skips its bias add): output = base(x) + scaling * (x A^T) B^T, with the
    TP reductions described in the module docstring. Shapes, TP size t, input [s, b, in_local]:
    column: A [r, in] replicated, B [out/t, r] (this rank's output rows);
    row: A [r, in/t] (this rank's input columns), B [out, r] replicated.
    Parameters carry Megatron's tensor-parallel attributes (`tensor_model_parallel`,
    `partition_dim`), which its grad-norm and checkpoint code read. `enabled = False` makes the
    layer the base layer (reference-policy logprobs). Under sequence parallelism a column
    layer's input is [s/t, b, in] and a row layer's output [s/t, b, out], as Megatron's.
    `is_expert`: an MoE expert's linear (`tp_size`/`tp_rank` are then the expert-TP ones; above
    1 the factors are split as the module docstring's expert tensor parallelism says).
    """

    def __init__(
        self,
        base: Any,
        *,
        name: str,
        kind: ParallelKind,
        config: LoraConfig,
        tp_size: int,
        tp_rank: int,
        is_expert: bool = False,
    ) -> None:
        from megatron.core import tensor_parallel

        super().__init__()
        # Expert linears leave all communication to the token dispatcher: their tokens are not a
        # sequence shard. Not only where Megatron sets `explicit_expert_comm`: its RowParallelLinear
        # leaves that False at expert-TP 1 and EP 1 (TP > 1), and a sequence-parallel B there
        # was summed over TP on top of the expert-DP sum (twice the gradient).
        self.sequence_parallel = (
            bool(getattr(base, "sequence_parallel", False))
            and not is_expert
            and not getattr(base, "explicit_expert_comm", False)
        )
        # Expert tensor parallelism: the dispatcher does every reduction (module docstring).
        self.expert_tp = is_expert and tp_size > 1
        if self.expert_tp and not getattr(base, "explicit_expert_comm", False):
            raise NotImplementedError(f"LoRA on {name}: an expert-TP linear without explicit_expert_comm")
        if kind == "column" and getattr(base, "gather_output", False):
            raise NotImplementedError(f"LoRA on {name}: column-parallel layers with gather_output")
        if kind == "row" and not getattr(base, "input_is_parallel", True):
            raise NotImplementedError(f"LoRA on {name}: row-parallel layers without input_is_parallel")
        self.base = base
        self.name = name
        self.kind = kind
        self.rank = config.rank
        self.scaling = config.scaling
        self.enabled = True
        self.tp_group = getattr(base, "tp_group", None)
        weight = base.weight
        out_local, in_local = weight.shape
        in_full = in_local * tp_size if kind == "row" else in_local
        out_full = out_local * tp_size if kind == "column" else out_local
        a_full = init_lora_a(config.seed, name, config.rank, in_full)
        a = a_full.chunk(tp_size, dim=1)[tp_rank] if kind == "row" else a_full
        b_rows = out_local if kind == "column" else out_full
        kw = {"dtype": weight.dtype, "device": weight.device}
        self.lora_A = torch.nn.Parameter(a.to(**kw).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(b_rows, config.rank, **kw))
        # An expert's factors count as tensor-parallel, like Megatron's expert weights: the grad
        # norm then counts them on every rank of the expert group, not only on dense TP rank 0
        # (`tensor_parallel/layers.py` param_is_not_tensor_parallel_duplicate).
        tensor_parallel.set_tensor_model_parallel_attributes(self.lora_A, kind == "row" or is_expert, 1, 1)
        tensor_parallel.set_tensor_model_parallel_attributes(self.lora_B, kind == "column" or is_expert, 0, 1)
        self.in_features = in_full
        self.out_features = out_full
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.is_expert = is_expert
        if is_expert:
            for param in (self.lora_A, self.lora_B):
                param.allreduce = False
        if self.expert_tp and tp_rank != 0:
            # Every expert-TP rank holds the same full gradient of the replicated factor (summed in
            # `_EtpReplicatedLinear`): the grad norm counts rank 0's (`param_is_not_shared`).
            (self.lora_A if kind == "column" else self.lora_B).shared = True
        if self.sequence_parallel:
            # The replicated factor sees only this rank's sequence shard: finalize_model_grads
            # sums its gradient over TP, as for the norms (`sequence_parallel` attribute).
            replicated = self.lora_A if kind == "column" else self.lora_B
            replicated.sequence_parallel = True

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        output, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return output, bias
        if self.expert_tp:
            return output + self._expert_tp_delta(x), bias
        hidden = F.linear(x, self.lora_A)
        if self.sequence_parallel and self.kind == "column":
            # x is this rank's sequence shard [s/t, b, in]: gather x A^T to [s, b, r]; the
            # backward reduce-scatters, summing dL/dhidden over the TP ranks' B rows.
            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        elif self.sequence_parallel:
            # Sum the partial x_rank A_rank^T over TP and keep this rank's shard [s/t, b, r].
            hidden = reduce_scatter_to_sequence_parallel_region(hidden, group=self.tp_group)
        elif self.kind == "column":
            # Identity forward; the backward sums dL/dhidden over TP (each rank has its B rows only).
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        else:
            # Sums the partial x_rank A_rank^T over TP; identity backward.
            hidden = reduce_from_tensor_model_parallel_region(hidden, group=self.tp_group)
        return output + F.linear(hidden, self.lora_B) * self.scaling, bias


    def _expert_tp_delta(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of scaling * (x A^T) B^T under expert tensor parallelism.

        x: [tokens, in_local] (the dispatcher's gathered tokens; in_local = in / etp for fc2).
        Returns [tokens, out_local]: column (fc1) this rank's output rows, complete; row (fc2) a
        partial sum over the expert-TP ranks, which the dispatcher's reduce-scatter completes.
        The replicated factor's gradient is all-reduced over the group (`_EtpReplicatedLinear`).
        """
        if self.kind == "column":
            hidden = _EtpReplicatedLinear.apply(x, self.lora_A, self.tp_group)
            return F.linear(hidden, self.lora_B) * self.scaling
        hidden = F.linear(x, self.lora_A)
        return _EtpReplicatedLinear.apply(hidden, self.lora_B, self.tp_group) * self.scaling


class _EtpReplicatedLinear(torch.autograd.Function):
    """y = x W^T for a factor W [n, k] replicated over the expert-TP group, whose gradient each
    rank only sees a part of; the backward all-reduces dL/dW over `group` (sum) and leaves dL/dx
    local (the token dispatcher sums the ranks' input gradients). x [..., k] -> y [..., n]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        torch.distributed.all_reduce(grad_weight, group=ctx.group)
        return grad_x, grad_weight, None


def apply_lora(module: Any, config: LoraConfig) -> dict[str, LoraLinear]:
    """Freeze every parameter of `module` (a GPTModel) and wrap its targeted linears with LoRA.

    Call after the base weights are loaded and after `init_parallel` (TP size and rank come from
    megatron-core), before wrapping in DDP and building the optimizer. Returns the wrappers by
    their module name, e.g. "decoder.layers.0.self_attention.linear_qkv", in module order;
    an MoE expert's linear by its global expert index, "decoder.layers.0.mlp.experts.5.linear_fc1"
    (the targets linear_fc1 / linear_fc2 cover dense MLPs and experts alike). Only the LoRA A and
    B parameters have `requires_grad` afterwards.

    Raises `NotImplementedError` for layers it cannot wrap yet (TE fused-norm linears) and
    `RuntimeError` when no targeted layer exists or the module already has LoRA.
    """
    from megatron.core import parallel_state as mpu

    if lora_layers(module):
        raise RuntimeError("the module already has LoRA adapters")
    for param in module.parameters():
        param.requires_grad_(False)
    dense = (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank())
    expert = (mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank())
    ep_rank = mpu.get_expert_model_parallel_rank()
    found: list[tuple[str, Any, str, Any, bool]] = []
    for path, child in module.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if leaf in config.targets and ".layers." in f".{path}":
            parent = module.get_submodule(path.rsplit(".", 1)[0])
            name, is_expert = _adapter_name(module, path, ep_rank)
            found.append((name, parent, leaf, child, is_expert))
    if not found:
        raise RuntimeError(f"no layer named {list(config.targets)} in the module")
    wrapped = {}
    for name, parent, leaf, child, is_expert in found:
        tp_size, tp_rank = expert if is_expert else dense
        layer = LoraLinear(
            child,
            name=name,
            kind=_kind_of(child),
            config=config,
            tp_size=tp_size,
            tp_rank=tp_rank,
            is_expert=is_expert,
        )
        setattr(parent, leaf, layer)
        wrapped[name] = layer
    return wrapped


_LOCAL_EXPERT = ".experts.local_experts."


def _adapter_name(module: Any, path: str, ep_rank: int) -> tuple[str, bool]:
    """(adapter name, is an expert layer) of the linear at `path` in `module`.

    A dense layer keeps its path, with the decoder layer's global index: under pipeline
    parallelism a stage numbers its `decoder.layers` from 0, and `decoder.layers.{i}` becomes
    `decoder.layers.{layer_number - 1}` (megatron-core's global `TransformerLayer.layer_number`,
    from 1), so names, initial A matrices and PEFT keys are the same on every pipeline layout.
    An expert's linear at `...mlp.experts.local_experts.{j}.{leaf}` is named
    `...mlp.experts.{ep_rank * local experts + j}.{leaf}` (Megatron's contiguous split of experts
    over EP ranks, `transformer/moe/moe_layer.py` local_expert_indices).
    """
    named = _global_layer_path(module, path)
    if _LOCAL_EXPERT not in path:
        return named, False
    head, tail = path.split(_LOCAL_EXPERT, 1)
    local, leaf = tail.split(".", 1)
    num_local = len(module.get_submodule(head + ".experts.local_experts"))
    return f"{named.split(_LOCAL_EXPERT, 1)[0]}.experts.{ep_rank * num_local + int(local)}.{leaf}", True


_LAYERS = "decoder.layers."


def _global_layer_path(module: Any, path: str) -> str:
    """`path` with its local decoder-layer index replaced by the layer's global one (see
    `_adapter_name`); unchanged outside `decoder.layers` and on a model of one stage."""
    if not path.startswith(_LAYERS):
        return path
    local, rest = path[len(_LAYERS) :].split(".", 1)
    layer = module.get_submodule(_LAYERS + local)
    number = getattr(layer, "layer_number", None)
    return path if number is None else f"{_LAYERS}{number - 1}.{rest}"


def lora_layers(module: Any) -> dict[str, LoraLinear]:
    """The LoRA wrappers inside `module` by their name (the wrapped layer's name), in module order."""
    return {layer.name: layer for layer in module.modules() if isinstance(layer, LoraLinear)}


def lora_parameters(module: Any) -> dict[str, torch.Tensor]:
    """This rank's LoRA parameters by name ("<layer>.lora_A" / "<layer>.lora_B"), in module order."""
    params = {}
    for name, layer in lora_layers(module).items():
        params[f"{name}.lora_A"] = layer.lora_A
        params[f"{name}.lora_B"] = layer.lora_B
    return params


@contextlib.contextmanager
def lora_disabled(module: Any) -> Iterator[None]:
    """Within the block, every LoRA layer of `module` computes its base layer only."""
    layers = list(lora_layers(module).values())
    previous = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer, state in zip(layers, previous):
            layer.enabled = state
