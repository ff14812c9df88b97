"""Wall time of one GRPO train step with LoRA per Megatron layout, on the tiny models on CPU.

Each layout is a world of gloo processes on 127.0.0.1 (`benchmarks/_trainer_step_rank.py`, one
thread each: OMP_NUM_THREADS=1, as the trainer service starts its ranks). A rank joins the world
from its row of a compiled topology's rank table (`compile_topology` with one loopback host and
`TrainerSpec(cpu_ranks_per_host=world)`), builds `TrainerEngine` through `jobs.build_engine`
(LoRA rank 8, alpha 16, every default target) and times `train_step` on its DP share of the same
seeded packed batch after one warm-up step. Layouts: dense tiny llama TP1 (1 rank), TP2, DP2
(distributed optimizer), CP2, PP2 (2 stages of 1 layer, 1F1B over gloo point-to-point), PP2+TP2
and PP2+DP2 (4 ranks); tiny Qwen3-MoE (4 experts, top-2) EP1 (1 rank), EP2, TP2+EP2 and
PP2+EP2 (4 ranks). Per layout it reports the median over ranks-synchronised steps of the slowest
rank's step time, its ratio to the one-process step of the same model (TP1 or EP1, same run),
tokens/s (non-padding tokens of the global batch / median step) and the peak RSS (VmHWM) of
its ranks. Never fails on a slow figure; a layout that crashes makes the exit status 1.

Usage: python benchmarks/trainer_step.py [--quick] [--steps N] [--layouts TP1,TP2,...] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from art_mega.agent.ports import free_port  # noqa: E402
from art_mega.errors import UserError  # noqa: E402

RANK_SCRIPT = HERE / "_trainer_step_rank.py"
STEPS, QUICK_STEPS, WARMUP = 5, 2, 1
BATCH = {"documents": 24, "seq_len": 128, "seed": 0}
"""The global batch: 24 seeded documents of 32..96 tokens packed into rows of 128."""
LORA = {"rank": 8, "alpha": 16.0}
MICRO_BATCH_ROWS = 2
LAYOUT_TIMEOUT_S = 1200


@dataclass(frozen=True)
class Layout:
    """One measured layout: its model ("dense" tiny llama or "moe" tiny Qwen3-MoE), parallel
    sizes and number of ranks; `baseline` names the one-process layout of the same model."""

    name: str
    model: str
    world: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    baseline: str = "TP1"


LAYOUTS = (
    Layout("TP1", "dense", 1),
    Layout("TP2", "dense", 2, tp=2),
    Layout("DP2", "dense", 2),
    Layout("CP2", "dense", 2, cp=2),
    Layout("PP2", "dense", 2, pp=2),
    Layout("PP2+TP2", "dense", 4, tp=2, pp=2),
    Layout("PP2+DP2", "dense", 4, pp=2),
    Layout("EP1", "moe", 1, baseline="EP1"),
    Layout("EP2", "moe", 2, ep=2, baseline="EP1"),
    Layout("TP2+EP2", "moe", 4, tp=2, ep=2, baseline="EP1"),
    Layout("PP2+EP2", "moe", 4, ep=2, pp=2, baseline="EP1"),
)
MODEL_NAMES = {"dense": "tiny llama", "moe": "tiny Qwen3-MoE"}


def select_layouts(names: str | None) -> list[Layout]:
    """The layouts named in the comma list `names` (None: all), in LAYOUTS order, with the
    baseline of each named layout's model added. Raises `UserError` for an unknown name."""
    known = {layout.name: layout for layout in LAYOUTS}
    if names is None:
        return list(LAYOUTS)
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    unknown = sorted(wanted - known.keys())
    if unknown or not wanted:
        raise UserError(
            f"--layouts={names!r} names no known layout {unknown or ''}; "
            f"use a comma list of {','.join(known)}."
        )
    wanted |= {known[name].baseline for name in wanted}
    return [layout for layout in LAYOUTS if layout.name in wanted]


def step_count(quick: bool, steps: int | None) -> int:
    """Timed steps per layout: `steps` when given, else 2 with `quick`, else 5.
    Raises `UserError` when `steps` < 1."""
    if steps is not None and steps < 1:
        raise UserError(f"--steps={steps} must be at least 1; pass a positive number of timed steps.")
    return steps if steps is not None else (QUICK_STEPS if quick else STEPS)


