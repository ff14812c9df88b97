"""ART 0.5.23's `art.megatron`: its `MegatronBackend`, for programs that port by changing the
import (`from art.megatron import MegatronBackend` -> `from art_mega.megatron import
MegatronBackend`), as ART's Qwen3.5 MoE, GPT-OSS and multi-host examples import it.

ART's MegatronBackend (`art/megatron/backend.py`) is its LocalBackend on Megatron ranks, so here it
is art-mega's `LocalBackend` (which trains on Megatron ranks too) with what ART's changes:
- its default LoRA (`art/megatron/lora_config.py`, `distributed_service.py`): rank 1 on an MoE
  model and 8 on a dense one (`default_lora_rank_for_handler`), alpha 32 (`LORA_ALPHA`), where
  LocalBackend's (Unsloth's, `art/unsloth/service.py`) is rank 8, alpha 16; the targets are the
  model's default either way (`MegatronBackend._lora_targets`). A `TrainableModel(lora_config=)`
  rank or alpha, or art-mega's `lora_rank=` / `lora_alpha=` keywords, replace them;
- `runtime=`: a started multi-host art-mega `ArtRuntime` (ART's takes its Monarch runtime there),
  whose `ClusterSpec.artifact_root` the runs live under (`path`, when also given, must be it).

Not copied: ART's requirement that `train` gets `packed_sequence_length` (art-mega packs into
rows of `seq_len` or of the longest trajectory without it), and `in_process=True`, which ART
refuses and art-mega's LocalBackend accepts with one logged line (nothing changes).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from art_mega.errors import UserError
from art_mega.local.backend import LocalBackend

log = logging.getLogger(__name__)

MOE_LORA_RANK = 1
DENSE_LORA_RANK = 8
LORA_ALPHA = 32.0
"""ART 0.5.23's Megatron LoRA defaults (`art/megatron/lora_config.py`)."""

__all__ = ["MegatronBackend"]


class MegatronBackend(LocalBackend):
    """ART's `art.megatron.MegatronBackend`: `LocalBackend` with ART's Megatron LoRA defaults
    (module docstring) and an optional started multi-host `runtime`.

    Args:
        in_process, path, enable_expert_replay: as `LocalBackend`'s.
        runtime: a started art-mega `ArtRuntime` to train on (its artifact root holds the runs),
            or None for a local one on this machine.
        options: art-mega's `MegatronBackend` keywords (`seq_len`, `lora_rank`, ...).

    Raises:
        UserError: `path` is given with a `runtime` and is not its artifact root, `runtime` is not
            a started ArtRuntime; and what `LocalBackend` raises.
    """

    def __init__(
        self,
        *,
        in_process: bool = False,
        path: str | None = None,
        enable_expert_replay: bool = True,
        runtime: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(in_process=in_process, path=path, enable_expert_replay=enable_expert_replay, **options)
        self._lora_given = {name for name in ("lora_rank", "lora_alpha") if name in options}
        """The LoRA values this program chose (keywords here, or its model's `lora_config`)."""
        if runtime is None:
            return
        root = getattr(getattr(getattr(runtime, "topology", None), "cluster", None), "artifact_root", None)
        if root is None or not all(hasattr(runtime, a) for a in ("clients", "health")):
            raise UserError(
                f"MegatronBackend(runtime={runtime!r}) must be a started art_mega ArtRuntime "
                "(await ArtRuntime.start(topology)), or None for a local one"
            )
        if path is not None and os.path.realpath(path) != os.path.realpath(root):
            raise UserError(
                f"MegatronBackend(path={path!r}) must be the runtime's ClusterSpec.artifact_root "
                f"{root!r}, where its runs live; leave path out"
            )
        self._runtime = runtime
        self._owns_runtime = False

    def _apply_lora_config(self, model: Any) -> None:
        from art_mega.dev.lora import lora_settings

        super()._apply_lora_config(model)
        self._lora_given |= set(lora_settings(getattr(model, "lora_config", None))) - {"lora_targets"}

    def _check_model_and_adapter(
        self, trainer: Any, replicas: Any, resolved: Any, run_dir: Any, committed: int | None
    ) -> None:
        """ART's Megatron LoRA defaults for the resolved model (rank by whether it is an MoE),
        where the program chose none; then the backend's checks."""
        from art_mega.trainer.families import family_for
        from art_mega.trainer.hf_checkpoint import read_hf_config

        config = read_hf_config(resolved.model_dir)
        spec = family_for(config)
        moe = bool(getattr(spec.model_args(config), "num_experts", 0))
        defaults = {"lora_rank": MOE_LORA_RANK if moe else DENSE_LORA_RANK, "lora_alpha": LORA_ALPHA}
        chosen = {name: value for name, value in defaults.items() if name not in self._lora_given}
        if chosen:
            self.lora["rank"] = int(chosen.get("lora_rank", self.lora["rank"]))
            self.lora["alpha"] = float(chosen.get("lora_alpha", self.lora["alpha"]))
            log.info(
                "MegatronBackend (ART's art.megatron): LoRA rank %d, alpha %g on this %s model, "
                "ART's Megatron defaults",
                self.lora["rank"],
                self.lora["alpha"],
                "MoE" if moe else "dense",
            )
        super()._check_model_and_adapter(trainer, replicas, resolved, run_dir, committed)


def __getattr__(name: str) -> Any:
    from art_mega.unsupported import missing  # ART's other art.megatron names: their sentence

    raise missing("art_mega.megatron", name)
