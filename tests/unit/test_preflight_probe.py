"""The preflight probe's warm form: torch imported first, config read from stdin."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from art_mega.runtime.ports import free_port
from art_mega.runtime.preflight_probe import RESULT_PREFIX, WARM_FLAG

pytest.importorskip("torch", reason="the probe runs in the trainer's environment (torch)")


def _warm_probe() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "art_mega.runtime.preflight_probe", WARM_FLAG],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_warm_probe_runs_the_config_it_reads_from_stdin():
    config = {
        "rank": 0,
        "world_size": 1,
        "host_id": "solo",
        "master_host": "127.0.0.1",
        "master_port": free_port(),
        "backend": "gloo",
        "timeout_s": 30,
        "bandwidth_bytes": 0,
        "log_dir": "/tmp",
    }
    out, err = _warm_probe().communicate(json.dumps(config) + "\n", timeout=120)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, err[-2000:]
    result = json.loads(lines[0][len(RESULT_PREFIX) :])
    assert result["ok"] is True
    assert [(m["host"], m["rank"], m["warm"]) for m in result["members"]] == [("solo", 0, True)]


def test_warm_probe_exits_quietly_when_stdin_closes():
    probe = _warm_probe()
    out, _ = probe.communicate("", timeout=120)
    assert probe.returncode == 0
    assert RESULT_PREFIX not in out
