"""The preflight probe's warm form: torch imported first, config read from stdin."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from art_mega.agent.ports import free_port
from art_mega.preflight.probe import (
    CONFIG_READ,
    RESULT_PREFIX,
    WARM_FLAG,
    check_config,
    main,
    probe_command,
)

pytest.importorskip("torch", reason="the probe runs in the trainer's environment (torch)")


def _warm_probe() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "art_mega.preflight.probe", WARM_FLAG],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def solo_config() -> dict:
    """A one-rank gloo collective on 127.0.0.1 as host "solo" (no bandwidth probe)."""
    return {
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


def test_warm_probe_runs_the_config_it_reads_from_stdin():
    config = solo_config()
    out, err = _warm_probe().communicate(json.dumps(config) + "\n", timeout=120)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, err[-2000:]
    # the agent tells a probe that took its rank from one that died before reading the config
    assert out.splitlines().index(CONFIG_READ) < out.splitlines().index(lines[0])
    result = json.loads(lines[0][len(RESULT_PREFIX) :])
    assert result["ok"] is True
    assert [(m["host"], m["rank"], m["warm"]) for m in result["members"]] == [("solo", 0, True)]


def test_warm_probe_exits_quietly_when_stdin_closes():
    probe = _warm_probe()
    out, _ = probe.communicate("", timeout=120)
    assert probe.returncode == 0
    assert RESULT_PREFIX not in out and CONFIG_READ not in out


def _result(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, out
    return json.loads(lines[0][len(RESULT_PREFIX) :])


def test_warm_probe_given_a_line_that_is_not_json_reports_it():
    probe = _warm_probe()
    out, err = probe.communicate('{"rank": 0, "world_size": \n', timeout=120)
    assert probe.returncode == 1
    assert "Traceback" not in err, err[-2000:]
    result = _result(out)
    assert result["ok"] is False and result["phase"] == "config"
    assert result["error"].startswith("preflight config is not JSON (Expecting value")
    assert CONFIG_READ not in out


GOOD = {
    "rank": 1,
    "world_size": 2,
    "host_id": "h1",
    "master_host": "10.0.0.1",
    "master_port": 12345,
    "timeout_s": 30.0,
    "backend": "gloo",
    "nccl_net": None,
    "bandwidth_bytes": 0,
    "log_dir": "/tmp",
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timeout_s": "soon"}, "field 'timeout_s' is 'soon', expected int or float"),
        ({"rank": "zero"}, "field 'rank' is 'zero', expected int"),
        ({"rank": True}, "field 'rank' is True, expected int"),
        ({"rank": 2}, "field 'rank' is 2, expected 0 <= rank < world_size=2"),
        ({"master_port": 70000}, "master_port=70000 and timeout_s=30.0 must be a TCP port"),
        ({"timeout_s": 0}, "master_port=12345 and timeout_s=0 must be a TCP port and a positive"),
        ({"backend": "mpi"}, "field 'backend' is 'mpi', expected 'gloo' or 'nccl'"),
        ({"nccl_net": 3}, "field 'nccl_net' is 3, expected str or null"),
        ({"host_id": None}, "field 'host_id' is None, expected str"),
    ],
)
def test_a_config_with_a_wrong_field_names_it(change, message, capsys):
    assert main([json.dumps({**GOOD, **change})]) == 1
    result = _result(capsys.readouterr().out)
    assert result["ok"] is False and result["phase"] == "config"
    assert message in result["error"], result["error"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([json.dumps({k: v for k, v in GOOD.items() if k != "master_port"})], "has no field 'master_port'"),
        (["[1, 2]"], "preflight config is list [1, 2], expected a JSON object"),
        ([], "usage: preflight_probe CONFIG_JSON | --stdin (got arguments [])"),
        ([WARM_FLAG, "extra"], "got arguments ['--stdin', 'extra']"),
    ],
)
def test_a_config_that_is_not_one_object_is_reported_not_raised(argv, message, capsys):
    assert main(argv) == 1
    result = _result(capsys.readouterr().out)
    assert result["ok"] is False and message in result["error"], result
    assert check_config(dict(GOOD)) == GOOD


def test_a_gloo_interface_this_host_lacks_fails_before_the_rendezvous():
    import os

    config = {**solo_config(), "world_size": 2}  # rank 1 never comes: the probe must not wait for it
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo,bad0"}
    probe = subprocess.run(
        [sys.executable, "-m", "art_mega.preflight.probe", json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    (line,) = [x for x in probe.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    result = json.loads(line[len(RESULT_PREFIX) :])
    assert probe.returncode == 1 and not result["ok"]
    assert result["error"].startswith(
        "RuntimeError: GLOO_SOCKET_IFNAME='lo,bad0' names 'bad0', which this host does not have (it has "
    )


def test_another_interpreter_gets_none_of_the_agents_environment():
    environ = {"PYTHONPATH": "/agent/site", "VIRTUAL_ENV": "/agent", "ART_MEGA_SECRET": "s", "HOME": "/root"}
    argv, env = probe_command("/opt/vllm/bin/python", ["CONFIG"], environ)
    assert argv[0] == "/opt/vllm/bin/python" and argv[1] == "-c" and argv[-1] == "CONFIG"
    assert argv[-2].endswith("/art_mega")  # the package folder the bootstrap loads, nothing else
    assert env == {"HOME": "/root"}
    own_argv, own_env = probe_command(sys.executable, ["CONFIG"], environ)
    assert own_argv == [sys.executable, "-m", "art_mega.preflight.probe", "CONFIG"]
    assert "ART_MEGA_SECRET" not in own_env and own_env["PYTHONPATH"] == "/agent/site"
