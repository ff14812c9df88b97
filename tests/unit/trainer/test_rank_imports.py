"""A trainer rank does not import what it never uses (`rank.main.NOT_IMPORTED`): the import fails
as if the module were not installed, and every import of it in the installed megatron-core is one
that expects that (inside a `try` that catches ImportError), so the rank still starts."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from art_mega.trainer.rank.main import NOT_IMPORTED


def test_a_blocked_module_fails_to_import_as_if_not_installed() -> None:
    code = (
        "from art_mega.trainer.rank.main import block_unused_imports\n"
        "block_unused_imports()\n"
        "try:\n"
        "    import wandb\n"
        "except ImportError:\n"
        "    print('ImportError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ImportError"


def guarded(tree: ast.AST, name: str) -> tuple[int, list[int]]:
    """(imports of `name` in `tree`, line numbers of those outside a try catching ImportError)."""
    catches: set[int] = set()  # ids of imports at the level of a try whose handler swallows ImportError
    import_errors = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            # the first handler that catches ImportError is the one that runs; it must not raise
            handler = next(
                (
                    h
                    for h in node.handlers
                    if h.type is None
                    or import_errors & {n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)}
                ),
                None,
            )
            if handler is not None and not any(isinstance(n, ast.Raise) for n in ast.walk(handler)):
                # imports at the try's own level, not inside a def it defines (that runs later)
                catches.update(id(s) for s in node.body if isinstance(s, ast.Import | ast.ImportFrom))
    imports = [
        node
        for node in ast.walk(tree)
        if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == name for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == name)
    ]
    # `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) imports never run; `if not ...` ones do
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in node.body
        for n in ast.walk(statement)
    }
    running = [n for n in imports if id(n) not in typing_only]
    return len(running), [n.lineno for n in running if id(n) not in catches]


def test_megatron_core_imports_the_blocked_modules_only_where_it_expects_import_error() -> None:
    root = Path(importlib.util.find_spec("megatron.core").origin).parent
    seen = 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="replace")
        for name in NOT_IMPORTED:
            if name not in text:
                continue
            count, unguarded = guarded(ast.parse(text), name)
            seen += count
            assert not unguarded, f"{path} imports {name} outside a try/except ImportError at {unguarded}"
    assert seen >= 3  # timers.py, the inference context and engine: what the rank would import


@pytest.mark.parametrize(
    ("code", "found"),
    [
        ("try:\n    import wandb\nexcept ImportError:\n    wandb = None\n", (1, [])),
        ("try:\n    import wandb\nexcept ImportError:\n    raise\n", (1, [2])),  # raised again
        ("import wandb\n", (1, [1])),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import wandb\n", (0, [])),
        ("if not TYPE_CHECKING:\n    import wandb\n", (1, [2])),  # runs
        ("try:\n    def f():\n        import wandb\nexcept ImportError:\n    pass\n", (1, [3])),  # later
        ("try:\n    from wandb import sdk\nexcept (ValueError, ModuleNotFoundError):\n    pass\n", (1, [])),
        ("try:\n    import wandb\nexcept ImportError:\n    raise\nexcept ValueError:\n    pass\n", (1, [2])),
        ("try:\n    import wandb\nexcept Exception:\n    raise\nexcept ImportError:\n    pass\n", (1, [2])),
    ],
)
def test_the_guard_check_tells_guarded_imports_from_unguarded(code: str, found: tuple) -> None:
    assert guarded(ast.parse(code), "wandb") == found
