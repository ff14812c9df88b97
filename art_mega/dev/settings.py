"""ART's engine and hardware settings (`InternalModelConfig.engine_args` / `init_args`) as
art-mega runs them: `engine_settings` turns them into `EngineSettings`.

The rule (docs/art-compatibility.md, "ART's settings rule"): a setting that tunes how the hardware or the engine runs is
honoured where it means the same here, or accepted with one logged line saying what art-mega
does instead; only what would change what is trained, or what art-mega cannot do, is refused
(`HyperParameterError`, one sentence naming the field, the value and the fix).

- `engine_args`: every key vLLM 0.32 knows (`inference.vllm_engine_args.ENGINE_ARGS`) goes to
  the replicas' vLLM as vLLM takes it (`EngineSettings.vllm_args`); the keys art-mega sets
  itself are honoured through its own fields (`max_model_len`, `gpu_memory_utilization`,
  `max_loras`, `max_lora_rank`, `dtype`, placement) or accepted with a line (`model`, ...);
  ART 0.5.18's keys that vLLM 0.32 no longer has (`RETIRED_ENGINE_ARGS`, e.g. the V0 engine's
  `num_scheduler_steps`) are dropped with a line (ART 0.5.23 hands them to vLLM's parser, which
  exits on them); any other key is refused with vLLM's nearest names, as vLLM's parser would.
- `init_args` (Unsloth's loader arguments in ART): those with a vLLM or trainer meaning are mapped
  (`INIT_TO_ENGINE`, `max_seq_length`, `dtype`), those that only tune Unsloth are accepted with a
  line (`INIT_NOTES`), those that change what is trained are refused when on (`INIT_REFUSED`).
"""

from __future__ import annotations

import difflib
import logging
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from art_mega.errors import HyperParameterError
from art_mega.inference.vllm_engine_args import ENGINE_ARGS, VLLM_VERSION, engine_arg_problem, nearest

log = logging.getLogger(__name__)

WHERE = "TrainableModel(_internal_config=...)"
MIN_MODEL_LEN = 16
"""The shortest vLLM context a replica is started with (`ReplicaLaunch.max_model_len`)."""

RETIRED_ENGINE_ARGS = frozenset(
    {
        "calculate_kv_scales",
        "device",
        "disable_async_output_proc",
        "disable_log_requests",
        "disable_logprobs_during_spec_decoding",
        "disable_mm_preprocessor_cache",
        "enable_lora_bias",
        "enable_prompt_adapter",
        "guided_decoding_backend",
        "logits_processor_pattern",
        "long_lora_scaling_factors",
        "lora_extra_vocab_size",
        "max_long_partial_prefills",
        "max_num_partial_prefills",
        "max_prompt_adapter_token",
        "max_prompt_adapters",
        "max_seq_len_to_capture",
        "multi_step_stream_outputs",
        "ngram_prompt_lookup_max",
        "ngram_prompt_lookup_min",
        "num_lookahead_slots",
        "num_scheduler_steps",
        "num_speculative_tokens",
        "override_neuron_config",
        "preemption_mode",
        "scheduler_delay_factor",
        "spec_decoding_acceptance_method",
        "speculative_disable_by_batch_size",
        "speculative_disable_mqa_scorer",
        "speculative_draft_tensor_parallel_size",
        "speculative_max_model_len",
        "speculative_model",
        "speculative_model_quantization",
        "swap_space",
        "tokenizer_pool_extra_config",
        "tokenizer_pool_size",
        "typical_acceptance_sampler_posterior_alpha",
        "typical_acceptance_sampler_posterior_threshold",
        "use_v2_block_manager",
    }
)
"""Keys of ART 0.5.18's `dev.EngineArgs` that vLLM 0.32's engine no longer has (V0 scheduling,
speculative and prompt-adapter settings): they tuned the engine only, so they are dropped with a
line. (`rope_scaling`, `rope_theta` and `qlora_adapter_name_or_path`, also gone, change the model
served and are refused by `ENGINE_REFUSED`.)"""

ENGINE_REFUSED: dict[str, str] = {
    "tokenizer": "the trainer tokenizes with the base model's own tokenizer, and the replicas must too",
    "revision": "the trainer trains the base model's files as resolved; pin a revision by pointing "
    "base_model at that revision's directory",
    "code_revision": "art-mega runs no remote model code",
    "tokenizer_revision": "the trainer tokenizes with the base model's own tokenizer, and the replicas must too",
    "hf_overrides": "the trainer builds the model from its config.json unchanged; edit a copy of the "
    "model's directory instead",
    "rope_scaling": "the trainer builds the model from its config.json unchanged; set rope_scaling in a "
    "copy of the model's config.json instead",
    "rope_theta": "the trainer builds the model from its config.json unchanged; set rope_theta in a "
    "copy of the model's config.json instead",
    "qlora_adapter_name_or_path": "art-mega serves the adapter it trains; leave it out",
}
"""Engine keys whose value changes the model the replicas serve away from the one trained (why)."""

