"""The model table (docs/models-and-parallelism.md, linked from README.md's Models section) names every family's HF model types (issue 31: the table lists each
architecture with what was verified on CPU and what only on a GPU), and every device check step
its GPU column names exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from art_mega.trainer.families import FAMILIES

REPO = Path(__file__).resolve().parents[3]


def _table() -> list[str]:
    text = (REPO / "docs" / "models-and-parallelism.md").read_text()
    section = text[text.index("## Models\n") :]
    section = section[: section.index("\n## ", 1)]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_every_family_has_a_row() -> None:
    rows = _table()
    named = {name for row in rows for name in re.findall(r"`([a-z0-9_]+)`", row.split(" | ")[0])}
    text_types = {t for t in FAMILIES if t.endswith("_text") and t.removesuffix("_text") in FAMILIES}
    assert set(FAMILIES) - text_types <= named, sorted(set(FAMILIES) - text_types - named)
    assert all(len(row.split(" | ")) == 4 for row in rows)


def test_the_gpu_column_names_device_check_steps() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import device_check

    steps = {name for row in _table() for name in re.findall(r"`([a-z0-9_]+)`", row.split(" | ")[3])}
    assert steps and steps <= set(device_check.STEPS), sorted(steps - set(device_check.STEPS))
