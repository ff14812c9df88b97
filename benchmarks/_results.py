"""Shared table printing and RESULTS.md recording for the benchmark scripts."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TABLE_HEADER = ("figure", "value", "unit", "machine", "date", "command")


def machine() -> str:
    """A short description of this machine for the table's machine column."""
    return f"cpu x{os.cpu_count()}, {platform.system()}, py{platform.python_version()}"


def fmt(value: float) -> str:
    """Three significant figures, no scientific notation for the usual ranges."""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def rows_for(figures: Sequence[tuple[str, float, str]], command: str) -> list[tuple[str, ...]]:
    today = datetime.date.today().isoformat()
    return [(name, fmt(value), unit, machine(), today, command) for name, value, unit in figures]


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Print rows under TABLE_HEADER as an aligned plain-text table."""
    table = [TABLE_HEADER, *rows]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(TABLE_HEADER))]
    for row in table:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def record(rows: Sequence[Sequence[str]], path: Path = RESULTS) -> None:
    """Replace rows with the same figure name in the markdown table of `path`; append new ones."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    lines = text.splitlines()
    header = "| " + " | ".join(TABLE_HEADER) + " |"
    if header not in lines:
        lines += ["", header, "|" + "---|" * len(TABLE_HEADER)]
    start = lines.index(header) + 2
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    existing = {line.split("|")[1].strip(): line for line in lines[start:end]}
    for row in rows:
        existing[row[0]] = "| " + " | ".join(row) + " |"
    lines[start:end] = list(existing.values())
    path.write_text("\n".join(lines) + "\n")
