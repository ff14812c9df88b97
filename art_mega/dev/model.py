"""ART's `art.dev` model configuration: `InternalModelConfig` and the argument dicts it holds
(typed as openpipe-art 0.5.23 types them; 0.5.18's `rollout_weights_mode` kept), and
`check_internal_config`, which refuses every field art-mega does not read (`READ_KEYS`) instead
of dropping it."""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import TypedDict

from art_mega.dev.engine import EngineArgs
from art_mega.errors import HyperParameterError

RolloutWeightUpdateMode = Literal["step_lora", "in_flight_lora"]
"""ART 0.5.23's `rollout_weight_update_mode` (0.5.18's `rollout_weights_mode`): "step_lora" loads
one adapter per policy step, what art-mega's replicas do; "in_flight_lora" is refused."""


class VllmRuntimeArgs(TypedDict, total=False):
    """ART 0.5.23's `vllm_runtime`: "managed" (ART starts vLLM; art-mega always does) or
    "external" (attach to a running server; refused: art-mega's replicas are its own)."""

    mode: Literal["managed", "external"]
    server_url: str
    api_key: str | None
    local_checkpoint_root: str | None
    server_checkpoint_root: str | None
    health_timeout_s: float


class InternalModelConfig(TypedDict, total=False):
    """ART's `TrainableModel(_internal_config=...)`: unstable per-model settings.

    art-mega reads the fields of `READ_KEYS` (GPU ids: CUDA device indices on the local host;
    `init_args` / `engine_args`: see `art_mega.dev.settings`; `chat_template_kwargs`: extra chat-template variables
    such as `enable_thinking`, JSON values, rendered into every request by the replicas and
    into every conversation the trainer tokenizes); `check_internal_config` refuses any other
    field that is set to something other than ART's "off" value.
    """

    init_args: InitArgs
    engine_args: EngineArgs
    peft_args: PeftArgs
    tinker_args: dict[str, Any] | None
    tinker_native_args: dict[str, Any] | None
    trainer_args: TrainerArgs
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]
    rollout_weights_mode: Literal["lora", "merged"]
    rollout_weight_update_mode: RolloutWeightUpdateMode
    chat_template_kwargs: dict[str, object]
    chat_template: str
    chat_template_path: str
    chat_template_content_format: str
    chat_template_tool_schema_format: Literal["default", "vllm_openai"]
    vllm_runtime: VllmRuntimeArgs
    allow_unvalidated_arch: bool
    megatron_model_initialization: Literal["pretrained", "random"]


class InitArgs(TypedDict, total=False):
    """ART's `dev.InitArgs` (Unsloth's FastLanguageModel arguments; how art-mega takes each:
    `art_mega.dev.settings`)."""

    model_name: str
    max_seq_length: int
    dtype: str | None
    load_in_4bit: bool
    load_in_8bit: bool
    load_in_16bit: bool
    full_finetuning: bool
    token: str | None
    device_map: str
    rope_scaling: dict | None
    fix_tokenizer: bool
    trust_remote_code: bool
    use_gradient_checkpointing: str
    resize_model_vocab: int | None
    revision: str | None
    use_exact_model_name: bool
    fast_inference: bool
    gpu_memory_utilization: float
    float8_kv_cache: bool
    random_state: int
    max_lora_rank: int
    disable_log_stats: bool
    enable_prefix_caching: bool
    use_async: bool


class PeftArgs(TypedDict, total=False):
    """ART's `dev.PeftArgs` (Unsloth's PEFT wrapper arguments; art-mega reads none: its LoRA is
    `MegatronBackend(lora_rank=, lora_alpha=, lora_targets=)`)."""

    r: int
    target_modules: list[str]
    lora_alpha: int
    lora_dropout: int
    bias: str
    layers_to_transform: list[int] | None
    layers_pattern: str | None
    use_gradient_checkpointing: str
    random_state: int
    max_seq_length: int
    use_rslora: bool
    modules_to_save: list[str] | None
    init_lora_weights: bool
    loftq_config: dict
    temporary_location: str


