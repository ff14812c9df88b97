"""A trainer rank's adapter export/import and its checkpoint state: `save_state` / `load_state`
on the layout a checkpoint was written with, `load_portable` (re-sharded Adam moments) on another.

`SavedState` is a part of `engine.TrainerEngine` (its base class), kept here by concern: it reads
the engine's `ddp`, `optimizer`, `model`, `lora_config`, `state` (the `ParallelState`) and `steps`.
The per-rank file's path and atomic write are `trainer.checkpoint`'s (the format's one owner).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from art_mega.trainer import checkpoint
from art_mega.trainer.rank.lora import lora_parameters

log = logging.getLogger("art_mega.trainer.rank.engine")

STATE_FORMAT = 2
"""Version of the per-rank state file written by `save_state` (2 adds the layout-free Adam
moments, `named_adam`, and pp to the layout; a format-1 file still loads on its own layout)."""


class SavedState:
    """`TrainerEngine`'s adapters and state (a base class of it; see the module docstring)."""

    def export_adapter(self, out_dir: str | os.PathLike[str]) -> Any:
        """Write the adapter as an HF PEFT directory (`peft_io.export_adapter`; collective, rank 0
        writes). Returns `AdapterFiles` on global rank 0, None on the others."""
        from art_mega.trainer.peft_io import export_adapter

        return export_adapter(
            self.ddp.module,
            self.lora_config,
            out_dir,
            num_heads=self.model.args.num_heads,
            num_query_groups=self.model.args.num_query_groups,
            names=self.model.family.lora_names(self.model.args),
            base_model_name_or_path=self.model_dir,
        )

    def load_adapter(self, adapter_dir: str | os.PathLike[str]) -> None:
        """Warm start: load an HF PEFT LoRA directory into this rank's shards (`peft_io.import_adapter`).

        The optimizer's state is kept; its main parameters are refreshed from the model.
        Raises `UserError` for an adapter of another rank, alpha or target set.
        """
        self._import_lora(adapter_dir)
        self.optimizer.reload_model_params()

    def _import_lora(self, adapter_dir: str | os.PathLike[str]) -> None:
        """Copy a PEFT adapter's LoRA weights into this rank's shards (`peft_io.import_adapter`),
        leaving the optimizer alone. Raises `UserError` as `load_adapter` says."""
        from art_mega.trainer.peft_io import import_adapter

        import_adapter(
            self.ddp.module,
            self.lora_config,
            adapter_dir,
            num_heads=self.model.args.num_heads,
            num_query_groups=self.model.args.num_query_groups,
            names=self.model.family.lora_names(self.model.args),
        )

    def _layout(self) -> dict[str, int]:
        s = self.state
        return {
            "world_size": s.world_size,
            "tp": s.tp,
            "dp": s.dp,
            "pp": s.pp,
            "tp_rank": s.tp_rank,
            "dp_rank": s.dp_rank,
            "pp_rank": s.pp_rank,
        }

    def state_file(self, directory: str | os.PathLike[str]) -> Path:
        """This rank's state file in `directory` (a checkpoint or its staging folder):
        `checkpoint.rank_state_file` of this global rank."""
        return checkpoint.rank_state_file(directory, self.state.rank)

    def save_state(self, directory: str | os.PathLike[str]) -> Path:
        """Write this rank's LoRA shards, optimizer state and step count to `state_file(directory)`.

        Collective only in that every rank writes its own file (`checkpoint.atomic_write`: temp
        file, fsync, rename). The distributed optimizer's parameter state is this rank's shard
        (`get_parameter_state_dp_reshardable`). Returns the path.
        """
        path = self.state_file(directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": STATE_FORMAT,
            "layout": self._layout(),
            "steps": self.steps,
            "lora": {name: p.detach().cpu().clone() for name, p in lora_parameters(self.ddp.module).items()},
            "optimizers": [_optimizer_state(sub) for sub in _sub_optimizers(self.optimizer)],
            "named_adam": self._named_adam(),
        }
        with checkpoint.atomic_write(path) as handle:
            torch.save(payload, handle)
        return path

    @torch.no_grad()
    def load_state(self, directory: str | os.PathLike[str]) -> None:
        """Restore a checkpoint `directory` written by `save_state` on every rank of a trainer.

        On the layout it was written with (world size, tp, dp, pp and this rank's coordinates):
        this rank's file as it was (LoRA shards, Megatron optimizer state, step count), exactly.
        On another layout (a lost node, a bigger allocation; `load_portable`): the LoRA from
        the checkpoint's PEFT adapter and the Adam moments re-sharded from every old rank's
        layout-free record.

        Raises `RuntimeError` when the file holds other LoRA parameters than this engine
        (another model or LoRA config).
        """
        path = self.state_file(directory)
        payload = torch.load(path, map_location=self.state.device, weights_only=False) if path.exists() else None
        if payload is None or _saved_layout(payload) != self._layout():
            self.load_portable(directory)
            return
        params = lora_parameters(self.ddp.module)
        if set(payload["lora"]) != set(params):
            raise RuntimeError(f"{path} holds other LoRA parameters than this model")
        for name, param in params.items():
            param.copy_(payload["lora"][name])
        subs = _sub_optimizers(self.optimizer)
        for sub, saved in zip(subs, payload["optimizers"], strict=True):
            _load_optimizer_state(sub, saved)
        self.optimizer.reload_model_params()
        self.steps = payload["steps"]

    @torch.no_grad()
    def load_portable(self, directory: str | os.PathLike[str]) -> None:
        """Resume a checkpoint written on another parallel layout (TP, PP, EP, DP, distributed
        optimizer or not): the LoRA weights from its PEFT adapter (`load_adapter`, layout-free),
        the step count from its rank files, and Adam's moments and step re-sharded from the
        `named_adam` records of every old rank (`portable`: the old shards are mapped to PEFT
        tensors and cut for this rank as the adapter's weights are).

        Where the moments cannot be rebuilt (rank files of format 1, a bf16 optimizer without
        the distributed layout, a parameter missing from the records) the optimizer restarts
        from zero moments, said in one logged line on global rank 0 (`portable.log_resume`).
        Not collective.
        """
        from art_mega.trainer.rank import portable

        files = sorted(Path(directory).glob("rank*.pt"))
        saved = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
        self.load_adapter(checkpoint.adapter_dir(directory))
        self.steps = saved[0]["steps"] if saved else 0
        problem = portable.missing_state(saved)
        if problem is None:
            problem = self._set_named_adam(portable.tp_shards([payload["named_adam"] for payload in saved]))
        if self.state.rank == 0:
            old = _saved_layout(saved[0]) if saved else None
            portable.log_resume(directory, old, self._layout(), problem)

    def _named_adam(self) -> dict[str, dict[str, Any]] | None:
        """This rank's Adam state per LoRA parameter, in a form any layout can read back:
        {name: {"exp_avg", "exp_avg_sq" (float32, this rank's part, flattened when the
        distributed optimizer holds a slice), "step", "shape" (the rank's shard), "full" (the
        unsharded shape), "split" (the TP-split dimension or None), "tp_rank", "range" (the
        flat [start, end) of the shard that this rank's slice covers, None for all of it)}}.
        None before the first step, or where the per-parameter state is not reachable (a bf16
        optimizer without the distributed layout)."""
        from art_mega.trainer.rank.lora import lora_layers

        out: dict[str, dict[str, Any]] = {}
        for layer_name, layer in lora_layers(self.ddp.module).items():
            for matrix in ("lora_A", "lora_B"):
                param = getattr(layer, matrix)
                place = self._main_of(param)
                if place is _NOT_HERE:
                    continue
                if place is None or not place[0].state.get(place[1]):
                    return None
                inner, main, span = place
                state = inner.state[main]
                split = _split_dim(layer, matrix)
                full = list(param.shape)
                if split is not None:
                    full[split] *= layer.tp_size
                out[f"{layer_name}.{matrix}"] = {
                    "exp_avg": state["exp_avg"].detach().float().cpu().clone(),
                    "exp_avg_sq": state["exp_avg_sq"].detach().float().cpu().clone(),
                    "step": float(state["step"]),
                    "shape": tuple(param.shape),
                    "full": tuple(full),
                    "split": split,
                    "tp_rank": layer.tp_rank if split is not None else 0,
                    "range": span,
                }
        return out

    def _set_named_adam(self, shards: dict[str, dict[str, Any]]) -> str | None:
        """Put the moments of the old TP shards (`portable.tp_shards`) into this rank's optimizer,
        cut for its layout (`portable.rank_moments`); None, or why not (nothing is set then)."""
        from art_mega.trainer.rank.lora import lora_layers
        from art_mega.trainer.rank.portable import MOMENTS, Slot, as_flat_slice, rank_moments

        targets = []
        for layer in lora_layers(self.ddp.module).values():
            moments = rank_moments(
                shards,
                Slot.of(layer),
                self.model.family.lora_names(self.model.args),
                self.model.args.num_heads,
                self.model.args.num_query_groups,
            )
            if isinstance(moments, str):
                return moments
            for matrix in ("lora_A", "lora_B"):
                place = self._main_of(getattr(layer, matrix))
                if place is None:
                    return "this optimizer keeps no fp32 main copy per LoRA parameter (bf16 without the distributed optimizer)"
                if place is not _NOT_HERE:
                    targets.append((moments[matrix], *place))
        for record, inner, main, span in targets:
            state = {m: as_flat_slice(record[m], span, main) for m in MOMENTS}
            state["step"] = torch.tensor(record["step"], dtype=torch.float32)
            inner.state[main] = state
        return None

    def _main_of(self, param: torch.Tensor) -> tuple[Any, torch.Tensor, tuple[int, int] | None] | None | Any:
        """(inner torch optimizer, main parameter, flat range) of `param` on this rank;
        `_NOT_HERE` where the distributed optimizer gives this rank no slice; None where no
        fp32 main copy is reachable."""
        distributed = False
        for sub in _sub_optimizers(self.optimizer):
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            if _is_distributed(sub):
                distributed = True
                if param in sub.model_param_group_index_map:
                    group, order = sub.model_param_group_index_map[param]
                    span = sub._get_model_param_range_map(param)["param"]
                    return inner, inner.param_groups[group]["params"][order], (span.start, span.end)
                continue
            for group in inner.param_groups:
                if any(p is param for p in group["params"]):
                    return inner, param, None
        return _NOT_HERE if distributed else None


