"""The memory plan (`trainer.prepare.memory_plan`) of published full-size configs, its numbers checked
against values computed by hand here, and register's refusal before any start
(`MegatronBackend._plan_memory`), with the GPUs' NVML memory faked through the preflight's
`HostFacts` as the local agent reports it (`LocalBackend`'s topology from `local_plan`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import art_mega as art
from art_mega.backend import MegatronBackend
from art_mega.errors import MemoryPlanError
from art_mega.launch.local_topology import local_plan
from art_mega.preflight.protocol import GpuInfo, HostFacts
from art_mega.trainer.families import family_for
from art_mega.trainer.prepare.memory_plan import (
    GIB,
    PLAN_FILE,
    ModelShape,
    check_plan,
    plan_memory,
    rank_terms,
    read_plan,
    write_plan,
)
from tests.real_size_configs import (
    CONFIGS,
    DEEPSEEK_V3,
    DEEPSEEK_V3_PARAMETERS,
    GEMMA4_31B_TEXT,
    KIMI_K2,
    KIMI_K2_PARAMETERS,
    PUBLISHED,
)
from tests.trainer.gemma3_configs import GEMMA3_27B_TEXT
from tests.trainer.gpt_oss_configs import GPT_OSS_20B, GPT_OSS_120B, GPT_OSS_PARAMETERS
from tests.trainer.qwen3_5_configs import QWEN3_5_35B_A3B, QWEN3_6_27B


def shape(name: str) -> ModelShape:
    config = CONFIGS[name]
    return ModelShape.from_args(family_for(config).model_args(config))


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_counts_from_config_equal_the_published_and_meta_counts(name: str) -> None:
    # PUBLISHED is what transformers and megatron-core build on the meta device
    # (tests/trainer/test_real_size_mapping.py asserts both equal it)
    assert shape(name).parameters() == PUBLISHED[name]


OTHER_PUBLISHED = {
    "Qwen3.6-27B": (QWEN3_6_27B, 26_895_998_464),
    "Qwen3.5-35B-A3B": (QWEN3_5_35B_A3B, 34_660_610_688),
    "gpt-oss-20b": (GPT_OSS_20B, GPT_OSS_PARAMETERS["gpt-oss-20b"]),
    "gpt-oss-120b": (GPT_OSS_120B, GPT_OSS_PARAMETERS["gpt-oss-120b"]),
    "gemma-4-31B": (GEMMA4_31B_TEXT, 30_697_345_280),
    "DeepSeek-V3": (DEEPSEEK_V3, DEEPSEEK_V3_PARAMETERS),
    "Kimi-K2": (KIMI_K2, KIMI_K2_PARAMETERS),  # model_type kimi_k2, read by the deepseek_v3 family
}
"""The other families' published configs and the counts their meta-device tests assert (HF's =
Megatron's). The plan once missed Qwen3.5 MoE's shared experts (-0.4%) and counted DeepSeek-V3's
MLA, dense first layers and shared experts as GQA MoE layers (+9%; +46% on a 3-layer Kimi-K2):
found by running other published configs of these families through `art-mega plan`."""


@pytest.mark.parametrize("name", OTHER_PUBLISHED)
def test_every_family_counts_its_published_parameters(name: str) -> None:
    config, published = OTHER_PUBLISHED[name]
    counted = ModelShape.from_args(family_for(config).model_args(config))
    assert counted.parameters() == published


def test_deepseek_v3_rank_holds_its_split_of_mla_dense_and_shared_experts() -> None:
    """DeepSeek-V3 at tp=8, ep=8, by hand: MLA's five projections split 8 ways plus the two latent
    norms, 3 dense MLPs and 58 shared experts split 8 ways, 32 of 256 routed experts a layer whole,
    the routers and norms whole, the vocabulary split 8 ways (untied)."""
    counted = ModelShape.from_args(family_for(DEEPSEEK_V3).model_args(DEEPSEEK_V3))
    h, heads = 7168, 128
    mla = h * 1536 + 1536 * heads * 192 + h * (512 + 64) + 512 * heads * (128 + 128) + heads * 128 * h
    expected = (
        2 * 129280 // 8 * h
        + 61 * (mla // 8 + 1536 + 512 + 2 * h)
        + 3 * 3 * h * 18432 // 8
        + 58 * (256 * h + 3 * h * 2048 // 8 + 32 * 3 * h * 2048)
        + h
    )
    assert counted.parameters(tp=8, ep=8) == expected


def test_gemma3_counts_its_four_norms_a_layer() -> None:
    gemma = ModelShape.from_args(family_for(GEMMA3_27B_TEXT).model_args(GEMMA3_27B_TEXT))
    assert gemma.norms_per_layer == 4
    # transformers' Gemma3ForCausalLM of this config on the meta device: 27,009,346,304 parameters
    assert gemma.parameters() == 27_009_346_304


def test_llama_31_8b_rank_terms_by_hand() -> None:
    """Llama-3.1-8B, tp=2, dp=4 (distributed optimizer), bfloat16, LoRA r=16 on all four linears,
    one 4096-token row, whole-row logprobs."""
    terms = rank_terms(
        shape("Llama-3.1-8B"), tp=2, dp=4, dtype="bfloat16", lora_rank=16, row_tokens=4096, micro_batch_rows=1
    )
    # embedding + LM head 128256/2 x 4096 each; a layer: QKV 4096 x (32 + 2*8)*128/2, proj
    # 32*128/2 x 4096, two norms, MLP 3 x 4096 x 14336/2; 32 layers; the final norm; 2 bytes
    weights = (2 * 64128 * 4096 + 32 * (4096 * 3072 + 2048 * 4096 + 2 * 4096 + 3 * 4096 * 7168) + 4096) * 2
    assert weights == 8_030_527_488
    # r x (in + out), the split factor halved: qkv 4096 + 3072, proj 2048 + 4096, fc1 4096 + 14336,
    # fc2 7168 + 4096
    lora = 32 * 16 * ((4096 + 3072) + (2048 + 4096) + (4096 + 14336) + (7168 + 4096))
    assert lora == 22_020_096
    # a token a layer (the census of benchmarks/RESULTS.md): norms' inputs, outputs and 1/rms
    # 4 x 4096 + 2, RoPE's cos and sin for q and k 4 x 128, SDPA's q, repeated k and v, output and
    # log-sum-exp (4 x 32*128 + 32)/2, fc1's output, its two SwiGLU halves and their product
    # 5 x 14336/2, 4 x 16 (LoRA); the final norm's input and 1/rms outside the layers, less the
    # first layer's input norm's input and 1/rms (the frozen embedding's output needs no gradient)
    per_token = (
        32 * (4 * 4096 + 2 + 4 * 128 + (4 * 32 * 128 + 32) // 2 + 5 * 14336 // 2 + 4 * 16) + 4097 - 4097
    )
    # SDPA's additive mask [4096, 4096] a layer in 2 bytes, and the packed rows' bool mask
    activations = per_token * 4096 * 2 + 32 * 4096 * 4096 * 2 + 4096 * 4096
    assert activations == 17_083_924_480
    # the LM head's output [4096, 128256/2] in 2 bytes, the entropy's float32 copy (4) and its
    # working set (21 bytes an element)
    logits = 64128 * 4096 * (2 + 4 + 21)
    assert logits == 7_092_043_776
    assert terms == {
        "weights": weights,
        "lora": lora * 2,
        "lora_grad": lora * 4,  # float32 gradient buffer
        "optimizer": lora * 12 // 4,  # float32 master + 2 Adam moments, sharded over dp=4
        "activations": activations,
        "logits": logits,
        "reserve": GIB,
    }
    chunked = rank_terms(
        shape("Llama-3.1-8B"),
        tp=2,
        dp=4,
        dtype="bfloat16",
        lora_rank=16,
        row_tokens=4096,
        logprob_chunk=512,
    )
    assert chunked["logits"] == logits  # the entropy's working set, not the cross entropy's, is the peak


def test_qwen3_8b_terms_and_activation_factor_by_hand() -> None:
    """Qwen3-8B, tp=1, bfloat16, LoRA r=8 (the backend's default), one 1024-token row."""
    qwen = shape("Qwen3-8B")
    terms = rank_terms(qwen, tp=1, dtype="bfloat16", lora_rank=8, row_tokens=1024)
    assert terms["weights"] == 8_190_735_360 * 2
    lora = 36 * 8 * ((4096 + 6144) + (4096 + 4096) + (4096 + 24576) + (12288 + 4096))
    assert lora == 18_284_544
    assert terms["lora"] + terms["lora_grad"] + terms["optimizer"] == lora * (2 + 4 + 12)  # 18 bytes
    # q/k-norm inputs (32 + 8) x 128 besides Llama's terms
    per_layer = 4 * 4096 + 2 + 4 * 128 + 4 * 32 * 128 + 32 + (32 + 8) * 128 + 5 * 12288 + 4 * 8
    assert per_layer == 99_906
    assert (
        qwen.activation_elements(1, 8, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) == per_layer
    )
    # the final norm's input and 1/rms (4096 + 1) less the first layer's input norm's (4096 + 1)
    assert terms["activations"] == 36 * per_layer * 1024 * 2 + 36 * 1024 * 1024 * 2 + 1024 * 1024
    assert terms["logits"] == 151936 * 1024 * (2 + 4 + 21)
    float32 = rank_terms(qwen, tp=1, dtype="float32", lora_rank=8, row_tokens=1024)
    assert float32["optimizer"] == lora * 8  # no master copy of float32 parameters


def test_moe_experts_split_by_ep_and_route_top_k() -> None:
    moe = shape("Qwen3-30B-A3B")
    # at ep=8: 128/8 experts of 3 x 2048 x 768 a layer, the router 128 x 2048 whole
    dense_part = (
        2 * 151936 * 2048 + 48 * (2048 * (32 + 8) * 128 + 32 * 128 * 2048 + 2 * 128 + 2 * 2048) + 2048
    )
    assert moe.parameters(1, 8) == dense_part + 48 * (128 * 2048 + 16 * 3 * 2048 * 768)
    # a token's MoE layer keeps 8 routed copies, their fc1 output, SwiGLU halves and product, and
    # 128 router logits
    assert (
        moe.activation_elements(1, 0, ())
        == 4 * 2048 + 2 + 4 * 128 + 4 * 32 * 128 + 32 + (32 + 4) * 128 + 8 * (2048 + 5 * 768) + 128
    )


# ------------------------------------------------------------------ register, with faked NVML figures


def gpu(index: int, gib: int) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index:08d}-aaaa",
        pci_bus_id=f"00000000:{index + 10:02X}:00.0",
        name="NVIDIA GeForce RTX 4090",
        memory_bytes=gib * GIB,
    )