def summarise(results: list[dict]) -> dict[str, float]:
    """One layout's figures from its ranks' results (see `_trainer_step_rank.py`): `step_s`,
    the median over steps of the slowest rank's step time (seconds); `tokens_per_s`, global
    non-padding tokens / step_s; `rss_mb`, the largest VmHWM over ranks (MB); `rss_min_mb`."""
    per_step = [max(steps) for steps in zip(*(r["step_seconds"] for r in results))]
    step_s = statistics.median(per_step)
    rss = [r["peak_rss_mb"] for r in results]
    return {
        "step_s": step_s,
        "tokens_per_s": results[0]["tokens"] / step_s,
        "rss_mb": max(rss),
        "rss_min_mb": min(rss),
        "setup_s": max(r["setup_seconds"] for r in results),
    }


def figures(layouts: list[Layout], summaries: dict[str, dict[str, float]]) -> list[tuple[str, float, str]]:
    """(figure, value, unit) rows for the measured layouts: step time, ratio to the baseline
    (when the baseline was measured in this run), tokens/s and peak RSS per rank."""
    rows: list[tuple[str, float, str]] = []
    for layout in layouts:
        got = summaries.get(layout.name)
        if got is None:
            continue
        what = f"{MODEL_NAMES[layout.model]}, {layout.name} ({layout.world} rank{'s' * (layout.world > 1)})"
        rows.append((f"trainer GRPO+LoRA step, {what}, median", got["step_s"], "s"))
        base = summaries.get(layout.baseline)
        if layout.name != layout.baseline and base is not None:
            rows.append(
                (
                    f"trainer step {layout.name} / {layout.baseline}, {MODEL_NAMES[layout.model]}",
                    got["step_s"] / base["step_s"],
                    "ratio",
                )
            )
        rows.append((f"trainer step throughput, {what}", got["tokens_per_s"], "tokens/s"))
        over = " (max over ranks)" if layout.world > 1 else ""
        rows.append((f"peak RSS trainer rank, {what}{over}", got["rss_mb"], "MB"))
    return rows


