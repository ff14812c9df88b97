"""ART's public names art-mega does not provide, each with the ART table's one sentence
(docs/art-compatibility.md, rows marked "not supported"). A package's module `__getattr__`
(`art_mega`, `art_mega.dev`, `art_mega.utils`, `art_mega.types`,
`art_mega.trajectories`, `art_mega.pipeline_trainer`) raises `missing(...)` for a name it lacks: the sentence for these
names, Python's usual AttributeError for any other.
"""

from __future__ import annotations

from art_mega.errors import UnsupportedNameError

_SERVERLESS = "W&B serverless training is ART's hosted service; train with art_mega.LocalBackend"
_TINKER = "art-mega has no Tinker backends; train with art_mega.LocalBackend"
_INTERNAL = "it is one of ART's internals"
_MEGATRON_RUNTIME = (
    "ART's Megatron runtime settings; art-mega's trainer is set by "
    "art_mega.TrainerSpec(tp=, cp=, ep=) and MegatronBackend(seq_len=)"
)
_PIPELINE_TUNER = (
    "ART's pipeline autotuner; pass PipelineTrainer(num_rollout_workers=, min_batch_size=, "
    "max_batch_size=, queue_maxsize=) directly"
)
_RETENTION = (
    "ART's checkpoint retention; art-mega keeps every committed step (model.delete_checkpoints() prunes)"
)
_TENSORS = "ART's tokenized/tensorized trajectory views; art-mega tokenizes inside backend.train"
_DASHBOARD = "ART's pipeline-RL dashboard metric definitions; art-mega logs its metrics by name"

NOT_PROVIDED: dict[str, dict[str, str]] = {
    "art_mega": {
        "ServerlessBackend": _SERVERLESS,
        "ServerlessTrainResult": _SERVERLESS,
        "MegatronRuntimeConfig": _MEGATRON_RUNTIME,
        "MegatronTopologyConfig": _MEGATRON_RUNTIME,
        "get_megatron_runtime_config": _MEGATRON_RUNTIME,
        "init_megatron_runtime_config": _MEGATRON_RUNTIME,
        "PipelineAutotuneConfig": _PIPELINE_TUNER,
        "PipelineRuntimeConfig": _PIPELINE_TUNER,
        "MetricDefinition": _DASHBOARD,
        "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS": _DASHBOARD,
        "PIPELINE_RL_METRIC_DEFINITIONS": _DASHBOARD,
        "PIPELINE_RL_SCORE_METRICS": _DASHBOARD,
        "tokenize": _TENSORS,
        "tensorize": _TENSORS,
    },
    "art_mega.dev": {
        "TinkerArgs": _TINKER,
        "TinkerNativeArgs": _TINKER,
        "TinkerTrainingClientArgs": _TINKER,
        "OpenAIServerConfig": "art-mega sets vLLM's server arguments itself (pass engine_args)",
        "ServerArgs": "art-mega sets vLLM's server arguments itself (pass engine_args)",
        "get_openai_server_config": "art-mega sets vLLM's server arguments itself (pass engine_args)",
        "is_dedicated_mode": "register checks the GPU placement from trainer_gpu_ids / inference_gpu_ids itself",
        "validate_dedicated_config": "register checks the GPU placement from trainer_gpu_ids / inference_gpu_ids itself",
        "is_external_vllm_mode": "art-mega always manages its own vLLM replicas",
        "BackendModelConfig": "pass TrainableModel(lora_config=..., _internal_config=...)",
    },
    "art_mega.utils": {
        "format_message": _INTERNAL,
        "log_http_errors": _INTERNAL,
        "record_provenance": _INTERNAL,
        "get_model_step": "use await model.get_step()",
    },
    "art_mega.types": {"ServerlessTrainResult": _SERVERLESS},
    "art_mega.trajectories": {
        name: "import it from art_mega (art_mega.trajectories holds the classes the capture builds)"
        for name in ("trajectory", "trajectory_group", "current_trajectory", "no_capture")
    },
    "art_mega.pipeline_trainer": {
        "CheckpointInfo": _RETENTION,
        "CheckpointRetentionContext": _RETENTION,
        "CheckpointRetentionStrategy": _RETENTION,
        "keep_recent_and_top": _RETENTION,
        "CHECKPOINT_CREATED_AT_METRIC": _RETENTION,
        "CHECKPOINT_EVAL_COMPLETED_METRIC": _RETENTION,
        "CHECKPOINT_SAVED_METRIC": _RETENTION,
        "StatusReporter": "art-mega's status is PipelineTrainer.status_line(), logged every log_interval_seconds",
        "PipelineAutotuneConfig": _PIPELINE_TUNER,
        "PipelineRuntimeConfig": _PIPELINE_TUNER,
    },
}
"""Per art-mega module: ART's name -> why art-mega lacks it and what to use instead."""


def missing(module: str, name: str) -> Exception:
    """The error for `module.name`, which `module` lacks: `UnsupportedNameError` with the
    The ART table's sentence for a name of `NOT_PROVIDED`, else an AttributeError worded as Python's."""
    why = NOT_PROVIDED.get(module, {}).get(name)
    if why is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    art = "art" + module.removeprefix("art_mega")
    return UnsupportedNameError(f"{art}.{name} is not supported by art-mega: {why}")
