"""vLLM 0.32's engine arguments as its OpenAI server's command line takes them, for a controller
without vLLM: `ENGINE_ARGS` (name -> (kind, type, choices)), `engine_arg_problem` (why a value
is not one vLLM's parser would take, or None), `nearest` (vLLM's names closest to an unknown one)
and `engine_argv` (the command-line words of a dict of engine arguments).

The table is generated from vLLM itself: run this file with vLLM's interpreter
(`.venv-vllm/bin/python art_mega/inference/vllm_engine_args.py`: its version, then the lines
between the GENERATED markers; given a server command line, then also its engine arguments as
vLLM's parser reads them, as JSON) and compare;
`tests/inference/test_vllm_engine_args.py` does and fails naming the difference. A name is an
engine argument when it is a field of `vllm.engine.arg_utils.AsyncEngineArgs` that the server's
parser (`vllm.entrypoints.launchers.cli_args.make_arg_parser`) has an option for. Kinds, from
the option's argparse action: "bool" (`--x` / `--no-x`), "flag" (`--x` only), "list" (several
values after one option), "value" (one value). Types: "int", "float", "str", "json" (a dict
given as JSON) or "any" (vLLM's own parser decides). Stdlib only: the generator runs under
vLLM's interpreter without art-mega's dependencies.
"""

from __future__ import annotations

import difflib
import json
import math
from typing import Any

VLLM_VERSION = "0.32.0"
"""The vLLM whose parser the table was generated from."""

