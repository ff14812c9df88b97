"""Child-process supervision for the agent: own process group, parent-death signal, bounded stop.

Every child runs in its own process group with PR_SET_PDEATHSIG set, so the agent's death takes
its children with it; `stop` sends SIGTERM to the group, then SIGKILL after a bound.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from art_mega.runtime.protocol import ChildStatus

PR_SET_PDEATHSIG = 1
DEFAULT_STOP_GRACE_S = 5.0


def set_parent_death_signal(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """Ask Linux to send `sig` to this process when its parent thread exits (no-op elsewhere).

    If `parent_pid` is given and the parent is already gone, exit at once: the signal would
    never come.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _child_preexec(parent_pid: int, sig: int) -> None:
    set_parent_death_signal(sig, parent_pid)


@dataclass
class Child:
    """A running (or finished) child process."""

    child_id: str
    role: str
    process: asyncio.subprocess.Process
    log_path: str | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.process.pid

    def status(self) -> ChildStatus:
        return ChildStatus(
            child_id=self.child_id,
            role=self.role,
            pid=self.pid,
            returncode=self.process.returncode,
            log_path=self.log_path,
        )


async def spawn_child(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    stdin: int | None = asyncio.subprocess.DEVNULL,
    stdout: int | None = None,
    stderr: int | None = None,
    pass_fds: Sequence[int] = (),
    death_signal: int = signal.SIGKILL,
) -> asyncio.subprocess.Process:
    """Start `argv` in a new session (own process group) with a parent-death signal set."""
    parent = os.getpid()
    return await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        preexec_fn=lambda: _child_preexec(parent, death_signal),
    )


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


async def stop_process(process: asyncio.subprocess.Process, grace_s: float = DEFAULT_STOP_GRACE_S) -> int:
    """SIGTERM the process group, wait up to `grace_s` seconds, then SIGKILL it; return the code.

    The group is signalled even when the leader already exited, so grandchildren go too.
    """
    _signal_group(process.pid, signal.SIGTERM)
    if process.returncode is None:
        try:
            await asyncio.wait_for(process.wait(), timeout=grace_s)
        except TimeoutError:
            pass
    _signal_group(process.pid, signal.SIGKILL)
    return await process.wait()


class Supervisor:
    """The set of children one agent owns."""

    def __init__(self) -> None:
        self._children: dict[str, Child] = {}

    def add(self, child: Child) -> None:
        self._children[child.child_id] = child

    def get(self, child_id: str) -> Child | None:
        return self._children.get(child_id)

    def children(self) -> list[Child]:
        return list(self._children.values())

    def statuses(self) -> tuple[ChildStatus, ...]:
        return tuple(c.status() for c in self._children.values())

    async def stop(
        self, child_ids: Sequence[str] | None = None, grace_s: float = DEFAULT_STOP_GRACE_S
    ) -> tuple[ChildStatus, ...]:
        """Stop the named children (all when None) concurrently and forget them."""
        ids = list(self._children) if child_ids is None else [c for c in child_ids if c in self._children]
        chosen = [self._children[c] for c in ids]
        await asyncio.gather(*(stop_process(c.process, grace_s) for c in chosen))
        for c in chosen:
            self._children.pop(c.child_id, None)
        return tuple(c.status() for c in chosen)
