"""ART's `art.distributed`: the multi-host names a controller program imports, with ART's use.

As the documentation's `examples/multinode/program.py` writes it::

    runtime = await ArtRuntime.start(
        launch.host_mesh, compile_topology(cluster=launch.homogeneous_cluster(cpu_slots=1))
    )
    executor = runtime.rollout_executor(
        InstalledAsyncCallable.from_callable(rollout), target_workers=launch.host_count
    )
    executor.set_workers(tuple(range(launch.host_count)))
    trajectory = await executor.run(0, rollout, model, scenario, None)

`rollout_executor` returns at once; the worker processes start on the first `run` (or on
`await executor`, which `await runtime.rollout_executor(...)` does). `set_workers` gives them
ART's worker ids; `run(worker_id, fn, *args, **kwargs)` takes any arguments (ART's: model,
scenario, config). The names are art-mega's own (`art_mega.launch`, `art_mega.runtime`,
`art_mega.rollouts`, `art_mega.topology`; the specs ART's docs name, `ClusterSpec`, `HostSpec`,
`EndpointSpec`, `NcclTransportSpec`, `NixlTransportSpec`, are here too) and load on first use,
as in `art_mega`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArtLaunchContext": "art_mega.launch.context",
    "ArtRuntime": "art_mega.runtime.runtime",
    "ClusterSpec": "art_mega.topology",
    "EndpointSpec": "art_mega.topology",
    "HostMesh": "art_mega.launch.context",
    "HostSpec": "art_mega.topology",
    "InstalledAsyncCallable": "art_mega.rollouts.installed",
    "NcclTransportSpec": "art_mega.topology",
    "NixlTransportSpec": "art_mega.topology",
    "RolloutExecutor": "art_mega.rollouts.remote",
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