# fmt: off
ENGINE_ARGS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # GENERATED: begin
    'additional_config': ('value', 'any', ()),
    'aggregate_engine_logging': ('flag', 'any', ()),
    'all2all_backend': ('value', 'str', ('allgather_reducescatter', 'deepep_high_throughput', 'deepep_low_latency', 'deepep_v2', 'flashinfer_all2allv', 'flashinfer_nvlink_one_sided', 'flashinfer_nvlink_two_sided', 'moonep', 'mori_high_throughput', 'mori_low_latency', 'naive', 'nixl_ep', 'pplx')),
    'allow_deprecated_quantization': ('bool', 'any', ()),
    'allowed_local_media_path': ('value', 'str', ()),
    'allowed_media_domains': ('list', 'str', ()),
    'async_scheduling': ('bool', 'any', ()),
    'attention_backend': ('value', 'str', ()),
    'attention_config': ('value', 'json', ()),
    'aux_output_config': ('value', 'json', ()),
    'block_size': ('value', 'int', ()),
    'code_revision': ('value', 'str', ()),
    'collect_detailed_traces': ('list', 'str', ('None', 'all', 'model', 'worker')),
    'compilation_config': ('value', 'json', ()),
    'config_format': ('value', 'str', ()),
    'convert': ('value', 'str', ('auto', 'classify', 'embed', 'none')),
    'cp_kv_cache_interleave_size': ('value', 'int', ()),
    'cpu_distributed_timeout_seconds': ('value', 'int', ()),
    'cpu_offload_gb': ('value', 'float', ()),
    'cpu_offload_params': ('list', 'str', ()),
    'cudagraph_capture_sizes': ('list', 'int', ()),
    'cudagraph_metrics': ('bool', 'any', ()),
    'custom_histogram_buckets': ('value', 'json', ()),
    'data_parallel_address': ('value', 'str', ()),
    'data_parallel_backend': ('value', 'str', ()),
    'data_parallel_external_lb': ('bool', 'any', ()),
    'data_parallel_hybrid_lb': ('bool', 'any', ()),
    'data_parallel_multi_port_external_lb': ('flag', 'any', ()),
    'data_parallel_rank': ('value', 'int', ()),
    'data_parallel_rpc_port': ('value', 'int', ()),
    'data_parallel_size': ('value', 'int', ()),
    'data_parallel_size_local': ('value', 'int', ()),
    'data_parallel_start_rank': ('value', 'int', ()),
    'dbo_decode_token_threshold': ('value', 'int', ()),
    'dbo_prefill_token_threshold': ('value', 'int', ()),
    'dcp_comm_backend': ('value', 'str', ('None', 'a2a', 'ag_rs')),
    'dcp_kv_cache_interleave_size': ('value', 'int', ()),
    'dcp_q_replicate': ('bool', 'any', ()),
    'decode_context_parallel_size': ('value', 'int', ()),
    'default_mm_loras': ('value', 'json', ()),
    'device_ids': ('value', 'any', ()),
    'diffusion_config': ('value', 'json', ()),
    'disable_cascade_attn': ('bool', 'any', ()),
    'disable_chunked_mm_input': ('bool', 'any', ()),
    'disable_custom_all_reduce': ('bool', 'any', ()),
    'disable_hybrid_kv_cache_manager': ('bool', 'any', ()),
    'disable_log_stats': ('flag', 'any', ()),
    'disable_nccl_for_dp_synchronization': ('bool', 'any', ()),
    'disable_sliding_window': ('bool', 'any', ()),
    'distributed_executor_backend': ('value', 'str', ()),
    'distributed_timeout_seconds': ('value', 'int', ()),
    'download_dir': ('value', 'str', ()),
    'dp_sync_interval': ('value', 'int', ()),
    'dtype': ('value', 'str', ('auto', 'bfloat16', 'float', 'float16', 'float32', 'half')),
    'ec_manager_config': ('value', 'json', ()),
    'ec_transfer_config': ('value', 'json', ()),
    'elastic_ep_max_dp_size': ('value', 'int', ()),
    'enable_batch_sharded_sampling': ('bool', 'any', ()),
    'enable_chunked_prefill': ('bool', 'any', ()),
    'enable_cumem_allocator': ('bool', 'any', ()),
    'enable_dbo': ('bool', 'any', ()),
    'enable_elastic_ep': ('bool', 'any', ()),
    'enable_ep_weight_filter': ('bool', 'any', ()),
    'enable_eplb': ('bool', 'any', ()),
    'enable_expert_parallel': ('bool', 'any', ()),
    'enable_fault_tolerance': ('bool', 'any', ()),
    'enable_flashinfer_autotune': ('bool', 'any', ()),
    'enable_hc_sp': ('bool', 'any', ()),
    'enable_layerwise_nvtx_tracing': ('bool', 'any', ()),
    'enable_log_requests': ('bool', 'any', ()),
    'enable_logging_iteration_details': ('bool', 'any', ()),
    'enable_lora': ('bool', 'any', ()),
    'enable_mamba_cache_stochastic_rounding': ('bool', 'any', ()),
    'enable_mamba_shared_prefix_checkpoint': ('bool', 'any', ()),
    'enable_mfu_metrics': ('bool', 'any', ()),
    'enable_mixed_moe_lora_format': ('bool', 'any', ()),
    'enable_mm_embeds': ('bool', 'any', ()),
    'enable_moe_shared_loras': ('bool', 'any', ()),
    'enable_nccl_comm_suspend': ('bool', 'any', ()),
    'enable_prefix_caching': ('bool', 'any', ()),
    'enable_prompt_embeds': ('bool', 'any', ()),
    'enable_return_routed_experts': ('bool', 'any', ()),
    'enable_shm_tensor_arena': ('bool', 'any', ()),
    'enable_sleep_mode': ('bool', 'any', ()),
    'enable_tower_connector_lora': ('bool', 'any', ()),
    'enable_trace_replay': ('bool', 'any', ()),
    'enforce_eager': ('bool', 'any', ()),
    'engram_config': ('value', 'json', ()),
    'eplb_config': ('value', 'json', ()),
    'expert_placement_strategy': ('value', 'str', ('linear', 'round_robin')),
    'fail_on_environ_validation': ('bool', 'any', ()),
    'fault_tolerance_config': ('value', 'json', ()),
    'fully_sharded_loras': ('bool', 'any', ()),
    'gdn_prefill_backend': ('value', 'str', ('aiter_flydsl', 'cutedsl', 'flashinfer', 'triton')),
    'generation_config': ('value', 'str', ()),
    'gpu_memory_utilization': ('value', 'float', ()),
    'hf_config_path': ('value', 'str', ()),
    'hf_overrides': ('value', 'any', ()),
    'hf_token': ('value', 'str', ()),
    'ignore_patterns': ('list', 'str', ()),
    'interleave_mm_strings': ('bool', 'any', ()),
    'io_processor_plugin': ('value', 'str', ()),
    'ir_op_priority': ('value', 'json', ()),
    'jit_monitor_mode': ('value', 'str', ('error', 'warn')),
    'jit_monitor_verbose': ('bool', 'any', ()),
    'kda_decode_backend': ('value', 'str', ('auto', 'flashinfer', 'native', 'triton')),
    'kda_prefill_backend': ('value', 'str', ('auto', 'flashinfer', 'flashkda', 'fused', 'triton')),
    'kernel_config': ('value', 'json', ()),
    'kv_cache_dtype': ('value', 'str', ('auto', 'bfloat16', 'float16', 'fp8', 'fp8_ds_mla', 'fp8_e4m3', 'fp8_e5m2', 'fp8_inc', 'fp8_per_token_head', 'int4_per_token_head', 'int8_per_token_head', 'nvfp4', 'nvfp4_4over6', 'nvfp4_ds_mla', 'turboquant_3bit_nc', 'turboquant_4bit_nc', 'turboquant_k3v4_nc', 'turboquant_k8v4', 'ultraquant_4bit')),
    'kv_cache_dtype_skip_layers': ('list', 'str', ()),
    'kv_cache_memory_bytes': ('value', 'int', ()),
    'kv_cache_metrics': ('bool', 'any', ()),
    'kv_cache_metrics_sample': ('value', 'float', ()),
    'kv_events_config': ('value', 'json', ()),
    'kv_offloading_backend': ('value', 'str', ('lmcache', 'native')),
    'kv_offloading_size': ('value', 'float', ()),
    'kv_sharing_fast_prefill': ('bool', 'any', ()),
    'kv_transfer_config': ('value', 'json', ()),
    'language_model_only': ('bool', 'any', ()),
    'limit_mm_per_prompt': ('value', 'json', ()),
    'linear_backend': ('value', 'any', ('aiter', 'auto', 'b12x', 'conch', 'cutlass', 'deep_gemm', 'emulation', 'exllama', 'fbgemm', 'flashinfer_b12x', 'flashinfer_cudnn', 'flashinfer_cutedsl', 'flashinfer_cutlass', 'flashinfer_trtllm', 'humming', 'machete', 'marlin', 'torch', 'triton', 'xpu', 'xpu_woq')),
    'load_format': ('value', 'str', ()),
    'log_config_file': ('value', 'str', ()),
    'log_level': ('value', 'str', ('CRITICAL', 'DEBUG', 'ERROR', 'INFO', 'NOTSET', 'WARNING')),
    'logging_config': ('value', 'json', ()),
    'logits_processors': ('list', 'str', ()),
    'logprobs_mode': ('value', 'str', ('processed_logits', 'processed_logprobs', 'raw_logits', 'raw_logprobs')),
    'long_prefill_token_threshold': ('value', 'int', ()),
    'long_prefill_token_threshold_adaptive': ('bool', 'any', ()),
    'lora_dtype': ('value', 'str', ('auto', 'bfloat16', 'float16')),
    'lora_target_modules': ('list', 'str', ()),
    'mamba_backend': ('value', 'str', ()),
    'mamba_block_size': ('value', 'int', ()),
    'mamba_cache_dtype': ('value', 'str', ('auto', 'bfloat16', 'float16', 'float32')),
    'mamba_cache_mode': ('value', 'str', ('align', 'none')),
    'mamba_cache_philox_rounds': ('value', 'int', ()),
    'mamba_ssm_cache_dtype': ('value', 'str', ('auto', 'bfloat16', 'float16', 'float32')),
    'mamba_ssu_algorithm': ('value', 'str', ('None', 'auto', 'horizontal', 'simple', 'vertical')),
    'master_addr': ('value', 'str', ()),
    'master_port': ('value', 'int', ()),
    'max_cpu_loras': ('value', 'int', ()),
    'max_cudagraph_capture_size': ('value', 'int', ()),
    'max_logprobs': ('value', 'int', ()),
    'max_lora_cls_labels': ('value', 'int', ()),
    'max_lora_rank': ('value', 'int', ('1', '128', '16', '256', '32', '320', '512', '64', '8')),
    'max_loras': ('value', 'int', ()),
    'max_model_len': ('value', 'int', ()),
    'max_num_active_seqs': ('value', 'int', ()),
    'max_num_batched_tokens': ('value', 'int', ()),
    'max_num_queued_reqs': ('value', 'int', ()),
    'max_num_queued_tokens': ('value', 'int', ()),
    'max_num_scheduled_tokens': ('value', 'int', ()),
    'max_num_seqs': ('value', 'int', ()),
    'max_parallel_loading_workers': ('value', 'int', ()),
    'media_io_kwargs': ('value', 'json', ()),
    'mm_device_do_normalize': ('bool', 'any', ()),
    'mm_encoder_attn_backend': ('value', 'str', ()),
    'mm_encoder_attn_dtype': ('value', 'str', ('None', 'fp8')),
    'mm_encoder_fp8_scale_path': ('value', 'str', ()),
    'mm_encoder_fp8_scale_save_margin': ('value', 'float', ()),
    'mm_encoder_fp8_scale_save_path': ('value', 'str', ()),
    'mm_encoder_only': ('bool', 'any', ()),
    'mm_encoder_tp_mode': ('value', 'str', ('data', 'weights')),
    'mm_hasher_algorithm': ('value', 'str', ('blake3', 'sha256', 'sha512')),
    'mm_ipc_gpu_memory_gb': ('value', 'float', ()),
    'mm_processor_cache_gb': ('value', 'float', ()),
    'mm_processor_cache_type': ('value', 'str', ('lru', 'shm')),
    'mm_processor_device': ('value', 'str', ('auto', 'cpu')),
    'mm_processor_kwargs': ('value', 'json', ()),
    'mm_shm_cache_max_object_size_mb': ('value', 'int', ()),
    'mm_tensor_ipc': ('value', 'str', ('direct_rpc', 'torch_shm')),
    'model': ('value', 'str', ()),
    'model_class_overrides': ('value', 'json', ()),
    'model_impl': ('value', 'str', ()),
    'model_loader_extra_config': ('value', 'any', ()),
    'moe_backend': ('value', 'any', ('aiter', 'aiter_mega_moe', 'aiter_triton_mxfp4_bf16', 'auto', 'b12x', 'batched_triton', 'cutlass', 'deep_gemm', 'deep_gemm_mega_moe', 'emulation', 'flashinfer_b12x', 'flashinfer_cutedsl', 'flashinfer_cutlass', 'flashinfer_moe_ep_cutedsl', 'flashinfer_moe_ep_mega_deep_gemm', 'flashinfer_trtllm', 'flydsl', 'hpc', 'humming', 'marlin', 'rdna3', 'triton', 'triton_unfused')),
    'nnodes': ('value', 'int', ()),
    'node_rank': ('value', 'int', ()),
    'num_gpu_blocks_override': ('value', 'int', ()),
    'numa_bind': ('bool', 'any', ()),
    'numa_bind_cpus': ('list', 'str', ()),
    'numa_bind_nodes': ('list', 'int', ()),
    'offload_backend': ('value', 'str', ('auto', 'prefetch', 'uva')),
    'offload_group_size': ('value', 'int', ()),
    'offload_num_in_group': ('value', 'int', ()),
    'offload_params': ('list', 'str', ()),
    'offload_prefetch_step': ('value', 'int', ()),
    'optimization_level': ('value', 'str', ()),
    'otlp_traces_endpoint': ('value', 'str', ()),
    'override_generation_config': ('value', 'json', ()),
    'per_request_spec_decode_metrics': ('value', 'str', ('detailed', 'none', 'summary')),
    'performance_mode': ('value', 'str', ('balanced', 'interactivity', 'throughput')),
    'pipeline_parallel_size': ('value', 'int', ()),
    'pooler_config': ('value', 'json', ()),
    'prefill_context_parallel_size': ('value', 'int', ()),
    'prefill_schedule_interval': ('value', 'int', ()),
    'prefix_cache_retention_interval': ('value', 'int', ()),
    'prefix_caching_hash_algo': ('value', 'str', ('sha256', 'sha256_cbor', 'xxhash', 'xxhash_cbor')),
    'prefix_match_unit': ('value', 'int', ()),
    'profiler_config': ('value', 'json', ()),
    'pt_load_map_location': ('value', 'any', ()),
    'quantization': ('value', 'str', ()),
    'quantization_config': ('value', 'json', ()),
    'ray_workers_use_nsight': ('bool', 'any', ()),
    'reasoning_config': ('value', 'json', ()),
    'reasoning_parser': ('value', 'str', ()),
    'reasoning_parser_plugin': ('value', 'str', ()),
    'renderer_num_workers': ('value', 'int', ()),
    'replayssm_buffer_len': ('value', 'int', ()),
    'return_sampling_mask': ('bool', 'any', ()),
    'revision': ('value', 'str', ()),
    'runner': ('value', 'str', ('auto', 'draft', 'generate', 'pooling')),
    'safetensors_load_strategy': ('value', 'str', ('None', 'eager', 'lazy', 'prefetch', 'torchao')),
    'safetensors_prefetch_block_size': ('value', 'int', ()),
    'safetensors_prefetch_num_threads': ('value', 'int', ()),
    'scheduler_cls': ('value', 'str', ()),
    'scheduler_reserve_full_isl': ('bool', 'any', ()),
    'scheduling_policy': ('value', 'str', ('fcfs', 'priority')),
    'seed': ('value', 'int', ()),
    'served_model_name': ('list', 'str', ()),
    'show_hidden_metrics_for_version': ('value', 'str', ()),
    'shutdown_timeout': ('value', 'int', ()),
    'skip_mm_profiling': ('bool', 'any', ()),
    'skip_tokenizer_init': ('bool', 'any', ()),
    'sleep_mode_offload_cudagraph': ('bool', 'any', ()),
    'sleep_preserve_parameter_names': ('list', 'str', ()),
    'sparse_indexer_topk_backend': ('value', 'any', ('aiter', 'auto', 'cooperative', 'deep_select', 'flashinfer', 'per_row', 'persistent', 'torch')),
    'spec_method': ('value', 'str', ('None', 'bailing_hybrid_mtp', 'bailing_hybrid_v3_mtp', 'custom_class', 'deepseek_mtp', 'dflash', 'dots3_note_mtp', 'draft_model', 'dspark', 'eagle', 'eagle3', 'ernie_mtp', 'exaone4_5_mtp', 'exaone_moe_mtp', 'extract_hidden_states', 'gemma4_mtp', 'glm4_moe_lite_mtp', 'glm4_moe_mtp', 'glm5_next_mtp', 'glm_ocr_mtp', 'hy_v3_mtp', 'hy_v4_mtp', 'inkling_mtp', 'kimi_k3_mtp', 'longcat_flash_mtp', 'medusa', 'mimo_mtp', 'mimo_v2_mtp', 'minimax_m3_mtp', 'mlp_speculator', 'mtp', 'nemotron_h_mtp', 'ngram', 'ngram_gpu', 'pangu_ultra_moe_mtp', 'qwen3_5_mtp', 'qwen3_next_mtp', 'qwen4_exp_mtp', 'step3p5_mtp', 'suffix')),
    'spec_model': ('value', 'str', ()),
    'spec_tokens': ('value', 'int', ()),
    'specialize_active_lora': ('bool', 'any', ()),
    'speculative_config': ('value', 'json', ()),
    'stream_interval': ('value', 'int', ()),
    'structured_outputs_config': ('value', 'json', ()),
    'swa_bounded_replay': ('bool', 'any', ()),
    'tensor_parallel_size': ('value', 'int', ()),
    'tokenizer': ('value', 'str', ()),
    'tokenizer_mode': ('value', 'str', ()),
    'tokenizer_revision': ('value', 'str', ()),
    'tokens_only': ('bool', 'any', ()),
    'trust_remote_code': ('bool', 'any', ()),
    'ubatch_size': ('value', 'int', ()),
    'use_fp64_gumbel': ('bool', 'any', ()),
    'use_replayssm': ('bool', 'any', ()),
    'use_tqdm_on_load': ('bool', 'any', ()),
    'video_pruning_method': ('value', 'str', ('evs', 'vidcom2')),
    'video_pruning_rate': ('value', 'float', ()),
    'watermark': ('value', 'float', ()),
    'watermark_config': ('value', 'json', ()),
    'weight_transfer_config': ('value', 'json', ()),
    'worker_cls': ('value', 'str', ()),
    'worker_extension_cls': ('value', 'str', ()),
    # GENERATED: end
}
# fmt: on


