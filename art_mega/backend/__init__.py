"""MegatronBackend: the runtime, the Megatron trainer ranks and the vLLM replicas behind ART's API.

The package's rooms: `options` (the backend's and its steps' options and their checks), `serving`
(`register`: start, warm and stop the ranks and replicas), `step` (`train`, `train_sft`: batches ->
job -> commit -> publish), `batches` (trajectories into a step's batches), `s3` (checkpoints in S3,
forks) and `facade` (the `MegatronBackend` class that joins them). Every name other modules import
from `art_mega.backend` is re-exported here.
"""

from art_mega.backend.batches import (
    PACKED_ROW_TOKENS,
    checked_groups,
    packed_row_len,
    rl_step_batches,
)
from art_mega.backend.facade import MegatronBackend
from art_mega.backend.options import (
    ART_OPTION_HINTS,
    ART_SFT_OPTIMIZER,
    ART_TRAINER_ARGS,
    BACKEND_WHOLE_NUMBERS,
    DEFAULT_LEARNING_RATE,
    GRPO_OPTIONS,
    Check,
    GRPOOptions,
    RefusedOption,
    art_optimizer,
    check_accumulation,
    check_backend_options,
    check_grpo_options,
    check_optimizer_snapshots,
    check_packing,
    trajectories_learning_rate,
)
from art_mega.backend.serving import (
    TOKENIZER_NICE,
    check_runtime_idle,
    default_vllm_python,
    in_lowered_thread,
    remote_trainer_hosts,
    replica_python,
)
from art_mega.types import LocalTrainResult, TrainResult

__all__ = [
    "ART_OPTION_HINTS",
    "ART_SFT_OPTIMIZER",
    "ART_TRAINER_ARGS",
    "BACKEND_WHOLE_NUMBERS",
    "DEFAULT_LEARNING_RATE",
    "GRPO_OPTIONS",
    "Check",
    "GRPOOptions",
    "PACKED_ROW_TOKENS",
    "TOKENIZER_NICE",
    "LocalTrainResult",
    "MegatronBackend",
    "RefusedOption",
    "TrainResult",
    "art_optimizer",
    "check_accumulation",
    "check_backend_options",
    "check_grpo_options",
    "check_optimizer_snapshots",
    "check_packing",
    "check_runtime_idle",
    "checked_groups",
    "default_vllm_python",
    "in_lowered_thread",
    "packed_row_len",
    "remote_trainer_hosts",
    "replica_python",
    "rl_step_batches",
    "trajectories_learning_rate",
]
