"""The agent's artifact-file routes: write one binary file, or remove one path, under artifact_root.

With a host-local artifact_root (`ClusterSpec.shared_artifact_root=False`) the controller puts
files where trainer ranks on other hosts read them (each step's batch) and deletes what they wrote
(old checkpoints) through these routes. `register(router, supervisor)` adds
`POST /v1/artifacts/write` and `/v1/artifacts/remove`; the router's signature check guards them like
every other route. Paths are relative to the root and may not leave it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from art_mega.errors import ArtifactFileError
from art_mega.transfer.protocol import (
    ARTIFACTS_REMOVE,
    ARTIFACTS_WRITE,
    ArtifactRemoveRequest,
    ArtifactResponse,
    ArtifactWriteRequest,
)

if TYPE_CHECKING:  # the agent imports this module too; it needs no HTTP client
    from art_mega.agent.client import AgentClient
    from art_mega.agent.routes import SignedRouter
    from art_mega.agent.supervisor import Supervisor


def artifact_path(root: str, path: str) -> Path:
    """`<root>/<path>` resolved; `path` must be relative and stay strictly inside `root`.

    Raises:
        ValueError: `path` is absolute, empty, or resolves to `root` itself or outside it.
    """
    if not path or Path(path).is_absolute():
        raise ValueError(f"artifact path {path!r} must be relative to artifact_root {root}")
    base = Path(root).resolve()
    target = (base / path).resolve()
    if not str(target).startswith(str(base) + os.sep):
        raise ValueError(f"artifact path {path!r} leaves artifact_root {root}")
    return target


def write_file(request: ArtifactWriteRequest) -> ArtifactResponse:
    """Agent side: decode, write to a temp file beside the target, fsync, rename, fsync the folder."""
    try:
        target = artifact_path(request.root, request.path)
        data = base64.b64decode(request.data_b64, validate=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
        return ArtifactResponse(ok=True, bytes=len(data))
    except (OSError, ValueError) as exc:
        return ArtifactResponse(ok=False, error=f"writing {request.path}: {type(exc).__name__}: {exc}")


def remove_path(request: ArtifactRemoveRequest) -> ArtifactResponse:
    """Agent side: delete the file or folder at `<root>/<path>`; `removed` says whether one was there."""
    try:
        target = artifact_path(request.root, request.path)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        else:
            return ArtifactResponse(ok=True, removed=False)
        return ArtifactResponse(ok=True, removed=True)
    except (OSError, ValueError) as exc:
        return ArtifactResponse(ok=False, error=f"removing {request.path}: {type(exc).__name__}: {exc}")


def register(router: SignedRouter, supervisor: Supervisor) -> None:
    """Add `POST /v1/artifacts/write` and `/v1/artifacts/remove` to the agent's `router`; each runs
    in an agent thread and answers `ArtifactResponse` (failures in it, not as HTTP errors). They
    start no child, so `supervisor` is not used."""

    @router.serve(ARTIFACTS_WRITE)
    async def artifacts_write(body: ArtifactWriteRequest) -> ArtifactResponse:
        return await asyncio.to_thread(write_file, body)

    @router.serve(ARTIFACTS_REMOVE)
    async def artifacts_remove(body: ArtifactRemoveRequest) -> ArtifactResponse:
        return await asyncio.to_thread(remove_path, body)


async def send_file(client: AgentClient, root: str, path: str, data: bytes, timeout_s: float = 120.0) -> int:
    """Controller side: write `data` to `<root>/<path>` on `client`'s host; returns the bytes written.

    Raises:
        ArtifactFileError: the agent refused the path or could not write it.
        AgentError: the agent did not answer.
    """
    body = ArtifactWriteRequest(root=root, path=path, data_b64=base64.b64encode(data).decode())
    reply = await client.call(ARTIFACTS_WRITE, body, timeout_s=timeout_s)
    if not reply.ok:
        raise ArtifactFileError(client.host, path, reply.error)
    return reply.bytes


async def remove_remote(client: AgentClient, root: str, path: str) -> bool:
    """Controller side: remove `<root>/<path>` on `client`'s host; returns whether it was there.

    Raises:
        ArtifactFileError: the agent refused the path or could not remove it.
        AgentError: the agent did not answer.
    """
    reply = await client.call(ARTIFACTS_REMOVE, ArtifactRemoveRequest(root=root, path=path))
    if not reply.ok:
        raise ArtifactFileError(client.host, path, reply.error)
    return reply.removed
