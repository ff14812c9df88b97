"""The real-model run (SmolLM2-135M GRPO main job): reward by step, step time and its split.

Reads a run directory's history.jsonl (or, with --run, first runs
`art-mega local --program examples/multinode/train.py:main` in a temp folder). The orchestration
share is P1: everything but vLLM generation (rollout seconds) and Megatron compute (the ranks'
forward/backward/optimizer seconds), over the whole step. Target < 5%.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _results import report  # noqa: E402

from art_mega.metrics import read_history  # noqa: E402

RUN = Path(".art/art-mega-quickstart/models/yes-no")


def summarize(run_dir: Path) -> list[tuple[str, float, str]]:
    rows = read_history(run_dir / "history.jsonl")
    train = [r for r in rows if "time/train_s" in r]
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    if not train:
        raise SystemExit(f"{run_dir}/history.jsonl has no training rows")
    steady = train[1:] or train  # the first step also loads the tokenizer
    figures: list[tuple[str, float, str]] = []
    for step, reward in val:
        figures.append((f"SmolLM2 GRPO val/reward at step {step}", reward, "reward"))
    rollout = statistics.median(r.get("time/rollout_s", 0.0) for r in steady)
    compute = statistics.median(r["time/rank_compute_s"] for r in steady)
    train_s = statistics.median(r["time/train_s"] for r in steady)
    prepare = statistics.median(r["time/prepare_s"] for r in steady)
    publish = statistics.median(r["time/publish_s"] for r in steady)
    step = rollout + prepare + train_s + publish
    orchestration = prepare + (train_s - compute) + publish
    has_rollout = any("time/rollout_s" in r for r in steady)
    label = "" if has_rollout else " (without rollout time: not logged by this run)"
    figures += [
        (f"SmolLM2 GRPO step time (median){label}", step, "s"),
        *([("SmolLM2 GRPO rollout (vLLM generation) per step", rollout, "s")] if has_rollout else []),
        ("SmolLM2 GRPO Megatron compute per step", compute, "s"),
        ("SmolLM2 GRPO batch prepare + job + checkpoint + publish per step", orchestration, "s"),
        (f"SmolLM2 GRPO orchestration share (P1){label}", 100 * orchestration / step if step else 0.0, "%"),
    ]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, help="an existing run directory (holds history.jsonl)")
    parser.add_argument("--run", action="store_true", help="run the main job first (minutes)")
    parser.add_argument("--quick", action="store_true", help="with --run: 2 steps")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    run_dir = args.run_dir
    if args.run:
        work = Path(tempfile.mkdtemp(prefix="art-mega-grpo-real-"))
        env = {"ART_MEGA_STEPS": "2"} if args.quick else {}
        import os

        subprocess.run(
            [
                sys.executable,
                "-m",
                "art_mega",
                "local",
                "--program",
                f"{REPO}/examples/multinode/train.py:main",
            ],
            cwd=work,
            env={**os.environ, **env},
            check=True,
        )
        run_dir = work / RUN
    if run_dir is None:
        parser.error("pass --run-dir DIR or --run")
    command = (
        "python benchmarks/grpo_real.py --run" + (" --quick" if args.quick else "")
        if args.run
        else f"python benchmarks/grpo_real.py --run-dir {args.run_dir}"
    )
    report(summarize(run_dir), command, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
