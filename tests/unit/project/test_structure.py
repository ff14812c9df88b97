"""The test tree's layout (tests/README.md): tiers at the top, rooms inside `unit/`.

A test file (`test_*.py`) lies in a tier folder that tests/README.md's table names, never directly
in tests/ or tests/unit/; each folder of tests/unit/ is a room: an art_mega package, `client` (the
top-level modules) or `project` (repo-wide checks), or `data` under a room.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

TESTS = REPO / "tests"
UNIT_ROOMS_BESIDE_PACKAGES = ("client", "project")


def readme_tiers(readme: str) -> set[str]:
    """The tier folders of tests/README.md's table: each row's first cell, "`name/`"."""
    return set(re.findall(r"^\| `(\w+)/` \|", readme, re.M))


def misplaced(tests: Path, tiers: set[str], rooms: set[str]) -> list[str]:
    """Each test file or unit/ folder of the tree at `tests` that breaks the layout, as
    "path: why" (paths relative to `tests`), sorted."""
    wrong = []
    for path in sorted(tests.rglob("test_*.py")):
        parts = path.relative_to(tests).parts
        if len(parts) == 1:
            wrong.append(f"{parts[0]}: a test file directly in tests/; move it into a tier folder")
        elif parts[0] not in tiers:
            wrong.append(f"{'/'.join(parts)}: {parts[0]}/ is not a tier of tests/README.md")
        elif parts[0] == "unit" and len(parts) == 2:
            wrong.append(f"{'/'.join(parts)}: directly in unit/; move it into its room's folder")
    unit = tests / "unit"
    for folder in sorted(p for p in unit.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if folder.name not in rooms:
            wrong.append(f"unit/{folder.name}: not a room (an art_mega package, client or project)")
    return wrong


def art_mega_rooms() -> set[str]:
    packages = {p.name for p in (REPO / "art_mega").iterdir() if (p / "__init__.py").is_file()}
    return packages | set(UNIT_ROOMS_BESIDE_PACKAGES)


def test_every_test_file_lies_in_a_tier_and_every_unit_test_in_a_room():
    tiers = readme_tiers((TESTS / "README.md").read_text())
    assert {"unit", "integration", "inference", "trainer"} <= tiers, tiers
    wrong = misplaced(TESTS, tiers, art_mega_rooms())
    assert wrong == [], "tests/ does not follow tests/README.md:\n" + "\n".join(wrong)


def test_the_check_names_a_misplaced_file(tmp_path):
    (tmp_path / "unit" / "agent").mkdir(parents=True)
    (tmp_path / "unit" / "agent" / "test_ok.py").write_text("")
    (tmp_path / "unit" / "test_flat.py").write_text("")
    (tmp_path / "unit" / "stuff").mkdir()
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "test_x.py").write_text("")
    (tmp_path / "test_top.py").write_text("")
    assert misplaced(tmp_path, {"unit"}, {"agent"}) == [
        "slow/test_x.py: slow/ is not a tier of tests/README.md",
        "test_top.py: a test file directly in tests/; move it into a tier folder",
        "unit/test_flat.py: directly in unit/; move it into its room's folder",
        "unit/stuff: not a room (an art_mega package, client or project)",
    ]