ENGINE_NOTES: dict[str, str] = {
    "model": "the replicas serve TrainableModel(base_model=...) and its adapters (ART sets it too)",
    "served_model_name": "the replicas serve the model as model.name, <name>@<step> and base_model "
    "(ART sets it too)",
    "enable_lora": "the replicas serve the trained LoRA adapters, so vLLM's LoRA stays on (as in ART)",
    "lora_target_modules": "the replicas apply the adapter to the modules the trainer trains "
    "(MegatronBackend(lora_targets=...))",
    "distributed_executor_backend": "art-mega picks vLLM's executor from the replica's devices "
    "('uni' for one device)",
    "pipeline_parallel_size": "art-mega places replicas from its topology (InferenceSpec.pp)",
    "data_parallel_size": "art-mega places replicas from its topology (InferenceSpec.replicas, dp)",
}
"""Engine keys art-mega sets itself, accepted with a line (what it does instead)."""

ENGINE_OWN = (
    "max_model_len",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "enable_sleep_mode",
    "max_loras",
    "max_lora_rank",
    "dtype",
)
"""Engine keys honoured through `EngineSettings`' own fields (the replica's argv sets them once)."""

INIT_TO_ENGINE = ("gpu_memory_utilization", "max_lora_rank", "enable_prefix_caching", "disable_log_stats")
"""`init_args` keys that are vLLM engine arguments of the same name and meaning (Unsloth hands
them to its vLLM); `engine_args` wins when both set one. `float8_kv_cache=True` is vLLM's
`kv_cache_dtype='fp8'` (what Unsloth passes)."""

INIT_REFUSED: dict[str, tuple[object, str]] = {
    "load_in_4bit": (
        False,
        "art-mega trains the LoRA on the base weights unquantized (no QLoRA); leave it out or set False",
    ),
    "load_in_8bit": (
        False,
        "art-mega trains the LoRA on the base weights unquantized; leave it out or set False",
    ),
    "full_finetuning": (False, "art-mega trains a LoRA adapter; leave it out or set False"),
    "rope_scaling": (
        None,
        "the trainer builds the model from its config.json unchanged; set "
        "rope_scaling in a copy of the model's config.json instead",
    ),
    "resize_model_vocab": (None, "the trainer builds the model from its config.json unchanged; leave it out"),
    "model_name": (None, "name the model with TrainableModel(base_model=...)"),
    "revision": (None, "pin the revision by pointing base_model at that revision's directory"),
}
"""`init_args` keys that change what is trained unless at their value here (off value, why)."""

INIT_NOTES: dict[str, str] = {
    "load_in_16bit": "art-mega trains on the base weights in the trainer's dtype (MegatronBackend(dtype=...))",
    "token": "art-mega downloads with huggingface_hub's own token (HF_TOKEN or `hf auth login`)",
    "device_map": "art-mega places the trainer ranks and replicas from its topology",
    "fix_tokenizer": "art-mega uses the base model's tokenizer and chat template as they are",
    "trust_remote_code": "art-mega builds its supported model families itself and runs no remote code",
    "use_gradient_checkpointing": "the Megatron trainer manages activation memory itself",
    "use_exact_model_name": "art-mega resolves base_model itself",
    "fast_inference": "vLLM always runs as its own replica process",
    "random_state": "art-mega initialises the LoRA with its own seed (B = 0, so step 0 is the base model)",
    "use_async": "vLLM always runs as its own replica process, serving requests asynchronously",
    "float8_kv_cache": "",  # mapped (see INIT_TO_ENGINE); listed so that it is a known key
    "max_seq_length": "",
    "dtype": "",
}
"""`init_args` keys that tune only Unsloth, accepted with a line (what art-mega does instead)."""

INIT_KEYS = frozenset((*INIT_TO_ENGINE, *INIT_REFUSED, *INIT_NOTES))
"""Every key of ART's `dev.InitArgs`."""


@dataclass(frozen=True)
class EngineSettings:
    """What a model's `init_args` / `engine_args` set, checked (see `engine_settings`).

    `max_seq_length`: the trainer's sequence limit in tokens (`init_args.max_seq_length`).
    `max_model_len`: the replicas' context in tokens. `gpu_memory_utilization`: fraction (0, 1] of
    each GPU vLLM takes. `tensor_parallel_size`, `enable_sleep_mode`: placement (see
    `launch.local_topology`). `max_loras`, `max_lora_rank`: vLLM's LoRA slots. `dtype`: vLLM's
    `--dtype` ("auto", "float32", "bfloat16", "float16"). `trainer_dtype`: the trainer's
    parameter dtype from `init_args.dtype` ("float32" or "bfloat16"). None everywhere: the
    backend's own. `vllm_args`: the other vLLM engine arguments, by vLLM's names, passed to the
    replicas as given (`inference.vllm_engine_args.engine_argv`). `notes`: one line per setting
    accepted but done otherwise here (`log_notes` logs them).
    """

    max_seq_length: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    dtype: str | None = None
    trainer_dtype: str | None = None
    vllm_args: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def _refuse(field: str, value: Any, why: str) -> HyperParameterError:
    return HyperParameterError(f"{WHERE} sets {field}={value!r}, {why}", field, value)


