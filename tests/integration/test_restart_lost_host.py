"""`art-mega ssh --max-restarts 1` on two namespace hosts: the main job's GRPO program (tiny Llama,
one vLLM replica, a trainer rank per host) loses host h1's link during a train step; the launcher
stops every host, waits for h1, proves the cluster again and reruns the program, which resumes
from LATEST and completes every step, with the restart in the run's history."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO, cli_env

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")
STEPS = 2


def _pump(stream, lines: list[str]) -> threading.Thread:
    def read() -> None:
        for line in stream:
            lines.append(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _wait_for(lines: list[str], fragment: str, timeout_s: float, process: subprocess.Popen) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(fragment in line for line in list(lines)):
            return time.monotonic()
        assert process.poll() is None, "".join(lines)[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no {fragment!r} after {timeout_s} s:\n{''.join(lines)[-3000:]}")


def test_link_cut_during_train_step_restarts_and_completes(netns_cluster, tmp_path):
    from art_mega.backend import default_vllm_python
    from art_mega.errors import UserError

    try:
        vllm_python = default_vllm_python()
    except UserError as exc:
        pytest.skip(str(exc))
    cluster = netns_cluster(2)
    env = cli_env()
    env.update(
        ART_MEGA_STEPS=str(STEPS),
        ART_MEGA_GROUP_SIZE="4",
        ART_MEGA_BASE_MODEL="tiny-llama",
        ART_MEGA_VLLM_PYTHON=vllm_python,
        ART_MEGA_CACHE=str(tmp_path / "cache"),
    )
    argv = [sys.executable, "-m", "art_mega", "ssh", "--program", f"{REPO}/examples/multinode/train.py:main"]
    argv += ["--port", "22710", "--max-restarts", "1", "--controller-lease", "5", "--startup-timeout", "120"]
    for host in cluster.hosts:
        argv += ["--host", host.ssh_alias]
    argv.append(f"--ssh-arg=-F {cluster.ssh_config}")
    process = cluster.hosts[0].exec(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    pump = _pump(process.stdout, lines)
    run = tmp_path / ".art" / "art-mega-quickstart" / "models" / "yes-no"
    try:
        # step 1's rollouts are in: the controller now sends the train job to both ranks
        _wait_for(lines, "step 1: ", 600, process)
        assert (run / "checkpoints" / "LATEST").read_text().strip() == "1"
        cut = time.monotonic()
        cluster.hosts[1].set_link(False)
        restarted = _wait_for(lines, "restart 1/1: host ", 60, process)
        cluster.hosts[1].set_link(True)
        process.wait(timeout=900)
        print(
            f"restart reported {restarted - cut:.1f} s after the cut; run done {time.monotonic() - cut:.1f} s after it"
        )
    finally:
        if process.poll() is None:
            process.kill()
        pump.join(timeout=5)
    out = "".join(lines)
    print(next(line for line in lines if "restart 1/1: host " in line).strip())
    assert process.returncode == 0, out[-4000:]
    assert "ART_MEGA_TRAIN_DONE" in out, out[-4000:]
    assert out.count("restart 1/1: host ") == 1
    assert (run / "checkpoints" / "LATEST").read_text().strip() == str(STEPS)
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    restarts = [r for r in rows if "launch/restart" in r]
    assert len(restarts) == 1 and restarts[0]["launch/restart"] == 1, restarts
    assert "was lost" in restarts[0]["launch/restart_cause"]
    resumed_at = restarts[0]["step"]
    assert resumed_at >= 1  # step 0 was committed before the cut and is not trained again
    train_steps = sorted(r["step"] for r in rows if any(k.startswith("train/") for k in r))
    assert set(train_steps) >= set(range(STEPS)), train_steps  # every step trained and logged
    committed = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert [int(c) for c in committed][-1] == STEPS and 1 <= resumed_at
