"""Run every benchmark script and rewrite benchmarks/RESULTS.md as one table.

    python benchmarks/run_all.py [--quick] [--with-real-model]

Each script prints its own table, records its rows (`--record`: same figure name replaced) and
never fails on a slow figure; a script that cannot run here (no root for namespace hosts, no
ray, no vLLM environment) says so and records nothing, and a script that is not in the folder
is skipped with a line. Rows nobody re-ran keep their date and command. At the end the table is
rewritten in SCRIPTS order, with the notes under it kept. The real-model run takes many minutes
on CPU and runs only with --with-real-model.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import RESULTS, rewrite  # noqa: E402

# (script, extra arguments), in table order; trainer_step.py, adapter_publish.py and grpo_step.py
# are written separately and may be absent
SCRIPTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("executor.py", ()),
    ("launch.py", ()),
    ("launch_scale.py", ()),
    ("preflight.py", ()),
    ("peers_torchrun.py", ()),
    ("memory.py", ()),
    ("trainer_step.py", ()),
    ("adapter_publish.py", ()),
    ("grpo_step.py", ()),
    ("grpo_real.py", ("--run",)),
)
REAL_MODEL = "grpo_real.py"


def commands(quick: bool, with_real_model: bool, folder: Path = HERE) -> tuple[list[list[str]], list[str]]:
    """(argv of each script to run, names of the scripts skipped with the reason)."""
    runs, skipped = [], []
    for name, extra in SCRIPTS:
        if name == REAL_MODEL and not with_real_model:
            skipped.append(f"{name} (the real-model run: pass --with-real-model)")
        elif not (folder / name).is_file():
            skipped.append(f"{name} (not in {folder})")
        else:
            runs.append(
                [sys.executable, str(folder / name), *extra, "--record", *(["--quick"] if quick else [])]
            )
    return runs, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument(
        "--with-real-model", action="store_true", help="also run the SmolLM2 GRPO job (many minutes)"
    )
    args = parser.parse_args(argv)
    runs, skipped = commands(args.quick, args.with_real_model)
    for line in skipped:
        print(f"== skipped: {line}", flush=True)
    failed = []
    for command in runs:
        name = Path(command[1]).name
        print(f"== {' '.join([name, *command[2:]])}", flush=True)
        started = time.monotonic()
        result = subprocess.run(command, cwd=HERE.parent)
        print(f"== {name}: exit {result.returncode} after {time.monotonic() - started:.0f} s", flush=True)
        if result.returncode != 0:
            failed.append(name)
    rewrite([name for name, _ in SCRIPTS])
    print(f"rewrote {RESULTS}")
    if failed:
        print(f"benchmarks that failed (their previous rows are kept): {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