def nearest(name: str, count: int = 3) -> list[str]:
    """vLLM's engine-argument names closest to `name` (difflib's ratio >= 0.6, best first)."""
    return difflib.get_close_matches(name, ENGINE_ARGS, n=count, cutoff=0.6)


def engine_arg_problem(name: str, value: Any) -> str | None:
    """Why vLLM's parser would refuse `value` for the engine argument `name` (a phrase such as
    "must be True or False"), or None when it takes it. None values are always taken (vLLM's
    default). Only the kind, type and choices of the table are checked; vLLM checks the rest
    when the replica starts (its log names it).

    Raises:
        KeyError: `name` is not an engine argument of vLLM (see `nearest`).
    """
    kind, kind_type, choices = ENGINE_ARGS[name]
    if value is None:
        return None
    if kind in ("bool", "flag"):
        if not isinstance(value, bool):
            return "must be True or False"
        if kind == "flag" and value is False:
            return None  # off is vLLM's default: the option is left out
        return None
    items = list(value) if kind == "list" and isinstance(value, (list, tuple)) else [value]
    for item in items:
        if kind_type == "int" and (isinstance(item, bool) or not isinstance(item, int)):
            return "must be a whole number"
        if kind_type == "float" and (
            isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item)
        ):
            return "must be a finite number"
        if kind_type == "json" and not isinstance(item, (dict, str)):
            return "must be a dict (vLLM takes it as JSON)"
        if kind_type == "str" and not isinstance(item, str):
            return "must be a string"
        if choices and str(item) not in choices:
            return f"must be one of {', '.join(choices)}"
        if isinstance(item, (dict, list)):
            try:
                json.dumps(item, allow_nan=False)
            except (TypeError, ValueError):
                return "must be JSON (vLLM takes it as JSON)"
    return None