def host(*gpus: GpuInfo) -> HostFacts:
    return HostFacts(
        host_id="local",
        hostname="box",
        boot_id="b",
        python_version="3.11.9",
        python_executable="/usr/bin/python3",
        art_mega_version="0",
        art_mega_files_sha256="0" * 64,
        packages={},
        env={},
        gpus=gpus,
        nvml_error="" if gpus else "NVML unavailable: no driver",
    )


def plan_at_register(
    tmp_path: Path, name: str, facts: HostFacts, config: dict[str, Any] | None = None, **backend: Any
) -> Any:
    """What `register` plans (and refuses) for `name`'s config.json on the local host `facts`
    describes, as `LocalBackend()` places it; nothing is started."""
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(CONFIGS[name]))
    placed = local_plan(
        facts,
        config,
        artifact_root=str(tmp_path / "art"),
        cache_root=str(tmp_path / "c"),
        vllm_python="/v/python",
    )
    backend_ = MegatronBackend(**backend)
    model = art.TrainableModel(name="m", project="p", base_model=f"Qwen/{name}", _internal_config=config)
    backend_._apply_model_config(model)  # as register does, before its local runtime starts
    backend_._runtime = SimpleNamespace(host_facts={"local": facts}, topology=placed.topology)
    return backend_._plan_memory(model, placed.topology, model_dir)


