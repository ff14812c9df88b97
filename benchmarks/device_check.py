"""The GPU device check's Python side: four checks on one NVIDIA GPU, each through art-mega's own
code paths, printed as RESULTS.md rows with "gpu ..." in the machine column.

    python benchmarks/device_check.py --log-dir DIR [--dry-run] [--record]

Steps (run in this order; the first failure stops the check with exit 1):
1. te_logits: `build_megatron_model(use_te=True)` on cuda:0 (TransformerEngine layer spec) for the
   tiny Qwen3 model, its logits against Hugging Face transformers' (fp32, max |diff| <= 1e-3).
2. grpo_lora: `MegatronBackend` on a one-GPU topology (trainer rank on GPU 0, one upstream vLLM
   replica sharing it), tiny Qwen3, LoRA r=8: 2 groups x 4 rollouts, one `backend.train` step.
3. adapter_publish: the step-1 adapter is published into the vLLM replica (`AdapterPublisher`
   inside `backend.train`) and a chat completion is served by `<name>@1`.
4. nccl_preflight: the preflight collective with backend NCCL over this host
   (`art_mega.runtime.preflight.run_collective`), proved from the NCCL log ("Using network").
Bad arguments: one sentence on stderr, exit 2. scripts/device_check.sh installs the `gpu` extra,
bounds the whole run to 10 minutes and keeps the full log in DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmarks"
STEPS = {
    "te_logits": "Megatron model with the TransformerEngine spec against Hugging Face logits (tiny Qwen3)",
    "grpo_lora": "one GRPO step with LoRA on tiny Qwen3: trainer rank on GPU 0, upstream vLLM replica",
    "adapter_publish": "the step-1 adapter published into vLLM and a chat completion served by it",
    "nccl_preflight": "the NCCL single-host preflight collective, proved from the NCCL log",
}
TE_TOLERANCE = 1e-3
MODEL = "tiny-qwen3"


class ArgumentError(Exception):
    """A bad command line; the message is one sentence."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit 2 itself
        raise ArgumentError(f"{message}; usage: device_check.py --log-dir DIR [--dry-run] [--record]")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the command line.

    Raises:
        ArgumentError: an unknown flag, --log-dir missing, empty or naming a file.
    """
    parser = _Parser(prog="device_check.py", add_help=True)
    parser.add_argument("--log-dir", required=True, help="folder for the full log and NCCL logs")
    parser.add_argument("--dry-run", action="store_true", help="list the steps; run nothing")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if not args.log_dir.strip():
        raise ArgumentError("--log-dir is empty; pass a folder, e.g. --log-dir /tmp/device-check")
    log_dir = Path(args.log_dir).expanduser()
    if log_dir.exists() and not log_dir.is_dir():
        raise ArgumentError(f"--log-dir {args.log_dir} is a file; pass a folder (it is created if missing)")
    args.log_dir = log_dir
    return args


def te_logits(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Step 1: TE-spec Megatron logits vs HF logits on cuda:0; raises AssertionError past tolerance."""
    import torch
    from transformers import AutoModelForCausalLM

    from art_mega.models.resolve import resolve_base_model
    from art_mega.runtime.ports import free_port
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.logprobs import forward_logits
    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.parallel import destroy_parallel, init_parallel

    model_dir = resolve_base_model(MODEL, work / "cache").model_dir
    rank = TrainerRank(rank=0, host_id="local", local_rank=0, gpu_id=0, **rank_coordinates(0, 1))
    init_parallel(rank, TrainerSpec(), 1, master_addr="127.0.0.1", master_port=free_port())
    try:
        built = build_megatron_model(model_dir, device="cuda:0", dtype="float32", use_te=True)
        assert built.uses_te, "build_megatron_model(use_te=True) built the local spec"
        ids = torch.randint(0, built.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1234))
        ids = ids.to("cuda:0")
        positions = torch.arange(ids.shape[1], device="cuda:0").expand_as(ids)
        with torch.no_grad():
            got = forward_logits(built.module, ids, positions)[..., : built.vocab_size].float()
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda:0")
            expected = hf(ids).logits.float()
        diff = (got - expected).abs().max().item()
    finally:
        destroy_parallel()
        torch.cuda.empty_cache()
    print(f"te_logits: max |megatron(TE) - hf| = {diff:.2e} (tolerance {TE_TOLERANCE})")
    assert diff <= TE_TOLERANCE, f"TE logits differ from HF by {diff:.2e} > {TE_TOLERANCE}"
    return [("gpu: Megatron (TE spec) vs HF max abs logit diff, tiny Qwen3 fp32", diff, "logit")]


async def _grpo_and_publish(work: Path, log_dir: Path) -> list[tuple[str, float, str]]:
    """Steps 2-4 on one runtime: GRPO step, publication + completion, NCCL preflight."""
    import art_mega as art
    from art_mega.runtime.ports import free_port
    from art_mega.runtime.preflight import run_collective
    from art_mega.runtime.runtime import ArtRuntime
    from art_mega.topology import ClusterSpec, HostSpec, InferenceSpec, TrainerSpec, compile_topology

    cluster = ClusterSpec(
        hosts=(
            HostSpec(
                host_id="gpu0", node_rank=0, worker_address="tcp://127.0.0.1:0", cpu_slots=2, gpu_ids=(0,)
            ),
        ),
        controller_host_id="gpu0",
        artifact_root=str(work / "artifacts"),
        cache_root=str(work / "cache"),
    )
    topology = compile_topology(
        cluster,
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
        report = await run_collective(
            runtime.clients,
            ["gpu0"],
            "127.0.0.1",
            120.0,
            backend="nccl",
            nccl_net="Socket",
            log_dir=str(log_dir),
        )
        proof = (log_dir / "nccl-preflight-rank0.log").read_text(errors="replace")
        line = next(line for line in proof.splitlines() if "Using network" in line)
        print(
            f"nccl_preflight: {report.backend} over {report.host_ids} in {report.seconds:.2f} s; log: {line.strip()}"
        )
        figures.append(("gpu: NCCL single-host preflight collective (log-proved)", report.seconds, "s"))
    finally:
        await backend.close()
        await runtime.close()
    return figures


def run_steps(log_dir: Path) -> list[tuple[str, float, str]]:
    """Run every step; returns (figure, value, unit). Raises the first step's failure."""
    work = Path(tempfile.mkdtemp(prefix="art-mega-device-check-"))
    os.environ.setdefault("ART_MEGA_CACHE", str(work / "cache"))
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("te_logits", lambda: te_logits(work, log_dir)),
        ("grpo_lora, adapter_publish, nccl_preflight", lambda: asyncio.run(_grpo_and_publish(work, log_dir))),
    ]
    figures = []
    for name, step in steps:
        started = time.perf_counter()
        print(f"== {name}", flush=True)
        figures += step()
        print(f"== {name}: ok after {time.perf_counter() - started:.1f} s", flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ArgumentError as exc:
        print(f"device_check: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for n, (name, what) in enumerate(STEPS.items(), 1):
            print(f"{n}. {name}: {what}")
        return 0
    args.log_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))
    import torch
    from _results import machine, report

    if not torch.cuda.is_available():
        print("device_check: error: torch sees no CUDA device; run this on a machine with an NVIDIA GPU")
        return 1
    where = machine("gpu", f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
    figures = run_steps(args.log_dir)
    report(figures, "bash scripts/device_check.sh --log-dir DIR", args.record, machine_name=where)
    print("DEVICE_CHECK_PASS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
