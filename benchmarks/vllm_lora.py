"""LoRA decoding on a CPU replica with and without art-mega's vLLM plugin
(art_mega/inference/vllm_plugin: vLLM's CPU LoRA ops as one matmul per adapter in the batch).

Two replicas started one after the other with the command line and environment art-mega gives a
CPU replica (`inference.replica.vllm_argv` / `vllm_env(on_cpu=True)`); the second has vLLM's own
`VLLM_PLUGINS=none`, so it runs vLLM's ops. Each serves SmolLM2-135M-Instruct and a random LoRA of
rank 8 on every linear layer (PEFT, B not zero, written once). Per replica and per round: 32
concurrent chat requests of 16 tokens (`ignore_eos`, temperature 1, the quickstart's batch) to the
base model, to the LoRA, and 16 + 16 mixed. Figures: the median over `--rounds` of each batch's
seconds, and the plugin's ratio on the LoRA batch.

Run: `.venv/bin/python benchmarks/vllm_lora.py [--rounds N] [--record]` (~2 minutes; needs the
vLLM interpreter, `.venv-vllm` or ART_MEGA_VLLM_PYTHON).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import print_table, record, rows_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REQUESTS = 32
NEW_TOKENS = 16
PROMPT = [{"role": "user", "content": "What is 7 plus 5? Answer yes or no only."}]
BASE_NAME = "base"
LORA_NAME = "base@1"


def write_lora(model_dir: Path, out: Path) -> Path:
    """A random rank-8 PEFT LoRA on every linear layer of `model_dir` (B drawn, not zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    )
    peft.save_pretrained(out)
    return out


async def batch(url: str, models: list[str]) -> float:
    """Seconds for one chat completion per entry of `models`, all sent at once."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(model: str) -> None:
            body = {
                "model": model,
                "messages": PROMPT,
                "max_tokens": NEW_TOKENS,
                "temperature": 1.0,
                "ignore_eos": True,
            }
            reply = await client.post("/v1/chat/completions", json=body)
            reply.raise_for_status()
            assert reply.json()["usage"]["completion_tokens"] == NEW_TOKENS

        started = time.perf_counter()
        await asyncio.gather(*(one(m) for m in models))
        return time.perf_counter() - started


async def measure(url: str, adapter: Path, rounds: int, process: subprocess.Popen) -> dict[str, float]:
    """Wait for the replica, load the LoRA, then time `rounds` of the three batches."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the replica exited with code {process.returncode}")
            try:
                if (await client.get("/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        loaded = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": LORA_NAME, "lora_path": str(adapter)}
        )
        loaded.raise_for_status()
    await batch(url, [BASE_NAME, LORA_NAME] * 2)  # warm-up
    times: dict[str, list[float]] = {"base": [], "lora": [], "mixed": []}
    for _ in range(rounds):
        times["base"].append(await batch(url, [BASE_NAME] * REQUESTS))
        times["lora"].append(await batch(url, [LORA_NAME] * REQUESTS))
        times["mixed"].append(await batch(url, [BASE_NAME, LORA_NAME] * (REQUESTS // 2)))
    return {kind: statistics.median(values) for kind, values in times.items()}


def run_replica(model_dir: Path, adapter: Path, plugin: bool, rounds: int, log: Path) -> dict[str, float]:
    """Start one replica as art-mega starts a CPU replica (`plugin` False: VLLM_PLUGINS=none),
    measure it, stop it."""
    from art_mega.agent.ports import free_port
    from art_mega.inference.protocol import ReplicaLaunch
    from art_mega.inference.replica import vllm_argv, vllm_env
    from art_mega.topology.compiled import ReplicaSpec
    from art_mega.topology.endpoint import EndpointSpec

    port = free_port()
    spec = ReplicaSpec(
        name="vllm",
        index=0,
        host_ids=("host0",),
        gpu_ids=(("host0", ()),),
        endpoint=EndpointSpec(host="127.0.0.1", port=port),
        tp=1,
        pp=1,
        dp=1,
        shared_gpus=False,
    )
    python = os.environ.get("ART_MEGA_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
    launch = ReplicaLaunch(
        model=str(model_dir), served_model_name=BASE_NAME, python=python, log_dir=str(log.parent)
    )
    env = vllm_env(launch, on_cpu=True)
    if not plugin:
        env["VLLM_PLUGINS"] = "none"  # vLLM's own switch: load no general plugin
    with open(log, "w") as out:
        process = subprocess.Popen(vllm_argv(spec, launch), env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        return asyncio.run(measure(f"http://127.0.0.1:{port}", adapter, rounds, process))
    finally:
        process.terminate()
        process.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--record", action="store_true", help="write the rows into RESULTS.md")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    from art_mega.basemodels.resolve import resolve_base_model
    from art_mega.launch.context import default_cache_root

    model_dir = resolve_base_model("SmolLM2-135M-Instruct", default_cache_root()).model_dir
    with tempfile.TemporaryDirectory(prefix="vllm-lora-bench-") as work:
        adapter = write_lora(model_dir, Path(work) / "lora")
        results = {
            mode: run_replica(model_dir, adapter, mode == "plugin", args.rounds, Path(work) / f"{mode}.log")
            for mode in ("plugin", "vllm")
        }
    what = f"{REQUESTS} x {NEW_TOKENS} tokens, SmolLM2-135M, LoRA r=8, CPU replica"
    figures = [
        (f"vLLM CPU {kind} batch, {mode} ops ({what})", results[mode][kind], "s")
        for mode in ("vllm", "plugin")
        for kind in ("base", "lora", "mixed")
    ]
    figures.append(
        (
            f"vLLM CPU LoRA batch, plugin / vLLM ops ({what})",
            results["plugin"]["lora"] / results["vllm"]["lora"],
            "ratio",
        )
    )
    rows = rows_for(figures, f"python benchmarks/vllm_lora.py --rounds {args.rounds}")
    print_table(rows)
    if args.record:
        record(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
