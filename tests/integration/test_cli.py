"""`art-mega` in a subprocess: the smoke passes, and every bad input is one sentence with exit 2."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, cli_env, run_cli

PROGRAMS = "tests/integration/programs"


def _one_sentence_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("art-mega: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_smoke_program_passes_through_art_mega_local():
    result = run_cli("local", "--program", "examples/multinode/program.py:main")
    assert result.returncode == 0, result.stderr
    assert "ART_MULTINODE_SMOKE_PASS hosts=1 answers=['yes', 'no', 'maybe']" in result.stdout


@pytest.mark.parametrize(
    "program,fragments",
    [
        ("missing/script.py:main", ["missing/script.py", "does not exist"]),
        ("examples/multinode/program.py:nope", ["has no function 'nope'"]),
        ("examples/multinode/program.py", ["has no ':'"]),
        (f"{PROGRAMS}/prog_sync_main.py:main", ["async def main"]),
        ("no_such_package.module:main", ["cannot be found"]),
    ],
)
def test_bad_program_references(program, fragments):
    _one_sentence_error(run_cli("local", "--program", program), *fragments)


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["local", "--port", "70000"], ["--port 70000"]),
        (["local", "--startup-timeout", "-1"], ["--startup-timeout"]),
        (["worker", "--address", "foo"], ["--address 'foo'", "tcp://"]),
        (["worker", "--address", "tcp://127.0.0.1:99999"], ["--address", "99999"]),
        (["controller", "--worker", "tcp://10.0.0.1"], ["--worker", "no port"]),
        (["worker", "--address", "tcp://127.0.0.1:0"], ["ART_MEGA_SECRET"]),
        (
            ["worker", "--address", "tcp://127.0.0.1:0", "--launch-id", "$(x);"],
            ["--launch-id", "letters, digits"],
        ),
    ],
)
def test_bad_cli_values(args, fragments):
    if args[0] in ("local", "controller"):
        args = [*args, "--program", "examples/multinode/program.py:main"]
    _one_sentence_error(run_cli(*args), *fragments)


def test_user_errors_inside_the_program(tmp_path):
    _one_sentence_error(run_cli("local", "--program", f"{PROGRAMS}/prog_lambda.py:main"), "lambda")
    _one_sentence_error(
        run_cli("local", "--program", f"{PROGRAMS}/prog_bad_topology.py:main"), "cpu_slots", "0"
    )
    env = cli_env()
    env["EDIT_ROLLOUT_DIR"] = str(tmp_path)
    result = run_cli("local", "--program", f"{PROGRAMS}/prog_edit_rollout.py:main", env=env)
    _one_sentence_error(result, "edited_module", "changed after the controller hashed it")
    assert "EDIT_NOT_REFUSED" not in result.stdout


def test_program_exception_exits_1_with_traceback():
    result = run_cli("local", "--program", f"{PROGRAMS}/prog_raise.py:main")
    assert result.returncode == 1
    assert "RuntimeError: program bug 42" in result.stderr
    assert "Traceback" in result.stderr


@pytest.mark.parametrize("command", ["local", "worker"])
def test_pre_existing_listener_is_refused(command):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        if command == "local":
            result = run_cli("local", "--port", str(port), "--program", "examples/multinode/program.py:main")
        else:
            env = cli_env()
            env["ART_MEGA_SECRET"] = "s" * 64
            result = run_cli("worker", "--address", f"tcp://127.0.0.1:{port}", env=env)
    _one_sentence_error(result, f"127.0.0.1:{port}", "refusing to reuse a pre-existing listener")


def test_controller_attaches_to_separately_started_workers():
    env = cli_env()
    env["ART_MEGA_SECRET"] = "t" * 64
    agents = []
    try:
        for _ in range(2):
            agents.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "art_mega",
                        "worker",
                        "--address",
                        "tcp://127.0.0.1:0",
                        "--launch-id",
                        "L1",
                    ],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        ports = []
        for agent in agents:
            line = agent.stdout.readline()
            assert line.startswith("ART_MEGA_READY ")
            ports.append(json.loads(line.split(" ", 1)[1])["port"])
        workers = [arg for p in ports for arg in ("--worker", f"tcp://127.0.0.1:{p}")]
        result = run_cli("controller", *workers, "--program", "examples/multinode/program.py:main", env=env)
        assert result.returncode == 0, result.stderr
        assert "ART_MULTINODE_SMOKE_PASS hosts=2" in result.stdout
        wrong = dict(env, ART_MEGA_SECRET="u" * 64)
        result = run_cli("controller", *workers, "--program", "examples/multinode/program.py:main", env=wrong)
        _one_sentence_error(result, "refused the launch secret", "ART_MEGA_SECRET")
        twice = ["--worker", f"tcp://127.0.0.1:{ports[0]}", "--worker", f"tcp://localhost:{ports[0]}"]
        result = run_cli("controller", *twice, "--program", "examples/multinode/program.py:main", env=env)
        _one_sentence_error(result, "is the same agent as", f"127.0.0.1:{ports[0]}")
    finally:
        for agent in agents:
            agent.terminate()
            agent.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(a.poll() is None for a in agents):
        time.sleep(0.05)
    assert all(a.returncode is not None for a in agents)
    assert os.environ.get("ART_MEGA_SECRET") is None
