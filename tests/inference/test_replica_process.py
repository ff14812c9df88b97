"""Replica start failures with stand-in interpreters (no vLLM needed): early exit, timeout, bad path."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from art_mega.agent.ports import free_port
from art_mega.errors import ReplicaStartError
from art_mega.inference import ReplicaLaunch
from art_mega.inference.replica import start_replica
from tests.conftest import pid_alive
from tests.inference.common import replica_spec


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


async def test_early_exit_reports_code_and_log_tail(tmp_path: Path) -> None:
    python = _script(tmp_path / "python", 'echo "no vllm here: $*" >&2; exit 3')
    launch = ReplicaLaunch(
        model="/m", served_model_name="tiny", python=python, log_dir=str(tmp_path / "logs")
    )
    with pytest.raises(ReplicaStartError) as info:
        await start_replica(replica_spec(free_port()), launch)
    message = str(info.value)
    assert "replica vllm-0" in message and "exited with code 3 before it was healthy" in message
    assert "no vllm here: -m vllm.entrypoints.openai.api_server --model /m" in message
    assert str(tmp_path / "logs" / "vllm-0.log") in message


async def test_not_ready_in_time_is_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    python = _script(tmp_path / "python", f"echo $$ > {pid_file}; exec sleep 60")
    launch = ReplicaLaunch(
        model="/m", served_model_name="tiny", python=python, log_dir=str(tmp_path), ready_timeout_s=1.0
    )
    started = time.monotonic()
    with pytest.raises(ReplicaStartError, match="was not healthy after 1 s"):
        await start_replica(replica_spec(free_port()), launch)
    assert time.monotonic() - started < 10
    assert not pid_alive(int(pid_file.read_text()))


async def test_missing_interpreter(tmp_path: Path) -> None:
    launch = ReplicaLaunch(
        model="/m", served_model_name="tiny", python=str(tmp_path / "nope"), log_dir=str(tmp_path)
    )
    with pytest.raises(ReplicaStartError, match=r"cannot run .*nope.* \(InferenceSpec.python\)"):
        await start_replica(replica_spec(free_port()), launch)