class TrainerArgs(TypedDict, total=False):
    """ART's `dev.TrainerArgs` (TRL's GRPO trainer arguments; art-mega trains with Megatron and
    reads none)."""

    output_dir: str | None
    overwrite_output_dir: bool
    do_train: bool
    do_eval: bool
    do_predict: bool
    eval_strategy: str
    prediction_loss_only: bool
    per_device_train_batch_size: int
    per_device_eval_batch_size: int
    per_gpu_train_batch_size: int | None
    per_gpu_eval_batch_size: int | None
    gradient_accumulation_steps: int
    eval_accumulation_steps: int | None
    eval_delay: float | None
    torch_empty_cache_steps: int | None
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    max_grad_norm: float
    num_train_epochs: float
    max_steps: int
    lr_scheduler_type: str
    lr_scheduler_kwargs: dict | str | None
    warmup_ratio: float
    warmup_steps: int
    log_level: str
    log_level_replica: str
    log_on_each_node: bool
    logging_dir: str | None
    logging_strategy: str
    logging_first_step: bool
    logging_steps: float
    logging_nan_inf_filter: bool
    save_strategy: str
    save_steps: float
    save_total_limit: int | None
    save_safetensors: bool | None
    save_on_each_node: bool
    save_only_model: bool
    restore_callback_states_from_checkpoint: bool
    no_cuda: bool
    use_cpu: bool
    use_mps_device: bool
    seed: int
    data_seed: int | None
    jit_mode_eval: bool
    use_ipex: bool
    bf16: bool
    fp16: bool
    fp16_opt_level: str
    half_precision_backend: str
    bf16_full_eval: bool
    fp16_full_eval: bool
    tf32: bool | None
    local_rank: int
    ddp_backend: str | None
    tpu_num_cores: int | None
    tpu_metrics_debug: bool
    debug: str | list[str]
    dataloader_drop_last: bool
    eval_steps: float | None
    dataloader_num_workers: int
    dataloader_prefetch_factor: int | None
    past_index: int
    run_name: str | None
    disable_tqdm: bool | None
    remove_unused_columns: bool | None
    label_names: list[str] | None
    load_best_model_at_end: bool | None
    metric_for_best_model: str | None
    greater_is_better: bool | None
    ignore_data_skip: bool
    fsdp: list[str] | str | None
    fsdp_min_num_params: int
    fsdp_config: dict | str | None
    fsdp_transformer_layer_cls_to_wrap: str | None
    accelerator_config: dict | str | None
    deepspeed: dict | str | None
    label_smoothing_factor: float
    optim: str
    optim_args: str | None
    adafactor: bool
    group_by_length: bool
    length_column_name: str | None
    report_to: str | list[str] | None
    ddp_find_unused_parameters: bool | None
    ddp_bucket_cap_mb: int | None
    ddp_broadcast_buffers: bool | None
    dataloader_pin_memory: bool
    dataloader_persistent_workers: bool
    skip_memory_metrics: bool
    use_legacy_prediction_loop: bool
    push_to_hub: bool
    resume_from_checkpoint: str | None
    hub_model_id: str | None
    hub_strategy: str
    hub_token: str | None
    hub_private_repo: bool | None
    hub_always_push: bool
    gradient_checkpointing: bool
    gradient_checkpointing_kwargs: dict | str | None
    include_inputs_for_metrics: bool
    include_for_metrics: list[str]
    eval_do_concat_batches: bool
    fp16_backend: str
    push_to_hub_model_id: str | None
    push_to_hub_organization: str | None
    push_to_hub_token: str | None
    mp_parameters: str
    auto_find_batch_size: bool
    full_determinism: bool
    torchdynamo: str | None
    ray_scope: str | None
    ddp_timeout: int
    torch_compile: bool
    torch_compile_backend: str | None
    torch_compile_mode: str | None
    include_tokens_per_second: bool | None
    include_num_input_tokens_seen: bool | None
    neftune_noise_alpha: float | None
    optim_target_modules: str | list[str] | None
    batch_eval_metrics: bool
    eval_on_start: bool
    use_liger_kernel: bool | None
    eval_use_gather_object: bool | None
    average_tokens_across_devices: bool | None
    model_init_kwargs: dict | None
    max_prompt_length: int | None
    num_generations: int | None
    temperature: float
    max_completion_length: int | None
    ds3_gather_for_generation: bool
    beta: float
    reward_weights: list[float] | None
    sync_ref_model: bool
    ref_model_mixup_alpha: float
    ref_model_sync_steps: int
    log_completions: bool


READ_KEYS: dict[str, frozenset[str] | None] = {
    "trainer_gpu_ids": None,
    "inference_gpu_ids": None,
    # honoured, mapped, accepted with a logged line or refused key by key (`dev.settings`)
    "init_args": None,
    "engine_args": None,
    # the optimizer (backend.art_optimizer): AdamW's betas and epsilon, RL's decay and clip
    "trainer_args": frozenset({"adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm"}),
    # the replicas' --default-chat-template-kwargs and the trainer's tokenization (trainer.prepare.tokenize)
    "chat_template_kwargs": None,
}
"""The `InternalModelConfig` fields art-mega reads (`LocalBackend.register`): a top-level field
with None is read whole; a dict field with a set is read for those keys only."""

OFF_VALUES: dict[str, object] = {
    "rollout_weights_mode": "lora",
    "rollout_weight_update_mode": "step_lora",
    "vllm_runtime": {"mode": "managed"},
    "megatron_model_initialization": "pretrained",
    "allow_unvalidated_arch": False,
    "tinker_args": None,
    "tinker_native_args": None,
}
"""Fields art-mega does not read but whose value here is what art-mega does anyway."""