def test_qwen3_32b_with_lora_on_one_24_gb_gpu_is_refused_with_the_tp_that_fits(tmp_path, caplog) -> None:
    with pytest.raises(MemoryPlanError) as caught, caplog.at_level(logging.INFO):
        plan_at_register(tmp_path, "Qwen3-32B", host(gpu(0, 24)))
    # by hand: weights 32,762,123,264 x 2; LoRA 59,244,544 x 18 bytes; activations
    # (64 x (4 x 5120 + 2 + 4 x 128 + 4 x 64*128 + 64 + (64 + 8) x 128 + 5 x 25600 + 4 x 8) + 5121
    # - 5121: the final norm's, less the first layer's input norm's) x 1024 tokens x 2, 64 SDPA masks
    # [1024, 1024] x 2 and the bool mask; logits 151936 x 1024 x 27; reserve 1 GiB
    activations = 64 * 191_074 * 1024 * 2 + 64 * 1024 * 1024 * 2 + 1024 * 1024
    needed = 32_762_123_264 * 2 + 59_244_544 * 18 + activations + 151936 * 1024 * 27 + GIB
    assert needed == 97_044_834_304  # 90.4 GiB
    assert str(caught.value) == (
        "Qwen/Qwen3-32B does not fit trainer rank 0 on host local (GPU 0, 24.0 GiB) at TrainerSpec tp=1, cp=1, "
        "ep=1 (dp=1): it needs 90.4 GiB (bfloat16 weights 61.0, LoRA with grads and Adam 1.0, activations of "
        "1 x 1024-token rows 23.5, logits 3.9, reserve 1.0); use TrainerSpec.tp=8 (8 such GPUs a model copy; "
        "14.7 GiB a rank), or larger GPUs"
    )
    error = caught.value
    assert (error.model, error.process, error.host_id) == ("Qwen/Qwen3-32B", "trainer rank 0", "local")
    assert (error.needed_bytes, error.available_bytes, error.exit_code) == (needed, 24 * GIB, 2)
    # the plan was logged in one line before the refusal
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan for")]
    assert "trainer rank 0 needs 90.4 GiB (weights 61.0," in line
    assert not (tmp_path / "art").exists()  # no run folder


