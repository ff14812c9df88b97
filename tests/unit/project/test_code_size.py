"""Size limits of the trainer's and the backend's code (the house rules, docs/ARCHITECTURE.md):
no function over 100 lines in art_mega/backend or art_mega/trainer, its docstring not counted,
unless its docstring says why ("over 100 lines because ..."); no module over 800 lines
(`art_mega/errors.py`, the one catalogue of exceptions, excepted).

Read with `ast` (nothing is imported). A function's lines run from its `def` to its last line,
a nested function's or class's lines counted in its enclosing function's too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

CHECKED = ("art_mega/backend", "art_mega/trainer")
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 800
REASON = "over 100 lines because"
"""The phrase a longer function's docstring holds, followed by why splitting it would hurt."""
MODULES_EXCEPTED = ("art_mega/errors.py",)


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of `node` from its `def` to its end, less its docstring's lines."""
    lines = node.end_lineno - node.lineno + 1
    if ast.get_docstring(node, clean=False) is not None:
        doc = node.body[0]
        lines -= doc.end_lineno - doc.lineno + 1
    return lines


def too_long(root: Path, folders: tuple[str, ...] = CHECKED) -> list[str]:
    """Each module over `MAX_MODULE_LINES` lines and each function over `MAX_FUNCTION_LINES`
    (without `REASON` in its docstring) under `root`'s `folders`, as "path: why", sorted."""
    wrong = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            text = path.read_text()
            module_lines = len(text.splitlines())
            if module_lines > MAX_MODULE_LINES and name not in MODULES_EXCEPTED:
                wrong.append(
                    f"{name}: {module_lines} lines (at most {MAX_MODULE_LINES}); split it by concern"
                )
            for node in ast.walk(ast.parse(text, filename=name)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                lines = function_lines(node)
                if lines > MAX_FUNCTION_LINES and REASON not in (ast.get_docstring(node) or ""):
                    wrong.append(
                        f"{name}:{node.lineno} {node.name}: {lines} lines without its docstring "
                        f"(at most {MAX_FUNCTION_LINES}, or a docstring saying '{REASON} ...')"
                    )
    return sorted(wrong)


def test_no_long_function_or_module_in_the_backend_and_the_trainer():
    wrong = too_long(REPO)
    assert wrong == [], "too long:\n" + "\n".join(wrong)


def _function(name: str, body_lines: int, docstring: str = "") -> str:
    doc = f'    """{docstring}"""\n' if docstring else ""
    return f"def {name}():\n{doc}" + "    x = 1\n" * (body_lines - 1) + "\n"


def test_the_check_names_a_long_function_and_module_and_honours_the_reason(tmp_path):
    trainer = tmp_path / "art_mega" / "trainer"
    trainer.mkdir(parents=True)
    # 100 lines with a 3-line docstring: the docstring is not counted
    (trainer / "ok.py").write_text(_function("fits", 100, "Three\n    lines\n    of docstring."))
    (trainer / "long.py").write_text(
        _function("long", 101) + _function("said", 150, f"It is {REASON} reasons.")
    )
    (trainer / "big.py").write_text("x = 1\n" * 801)
    assert too_long(tmp_path, ("art_mega/trainer",)) == [
        "art_mega/trainer/big.py: 801 lines (at most 800); split it by concern",
        "art_mega/trainer/long.py:1 long: 101 lines without its docstring "
        f"(at most 100, or a docstring saying '{REASON} ...')",
    ]
