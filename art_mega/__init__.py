"""art-mega: train LLM agents with GRPO and SFT on one machine or many (ART-compatible API).

Names are imported lazily so `art-mega --help` and the agents start fast.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from art_mega.torch_extensions import hide_mismatched

hide_mismatched()  # before anything imports transformers or vllm (its docstring)

try:
    __version__ = version("art-mega")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"

_EXPORTS = {
    "Trajectory": "art_mega.trajectories",
    "LocalBackend": "art_mega.local.backend",
    "Backend": "art_mega.types",
    "Messages": "art_mega.types",
    "MessagesAndChoices": "art_mega.types",
    "Tools": "art_mega.types",
    "retry": "art_mega.utils.retry",
    "auto_trajectory": "art_mega.captured",
    "capture_auto_trajectory": "art_mega.captured",
    "trajectory": "art_mega.captured",
    "trajectory_group": "art_mega.captured",
    "current_trajectory": "art_mega.captured",
    "no_capture": "art_mega.captured",
    "LoRAConfig": "art_mega.dev.lora",
    "LocalServingUnavailableError": "art_mega.errors",
    "get_tokenizer": "art_mega.utils.tokenizer",
    "yield_trajectory": "art_mega.yielded",
    "capture_yielded_trajectory": "art_mega.yielded",
    "TrajectoryGroup": "art_mega.trajectories",
    "gather_trajectory_groups": "art_mega.gather",
    "gather_trajectories": "art_mega.gather",
    "trajectory_group_batches": "art_mega.batches",
    "TrainSFTConfig": "art_mega.sft",
    "LocalTrainResult": "art_mega.types",
    "iterate_dataset": "art_mega.sft",
    "TrainableModel": "art_mega.model",
    "MegatronBackend": "art_mega.backend",
    "TrainResult": "art_mega.types",
    "Model": "art_mega.model",
    "TrainConfig": "art_mega.model",
    "ArtLaunchContext": "art_mega.launch.context",
    "ArtRuntime": "art_mega.runtime.runtime",
    "InstalledAsyncCallable": "art_mega.rollouts.installed",
    "RolloutExecutor": "art_mega.rollouts.remote",
    "UserError": "art_mega.errors",
    "compile_topology": "art_mega.topology",
    "ClusterSpec": "art_mega.topology",
    "HostSpec": "art_mega.topology",
    "EndpointSpec": "art_mega.topology",
    "TrainerSpec": "art_mega.topology",
    "InferenceSpec": "art_mega.topology",
    "NcclTransportSpec": "art_mega.topology",
    "NixlTransportSpec": "art_mega.topology",
    "CompiledTopology": "art_mega.topology",
}

_SUBMODULES = (
    "dev",
    "distributed",
    "local",
    "megatron",
    "utils",
    "types",
    "pipeline_trainer",
    "trajectories",
    "gather",
    "metrics",
)
"""ART's submodules that programs reach as attributes (`art.dev.TrainConfig`, `art.utils.retry`)."""

__all__ = ["__version__", *_SUBMODULES, *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"art_mega.{name}")
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        from art_mega.unsupported import missing  # ART's names art-mega lacks: their sentence

        raise missing("art_mega", name)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