_NOT_HERE = object()
"""A parameter whose distributed-optimizer state lives on other DP ranks only."""


def _saved_layout(payload: dict[str, Any]) -> dict[str, int]:
    """The layout of a rank file, with pp = 1 for a format-1 file (written before pipelines)."""
    return {"pp": 1, "pp_rank": 0, **payload.get("layout", {})}


def _split_dim(layer: Any, matrix: str) -> int | None:
    """The dimension of `layer`'s `matrix` ("lora_A" / "lora_B") split over its TP group: B's
    rows in a column-parallel layer, A's columns in a row-parallel one (`lora.LoraLinear`)."""
    if layer.tp_size == 1:
        return None
    if layer.kind == "column":
        return 0 if matrix == "lora_B" else None
    return 1 if matrix == "lora_A" else None


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def _optimizer_state(optimizer: Any) -> dict[str, Any] | None:
    """One (non-chained) Megatron optimizer's state on this rank; None before its first step."""
    inner = getattr(optimizer, "optimizer", None)
    if inner is None or not inner.state:
        return None
    if _is_distributed(optimizer):
        param_state = optimizer.get_parameter_state_dp_reshardable()
        # The loader skips entries marked as padding and expects the mark on every entry
        # (`distrib_optimizer.py` load_parameter_state_from_dp_reshardable); this rank's own
        # entries are never padding.
        for key, per_dtype in param_state.items():
            if isinstance(key, int):
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry.setdefault("padding", False)
        return {"state": optimizer.state_dict(), "param_state": param_state}
    return {"state": optimizer.state_dict()}


def _load_optimizer_state(optimizer: Any, saved: dict[str, Any] | None) -> None:
    if saved is None:
        return
    optimizer.load_state_dict(saved["state"])
    if _is_distributed(optimizer):
        optimizer.load_parameter_state_from_dp_reshardable(saved["param_state"])
        # Without apex/TE, `DistributedOptimizer.load_state_dict` gives every parameter the same
        # `step` tensor object; torch's foreach Adam then adds 1 to it once per parameter per
        # step, and the bias correction goes wrong. Each parameter gets its own copy.
        for state in optimizer.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()
