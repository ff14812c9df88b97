"""`--program` references: `path/to/script.py:fn` or `package.module:fn`, loaded and checked.

A script is imported as a module named after its file, with its folder on `sys.path` (and on
every worker's), so functions it defines can be re-imported by rollout workers.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_mega.errors import ProgramImportError, UserError


@dataclass(frozen=True)
class ProgramRef:
    """A parsed `--program` value."""

    text: str
    module: str
    function: str
    script: Path | None = None

    @property
    def sys_path(self) -> tuple[str, ...]:
        """Entries the controller and every worker put on sys.path (the script's folder)."""
        return (str(self.script.parent),) if self.script is not None else ()


def parse_program(text: str) -> ProgramRef:
    """Parse `path/to/script.py:fn` or `package.module:fn`.

    Raises:
        UserError: no `:`, an empty part, a missing script, or an invalid module name.
    """
    if ":" not in text:
        raise UserError(f"--program {text!r} has no ':'; use path/to/script.py:main or package.module:main")
    target, _, function = text.rpartition(":")
    if not target or not function:
        raise UserError(f"--program {text!r} needs both parts; use path/to/script.py:main")
    if not function.isidentifier():
        raise UserError(f"--program {text!r}: {function!r} is not a function name")
    if target.endswith(".py") or "/" in target or "\\" in target:
        script = Path(target).expanduser().resolve()
        if script.is_dir():
            raise UserError(f"--program {text!r}: {target} is a directory; name a .py file in it")
        if not script.is_file():
            raise UserError(f"--program {text!r}: script {target} does not exist")
        if script.suffix != ".py":
            raise UserError(f"--program {text!r}: {target} is not a .py file")
        if not script.stem.isidentifier():
            raise UserError(f"--program {text!r}: file name {script.name} is not an importable module name")
        return ProgramRef(text=text, module=script.stem, function=function, script=script)
    if not all(part.isidentifier() for part in target.split(".")):
        raise UserError(f"--program {text!r}: {target!r} is not a module name or a .py path")
    return ProgramRef(text=text, module=target, function=function)


def _one_line(text: str, limit: int = 300) -> str:
    """`text` with line breaks folded into spaces, cut to `limit` characters."""
    folded = " ".join(text.split()) or "(no message)"
    return folded if len(folded) <= limit else folded[: limit - 3] + "..."


def _raised_at(exc: BaseException) -> str:
    """`file:line` of the innermost frame outside the import machinery that raised `exc`, skipping
    a replacement of `sys.exit` that a library installed (wandb's exit hook wraps it), so a
    program's `sys.exit(...)` is named at its own line."""
    exit_fn = getattr(sys.exit, "__func__", sys.exit)
    exit_wrapper = getattr(exit_fn, "__code__", None)
    where = "an unknown line"
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if tb.tb_frame.f_code is exit_wrapper:
            pass
        elif not filename.startswith("<frozen ") and "importlib" not in Path(filename).parts:
            where = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def load_program(ref: ProgramRef) -> Callable[[Any], Any]:
    """Import the program and return its `async def main(launch)`.

    Raises:
        ProgramImportError: the module (or a module it imports) imports a package that is not
            installed, or its top-level code raises or calls sys.exit; the message names the
            module, the missing name or the exception, and the file:line; the original is
            chained for --debug.
        UserError: the module cannot be found, does not compile, its name clashes with another
            module, or the function is missing, not top level, not async, or does not take one
            argument.
    """
    for entry in reversed(ref.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        module = importlib.import_module(ref.module)
    except ModuleNotFoundError as exc:
        if exc.name and (ref.module == exc.name or ref.module.startswith(exc.name + ".")):
            raise UserError(f"--program {ref.text!r}: module {ref.module} cannot be found") from None
        missing = exc.name or _one_line(str(exc))
        raise ProgramImportError(
            f"--program {ref.text!r}: importing {ref.module} failed at {_raised_at(exc)}: module "
            f"{missing!r} is not installed in this environment ({sys.executable}); install it or "
            "remove the import (--debug shows the traceback)",
            ref.module,
            type(exc).__name__,
        ) from exc
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else ref.module
        raise UserError(f"--program {ref.text!r}: {where}: {exc.msg}; fix the program's syntax") from exc
    except ValueError as exc:  # e.g. null bytes in the source
        raise UserError(f"--program {ref.text!r}: {ref.module} cannot be compiled ({exc})") from exc
    except SystemExit as exc:  # the launch would end with the module's code, main never run
        raise ProgramImportError(
            f"--program {ref.text!r}: importing {ref.module} called sys.exit({exc.code!r}) at "
            f"{_raised_at(exc)}, so main would never run; move that code into main or under "
            "if __name__ == '__main__': (--debug shows the traceback)",
            ref.module,
            "SystemExit",
        ) from exc
    except Exception as exc:
        raise ProgramImportError(
            f"--program {ref.text!r}: importing {ref.module} raised {type(exc).__name__}: "
            f"{_one_line(str(exc))} at {_raised_at(exc)}; fix the module's top-level code "
            "(--debug shows the traceback)",
            ref.module,
            type(exc).__name__,
        ) from exc
    if ref.script is not None:
        loaded = Path(getattr(module, "__file__", "") or "").resolve()
        if loaded != ref.script:
            raise UserError(
                f"--program {ref.text!r}: the name {ref.module!r} is already taken by {loaded}; rename the script"
            )
    fn = getattr(module, ref.function, None)
    if fn is None:
        raise UserError(f"--program {ref.text!r}: {ref.module} has no function {ref.function!r}")
    if not inspect.isfunction(fn) or fn.__qualname__ != ref.function:
        raise UserError(f"--program {ref.text!r}: {ref.function} must be a top-level function")
    if not inspect.iscoroutinefunction(fn):
        raise UserError(
            f"--program {ref.text!r}: {ref.function} must be declared 'async def {ref.function}(launch)'"
        )
    try:
        inspect.signature(fn).bind(object())
    except TypeError:
        raise UserError(
            f"--program {ref.text!r}: {ref.function} must take exactly one argument, launch"
        ) from None
    return fn
