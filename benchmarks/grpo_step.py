"""One GRPO step of the tiny model on CPU through `MegatronBackend.train`, and where its wall time goes.

Starts `ArtRuntime.start_local` on one loopback host with the trainer ranks only (no vLLM), and
attaches a `MegatronBackend` to it the way `register` does for its trainer half: the ranks start
from the tiny Llama (`tiny-llama`, built into the art-mega cache on first use), step 0 is exported
and committed. Then each step is `backend.train(model, groups)` itself: advantages, tokenization,
packing, the batch file, one job on every rank (batch load, Megatron forward/backward/optimizer,
adapter export, optimizer state, manifest, fsync, rename), the commit pointer. There are no
replicas, so the adapter publish is a no-op here (`grpo_real.py` measures it with vLLM).

Trajectories are synthetic: a user prompt through the chat template and a sampled `Choice`
with random token ids and logprob -2.0 per token (the trainer recomputes nothing from them but
the policy ratio), rewards 0..1 within each group.

The split comes from the step's metrics: controller side `time/prepare_s` (advantages, tokens,
pack, batch write), `time/train_s` (job round trip + commit), `time/publish_s`; rank 0 side
(`trainer.rank.jobs.run_train_job`) `time/batch_load_s`, `time/megatron_s`, `time/adapter_export_s`,
`time/state_save_s`, `time/checkpoint_s`. "Outside Megatron" is the step's wall time minus
`time/megatron_s`. The first step (tokenizer load, first-call allocations) is a warm-up and is
not counted; the figures are the split of the median step by wall time among the rest (one
step's own parts add up to it; medians of each part would not, and means follow outside load). It never fails on a slow figure; `--record`
writes the rows into benchmarks/RESULTS.md.

Usage: python benchmarks/grpo_step.py [--quick] [--steps N] [--groups G] [--ranks R] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _results import print_table, record, rows_for  # noqa: E402

from art_mega.agent.ports import free_port  # noqa: E402

GROUP_SIZE = 4
COMPLETION_TOKENS = 48


class _NoPublisher:
    """Stands in for `AdapterPublisher` when no replica runs: publishing costs nothing."""

    class _Report:
        load_s: dict[str, float] = {}

    async def publish(self, step: int, adapter_dir: str) -> Any:
        return self._Report()

    def window(self) -> list[int]:
        return []

    async def aclose(self) -> None:
        return None


async def attach_trainer(backend: Any, model: Any) -> None:
    """`MegatronBackend.register`'s trainer half: resolve, start the ranks, export and commit step 0."""
    from art_mega.basemodels.resolve import resolve_base_model
    from art_mega.trainer import checkpoint
    from art_mega.trainer.protocol import EngineConfig, ExportJob, LoraConfig
    from art_mega.trainer.remote import TrainerService

    runtime = backend._runtime
    cluster = runtime.topology.cluster
    resolved = resolve_base_model(model.base_model, cluster.cache_root)
    run_dir = Path(cluster.artifact_root) / model.project / "models" / model.name
    checkpoint.checkpoints_dir(run_dir).mkdir(parents=True, exist_ok=True)
    backend._model, backend._model_dir, backend._run_dir = model, resolved.model_dir, run_dir
    backend._service = TrainerService(runtime.clients, runtime.topology, run_dir / "logs")
    lora = LoraConfig(
        rank=backend.lora["rank"],
        alpha=backend.lora["alpha"],
        **({"targets": tuple(backend.lora["targets"])} if backend.lora["targets"] else {}),
    )
    await backend._service.start(EngineConfig(model_dir=str(resolved.model_dir), lora=lora))
    await backend._service.run(ExportJob(step=0, checkpoint_dir=str(backend._checkpoint(0))))
    checkpoint.write_commit(checkpoint.checkpoints_dir(run_dir), 0)
    backend._publisher = _NoPublisher()


def synthetic_groups(vocab_size: int, groups: int, rng: random.Random) -> list[Any]:
    """`groups` groups of GROUP_SIZE trajectories: a prompt, a sampled Choice, rewards 0..1."""
    from openai.types.chat.chat_completion import Choice

    from art_mega import Trajectory, TrajectoryGroup

    out = []
    for g in range(groups):
        trajectories = []
        for i in range(GROUP_SIZE):
            ids = [rng.randrange(3, vocab_size) for _ in range(COMPLETION_TOKENS - 1)] + [2]
            choice = Choice.model_validate(
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "x"},
                    "token_ids": ids,
                    "logprobs": {
                        "content": [
                            {"token": str(t), "logprob": -2.0, "bytes": [], "top_logprobs": []} for t in ids
                        ]
                    },
                }
            )
            prompt = {"role": "user", "content": f"question {g}: what is {g} plus {i}?"}
            trajectories.append(
                Trajectory(messages_and_choices=[prompt, choice], reward=i / (GROUP_SIZE - 1))
            )
        out.append(TrajectoryGroup(trajectories))
    return out