_INSTEAD: dict[str, str] = {
    "peft_args.r": "set MegatronBackend(lora_rank=...)",
    "peft_args.lora_alpha": "set MegatronBackend(lora_alpha=...)",
    "peft_args.target_modules": "set MegatronBackend(lora_targets=...)",
    "trainer_args": "art-mega trains with Megatron, not TRL: pass the learning rate as "
    "model.train(config=art.TrainConfig(learning_rate=...)) and the loss options to backend.train "
    "(of trainer_args it reads adam_beta1, adam_beta2, adam_epsilon, weight_decay, max_grad_norm)",
    "rollout_weights_mode": "art-mega serves LoRA adapters ('lora'); leave it out",
    "rollout_weight_update_mode": "art-mega's replicas load one adapter per policy step "
    "('step_lora'); leave it out",
    "vllm_runtime": "art-mega starts and manages its own vLLM replicas (mode='managed'); leave it out",
    "megatron_model_initialization": "art-mega trains a LoRA adapter on the pretrained weights "
    "('pretrained'); leave it out",
    "allow_unvalidated_arch": "art-mega trains only the families in art_mega.trainer.families; leave it out",
    "tinker_args": "art-mega has no Tinker backend; leave it out",
    "tinker_native_args": "art-mega has no Tinker backend; leave it out",
}


def _refusal(where: str, field: str, value: Any) -> HyperParameterError:
    top = field.split(".")[0]
    fix = _INSTEAD.get(field) or _INSTEAD.get(top) or "leave it out"
    return HyperParameterError(
        f"{where} sets {field}={value!r}, which art-mega does not implement; {fix}", field, value
    )


def check_internal_config(
    value: Any, where: str = "TrainableModel(_internal_config=...)"
) -> InternalModelConfig:
    """`value` as an `InternalModelConfig` whose every set field art-mega reads.

    Returns the dict as given (a copy, nested dicts copied too). An empty dict or one at
    `OFF_VALUES` is accepted; the values of `READ_KEYS` are type-checked strictly (a bool is
    not an int, a GPU id list holds whole numbers).

    Raises:
        HyperParameterError: `value` is not a dict; a key ART's InternalModelConfig lacks; a field
            art-mega does not read set to a value other than its off value (one sentence
            naming `field`, the value and what to do instead); a read field of the wrong type.
    """
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(value, dict):
        raise HyperParameterError(
            f"{where} got {type(value).__name__} {value!r}; pass art.dev.InternalModelConfig(...) (a dict)",
            "_internal_config",
            value,
        )
    fields = InternalModelConfig.__annotations__
    checked: dict[str, Any] = {}
    for key, item in value.items():
        if key not in fields:
            raise HyperParameterError(
                f"{where} has the key {key!r}, which ART's InternalModelConfig does not have; "
                f"use one of {', '.join(fields)}",
                str(key),
                item,
            )
        if key in OFF_VALUES and item == OFF_VALUES[key] and type(item) is type(OFF_VALUES[key]):
            checked[key] = item
            continue
        if key not in READ_KEYS:
            if isinstance(item, dict) and item:  # name the first argument set inside
                sub, sub_value = next(iter(item.items()))
                raise _refusal(where, f"{key}.{sub}", sub_value)
            if item != {}:
                raise _refusal(where, key, item)
            checked[key] = {}
            continue
        read = READ_KEYS[key]
        if read is not None and isinstance(item, dict):
            for sub, sub_value in item.items():
                if sub not in read:
                    raise _refusal(where, f"{key}.{sub}", sub_value)
            item = dict(item)
        checked[key] = item
    if all(isinstance(checked.get(k, {}), dict) for k in ("init_args", "engine_args")):
        from art_mega.dev.settings import engine_settings

        engine_settings(checked)  # refused here, in vLLM's and ART's terms, not first at register
    try:
        TypeAdapter(InternalModelConfig).validate_python(checked, strict=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
        raise HyperParameterError(
            f"{where} sets {field}={error.get('input')!r}: {error['msg'].lower()} (for example "
            "trainer_gpu_ids=[0], init_args={'max_seq_length': 2048}, engine_args={'max_model_len': 2048})",
            field,
            error.get("input"),
        ) from None
    _check_template_kwargs(checked.get("chat_template_kwargs", {}), where)
    return checked  # type: ignore[return-value]


def _check_template_kwargs(kwargs: dict[str, Any], where: str) -> None:
    """Each `chat_template_kwargs` value is JSON (vLLM's --default-chat-template-kwargs is JSON).

    Raises:
        HyperParameterError: a value JSON cannot hold (named with its key).
    """
    import json

    for key, item in kwargs.items():
        try:
            json.dumps(item, allow_nan=False)
        except (TypeError, ValueError):
            raise HyperParameterError(
                f"{where} sets chat_template_kwargs.{key}={item!r}, which is not JSON (the replicas "
                "take these as JSON); use a string, number, bool, None, list or dict",
                f"chat_template_kwargs.{key}",
                item,
            ) from None