def engine_argv(args: dict[str, Any]) -> list[str]:
    """The command-line words of the engine arguments `args` (names of `ENGINE_ARGS`, values
    `engine_arg_problem` takes), in their order: True -> `--x`, False -> `--no-x` ("bool") or
    nothing ("flag"), None -> nothing (vLLM's default), a dict -> JSON, a list -> one word each
    ("list"), anything else -> `str(value)`.

    Raises:
        ValueError: a name that is not one of vLLM's engine arguments, or a value it refuses.
    """
    argv: list[str] = []
    for name, value in args.items():
        if name not in ENGINE_ARGS:
            raise ValueError(f"{name!r} is not an engine argument of vLLM {VLLM_VERSION}")
        problem = engine_arg_problem(name, value)
        if problem is not None:
            raise ValueError(f"vLLM's engine argument {name}={value!r} {problem}")
        kind = ENGINE_ARGS[name][0]
        option = "--" + name.replace("_", "-")
        if value is None or (kind == "flag" and value is False):
            continue
        if kind in ("bool", "flag"):
            argv.append(option if value else "--no-" + name.replace("_", "-"))
        elif kind == "list" and isinstance(value, (list, tuple)):
            argv += [option, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        else:
            argv += [option, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv


def _generate() -> dict[str, tuple[str, str, tuple[str, ...]]]:  # pragma: no cover - vLLM's interpreter
    """The table from the installed vLLM (see the module docstring)."""
    import argparse
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def base_type(parse: Any) -> str:
        for _ in range(4):  # vLLM wraps parsers in closures (optional_type, parse_type)
            cells = [
                c.cell_contents
                for c in getattr(parse, "__closure__", None) or ()
                if callable(c.cell_contents)
            ]
            if not cells:
                break
            parse = cells[0]
        name = getattr(parse, "__name__", "")
        if name in ("int", "human_readable_int", "human_readable_int_or_auto"):
            return "int"
        return {"float": "float", "str": "str", "loads": "json", "parse_dataclass": "json"}.get(name, "any")

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    table: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for action in make_arg_parser(FlexibleArgumentParser())._actions:
        if action.dest not in fields or not action.option_strings:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            kind, kind_type = "bool", "any"
        elif action.nargs == 0:
            kind, kind_type = "flag", "any"
        else:
            kind = "list" if action.nargs in ("+", "*") else "value"
            kind_type = base_type(action.type)
            if action.type is None:
                kind_type = "str"
        choices = tuple(sorted(str(c) for c in action.choices or ()))
        table[action.dest] = (kind, kind_type, choices)
    return dict(sorted(table.items()))


def _render(table: dict[str, tuple[str, str, tuple[str, ...]]]) -> str:
    """The table's lines as they stand between the GENERATED markers."""
    return "".join(f"    {name!r}: {entry!r},\n" for name, entry in table.items())


if __name__ == "__main__":  # pragma: no cover - run with vLLM's interpreter
    import sys

    import vllm

    sys.stdout.write(f"# vLLM {vllm.__version__}\n{_render(_generate())}")
    if len(sys.argv) > 1:  # a server command line to parse as vLLM does: its engine arguments as JSON
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parsed = vars(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]))
        sys.stdout.write(
            json.dumps({k: v for k, v in parsed.items() if k in ENGINE_ARGS}, default=str) + "\n"
        )
