"""ART's `art.distributed`: the multi-host names a controller program imports.

They are art-mega's own (`art_mega.launch`, `art_mega.runtime`, `art_mega.rollouts`,
`art_mega.topology`), with art-mega's signatures: `ArtRuntime.start(launch, topology)` takes the
launch context itself (ART: `launch.host_mesh`), `await runtime.rollout_executor(fn,
target_workers=n)` is a coroutine and starts its workers at once (ART's returns an executor whose
`set_workers` starts them). Names load on first use, as in `art_mega`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArtLaunchContext": "art_mega.launch.context",
    "ArtRuntime": "art_mega.runtime.runtime",
    "InstalledAsyncCallable": "art_mega.rollouts.installed",
    "RolloutExecutor": "art_mega.rollouts.executor",
    "compile_topology": "art_mega.topology",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'art_mega.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
