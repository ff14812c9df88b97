"""Async callables named by import reference and pinned by the sha256 of their source file.

Code is never shipped to workers: they re-import the module and refuse a source whose hash
differs from the one the controller recorded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_mega.errors import UserError
from art_mega.rollouts.protocol import CallableRef


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def source_sha256(path: str) -> str:
    """sha256 (hex) of a file's bytes, cached by (path, mtime, size)."""
    stat = Path(path).stat()
    return _file_sha256(path, stat.st_mtime_ns, stat.st_size)


_IMPORTED_SHA256: dict[str, str] = {}
"""module name -> sha256 of its source when this process imported it (worker side)."""


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


@dataclass(frozen=True)
class InstalledAsyncCallable:
    """A top-level `async def` that workers can import: module, qualname, source sha256."""

    module: str
    qualname: str
    source_sha256: str

    @classmethod
    def from_callable(cls, fn: Callable[..., Any] | InstalledAsyncCallable) -> InstalledAsyncCallable:
        """Record `fn`'s import reference and source hash (an `InstalledAsyncCallable` is
        returned as it is).

        `fn` is a plain module-level `async def` (or what a decorator such as `art.retry` put
        under its name): what workers find when they import `fn.__module__` and look up
        `fn.__qualname__`.

        Raises:
            UserError: for a lambda, a closure or nested function (`<locals>`), a function that
                is not `async def`, a function defined in `__main__`, one without a source file,
                or one that is not what its module's name holds (a bound method, a copy
                re-wrapped after definition).
        """
        if isinstance(fn, InstalledAsyncCallable):
            return fn
        name = _describe(fn)
        if not callable(fn) or not hasattr(fn, "__qualname__") or not hasattr(fn, "__module__"):
            raise UserError(f"rollout {name!r} is not a function; pass a top-level async def")
        if fn.__name__ == "<lambda>":
            raise UserError(f"rollout {name} is a lambda; pass a top-level async def by name")
        if "<locals>" in fn.__qualname__:
            raise UserError(
                f"rollout {name} is defined inside another function; "
                "move it to module top level so workers can import it"
            )
        if not inspect.iscoroutinefunction(fn):
            raise UserError(f"rollout {name} is not an async function; declare it with 'async def'")
        if fn.__module__ == "__main__":
            raise UserError(
                f"rollout {name} is defined in __main__; put it in an importable module or "
                "load the script with --program"
            )
        module = sys.modules.get(fn.__module__)
        path = getattr(module, "__file__", None)
        if not path:
            raise UserError(f"rollout {name} has no source file to pin; define it in a .py file")
        named: Any = module
        for part in fn.__qualname__.split("."):
            named = getattr(named, part, None)
        if named is not fn:
            raise UserError(
                f"rollout {name} is not what {fn.__module__}.{fn.__qualname__} names, so workers would "
                "import something else; pass the module-level function itself (not a bound method or a copy)"
            )
        return cls(fn.__module__, fn.__qualname__, source_sha256(path))

    def ref(self) -> CallableRef:
        """The wire form of this reference."""
        return CallableRef(module=self.module, qualname=self.qualname, source_sha256=self.source_sha256)

    @classmethod
    def from_ref(cls, ref: CallableRef) -> InstalledAsyncCallable:
        return cls(ref.module, ref.qualname, ref.source_sha256)

    def load(self) -> Callable[..., Any]:
        """Import the function here and check its source hash (worker side).

        Raises:
            UserError: when the module cannot be imported, the name is missing or not async, or
                the source file's sha256 differs from the one recorded by the controller.
        """
        fresh = self.module not in sys.modules
        try:
            module = importlib.import_module(self.module)
        except Exception as exc:  # the user's module may raise anything at import
            raise UserError(
                f"rollout module {self.module!r} cannot be imported on this worker: {exc}"
            ) from exc
        path = getattr(module, "__file__", None)
        if self.module not in _IMPORTED_SHA256 or fresh:
            # The hash of the source this process actually runs, fixed at first import: a file
            # edited later must not pass as the code already loaded.
            _IMPORTED_SHA256[self.module] = source_sha256(path) if path else ""
        actual = _IMPORTED_SHA256[self.module]
        if actual != self.source_sha256:
            raise UserError(
                f"rollout module {self.module} ({path}) changed after the controller hashed it "
                f"(sha256 {actual[:12]} != {self.source_sha256[:12]}); restart the launch"
            )
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise UserError(f"rollout {self.module}:{self.qualname} does not exist on this worker")
        if not inspect.iscoroutinefunction(obj):
            raise UserError(f"rollout {self.module}:{self.qualname} is not an async function")
        return obj
