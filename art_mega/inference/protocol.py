"""How a vLLM replica is launched, and the agent's inference routes and their bodies.

Pydantic models, JSON on the wire; `ReplicaLaunch` is what `replica.start_replica` needs beside
the topology's `ReplicaSpec`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from art_mega.agent.protocol import ShutdownResponse
from art_mega.agent.routes import Route
from art_mega.topology.compiled import ReplicaSpec

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `--max-lora-rank`."""


def lora_rank_slot(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of rank `rank`.

    Raises `ValueError` for a rank < 1 or above vLLM's largest slot (512).
    """
    if rank >= 1:
        for slot in VLLM_LORA_RANKS:
            if rank <= slot:
                return slot
    raise ValueError(f"LoRA rank {rank} is outside 1..{VLLM_LORA_RANKS[-1]}, the ranks vLLM can serve")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaLaunch(_Body):
    """What one vLLM OpenAI server is started with (besides the replica's host and port).

    `model` is the HF model directory on the replica's host; `served_model_name` is the base
    model's name in the API (adapters are served as `<served_model_name>@<step>`). `python` is
    the interpreter that runs `-m vllm.entrypoints.openai.api_server` (None: the agent's own).
    `max_lora_rank` must be one of vLLM's slots (see `lora_rank_slot`); `max_loras` is how
    many adapters one batch may mix. `kv_cache_gib` sets `VLLM_CPU_KVCACHE_SPACE` (CPU only,
    whole GiB). `log_dir` receives `<replica>.log` (appended to on restart). Timeouts in seconds:
    `ready_timeout_s` bounds start to healthy plus the warm-up completion; `stop_grace_s` is the
    wait between SIGTERM and SIGKILL. `extra_args` are appended to vLLM's argv; `env` is added
    to the environment (e.g. the topology's `ProcessSpec.environ`). `gpu_memory_utilization`
    (GPU only) is the fraction of each GPU's memory vLLM may take (None: vLLM's default, 0.9);
    lower it when replicas share GPUs with trainer ranks whose weights stay resident.
    `tool_call_parser` turns on vLLM's automatic tool choice with that parser (vLLM's name, e.g.
    "hermes"; None: no tool calling); `generation_config` is vLLM's `--generation-config`
    ("vllm": vLLM's own sampling defaults, not the model's generation_config.json; None: vLLM's
    default); `chat_template_kwargs` are rendered into every chat request's template (a request
    may override them; {}: none). `base_model_name` (None: none) is a second name the base model
    answers to (ART's `base_model`, e.g. "Qwen/Qwen2.5-7B-Instruct"); `served_model_name` itself
    means the latest step the replica has loaded (`vllm_plugin/art_mega_vllm_serve.py`).
    """

    model: str
    served_model_name: str = Field(min_length=1)
    python: str | None = None
    max_lora_rank: int = 8
    max_loras: int = Field(default=2, ge=1)
    max_model_len: int = Field(default=512, ge=16)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    kv_cache_gib: int = Field(default=1, ge=1)
    log_dir: str
    ready_timeout_s: float = Field(default=180.0, gt=0, allow_inf_nan=False)
    stop_grace_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    tool_call_parser: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    generation_config: str | None = Field(default=None, min_length=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    base_model_name: str | None = Field(default=None, min_length=1)

    @field_validator("max_lora_rank")
    @classmethod
    def _check_rank(cls, value: int) -> int:
        if value not in VLLM_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank {value} is not one vLLM accepts ({', '.join(map(str, VLLM_LORA_RANKS))}); "
                f"use lora_rank_slot({value}) = the next larger one"
            )
        return value

    @field_validator("served_model_name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if "@" in value or any(c.isspace() for c in value):
            raise ValueError(
                f"served_model_name {value!r} must not contain '@' or whitespace ('@' separates the step)"
            )
        return value


class InferenceStartRequest(_Body):
    """Start the head process of `replica` on the receiving agent's host and wait until ready."""

    replica: ReplicaSpec
    launch: ReplicaLaunch


class InferenceStartResponse(_Body):
    """A started, warmed-up replica (`ok`), or why it did not come up (`error`, with its log tail).

    `seconds` is the wall time from spawn to the end of the warm-up completion.
    """

    ok: bool
    name: str
    pid: int | None = None
    log_path: str = ""
    url: str = ""
    seconds: float = 0.0
    error: str = ""


class InferenceStopRequest(_Body):
    """Stop these replicas by process name ("NAME-INDEX"; empty = every replica of this agent)."""

    names: tuple[str, ...] = ()


class InferenceWarmRequest(_Body):
    """Warm the interpreter this host's CPU replica will run under (see `inference.warm`):
    `python` imports vLLM's server now, started with the replica's environment (`vllm_env` with
    `env` as the launch's); None stops the warm interpreter. `cache_dir` (the host's cache root;
    None: none) keeps the list of files the import read, read ahead the next time."""

    python: str | None = Field(default=None, min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cache_dir: str | None = Field(default=None, min_length=1)


class InferenceWarmResponse(_Body):
    """The warm interpreter's pid (`ok`), or why it could not be started (`error`)."""

    ok: bool
    pid: int | None = None
    error: str = ""


INFERENCE_START = Route("POST", "/inference/start", InferenceStartRequest, InferenceStartResponse)
INFERENCE_STOP = Route("POST", "/inference/stop", InferenceStopRequest, ShutdownResponse)
INFERENCE_WARM = Route("POST", "/inference/warm", InferenceWarmRequest, InferenceWarmResponse)
