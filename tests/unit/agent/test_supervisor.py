"""The supervisor stops a child's whole tree, including descendants that left its session."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from art_mega.agent.supervisor import descendants, spawn_child, stop_process

# A child that starts a grandchild in a new session (the way a sandbox is often started), prints
# the grandchild's pid, then ignores SIGTERM so that only the SIGKILL stage ends it.
CHILD = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print(grandchild.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_process_kills_a_grandchild_in_another_session() -> None:
    async def scenario() -> tuple[int, list[int], int]:
        child = await spawn_child([sys.executable, "-c", CHILD], stdout=asyncio.subprocess.PIPE)
        assert child.stdout is not None
        grandchild = int((await asyncio.wait_for(child.stdout.readline(), 30)).decode())
        tree = [pid for pid, _ in descendants(child.pid)]
        assert os.getsid(grandchild) != os.getsid(child.pid)  # outside the group stop_process signals
        code = await stop_process(child, grace_s=0.5)
        return grandchild, tree, code

    grandchild, tree, code = asyncio.run(scenario())
    assert tree == [grandchild]
    assert code == -signal.SIGKILL  # SIGTERM was ignored: the bounded stop escalated
    for _ in range(100):  # the grandchild is re-parented to init, which reaps it
        if not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_descendants_of_a_leaf_process_is_empty() -> None:
    import subprocess

    leaf = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert (leaf.pid, descendants(leaf.pid)) == (leaf.pid, [])
        assert leaf.pid in [pid for pid, _ in descendants(os.getpid())]
    finally:
        leaf.kill()
        leaf.wait()


def test_a_child_added_under_the_same_name_during_a_stop_stays() -> None:
    """A restart of a name whose old process is being stopped (its grace running) registers a new
    child; the stop forgets only the child it stopped, so the new one stays supervised."""
    from art_mega.agent.supervisor import Child, Supervisor

    async def scenario() -> tuple[bool, int | None]:
        supervisor = Supervisor("launch")
        stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(300)"
        old = await spawn_child([sys.executable, "-c", stubborn], stdout=asyncio.subprocess.PIPE)
        await asyncio.wait_for(old.stdout.readline(), 30)  # SIGTERM is ignored from here on
        supervisor.add(Child(child_id="r", role="inference", process=old))
        stopping = asyncio.ensure_future(supervisor.stop(["r"], grace_s=1.0))
        await asyncio.sleep(0.2)  # the stop waits out its grace
        new = await spawn_child([sys.executable, "-c", "import time; time.sleep(300)"])
        supervisor.add(Child(child_id="r", role="inference", process=new))
        await stopping
        kept = supervisor.get("r")
        try:
            return kept is not None and kept.process is new, new.returncode
        finally:
            await supervisor.stop()

    kept_new, returncode = asyncio.run(scenario())
    assert kept_new and returncode is None


def test_close_stops_a_child_added_while_it_runs_and_one_added_after() -> None:
    """A start that was under way when the agent began to close adds its child while the other
    children stop: close returns only once that one is stopped too; one added after close
    returned is stopped in the background."""
    from art_mega.agent.supervisor import Child, Supervisor

    async def scenario() -> tuple[list[str], int | None, int | None]:
        supervisor = Supervisor("launch")
        stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(300)"
        old = await spawn_child([sys.executable, "-c", stubborn], stdout=asyncio.subprocess.PIPE)
        await asyncio.wait_for(old.stdout.readline(), 30)  # SIGTERM is ignored from here on
        supervisor.add(Child(child_id="rank", role="trainer", process=old))
        closing = asyncio.ensure_future(supervisor.close())
        await asyncio.sleep(0.5)  # the stop waits out its grace (5 s)
        assert not closing.done()
        during = await spawn_child([sys.executable, "-c", "import time; time.sleep(300)"])
        supervisor.add(Child(child_id="vllm-0", role="inference", process=during))
        stopped = await asyncio.wait_for(closing, 60)
        after = await spawn_child([sys.executable, "-c", "import time; time.sleep(300)"])
        supervisor.add(Child(child_id="late", role="inference", process=after))
        await asyncio.wait_for(after.wait(), 30)
        return [c.child_id for c in stopped], during.returncode, after.returncode

    stopped, during, after = asyncio.run(scenario())
    assert stopped == ["rank", "vllm-0"]
    assert during is not None and after is not None  # neither outlived the agent's close
