"""ART's engine and hardware settings (`engine_args`, `init_args`, LocalBackend's flags) are
honoured, accepted with one logged line, or refused by name (`art_mega.dev.settings`)."""

import logging

import pytest

import art_mega as art
from art_mega.dev.settings import (
    RETIRED_ENGINE_ARGS,
    default_max_model_len,
    engine_settings,
    kv_bytes_per_token,
)
from art_mega.errors import HyperParameterError
from art_mega.inference.vllm_engine_args import ENGINE_ARGS, engine_argv

WHERE = "TrainableModel(_internal_config=...)"

# ART's 2048 example (OpenPipe/ART examples/2048/2048.py at 779559fd), "to run on a T4"
T4_2048 = art.dev.InternalModelConfig(
    init_args=art.dev.InitArgs(max_seq_length=8192),
    engine_args=art.dev.EngineArgs(enforce_eager=True, gpu_memory_utilization=0.8, num_scheduler_steps=1),
)


def test_arts_t4_settings_are_honoured_and_the_v0_setting_dropped_with_a_line():
    settings = engine_settings(T4_2048)
    assert settings.vllm_args == {"enforce_eager": True}
    assert (settings.max_seq_length, settings.gpu_memory_utilization) == (8192, 0.8)
    assert settings.notes == (
        f"{WHERE}: engine_args.num_scheduler_steps=1 is dropped: vLLM 0.32.0's engine no longer has it "
        "(a vLLM V0 setting), and schedules and tunes itself",
    )
    model = art.TrainableModel(name="m", project="p", base_model="b", _internal_config=T4_2048)
    assert model._internal_config["engine_args"]["num_scheduler_steps"] == 1  # kept as given


def test_every_engine_argument_vllm_knows_goes_to_vllm_as_vllm_takes_it():
    settings = engine_settings(
        {
            "engine_args": {
                "enforce_eager": True,
                "max_num_seqs": 7,
                "enable_prefix_caching": False,
                "compilation_config": {"mode": 0},
                "kv_cache_dtype": "auto",
                "seed": None,
            }
        }
    )
    assert engine_argv(settings.vllm_args) == [
        "--enforce-eager",
        "--max-num-seqs", "7",
        "--no-enable-prefix-caching",
        "--compilation-config", '{"mode": 0}',
        "--kv-cache-dtype", "auto",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("engine_args", "sentence"),
    [
        (
            {"max_num_seq": 7},
            "sets engine_args.max_num_seq=7, which is not an engine argument of vLLM 0.32.0 (vLLM's own "
            "parser would refuse --max-num-seq); did you mean max_num_seqs or max_num_active_seqs or "
            "max_num_queued_reqs? use vLLM's engine-argument names",
        ),
        (
            {"enforce_eager": "yes"},
            "sets engine_args.enforce_eager='yes', but vLLM's enforce_eager must be True or False",
        ),
        (
            {"max_num_seqs": 7.5},
            "sets engine_args.max_num_seqs=7.5, but vLLM's max_num_seqs must be a whole number",
        ),
        (
            {"kv_cache_dtype": "fp4"},
            "sets engine_args.kv_cache_dtype='fp4', but vLLM's kv_cache_dtype must be one of auto, bfloat16",
        ),
        (
            {"tokenizer": "other/tok"},
            "sets engine_args.tokenizer='other/tok', which changes the model the replicas serve: the trainer "
            "tokenizes with the base model's own tokenizer, and the replicas must too",
        ),
    ],
)
def test_an_engine_argument_vllm_would_refuse_is_refused_by_name(engine_args, sentence):
    with pytest.raises(HyperParameterError) as caught:
        art.TrainableModel(
            name="m", project="p", base_model="b", _internal_config={"engine_args": engine_args}
        )
    assert str(caught.value).startswith(f"{WHERE} {sentence}"), str(caught.value)
    assert caught.value.name == f"engine_args.{next(iter(engine_args))}"