def _whole_number(field: str, value: Any, least: int, example: int) -> int:
    try:  # any integer type, numpy's too; not a bool and not a float
        number = None if "bool" in type(value).__name__ else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < least:
        raise _refuse(field, value, f"which must be a whole number of at least {least}, e.g. {example}")
    return number


def _fraction(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _refuse(
            field, value, "which is a fraction of each GPU's memory; use a number in (0, 1], e.g. 0.5"
        )
    return float(value)


_VLLM_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
_TRAINER_DTYPES = {
    "float32": "float32",
    "torch.float32": "float32",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
}


def _init_settings(init: Mapping[str, Any], notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(settings, engine arguments) from `init_args`; notes appended. Raises HyperParameterError."""
    settings: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for key, value in init.items():
        name = f"init_args.{key}"
        if key not in INIT_KEYS:
            close = " or ".join(difflib.get_close_matches(key, sorted(INIT_KEYS), n=3))
            raise _refuse(
                name,
                value,
                f"which ART's dev.InitArgs does not have; {'did you mean ' + close + '? ' if close else ''}"
                f"its keys are {', '.join(sorted(INIT_KEYS))}",
            )
        if key in INIT_REFUSED:
            off, why = INIT_REFUSED[key]
            if value is not off:
                raise _refuse(name, value, f"which changes what is trained: {why}")
        elif key == "max_seq_length":
            settings["max_seq_length"] = _whole_number(name, value, 1, 2048)
        elif key == "dtype":
            if value is not None:
                if str(value) not in _TRAINER_DTYPES:
                    raise _refuse(
                        name, value, "but art-mega trains in 'float32' or 'bfloat16'; use one or None"
                    )
                settings["trainer_dtype"] = _TRAINER_DTYPES[str(value)]
        elif key == "float8_kv_cache":
            if not isinstance(value, bool):
                raise _refuse(name, value, "which must be True or False")
            if value:
                engine["kv_cache_dtype"] = "fp8"
        elif key in INIT_TO_ENGINE:
            engine[key] = value
        elif value is not None and value is not False:
            notes.append(f"{WHERE}: {name}={value!r} is accepted; {INIT_NOTES[key]}")
    return settings, engine


def engine_settings(config: Mapping[str, Any]) -> EngineSettings:
    """The `init_args` and `engine_args` of the `InternalModelConfig` `config`, checked and
    mapped (module docstring). `engine_args` wins over the `init_args` key of the same meaning.

    Raises:
        HyperParameterError: an `engine_args` key vLLM 0.32 does not know (with its nearest
            names) or a value its parser would refuse; an `init_args` key ART's InitArgs lacks;
            a setting that changes what is trained (`ENGINE_REFUSED`, `INIT_REFUSED`); a value
            of the wrong type or range (one sentence naming the field).
    """
    init = dict(config.get("init_args") or {})
    notes: list[str] = []
    settings, from_init = _init_settings(init, notes)
    engine = {**from_init, **dict(config.get("engine_args") or {})}
    dropped = [key for key in engine if key in RETIRED_ENGINE_ARGS and key not in ENGINE_ARGS]
    notes += [
        f"{WHERE}: engine_args.{key}={engine[key]!r} is dropped: vLLM {VLLM_VERSION}'s engine no longer "
        "has it (a vLLM V0 setting), and schedules and tunes itself"
        for key in dropped
    ]
    vllm_args: dict[str, Any] = {}
    for key, value in engine.items():
        name = f"engine_args.{key}"
        if key in dropped:
            continue
        if key in ENGINE_REFUSED:
            if value is not None:
                raise _refuse(
                    name, value, f"which changes the model the replicas serve: {ENGINE_REFUSED[key]}"
                )
            continue
        if key not in ENGINE_ARGS:
            close = nearest(key)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise _refuse(
                name,
                value,
                f"which is not an engine argument of vLLM {VLLM_VERSION} (vLLM's own parser "
                f"would refuse --{key.replace('_', '-')}); {hint}use vLLM's engine-argument names",
            )
        problem = engine_arg_problem(key, value)
        if problem is not None:
            raise _refuse(name, value, f"but vLLM's {key} {problem}")
        if key in ENGINE_NOTES:
            if key == "enable_lora" and value is not False:
                continue
            if key in ("pipeline_parallel_size", "data_parallel_size") and value in (None, 1):
                continue
            notes.append(f"{WHERE}: {name}={value!r} is accepted; {ENGINE_NOTES[key]}")
        elif key not in ENGINE_OWN:
            vllm_args[key] = value
    if engine.get("max_model_len") is not None:
        settings["max_model_len"] = _whole_number(
            "engine_args.max_model_len", engine["max_model_len"], MIN_MODEL_LEN, 2048
        )
    if engine.get("tensor_parallel_size") is not None:
        settings["tensor_parallel_size"] = _whole_number(
            "engine_args.tensor_parallel_size", engine["tensor_parallel_size"], 1, 1
        )
    if engine.get("gpu_memory_utilization") is not None:
        field_name = (
            "engine_args" if "gpu_memory_utilization" in (config.get("engine_args") or {}) else "init_args"
        )
        settings["gpu_memory_utilization"] = _fraction(
            f"{field_name}.gpu_memory_utilization", engine["gpu_memory_utilization"]
        )
    if engine.get("enable_sleep_mode") is not None:
        settings["enable_sleep_mode"] = engine["enable_sleep_mode"]
    if engine.get("max_loras") is not None:
        settings["max_loras"] = _whole_number("engine_args.max_loras", engine["max_loras"], 1, 2)
    if engine.get("max_lora_rank") is not None:
        settings["max_lora_rank"] = _whole_number("engine_args.max_lora_rank", engine["max_lora_rank"], 1, 16)
    if engine.get("dtype") is not None:
        settings["dtype"] = _VLLM_DTYPES[engine["dtype"]]
    return EngineSettings(**settings, vllm_args=vllm_args, notes=tuple(notes))


def log_notes(settings: EngineSettings) -> None:
    """Log each of `settings.notes` (one WARNING line each, on this module's logger)."""
    for note in settings.notes:
        log.warning("%s", note)


CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "seq_length",
    "max_sequence_length",
    "model_max_length",
)
"""The config.json keys of a model's context length, in the order ART 0.5.23 reads them
(`art.dev.sequence_lengths`), also inside `text_config` / `llm_config` / `language_config`."""


def model_context(hf_config: Mapping[str, Any]) -> int | None:
    """The model's context length in tokens from its config.json dict (`CONTEXT_KEYS`), None
    when it names none."""
    sections = [hf_config.get(k) for k in ("text_config", "llm_config", "language_config")]
    for section in [*(s for s in sections if isinstance(s, Mapping)), hf_config]:
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1_000_000_000:
                return value
    return None


def kv_bytes_per_token(hf_config: Mapping[str, Any], dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes in vLLM: 2 (a key and a value) x num_hidden_layers x
    num_key_value_heads x head_dim x `dtype_bytes` (4 for float32, 2 for bfloat16/float16);
    head_dim is the config's, else hidden_size / num_attention_heads, and num_key_value_heads
    defaults to num_attention_heads (vLLM's `get_num_kv_heads`, `get_head_size`). A
    `text_config` section (multimodal configs) is read first."""
    text = hf_config.get("text_config")
    config = text if isinstance(text, Mapping) else hf_config
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def default_max_model_len(
    hf_config: Mapping[str, Any], kv_cache_bytes: int | None, dtype_bytes: int, block_size: int = 16
) -> tuple[int, str | None]:
    """The replicas' context in tokens when none is set, and the line to log when it was capped.

    The model's context (`model_context`; 2048 when config.json names none), capped by the
    tokens the replica's KV cache holds: floor(kv_cache_bytes / `kv_bytes_per_token`) rounded
    down to a whole `block_size` (vLLM allocates the cache in blocks and refuses a context one
    sequence cannot fill). `kv_cache_bytes` None: not capped (vLLM fits it). Never below
    `MIN_MODEL_LEN`.

    Example: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) in float32 on a CPU replica with
    VLLM_CPU_KVCACHE_SPACE=1 GiB: 46,080 bytes a token, 23,301 tokens, so its 8192 is not capped.
    """
    context = model_context(hf_config) or 2048
    if kv_cache_bytes is None:
        return context, None
    fits = kv_cache_bytes // kv_bytes_per_token(hf_config, dtype_bytes) // block_size * block_size
    if fits >= context:
        return context, None
    capped = max(fits, MIN_MODEL_LEN)
    return capped, (
        f"max_model_len defaults to {capped} tokens, not the model's context of {context}: the replica's "
        f"KV cache of {kv_cache_bytes / 2**30:.3g} GiB holds {fits} tokens at "
        f"{kv_bytes_per_token(hf_config, dtype_bytes)} bytes each; set engine_args.max_model_len (and "
        "more KV cache memory: gpu_memory_utilization, or VLLM_CPU_KVCACHE_SPACE on CPU) for more"
    )
