"""Peak resident memory (VmHWM) of each art-mega process kind, on the tiny model.

Runs `art-mega local --program benchmarks/memory.py:program` in a temp folder. The program reads
/proc for the controller (its own process) and every process below it, classified by command
line: agent (`art_mega worker`), rollout worker, trainer rank, vLLM replica (API server and
engine core, summed). It measures at the program's start (targets: agent < 150 MB, controller
< 300 MB before the program allocates anything), after rollout workers ran a call, and after
one SFT step for each trainer layout (TP1 on 1 rank, TP2 and DP2 on 2 ranks). VmHWM is the
high-water mark of the resident set, in bytes (kB in /proc, converted). Never fails on a figure.

Usage: python benchmarks/memory.py [--quick] [--record]   (--quick: the TP1 layout only)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from art_mega.agent.ports import free_port

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmarks"
MARK = "MEMORY "
KINDS = (
    ("art_mega.rollouts.worker", "rollout worker"),
    ("art_mega.trainer.rank.main", "trainer rank"),
    ("art_mega.preflight.probe", "preflight probe"),
    ("vllm.entrypoints", "vLLM replica"),
    ("art_mega worker", "agent"),
)
LAYOUTS = {"TP1": (1, 1), "TP2": (2, 2), "DP2": (1, 2)}  # name: (tp, ranks on the host)


def peak_rss_bytes(pid: int) -> int:
    """VmHWM of `pid` in bytes (0 when the process is gone or has no memory map)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def _kind(pid: int) -> str | None:
    try:
        argv = (Path(f"/proc/{pid}") / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    text = " ".join(a.decode(errors="replace") for a in argv)
    return next((kind for needle, kind in KINDS if needle in text), None)


def peaks_below(root: int) -> dict[str, list[int]]:
    """Peak RSS (bytes) of every classified process below `root`, by kind; a vLLM replica's
    children (its engine core) are added to their replica's figure."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[str, list[int]] = {}

    def subtree(pid: int) -> int:
        return peak_rss_bytes(pid) + sum(subtree(c) for c in children.get(pid, []))

    def walk(pid: int) -> None:
        for child in children.get(pid, []):
            kind = _kind(child)
            if kind == "vLLM replica":
                found.setdefault(kind, []).append(subtree(child))
                continue
            if kind is not None:
                found.setdefault(kind, []).append(peak_rss_bytes(child))
            walk(child)

    walk(root)
    return found


def _report(stage: str, extra: dict | None = None) -> None:
    figures = {"controller": [peak_rss_bytes(os.getpid())], **peaks_below(os.getpid())}
    print(MARK + json.dumps({"stage": stage, "peaks": figures, **(extra or {})}), flush=True)


async def program(launch) -> None:
    """Measure at start, after a rollout call, and after one SFT step per layout in BENCH_LAYOUTS."""
    _report("start")
    from _rollouts import noop

    import art_mega as art
    from art_mega import ArtRuntime, InferenceSpec, TrainerSpec, compile_topology
    from art_mega.sft import TrainSFTConfig, read_sft_jsonl

    rows = read_sft_jsonl(REPO / "examples" / "multinode" / "sft_yes_no.jsonl")[:8]
    cluster = launch.homogeneous_cluster(cpu_slots=2, allow_shared_kernel=True)
    for n, layout in enumerate(os.environ.get("BENCH_LAYOUTS", "TP1").split(",")):
        tp, ranks = LAYOUTS[layout]
        topology = compile_topology(
            cluster,
            trainer=TrainerSpec(tp=tp, cpu_ranks_per_host=ranks, master_port=free_port()),
            inference=InferenceSpec(replicas=1, api_port=free_port()),
        )
        runtime = await ArtRuntime.start(launch, topology)
        try:
            if n == 0:
                executor = await runtime.rollout_executor(noop)
                for i in range(100):
                    await executor.submit(noop, i)
                _report("rollout")
            backend = art.MegatronBackend(runtime=runtime, seq_len=256, max_model_len=256, lora_rank=8)
            model = art.TrainableModel(
                name=f"memory-{layout.lower()}", project="bench", base_model="tiny-llama"
            )
            try:
                await model.register(backend)
                await model.train_sft(rows, TrainSFTConfig(learning_rate=1e-4, batch_size=8))
                _report("train", {"layout": layout})
            finally:
                await backend.close()
        finally:
            await runtime.close()


def figures_from(stdout: str) -> list[tuple[str, float, str]]:
    """Rows (figure, MB, unit) from the program's MEMORY lines; MB = 10^6 bytes."""
    figures = []
    for line in stdout.splitlines():
        if not line.startswith(MARK):
            continue
        report = json.loads(line[len(MARK) :])
        peaks, stage, layout = report["peaks"], report["stage"], report.get("layout")
        wanted = {
            "start": [
                ("controller", "peak RSS controller at program start (target < 300)"),
                ("agent", "peak RSS agent at program start (target < 150)"),
            ],
            "rollout": [("rollout worker", "peak RSS rollout worker (after 100 calls)")],
            "train": [("trainer rank", f"peak RSS trainer rank, tiny model, {layout} (max over ranks)")],
        }[stage]
        if layout == "TP1":
            wanted += [
                ("vLLM replica", "peak RSS vLLM replica, tiny model (API server + engine core)"),
                ("controller", "peak RSS controller after one SFT step"),
                ("agent", "peak RSS agent after one SFT step"),
            ]
        figures += [(name, max(peaks.get(kind, [0])) / 1e6, "MB") for kind, name in wanted]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the TP1 layout only")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(HERE)]
    from _results import report

    layouts = "TP1" if args.quick else "TP1,TP2,DP2"
    env = dict(os.environ, BENCH_LAYOUTS=layouts, PYTHONUNBUFFERED="1")
    env.setdefault("ART_MEGA_CACHE", str(Path.home() / ".cache" / "art-mega"))
    env.pop("ART_MEGA_SECRET", None)
    with tempfile.TemporaryDirectory(prefix="art-mega-bench-memory-") as work:
        result = subprocess.run(
            [sys.executable, "-m", "art_mega", "local", "--program", f"{HERE}/memory.py:program"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    figures = figures_from(result.stdout)
    if result.returncode != 0:
        print(f"memory benchmark: art-mega local exited {result.returncode}: {result.stderr[-1500:]}")
    shown = " --quick" if args.quick else ""
    report(figures, f"python benchmarks/memory.py{shown}", args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