def test_a_trainer_beside_its_replica_must_leave_the_replica_its_share(tmp_path) -> None:
    # ART's shared mode on one 80 GiB GPU: Qwen3-8B's rank holds 16.6 GiB between steps; vLLM
    # starts after it and wants 0.9 x 80 GiB free
    with pytest.raises(MemoryPlanError) as caught:
        plan_at_register(tmp_path, "Qwen3-8B", host(gpu(0, 80)))
    resident = 8_190_735_360 * 2 + 18_284_544 * 18 + GIB
    assert (caught.value.needed_bytes, caught.value.available_bytes) == (resident, 8 * GIB)
    assert str(caught.value).endswith(
        "the rank holds 16.6 GiB between steps, and the replica, which starts after it, needs "
        "gpu_memory_utilization=0.9 of 80.0 GiB free, which leaves the rank 8.0 GiB; set "
        "gpu_memory_utilization=0.79 or lower, or give the replicas their own GPUs"
    )
    (tmp_path / "b").mkdir()
    plan = plan_at_register(tmp_path / "b", "Qwen3-8B", host(gpu(0, 80)), gpu_memory_utilization=0.79)
    assert plan.ranks[0].shared_with_replica and plan.ranks[0].available_bytes == 80 * GIB


def test_a_replica_whose_weights_do_not_fit_is_refused(tmp_path) -> None:
    config = {"trainer_gpu_ids": [0], "inference_gpu_ids": [1], "engine_args": {"max_model_len": 4096}}
    with pytest.raises(MemoryPlanError) as caught:
        plan_at_register(tmp_path, "Qwen3-8B", host(gpu(0, 80), gpu(1, 16)), config)
    kv = 2 * 36 * 8 * 128 * 2 * 4096  # one 4096-token sequence
    assert caught.value.process == "replica vllm/0"
    assert str(caught.value) == (
        "Qwen/Qwen3-8B does not fit replica vllm/0 on host local (1 GPU(s), 14.4 GiB at "
        "gpu_memory_utilization=0.9): it needs 16.9 GiB (bfloat16 weights 15.3, LoRA slots 0.1, the KV cache "
        f"of one 4096-token sequence {kv / GIB:.1f}, reserve 1.0); use a larger InferenceSpec.tp, a smaller "
        "max_model_len, or a higher gpu_memory_utilization"
    )


