"""What a person watching a run reads: progress bars (one library, tqdm, as ART uses) and plain
lines when the output is not a terminal.

`bar(...)` is a tqdm bar on a terminal; piped to a file or a CI log it draws nothing (a bar's
carriage returns turn a log into `step 0 ━━ 32… 0…`), and the caller's own one-line summaries
(`gather_trajectory_groups`' line per gather, `model.log`'s line per training step) say what
happened. `ART_MEGA_PROGRESS=bars|lines` overrides the terminal test.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

PLANNED_STEPS: dict[str, int] = {"last": 0}
"""The step count the newest `iterate_dataset` will yield up to (its `total`), so that a step's
summary line reads "step 3/6"; 0 when no dataset iteration is running."""


def stream() -> TextIO:
    """Where progress goes: standard error, as tqdm writes."""
    return sys.stderr


def bars_shown() -> bool:
    """True when progress is drawn as bars: `ART_MEGA_PROGRESS=bars`, or unset and standard
    error is a terminal; False (plain lines) for `ART_MEGA_PROGRESS=lines` or a pipe or file."""
    choice = os.environ.get("ART_MEGA_PROGRESS", "").strip().lower()
    if choice in ("bars", "lines"):
        return choice == "bars"
    try:
        return stream().isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def bar(total: int, desc: str, unit: str, initial: int = 0, eta: bool = True) -> Any:
    """A tqdm bar of `total` `unit`s labelled `desc` when `bars_shown()`, else None.
    `eta=False` leaves out the remaining-time estimate (for a total the program may never
    reach, such as `iterate_dataset`'s epochs when the program stops earlier)."""
    if not bars_shown():
        return None
    from tqdm.auto import tqdm

    fmt = None if eta else "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}]{postfix}"
    return tqdm(initial=initial, total=total, desc=desc, unit=unit, bar_format=fmt, file=stream())


def line(text: str) -> None:
    """One plain progress line on standard output, flushed (it interleaves with a program's prints)."""
    print(text, flush=True)