async def measure(
    steps: int, groups: int, ranks: int
) -> tuple[list[tuple[str, float, str]], list[list[str]]]:
    """Run `steps` GRPO steps; returns (figure rows, per-part table)."""
    from art_mega import ArtRuntime, TrainableModel
    from art_mega.backend import MegatronBackend
    from art_mega.launch.context import default_cache_root
    from art_mega.topology import ClusterSpec, HostSpec, TrainerSpec, compile_topology

    work = Path(tempfile.mkdtemp(prefix="art-mega-grpo-step-"))
    cluster = ClusterSpec(
        hosts=(HostSpec(host_id="local", node_rank=0, worker_address="tcp://127.0.0.1:0", cpu_slots=ranks),),
        controller_host_id="local",
        artifact_root=str(work / "artifacts"),
        cache_root=default_cache_root(),
    )
    topology = compile_topology(
        cluster, trainer=TrainerSpec(cpu_ranks_per_host=ranks, master_port=free_port())
    )
    runtime = await ArtRuntime.start_local(topology)
    backend = MegatronBackend(runtime=runtime)
    model = TrainableModel(name="grpo-step", project="bench", base_model="tiny-llama")
    samples: list[dict[str, float]] = []
    try:
        await attach_trainer(backend, model)
        vocab = len(backend.tokenizer())
        rng = random.Random(0)
        for _ in range(steps):
            batch = synthetic_groups(vocab, groups, rng)
            started = time.perf_counter()
            result = await backend.train(model, batch, learning_rate=1e-4)
            samples.append({**result.metrics, "wall_s": time.perf_counter() - started})
    finally:
        await backend.close()
        await runtime.close()
    return summarize(samples[1:] or samples, groups, ranks)


def summarize(
    samples: list[dict[str, float]], groups: int, ranks: int
) -> tuple[list[tuple[str, float, str]], list[list[str]]]:
    median_step = sorted(samples, key=lambda s: s["wall_s"])[(len(samples) - 1) // 2]

    def part(key: str) -> float:
        return float(median_step.get(key, 0.0))

    wall, megatron = part("wall_s"), part("time/megatron_s")
    checkpoint, export, state = (
        part("time/checkpoint_s"),
        part("time/adapter_export_s"),
        part("time/state_save_s"),
    )
    rank_side = part("time/rank_compute_s") + checkpoint
    parts = [
        ("advantages + tokenization + packing + batch write (controller)", part("time/prepare_s")),
        ("batch load (rank)", part("time/batch_load_s")),
        ("job dispatch, event relay, commit pointer", part("time/train_s") - rank_side),
        ("adapter export (HF PEFT, rank 0)", export),
        ("optimizer state + LoRA shards save", state),
        ("manifest, fsync, rename, barriers", checkpoint - export - state),
        ("adapter publish (no replicas here)", part("time/publish_s")),
    ]
    outside = wall - megatron
    label = f"tiny GRPO step ({groups}x{GROUP_SIZE} trajectories, {ranks} CPU rank{'s' if ranks > 1 else ''})"
    figures = [
        (f"{label} wall time (median)", wall, "s"),
        (f"{label} Megatron forward/backward/optimizer", megatron, "s"),
        (f"{label} outside Megatron", outside, "s"),
        (f"{label} share outside Megatron", 100 * outside / wall if wall else 0.0, "%"),
        (f"{label} checkpoint write", checkpoint, "s"),
    ]
    table = [[name, f"{seconds * 1e3:.1f}", f"{100 * seconds / wall:.1f}"] for name, seconds in parts]
    unaccounted = outside - sum(seconds for _, seconds in parts)
    table.append(
        [
            "other (controller bookkeeping, not split)",
            f"{unaccounted * 1e3:.1f}",
            f"{100 * unaccounted / wall:.1f}",
        ]
    )
    table.append(
        ["Megatron forward/backward/optimizer", f"{megatron * 1e3:.1f}", f"{100 * megatron / wall:.1f}"]
    )
    return figures, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 steps of 4 groups")
    parser.add_argument("--steps", type=int, default=6, help="steps, the first one a warm-up (default 6)")
    parser.add_argument("--groups", type=int, default=8, help=f"groups of {GROUP_SIZE} per step (default 8)")
    parser.add_argument(
        "--ranks", type=int, default=1, help="CPU trainer ranks (DP; default 1, as the local backend)"
    )
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    steps, groups = (3, 4) if args.quick else (max(args.steps, 2), args.groups)
    figures, parts = asyncio.run(measure(steps, groups, args.ranks))
    widths = [max(len(r[i]) for r in [["part", "ms", "% of step"], *parts]) for i in range(3)]
    for row in [["part", "ms", "% of step"], *parts]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print()
    flags = ["--quick"] if args.quick else [f"--steps {steps}", f"--groups {groups}"]
    command = " ".join(
        ["python benchmarks/grpo_step.py", *flags, *([f"--ranks {args.ranks}"] if args.ranks != 1 else [])]
    )
    rows = rows_for(figures, command)
    print_table(rows)
    if args.record:
        record(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