def test_init_args_with_a_vllm_or_trainer_meaning_are_mapped_and_engine_args_win():
    settings = engine_settings(
        {
            "init_args": {"gpu_memory_utilization": 0.5, "max_lora_rank": 32, "enable_prefix_caching": True,
                          "float8_kv_cache": True, "dtype": "bfloat16", "max_seq_length": 4096,
                          "load_in_4bit": False, "full_finetuning": False},
            "engine_args": {"gpu_memory_utilization": 0.7},
        }
    )  # fmt: skip
    assert (settings.gpu_memory_utilization, settings.max_lora_rank, settings.trainer_dtype) == (
        0.7,
        32,
        "bfloat16",
    )
    assert settings.vllm_args == {"enable_prefix_caching": True, "kv_cache_dtype": "fp8"}
    assert settings.max_seq_length == 4096 and settings.notes == ()


def test_init_args_that_tune_only_unsloth_are_accepted_with_one_line_each():
    settings = engine_settings(
        {"init_args": {"fast_inference": True, "use_gradient_checkpointing": "unsloth"}}
    )
    assert settings.notes == (
        f"{WHERE}: init_args.fast_inference=True is accepted; vLLM always runs as its own replica process",
        f"{WHERE}: init_args.use_gradient_checkpointing='unsloth' is accepted; the Megatron trainer manages "
        "activation memory itself",
    )


@pytest.mark.parametrize(
    ("init_args", "sentence"),
    [
        (
            {"load_in_4bit": True},
            "sets init_args.load_in_4bit=True, which changes what is trained: art-mega trains the LoRA on the "
            "base weights unquantized (no QLoRA); leave it out or set False",
        ),
        ({"full_finetuning": True}, "sets init_args.full_finetuning=True, which changes what is trained: art-mega"),
        ({"max_seq_lenght": 8}, "sets init_args.max_seq_lenght=8, which ART's dev.InitArgs does not have; did you "
         "mean max_seq_length?"),
        ({"dtype": "float16"}, "sets init_args.dtype='float16', but art-mega trains in 'float32' or 'bfloat16'"),
    ],
)  # fmt: skip
def test_init_args_that_change_what_is_trained_are_refused_by_name(init_args, sentence):
    with pytest.raises(HyperParameterError) as caught:
        engine_settings({"init_args": init_args})
    assert str(caught.value).startswith(f"{WHERE} {sentence}"), str(caught.value)


def test_no_key_of_arts_engine_args_crashes_a_program():
    """Each of ART's `dev.EngineArgs` keys (0.5.18's) is vLLM's, dropped with a line, art-mega's
    own, or one of the few that change the model served (refused with their sentence)."""
    from art_mega.dev.engine import EngineArgs
    from art_mega.dev.settings import ENGINE_REFUSED

    unplaced = set(EngineArgs.__annotations__) - set(ENGINE_ARGS) - RETIRED_ENGINE_ARGS - set(ENGINE_REFUSED)
    assert unplaced == set()
    assert RETIRED_ENGINE_ARGS.isdisjoint(ENGINE_ARGS)


# ------------------------------------------------------------------ max_model_len's default

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "max_position_embeddings": 8192}  # fmt: skip
LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "head_dim": 128, "max_position_embeddings": 131072}  # fmt: skip


def test_max_model_len_defaults_to_the_models_context_when_the_kv_cache_holds_it():
    assert kv_bytes_per_token(SMOLLM2, 4) == 2 * 30 * 3 * 64 * 4 == 46080
    assert default_max_model_len(SMOLLM2, 2**30, 4, 32) == (8192, None)  # 23,301 tokens fit
    assert default_max_model_len({**SMOLLM2, "max_position_embeddings": None}, None, 4) == (2048, None)


def test_max_model_len_is_capped_by_the_kv_cache_with_one_line():
    assert kv_bytes_per_token(LLAMA_8B, 4) == 262144
    assert default_max_model_len(LLAMA_8B, 2**30, 4, 32) == (
        4096,
        "max_model_len defaults to 4096 tokens, not the model's context of 131072: the replica's KV cache "
        "of 1 GiB holds 4096 tokens at 262144 bytes each; set engine_args.max_model_len (and more KV cache "
        "memory: gpu_memory_utilization, or VLLM_CPU_KVCACHE_SPACE on CPU) for more",
    )
    # in bfloat16 on a GPU with 20 GiB for the cache: 163,840 tokens would fit, so the context
    assert default_max_model_len(LLAMA_8B, 20 * 2**30, 2, 16) == (131072, None)


