"""Child-process supervision for the agent: own process group, parent-death signal, bounded stop.

Every child runs in its own process group with PR_SET_PDEATHSIG set, so the agent's death takes
its children with it; `stop` sends SIGTERM to the group, then SIGKILL after a bound. Descendants
that left the group (a rollout that starts a sandbox with `start_new_session=True`) are found by
walking /proc parent links before the stop and signalled too.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from art_mega.agent.protocol import ChildStatus

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


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of `pid` from /proc, or None if gone.

    Fields 4 and 22 of proc(5) `/proc/PID/stat`; the command name (field 2) may hold spaces or
    parentheses, so fields are counted after its closing parenthesis.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """Every living descendant of `pid` as (pid, start time), found through /proc parent links.

    The start time lets a later signal skip a pid that the kernel reused. Empty off Linux.
    """
    parents: dict[int, list[tuple[int, int]]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is not None:
            parents.setdefault(stat[0], []).append((int(entry), stat[1]))
    found: list[tuple[int, int]] = []
    frontier = [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found.extend(children)
        frontier.extend(child for child, _ in children)
    return found


def _signal_descendants(procs: list[tuple[int, int]], sig: int) -> None:
    for pid, started in procs:
        stat = _proc_stat(pid)
        if stat is None or stat[1] != started:
            continue  # exited, or the pid now names another process
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


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

    The group is signalled even when the leader already exited, so grandchildren go too;
    descendants in other process groups or sessions (snapshotted before the SIGTERM, while their
    parent links still lead to the child) get the same two signals.
    """
    escaped = descendants(process.pid) if process.returncode is None else []
    _signal_group(process.pid, signal.SIGTERM)
    _signal_descendants(escaped, signal.SIGTERM)
    if process.returncode is None:
        try:
            await asyncio.wait_for(process.wait(), timeout=grace_s)
        except TimeoutError:
            pass
    _signal_group(process.pid, signal.SIGKILL)
    _signal_descendants(escaped, signal.SIGKILL)
    return await process.wait()


class Supervisor:
    """The set of children one agent owns, and what its services stop when the agent closes.

    `launch_id` names the launch these children serve (a service puts it in the names of the
    scratch folders it makes, e.g. etcd's data dir).
    """

    def __init__(self, launch_id: str) -> None:
        self.launch_id = launch_id
        self._children: dict[str, Child] = {}
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._closed = False
        self._late: set[asyncio.Future] = set()  # stops of children added after close returned

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run `closer()` at every `close`, before the children are stopped (in the order the
        closers were added): a service stops there what it owns beyond its children (sockets,
        file locks, etcd and its data dir). A closer may run more than once."""
        self._closers.append(closer)

    async def close(self) -> tuple[ChildStatus, ...]:
        """The agent closes: run every closer, then stop every child, until none is left (a start
        under way when the close began adds its child while the others stop, and that one is
        stopped too); the children stopped. A child added after a close returned is stopped at
        once (`add`)."""
        for closer in self._closers:
            await closer()
        stopped: list[ChildStatus] = []
        while self._children:
            stopped.extend(await self.stop(None))
        self._closed = True
        return tuple(stopped)

    def add(self, child: Child) -> None:
        """Supervise `child`. After `close` returned, the agent keeps no children: the child is
        recorded and stopped (SIGTERM, then SIGKILL after the default grace) in the background."""
        self._children[child.child_id] = child
        if self._closed:
            task = asyncio.ensure_future(self.stop([child.child_id]))
            self._late.add(task)
            task.add_done_callback(self._late_done)

    def _late_done(self, task: asyncio.Future) -> None:
        self._late.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logging.getLogger(__name__).warning(
                "stopping a child added after the agent closed failed: %r", task.exception()
            )

    def get(self, child_id: str) -> Child | None:
        return self._children.get(child_id)

    def children(self) -> list[Child]:
        return list(self._children.values())

    def statuses(self) -> tuple[ChildStatus, ...]:
        return tuple(c.status() for c in self._children.values())

    async def stop(
        self, child_ids: Sequence[str] | None = None, grace_s: float = DEFAULT_STOP_GRACE_S
    ) -> tuple[ChildStatus, ...]:
        """Stop the named children (all when None) concurrently and forget them. A child added
        under the same name while they stop (a restart once the old process has exited) is
        another child: it stays, and runs."""
        ids = list(self._children) if child_ids is None else [c for c in child_ids if c in self._children]
        chosen = [self._children[c] for c in ids]
        await asyncio.gather(*(stop_process(c.process, grace_s) for c in chosen))
        for c in chosen:
            if self._children.get(c.child_id) is c:
                del self._children[c.child_id]
        return tuple(c.status() for c in chosen)
