"""`backend.in_lowered_thread`: the first step's tokenizer loads in a thread `nice` steps below
the controller, which keeps its own priority; results and exceptions come back to the caller."""

import asyncio
import os
import sys
import threading

import pytest

from art_mega.backend import in_lowered_thread

pytestmark = pytest.mark.asyncio


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
async def test_the_thread_runs_lower_and_the_caller_keeps_its_priority():
    before = _own_nice()
    assert await in_lowered_thread(_own_nice, nice=7) == min(before + 7, 19)
    assert _own_nice() == before


async def test_results_and_exceptions_come_back():
    assert await in_lowered_thread(sum, [1, 2, 3], nice=1) == 6

    def fails() -> None:
        raise ValueError("bad tokenizer folder")

    with pytest.raises(ValueError, match="bad tokenizer folder"):
        await in_lowered_thread(fails, nice=1)

    def stops() -> None:
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration"):  # a Future cannot carry it
        await asyncio.wait_for(in_lowered_thread(stops, nice=1), timeout=10)


async def test_a_cancelled_wait_leaves_the_thread_to_finish():
    release, finished = threading.Event(), threading.Event()

    def slow() -> int:
        release.wait(10)
        finished.set()
        return 1

    waiting = asyncio.ensure_future(in_lowered_thread(slow, nice=1))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    release.set()
    assert await asyncio.to_thread(finished.wait, 10)
    await asyncio.sleep(0.05)  # its result reaches a future nobody waits for: no error
