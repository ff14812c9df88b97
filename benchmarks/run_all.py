"""Run every benchmark script and record its rows in benchmarks/RESULTS.md.

    python benchmarks/run_all.py [--quick] [--with-real-model]

Each script prints its own table and never fails on a slow figure; a script that cannot run
here (e.g. namespace hosts without root) says so and is skipped. The real-model run takes
minutes and runs only with --with-real-model.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ("executor.py", "launch.py", "preflight.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument(
        "--with-real-model", action="store_true", help="also run the SmolLM2 GRPO job (minutes)"
    )
    args = parser.parse_args(argv)
    scripts = [[name] for name in SCRIPTS]
    if args.with_real_model:
        scripts.append(["grpo_real.py", "--run"])
    failed = []
    for script in scripts:
        command = [
            sys.executable,
            str(HERE / script[0]),
            *script[1:],
            "--record",
            *(["--quick"] if args.quick else []),
        ]
        print(f"== {' '.join(script)}", flush=True)
        started = time.monotonic()
        result = subprocess.run(command, cwd=HERE.parent)
        print(
            f"== {script[0]}: exit {result.returncode} after {time.monotonic() - started:.0f} s", flush=True
        )
        if result.returncode != 0:
            failed.append(script[0])
    if failed:
        print(f"benchmarks that did not run: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
