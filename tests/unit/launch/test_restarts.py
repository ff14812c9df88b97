"""`--max-restarts`: the restart loop's decisions and the history rows it leaves."""

from __future__ import annotations

import asyncio

import pytest

from art_mega import metrics
from art_mega.errors import HostLostError
from art_mega.launch.controller import run_with_restarts


@pytest.fixture(autouse=True)
def _fresh_restarts():
    metrics.LAUNCH_RESTARTS.clear()
    metrics._RECORDED.clear()
    yield
    metrics.LAUNCH_RESTARTS.clear()
    metrics._RECORDED.clear()


def _attempts(outcomes):
    calls = []

    async def attempt(number):
        calls.append(number)
        return outcomes[number]

    return attempt, calls


def test_lost_host_restarts_until_success(capsys):
    lost = HostLostError("host1", "tcp://10.0.0.2:22222", "no heartbeat answer for 4.1 s")
    attempt, calls = _attempts([(1, lost), (0, None)])
    assert asyncio.run(run_with_restarts(attempt, 2)) == 0
    assert calls == [0, 1]
    assert metrics.LAUNCH_RESTARTS == [
        {
            "restart": 1,
            "max_restarts": 2,
            "cause": "host host1 (tcp://10.0.0.2:22222) was lost: no heartbeat answer for 4.1 s",
        }
    ]
    assert "art-mega: restart 1/2: host host1" in capsys.readouterr().err


def test_restarts_spent_or_other_failure_end_the_run(capsys):
    lost = HostLostError("host1", "tcp://10.0.0.2:22222", "its SSH session ended")
    attempt, calls = _attempts([(1, lost), (1, lost), (0, None)])
    assert asyncio.run(run_with_restarts(attempt, 1)) == 1
    assert calls == [0, 1]
    assert "no restart left (--max-restarts 1)" in capsys.readouterr().err
    attempt, calls = _attempts([(1, None), (0, None)])  # the program's own failure: no restart
    assert asyncio.run(run_with_restarts(attempt, 3)) == 1 and calls == [0]
    attempt, calls = _attempts([(1, lost)])
    assert asyncio.run(run_with_restarts(attempt, 0)) == 1 and calls == [0]


def test_restart_rows_in_history_once_per_run(tmp_path):
    metrics.LAUNCH_RESTARTS.append({"restart": 1, "max_restarts": 1, "cause": "host h1 was lost"})
    metrics.record_restarts(tmp_path, 2)
    metrics.record_restarts(tmp_path, 2)  # a second model.register of the same run
    rows = metrics.read_history(tmp_path / "history.jsonl")
    assert len(rows) == 1
    assert rows[0]["step"] == 2 and rows[0]["launch/restart"] == 1
    assert rows[0]["launch/restart_cause"] == "host h1 was lost"