def test_the_default_context_and_sequence_limit_follow_the_model(tiny_llama_dir):
    from art_mega.local import LocalBackend
    from art_mega.topology import ClusterSpec, HostSpec, InferenceSpec, TrainerSpec, compile_topology

    host = HostSpec(host_id="h", node_rank=0, worker_address="tcp://127.0.0.1:1", cpu_slots=2)
    topology = compile_topology(
        ClusterSpec(hosts=(host,), controller_host_id="h", artifact_root="/tmp/a", cache_root="/tmp/c"),
        trainer=TrainerSpec(cpu_ranks_per_host=1),
        inference=InferenceSpec(replicas=1),
    )
    backend = LocalBackend()
    backend._apply_model_config(art.TrainableModel(name="m", project="p", base_model="tiny-llama"))
    engine = backend._engine_for(topology, tiny_llama_dir)
    assert (backend.max_model_len, backend.seq_len) == (2048, 2048)  # the tiny model's context
    assert engine == {"dtype": "float32", "max_lora_rank": 8, "extra_args": ()}
    config = {"engine_args": {"max_model_len": 512, "enforce_eager": True, "max_loras": 3}}
    backend._apply_model_config(
        art.TrainableModel(name="m", project="p", base_model="b", _internal_config=config)
    )
    engine = backend._engine_for(topology, tiny_llama_dir)
    assert (backend.max_model_len, backend.seq_len) == (512, 512)
    assert engine == {
        "dtype": "float32",
        "max_lora_rank": 8,
        "max_loras": 3,
        "extra_args": ("--enforce-eager",),
    }


# ------------------------------------------------------------------ LocalBackend's placement flags


def test_local_backends_placement_flags_are_accepted_with_one_line_each(caplog):
    with caplog.at_level(logging.WARNING, logger="art_mega.local.backend"):
        art.LocalBackend(in_process=True, enable_expert_replay=False)
        art.LocalBackend(in_process=False, enable_expert_replay=True)
    assert [r.getMessage() for r in caplog.records] == [
        "LocalBackend(in_process=True) is accepted: art-mega runs the trainer and vLLM as child processes "
        "of a local agent (ART's default placement), which changes no result",
        "LocalBackend(enable_expert_replay=False) is accepted: art-mega's trainer never replays vLLM's "
        "routed experts; it routes every token itself, as ART does with False",
    ]


def test_register_logs_each_setting_it_accepts_but_does_otherwise(caplog):
    config = {**T4_2048, "init_args": {"use_async": True}}
    model = art.TrainableModel(name="m", project="p", base_model="b", _internal_config=config)
    with caplog.at_level(logging.WARNING, logger="art_mega.dev.settings"):
        art.LocalBackend()._apply_model_config(model)
    assert [r.getMessage() for r in caplog.records] == [
        f"{WHERE}: init_args.use_async=True is accepted; vLLM always runs as its own replica process, "
        "serving requests asynchronously",
        f"{WHERE}: engine_args.num_scheduler_steps=1 is dropped: vLLM 0.32.0's engine no longer has it "
        "(a vLLM V0 setting), and schedules and tunes itself",
    ]


def test_a_max_lora_rank_below_the_trained_rank_is_refused_at_register():
    model = art.TrainableModel(
        name="m", project="p", base_model="b", _internal_config={"engine_args": {"max_lora_rank": 1}}
    )
    with pytest.raises(HyperParameterError) as caught:
        art.LocalBackend(lora_rank=8)._apply_model_config(model)
    assert str(caught.value) == (
        f"{WHERE} sets max_lora_rank=1, below the LoRA rank 8 the replicas must serve; raise it or leave it out"
    )


def test_packed_rows_follow_the_batch_up_to_the_sequence_limit():
    from art_mega.backend import packed_row_len

    assert [packed_row_len(8192, n) for n in (0, 40, 1024, 1500, 9000)] == [1024, 1024, 1024, 1500, 8192]
    assert packed_row_len(512, 40) == 512  # a limit below the default row: the limit
    backend = art.LocalBackend()
    config = {"init_args": {"max_seq_length": 8192}}  # ART's 2048 notebook: a limit, not a row
    backend._apply_model_config(
        art.TrainableModel(name="m", project="p", base_model="b", _internal_config=config)
    )
    assert (backend.seq_len, backend._fixed_rows) == (8192, False)
    fixed = art.LocalBackend(seq_len=256)
    fixed._apply_model_config(art.TrainableModel(name="m", project="p", base_model="b"))
    assert (fixed.seq_len, fixed._fixed_rows) == (256, True)
