"""Reach checks: before a trainer rank or a replica starts, every host that will read a path can.

The backend runs them at `register`, after the runtime's proof (which showed what the agents
see of artifact_root) and before it allocates anything: the topology can share the
controller's artifact_root with trainer rank 0 (`check_artifact_root_reach`), this controller
process sees its host's artifact_root (`check_controller_sees_artifact_root`), and every trainer
and replica host reads the base model and warm-start adapter (`check_hosts_see_model`). Each
refusal is one `UserError` sentence naming the host, the path and the fix.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from art_mega.agent.client import AgentClient
from art_mega.errors import UserError
from art_mega.preflight.fs_probe import PROBE_DIR, files_missing
from art_mega.preflight.protocol import FS_OP, FsOpRequest
from art_mega.topology import CompiledTopology


class ProvedRuntime(Protocol):
    """What the reach checks read of an `ArtRuntime`: its topology and its agents' clients."""

    @property
    def topology(self) -> CompiledTopology: ...

    @property
    def clients(self) -> dict[str, AgentClient]: ...


def check_artifact_root_reach(topology: CompiledTopology) -> None:
    """Refuse a topology whose trainer rank 0 cannot share the controller's artifact_root.

    The controller writes each step's batch and the commit pointer under its own artifact_root
    and reads the manifest of rank 0's checkpoints there. With `ClusterSpec.shared_artifact_root=False`
    that needs trainer rank 0 on the controller's host; ranks on other hosts get their batches
    through their agents (`art_mega.backend.remote_trainer_hosts`), commit their own hosts'
    checkpoint folders (`trainer.rank.jobs.write_checkpoint`), and adapters reach replica hosts over NIXL.

    Raises:
        UserError: artifact_root is host-local and trainer rank 0 runs on another host.
    """
    cluster = topology.cluster
    if cluster.shared_artifact_root:
        return
    controller = cluster.controller_host_id
    rank0 = next(r for r in topology.trainer_ranks if r.rank == 0).host_id
    if rank0 != controller:
        raise UserError(
            f"ClusterSpec.shared_artifact_root=False, but trainer rank 0 runs on host {rank0} while "
            f"the controller runs on host {controller}, so the controller cannot read its checkpoints "
            f"under the host-local artifact_root {cluster.artifact_root}; include host {controller} in "
            "TrainerSpec.host_ids with the lowest node_rank among them (ranks follow node-rank order), "
            f"name host {rank0} as ClusterSpec.controller_host_id, or set ClusterSpec.shared_artifact_root=True"
        )


async def check_controller_sees_artifact_root(runtime: ProvedRuntime) -> None:
    """Refuse a controller process that does not see its host's artifact_root.

    The controller writes batches and the commit pointer where the trainer ranks of its host
    read and write (see `check_artifact_root_reach`); the FS probe only proved what the agents
    see. Here the controller host's agent writes a token under `<root>/.art-mega-probe/` and
    this process must read it back (one HTTP round trip).

    Raises:
        UserError: the token is not there (the controller runs on another machine or mount
            namespace than `ClusterSpec.controller_host_id`'s agent).
    """
    cluster = runtime.topology.cluster
    host, root = cluster.controller_host_id, cluster.artifact_root
    client = runtime.clients[host]
    folder, token = f"controller-{secrets.token_hex(6)}", secrets.token_hex(16)
    written = await client.call(
        FS_OP, FsOpRequest(op="write", root=root, name=f"{folder}/probe", content=token)
    )
    try:
        probe = Path(root) / PROBE_DIR / folder / "probe"
        seen = written.ok and probe.is_file() and probe.read_text() == token
    finally:
        await client.call(FS_OP, FsOpRequest(op="cleanup", root=root, name=folder))
    if not seen:
        raise UserError(
            f"this controller process does not see the artifact_root {root} of its host {host} "
            f"(ClusterSpec.controller_host_id={host!r}): a file host {host}'s agent wrote there is "
            f"missing here; run the controller on host {host} (same machine and mounts) or name the "
            "host it runs on as controller_host_id"
        )


async def check_hosts_see_model(
    runtime: ProvedRuntime, model_dir: Path, warm_start: Path | None = None, hub_id: str | None = None
) -> None:
    """Refuse to start when a trainer or replica host cannot read the base model (or warm start).

    The controller resolves `base_model` into a directory (under its `cache_root`, or the
    snapshot of Hugging Face repo `hub_id` in its HF cache), and every trainer rank and vLLM
    replica reads that same path on its own host. Each of those hosts' agents checks the
    directory's top-level files (config, weights, tokenizer; an HF snapshot's links followed to
    their blobs) are readable there: one signed call per host, in parallel, before any rank or
    replica starts.

    Raises:
        UserError: a host misses some of the files (the first such host is named, with the
            directory and how many of its files are missing).
    """
    topology = runtime.topology
    hosts = [
        h
        for h in topology.cluster.host_ids
        if any(r.host_id == h for r in topology.trainer_ranks)
        or any(h in r.host_ids for r in topology.replicas)
    ]
    folders = {Path(model_dir): "base model directory"}
    if warm_start is not None:
        folders[Path(warm_start)] = "warm-start adapter directory"
    files = tuple(str(f) for folder in folders for f in sorted(folder.iterdir()) if f.is_file() and _utf8(f))
    missing = await asyncio.gather(*(files_missing(runtime.clients[h], files) for h in hosts))
    for host, lost in zip(hosts, missing):
        if lost:
            raise unreadable_model_error(host, lost, folders, {Path(model_dir): hub_id} if hub_id else None)


def unreadable_model_error(
    host: str, lost: Sequence[str], folders: Mapping[Path, str], hub_ids: Mapping[Path, str] | None = None
) -> UserError:
    """The one-sentence error for `host` missing the files `lost` (non-empty) of `folders`
    (directory -> what it is, e.g. "base model directory"): names the folder of the first lost
    file and counts that folder's lost files only. `hub_ids`: the folders that are Hugging Face
    cache snapshots -> their repo id (the fix is then the HF cache's, not `cache_root`'s)."""
    folder = Path(lost[0]).parent
    count = sum(Path(p).parent == folder for p in lost)
    hub_id = (hub_ids or {}).get(folder)
    fix = (
        "put ClusterSpec.cache_root on a filesystem every host mounts, or copy the directory "
        f"to the same path on host {host}"
        if hub_id is None
        else f"it is the Hugging Face cache snapshot of {hub_id!r}: put the controller's HF cache "
        f"(HF_HOME or HF_HUB_CACHE) on a filesystem every host mounts at the same path, or download "
        f"{hub_id} on host {host} into a cache at that same path (hf download {hub_id})"
    )
    return UserError(
        f"host {host} cannot read the {folders[folder]} {folder} ({count} of its files are "
        f"missing there, e.g. {Path(lost[0]).name}), which its trainer ranks or replicas load; {fix}"
    )


def _utf8(path: Path) -> bool:
    """True when `path` is valid UTF-8 (a name that is not cannot travel in JSON; no loader reads it)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