def detail_table(layouts: list[Layout], summaries: dict[str, dict[str, float]]) -> list[str]:
    """Plain-text lines, one per layout: step s, ratio, tokens/s, setup s, RSS range (MB)."""
    head = ("layout", "model", "ranks", "step s", "ratio", "tokens/s", "setup s", "RSS MB/rank")
    lines = [head]
    for layout in layouts:
        got = summaries.get(layout.name)
        if got is None:
            lines.append(
                (layout.name, MODEL_NAMES[layout.model], str(layout.world), "failed", "", "", "", "")
            )
            continue
        base = summaries.get(layout.baseline)
        ratio = f"{got['step_s'] / base['step_s']:.2f}" if base else "-"
        rss = f"{got['rss_min_mb']:.0f}" + (f"..{got['rss_mb']:.0f}" if layout.world > 1 else "")
        lines.append(
            (
                layout.name,
                MODEL_NAMES[layout.model],
                str(layout.world),
                f"{got['step_s']:.3f}",
                ratio,
                f"{got['tokens_per_s']:.0f}",
                f"{got['setup_s']:.1f}",
                rss,
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]


def build_models(root: Path) -> dict[str, Path]:
    """The tiny llama (`art_mega.basemodels.tiny`) and tiny Qwen3-MoE (`art_mega.basemodels.tiny_moe`)
    HF directories under `root`, by model kind."""
    from art_mega.basemodels.tiny import build_tiny_model
    from art_mega.basemodels.tiny_moe import build_tiny_moe

    return {"dense": build_tiny_model(root / "tiny-llama", "llama"), "moe": build_tiny_moe(root / "tiny-moe")}


def rank_table(layout: Layout, port: int) -> tuple[list[dict], dict]:
    """(rank table rows as JSON dicts, trainer spec as a JSON dict) of `layout`, compiled from a
    one-host loopback cluster with `layout.world` CPU ranks and master port `port`."""
    from art_mega.topology import ClusterSpec, EndpointSpec, HostSpec, TrainerSpec, compile_topology

    work = Path(tempfile.gettempdir()) / "art-mega-bench"
    cluster = ClusterSpec(
        hosts=(
            HostSpec(host_id="host0", node_rank=0, worker_address=EndpointSpec(host="127.0.0.1", port=0)),
        ),
        controller_host_id="host0",
        artifact_root=str(work / "artifacts"),
        cache_root=str(work / "cache"),
        allow_shared_kernel=True,
    )
    spec = TrainerSpec(
        tp=layout.tp,
        cp=layout.cp,
        ep=layout.ep,
        pp=layout.pp,
        cpu_ranks_per_host=layout.world,
        master_port=port,
    )
    topology = compile_topology(cluster, trainer=spec)
    return [row.model_dump(mode="json") for row in topology.trainer_ranks], spec.model_dump(mode="json")


def run_layout(layout: Layout, model_dir: Path, steps: int, work: Path) -> list[dict] | None:
    """Start `layout.world` rank processes, wait for them; their results, or None (with a printed
    line) when one failed or the layout ran past LAYOUT_TIMEOUT_S."""
    port = free_port()
    table, trainer = rank_table(layout, port)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs, outs = [], []
    for rank in range(layout.world):
        out = work / f"{layout.name}-rank{rank}.json"
        config = {
            "rank": rank,
            "world_size": layout.world,
            "master_addr": "127.0.0.1",
            "master_port": port,
            "rank_table": table,
            "trainer": trainer,
            "engine": {"model_dir": str(model_dir), "lora": LORA, "micro_batch_rows": MICRO_BATCH_ROWS},
            "batch": BATCH,
            "warmup": WARMUP,
            "steps": steps,
            "out": str(out),
        }
        path = work / f"{layout.name}-rank{rank}.config.json"
        path.write_text(json.dumps(config))
        log = open(work / f"{layout.name}-rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(RANK_SCRIPT), str(path)],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
        outs.append(out)
    failed = None
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=LAYOUT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != 0 and failed is None:
            failed = (rank, code)
            for other, _ in procs:
                if other.poll() is None:
                    other.kill()
                    other.wait()
        log.close()
    if failed is not None:
        rank, code = failed
        tail = (work / f"{layout.name}-rank{rank}.log").read_text()[-2000:]
        print(f"{layout.name}: rank {rank} ended with {code}; its log ends:\n{tail}", flush=True)
        return None
    return [json.loads(out.read_text()) for out in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} timed steps instead of {STEPS}")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per layout (after 1 warm-up)")
    parser.add_argument("--layouts", default=None, help="comma list of layouts (default: all)")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    try:
        layouts = select_layouts(args.layouts)
        steps = step_count(args.quick, args.steps)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from _results import report

    summaries: dict[str, dict[str, float]] = {}
    crashed = []
    with tempfile.TemporaryDirectory(prefix="art-mega-bench-trainer-step-") as tmp:
        work = Path(tmp)
        models = build_models(work / "models")
        for layout in layouts:
            print(f"== {layout.name}: {layout.world} rank(s), {steps} timed step(s)", flush=True)
            results = run_layout(layout, models[layout.model], steps, work)
            if results is None:
                crashed.append(layout.name)
                continue
            summaries[layout.name] = summarise(results)
    print()
    print("\n".join(detail_table(layouts, summaries)))
    print(
        f"\nnotes: global batch {BATCH['documents']} documents packed into rows of {BATCH['seq_len']} tokens, "
        f"split over DP; micro batch {MICRO_BATCH_ROWS} rows; LoRA rank {LORA['rank']}; fp32; "
        f"{WARMUP} warm-up step then {steps} timed; step = slowest rank, median over steps; ratio to "
        "the one-process step of the same model (TP1 dense, EP1 MoE). One thread per rank on "
        f"{os.cpu_count()} cores shared with other users: layouts with more ranks than cores (TP2+EP2 "
        "runs 4) time-share the cores, so their ratios measure oversubscription as much as parallelism.\n"
    )
    command = "python benchmarks/trainer_step.py" + (" --quick" if args.quick else "")
    if args.steps is not None:
        command += f" --steps {args.steps}"
    if args.layouts is not None:
        command += f" --layouts {args.layouts}"
    report(figures(layouts, summaries), command, args.record)
    if crashed:
        print(f"layouts that failed (no rows): {crashed}")
    return 1 if crashed else 0


if __name__ == "__main__":
    raise SystemExit(main())
