"""Shared-filesystem probe: is `artifact_root` one filesystem seen alike by every host?

Shared (the default): one host creates, writes and renames a file; every other host must read it
and see the rename; a lock held on one host must be seen as held on every other. Host-local: each
host must be able to write there. Agent-side steps are confined to `<root>/.art-mega-probe/`.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from art_mega.errors import PreflightError
from art_mega.preflight.protocol import (
    FILES_CHECK,
    FILES_PER_CHECK,
    FS_OP,
    FilesCheckRequest,
    FsOpRequest,
    FsOpResponse,
)

if TYPE_CHECKING:  # the agent imports this module too; it needs no HTTP client
    from art_mega.agent.client import AgentClient

PROBE_DIR = ".art-mega-probe"


class FsProbeOps:
    """Agent side: the probe's file operations and the locks this agent holds."""

    def __init__(self) -> None:
        self._locks: dict[str, int] = {}

    @staticmethod
    def _path(root: str, name: str) -> Path:
        base = (Path(root) / PROBE_DIR).resolve()
        path = (base / name).resolve()
        if not str(path).startswith(str(base) + os.sep) and path != base:
            raise ValueError(f"probe path {name!r} escapes {base}")
        return path

    def run(self, request: FsOpRequest) -> FsOpResponse:
        try:
            return self._run(request)
        except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: pathlib's symlink loop
            return FsOpResponse(ok=False, error=f"{type(exc).__name__}: {exc}")

    def _run(self, request: FsOpRequest) -> FsOpResponse:
        path = self._path(request.root, request.name)
        if request.op == "write":
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w") as handle:
                handle.write(request.content)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            return FsOpResponse(ok=True, exists=True)
        if request.op == "read":
            tmp_exists = path.with_name(path.name + ".tmp").exists()
            if not path.exists():
                return FsOpResponse(ok=True, exists=False, busy=tmp_exists)
            return FsOpResponse(ok=True, exists=True, content=path.read_text(), busy=tmp_exists)
        if request.op in ("lock", "trylock"):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return FsOpResponse(ok=True, busy=True)
            if request.op == "trylock":
                fcntl.lockf(fd, fcntl.LOCK_UN)
                os.close(fd)
            else:
                self._locks[str(path)] = fd
            return FsOpResponse(ok=True, busy=False)
        if request.op == "unlock":
            fd = self._locks.pop(str(path), None)
            if fd is not None:
                fcntl.lockf(fd, fcntl.LOCK_UN)
                os.close(fd)
            return FsOpResponse(ok=True)
        # cleanup: remove this probe's folder
        shutil.rmtree(path, ignore_errors=True)
        return FsOpResponse(ok=True)

    def close(self) -> None:
        for fd in self._locks.values():
            os.close(fd)
        self._locks.clear()


async def _op(client: AgentClient, op: str, root: str, name: str, content: str = "") -> FsOpResponse:
    reply = await client.call(FS_OP, FsOpRequest(op=op, root=root, name=name, content=content))  # type: ignore[arg-type]
    if not reply.ok:
        raise PreflightError(
            f"host {client.host}: artifact_root {root} cannot be used ({op} failed: {reply.error})",
            (client.host,),
        )
    return reply


async def probe_artifact_root(
    clients: Mapping[str, AgentClient], root: str, shared: bool, writer_host: str, launch_id: str
) -> float:
    """Check `root` on every host; return the seconds it took.

    Raises:
        PreflightError: naming the host that cannot write, does not see the writer's file or its
            rename, or does not see the writer's lock.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    folder = f"{launch_id}-{secrets.token_hex(4)}"
    if not shared:
        await asyncio.gather(*(_check_local(c, root, f"{folder}-{h}") for h, c in clients.items()))
        return loop.time() - started
    writer = clients[writer_host]
    token = secrets.token_hex(16)
    try:
        await _op(writer, "write", root, f"{folder}/probe.json", token)
        readers = {h: c for h, c in clients.items() if h != writer_host}
        replies = await asyncio.gather(
            *(_op(c, "read", root, f"{folder}/probe.json") for c in readers.values())
        )
        for host, reply in zip(readers, replies):
            if not reply.exists or reply.content != token or reply.busy:
                seen = (
                    "no file"
                    if not reply.exists
                    else ("the temp file before the rename" if reply.busy else "other content")
                )
                raise PreflightError(
                    f"host {host} sees {seen} where host {writer_host} wrote {root}/{PROBE_DIR}/{folder}/probe.json: "
                    "artifact_root is not one shared filesystem there; mount it on every host or set "
                    "ClusterSpec.shared_artifact_root=False",
                    (host, writer_host),
                )
        await _op(writer, "lock", root, f"{folder}/probe.lock")
        try:
            replies = await asyncio.gather(
                *(_op(c, "trylock", root, f"{folder}/probe.lock") for c in readers.values())
            )
            for host, reply in zip(readers, replies):
                if not reply.busy:
                    raise PreflightError(
                        f"host {host} does not see the lock host {writer_host} holds on {root}: file locks do not "
                        "cross hosts on this filesystem; use a filesystem with working POSIX locks",
                        (host, writer_host),
                    )
        finally:
            await _op(writer, "unlock", root, f"{folder}/probe.lock")
    finally:
        try:
            await writer.call(FS_OP, FsOpRequest(op="cleanup", root=root, name=folder))
        except Exception:  # best effort: the probe folder is tiny
            pass
    return loop.time() - started


async def _check_local(client: AgentClient, root: str, folder: str) -> None:
    token = secrets.token_hex(8)
    await _op(client, "write", root, f"{folder}/probe.json", token)
    reply = await _op(client, "read", root, f"{folder}/probe.json")
    await client.call(FS_OP, FsOpRequest(op="cleanup", root=root, name=folder))
    if reply.content != token:
        raise PreflightError(
            f"host {client.host}: artifact_root {root} does not read back what was written",
            (client.host,),
        )


async def files_missing(client: AgentClient, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Which of these absolute file paths the client's host cannot read (relative ones count as
    missing), in the given order; sent in requests of at most `FILES_PER_CHECK` paths.

    Raises:
        AgentError: the agent did not answer one of them.
    """
    missing: list[str] = []
    for start in range(0, len(paths), FILES_PER_CHECK):
        request = FilesCheckRequest(paths=paths[start : start + FILES_PER_CHECK])
        missing += (await client.call(FILES_CHECK, request)).missing
    return tuple(missing)
