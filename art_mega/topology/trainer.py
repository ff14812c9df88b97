"""What the Megatron trainer asks for: its parallel sizes, its hosts and its rendezvous port.

The data-parallel size is not given: `compile_topology` derives it from the hosts' GPUs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from art_mega.topology.base import GpuId, Integer, ListenPort, SpecModel, unique_gpu_ids, unique_names


class TrainerSpec(SpecModel):
    """Megatron parallel sizes and placement of the trainer ranks.

    `tp`, `cp`, `ep`, `etp`, `pp` are the tensor, context, expert, expert-tensor and pipeline
    parallel sizes (each >= 1). The world size is one rank per GPU of every trainer host, or
    `cpu_ranks_per_host` ranks on a host without GPUs; then dp = world / (tp*cp*pp) and the
    expert data-parallel size = world / (etp*ep*pp), and `compile_topology` raises
    `TopologyError` when either does not divide. `host_ids` None means every host with GPUs (or
    every host when none has GPUs). `gpu_ids` restricts which GPUs of each trainer host get a
    rank (None: every GPU the host lists), so one host can hold the trainer on some GPUs and
    replicas on others. `master_port` is the torch.distributed rendezvous port on rank 0's
    host; None (the default) is a port rank 0's agent finds free when the runtime starts
    (`ArtRuntime.start`; `runtime.topology.trainer.master_port` and every rank's MASTER_PORT
    hold it), so two runs on one machine never meet on a fixed port. Raises `ValidationError`
    for sizes < 1, an empty or repeated host or GPU id or a port outside 1..65535.
    """

    tp: Integer = Field(default=1, ge=1)
    cp: Integer = Field(default=1, ge=1)
    ep: Integer = Field(default=1, ge=1)
    etp: Integer = Field(default=1, ge=1)
    pp: Integer = Field(default=1, ge=1)
    host_ids: tuple[str, ...] | None = None
    gpu_ids: tuple[GpuId, ...] | None = None
    cpu_ranks_per_host: Integer = Field(default=1, ge=1)
    cpu_train_threads: Integer | None = Field(default=None, ge=1)
    """Intra-op threads (torch.set_num_threads) a rank uses while it runs a train job; between
    jobs it holds one. None: on a CPU rank, the cores of its CPU affinity divided among the CPU
    ranks of its host, because the replicas are idle while the trainer trains, but no more than
    the cores not busy at the job's start (at least 1; `trainer.rank.main.train_threads`); on a
    GPU rank, torch's default. More than the rank's cores is refused at its start."""
    master_port: ListenPort | None = None
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation (megatron-core `TransformerConfig.recompute_granularity`; Korthikanti
    et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"): "none" keeps
    every activation for the backward; "selective" re-runs the submodules in `recompute_modules`
    in the backward (keeping their inputs only); "full" keeps each recomputed layer's input only and
    re-runs the whole layer in the backward. The step's values do not change, only its memory
    and time (`art_mega.trainer.prepare.memory_plan` plans each)."""
    recompute_modules: tuple[Literal["core_attn", "mlp"], ...] = ("core_attn",)
    """Under "selective": the submodules re-run (megatron-core's `recompute_modules`): "core_attn"
    the attention core (softmax(QK^T)V), "mlp" a dense layer's MLP (fc1, SwiGLU, fc2)."""
    recompute_layers: Integer | None = Field(default=None, ge=1)
    """Under "full": the layers of each pipeline stage recomputed, its first ones
    (`recompute_method="block"`, `recompute_num_layers`); the rest keep their activations. None:
    every layer, one at a time (`recompute_method="uniform"`, `recompute_num_layers=1`)."""

    @model_validator(mode="after")
    def _check_recompute(self) -> TrainerSpec:
        if self.recompute_layers is not None and self.recompute != "full":
            raise ValueError(
                f"recompute_layers={self.recompute_layers} counts fully recomputed layers; "
                f'set recompute="full" with it, or leave it None'
            )
        if self.recompute == "selective" and not self.recompute_modules:
            raise ValueError('recompute="selective" needs recompute_modules, e.g. ("core_attn",)')
        return self

    @field_validator("host_ids")
    @classmethod
    def _check_host_ids(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("host_ids is empty; list at least one host or use None for all")
        return unique_names(value, "host_ids")

    @field_validator("gpu_ids")
    @classmethod
    def _check_gpu_ids(cls, value: tuple[int | str, ...] | None) -> tuple[int | str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("gpu_ids is empty; list at least one GPU or use None for all")
        return unique_gpu_ids(value, "gpu_ids")

    def unsupported(self) -> tuple[str, str] | None:
        """(field, sentence) of the first size art-mega's trainer cannot run yet, or None.

        pp > 1 with cp > 1: pipeline stages do not split context-parallel rows (`trainer/rank/engine.py`).
        Whether a model can be split into pp stages needs its config
        (`model_builder.check_pipeline`, at register). `compile_topology` raises it as a
        `TopologyError` (and `MegatronBackend.register` and a rank's `init_parallel` again, for a
        topology not compiled here), so it is refused before any rank or replica starts.
        """
        if self.pp != 1 and self.cp != 1:
            return "TrainerSpec.pp", (
                f"TrainerSpec.pp={self.pp} with cp={self.cp} is not supported yet (pipeline stages "
                "do not split context-parallel rows); use cp=1 with pp, or pp=1 with cp."
            )
        return None

    @property
    def model_parallel_size(self) -> int:
        """tp * cp * pp: the ranks one copy of the dense model spans."""
        return self.tp * self.cp * self.pp

    @property
    def expert_model_parallel_size(self) -> int:
        """etp * ep * pp: the ranks one copy of the expert layers spans."""
        return self.etp * self.ep * self.pp