def test_dedicated_gpus_that_fit_plan_the_kv_cache_and_the_longest_row(tmp_path) -> None:
    config = {"trainer_gpu_ids": [0], "inference_gpu_ids": [1], "engine_args": {"max_model_len": 32768}}
    plan = plan_at_register(tmp_path, "Qwen3-8B", host(gpu(0, 80), gpu(1, 80)), config)
    (rank,) = plan.ranks
    (replica,) = plan.replicas
    assert (rank.available_bytes, replica.available_bytes) == (80 * GIB, int(0.9 * 80 * GIB))
    # the KV cache is what vLLM's budget leaves: 72 GiB less weights, 2 LoRA slots of rank 8, 1 GiB
    slots = 2 * 18_284_544 * 2
    assert replica.kv_cache_bytes == int(0.9 * 80 * GIB) - 8_190_735_360 * 2 - slots - GIB

    # rows that fit: the longest row n whose activations (linear in n, and 36 SDPA masks n x n) and
    # whole-row logits fit 80 GiB less the resident bytes
    def row(n: int) -> int:
        return 36 * 99_906 * n * 2 + (36 * 2 + 1) * n * n + 151936 * n * 27

    resident = 8_190_735_360 * 2 + 18_284_544 * 18 + GIB
    assert row(5811) <= 80 * GIB - resident < row(5812)
    assert rank.max_row_tokens == 5811
    assert plan.warnings() == [
        "trainer rank 0 on host local fits 1 packed row(s) of up to 5811 tokens of Qwen/Qwen3-8B in 80.0 GiB, "
        "but rows may pack up to 32768 tokens: a step with longer rows runs out of GPU memory; set "
        "max_seq_length (or MegatronBackend(seq_len=)) at most that, set TrainerSpec.recompute, or use more TP"
    ]


def test_cpu_hosts_are_planned_and_never_refused(tmp_path) -> None:
    plan = plan_at_register(tmp_path, "Qwen3-32B", host())  # no NVML: a CPU rank and replica
    (rank,) = plan.ranks
    assert (rank.gpu_id, rank.available_bytes, rank.max_row_tokens) == (None, None, None)
    assert plan.trainer_dtype == "float32" and rank.weights_bytes == 32_762_123_264 * 4
    assert plan.replicas[0].available_bytes is None
    check_plan(plan, shape("Qwen3-32B"))  # nothing to compare with: no refusal
    assert plan.line().endswith("of CPU memory")
    path = write_plan(tmp_path / "run", plan)
    assert path == tmp_path / "run" / PLAN_FILE
    assert read_plan(tmp_path / "run") == plan


def test_plan_memory_counts_the_dp_of_the_topology(tmp_path) -> None:
    """8 GPUs at tp=2: dp=4 and the distributed optimizer shard Adam's 12 bytes a parameter."""
    from art_mega.topology import ClusterSpec, HostSpec, TrainerSpec, compile_topology

    hosts = (HostSpec(host_id="h", node_rank=0, worker_address="tcp://10.0.0.1:1", gpu_ids=tuple(range(8))),)
    topology = compile_topology(
        ClusterSpec(hosts=hosts, controller_host_id="h", artifact_root="/a", cache_root="/c"),
        trainer=TrainerSpec(tp=2),
    )
    plan = plan_memory(
        shape("Llama-3.1-8B"),
        topology,
        {("h", i): 80 * GIB for i in range(8)},
        model="meta-llama/Llama-3.1-8B",
        trainer_dtype="bfloat16",
        replica_dtype="bfloat16",
        lora_rank=16,
        row_tokens=4096,
        seq_len=4096,
        max_model_len=4096,
    )
    assert (plan.dp, plan.distributed_optimizer, len(plan.ranks)) == (4, True, 8)
    assert plan.ranks[7].optimizer_bytes == 22_020_096 * 12 // 4
    assert plan.ranks[7].needed_bytes == 8_030_527_488 + 22_020_096 * 9 + 17_083_924_480 + 7_092_043_776 + GIB
