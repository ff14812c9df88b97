"""Shared table printing and RESULTS.md recording for the benchmark scripts.

RESULTS.md is a title, a short paragraph, ONE markdown table (figure, value, unit, machine,
date, command) and a `## Notes` section written by people; `record` replaces rows by figure
name and `rewrite` orders the table and keeps the notes.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TABLE_HEADER = ("figure", "value", "unit", "machine", "date", "command")
HEADER_LINE = "| " + " | ".join(TABLE_HEADER) + " |"
NOTES = "## Notes"
INTRO = """# Benchmark results

Every figure art-mega is judged by, one row each: `python benchmarks/run_all.py [--quick]
[--with-real-model]` reruns them and rewrites this table (a row keeps the date and the command
that produced it; rows a run could not reproduce stay as they were). GPU rows (machine `gpu ...`)
come from `bash scripts/device_check.sh --log-dir DIR`. Ratios taken in the same run are worth
more than absolute times: these machines are shared and noisy. Targets and context are in the
notes under the table.
"""


def machine(kind: str = "cpu", accelerator: str = "") -> str:
    """This machine for the table's machine column, e.g. `cpu x2, Linux, py3.11.7` or
    `gpu NVIDIA H200 x1, cpu x16, Linux, py3.11.7` (kind "gpu", `accelerator` its name)."""
    base = f"cpu x{os.cpu_count()}, {platform.system()}, py{platform.python_version()}"
    return f"gpu {accelerator}, {base}" if kind == "gpu" else base


def fmt(value: float) -> str:
    """Three significant figures, no scientific notation for the usual ranges."""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def rows_for(
    figures: Sequence[tuple[str, float, str]], command: str, machine_name: str | None = None
) -> list[tuple[str, ...]]:
    """Table rows for (figure, value, unit) triples measured today by `command` on this machine."""
    today = datetime.date.today().isoformat()
    where = machine_name or machine()
    return [(name, fmt(value), unit, where, today, command) for name, value, unit in figures]


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Print rows under TABLE_HEADER as an aligned plain-text table."""
    table = [TABLE_HEADER, *rows]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(TABLE_HEADER))]
    for n, row in enumerate(table):
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _cells(line: str) -> list[str]:
    return [cell.strip().replace("\\|", "|") for cell in line.strip().strip("|").split(" | ")]


def _line(row: Sequence[str]) -> str:
    return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |"


def read_rows(path: Path = RESULTS) -> list[list[str]]:
    """The rows of the results table in `path` (empty when the file or table is missing)."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if HEADER_LINE not in lines:
        return []
    rows = []
    for line in lines[lines.index(HEADER_LINE) + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def notes(path: Path = RESULTS) -> str:
    """The `## Notes` section of `path` and everything after it ("" when absent)."""
    text = path.read_text() if path.exists() else ""
    at = text.find("\n" + NOTES)
    return text[at + 1 :] if at >= 0 else ""


def write(rows: Sequence[Sequence[str]], path: Path = RESULTS) -> None:
    """Write `path` as INTRO, one table of `rows`, then its current notes section."""
    table = [HEADER_LINE, "|" + "---|" * len(TABLE_HEADER), *(_line(r) for r in rows)]
    kept = notes(path)
    path.write_text(INTRO + "\n" + "\n".join(table) + "\n" + (f"\n{kept.rstrip()}\n" if kept else ""))


def record(rows: Sequence[Sequence[str]], path: Path = RESULTS) -> None:
    """Replace rows with the same figure name in the table of `path`; append new ones."""
    existing = read_rows(path)
    new = {row[0]: list(row) for row in rows}
    merged = [new.pop(row[0]) if row[0] in new else row for row in existing]
    merged += [list(row) for row in rows if row[0] in new]
    write(merged, path)


def rewrite(script_order: Sequence[str], path: Path = RESULTS) -> None:
    """Order the table's rows by the script named in their command (`script_order`, e.g.
    "executor.py"; others last), keeping each script's rows in their order; notes are kept."""
    rows = read_rows(path)

    def rank(row: list[str]) -> int:
        command = row[5] if len(row) > 5 else ""
        return next((i for i, name in enumerate(script_order) if name in command), len(script_order))

    write(sorted(rows, key=rank), path)


def report(
    figures: Sequence[tuple[str, float, str]], command: str, save: bool, machine_name: str | None = None
) -> list[tuple[str, ...]]:
    """Print the rows of `figures` (see `rows_for`) and, when `save`, `record` them; returns them."""
    rows = rows_for(figures, command, machine_name)
    print_table(rows)
    if save and rows:
        record(rows)
        print(f"recorded in {RESULTS}")
    return rows
