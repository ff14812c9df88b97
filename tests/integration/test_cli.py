"""`art-mega` in a subprocess: the smoke passes, and every bad input is one sentence with exit 2."""

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from art_mega.readahead import parse_line
from tests.conftest import REPO, cli_env, run_cli, wait_gone

PROGRAMS = "tests/integration/programs"


def _one_sentence_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("art-mega: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_smoke_program_passes_through_art_mega_local(tmp_path):
    env = {**cli_env(), "ART_MEGA_CACHE": str(tmp_path / "cache")}
    result = run_cli("local", "--program", "examples/multinode/program.py:main", env=env)
    assert result.returncode == 0, result.stderr
    assert "ART_MULTINODE_SMOKE_PASS hosts=1 answers=['yes', 'no', 'maybe']" in result.stdout
    # the controller listed what it read, for its next start to read ahead (art_mega.readahead)
    (listing,) = (tmp_path / "cache" / "read-ahead").glob("controller-*.files")
    named = [parse_line(line)[0] for line in listing.read_text().splitlines()]
    assert str(REPO / "examples" / "multinode" / "program.py") in named
    assert any(p.endswith(os.path.join("art_mega", "launch", "cli.py")) for p in named)
    # and so did the agent, when the controller asked it to shut down
    (agent,) = (tmp_path / "cache" / "read-ahead").glob("agent-*.files")
    named = [parse_line(line)[0] for line in agent.read_text().splitlines()]
    assert any(p.endswith(os.path.join("art_mega", "agent", "app.py")) for p in named)
    assert str(REPO / "examples" / "multinode" / "program.py") not in named


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


@pytest.mark.parametrize(
    "source,fragments",
    [
        (
            "import os\nimport no_such_package_xyz\n",
            [
                "importing prog_import_err failed at",
                "prog_import_err.py:2",
                "'no_such_package_xyz'",
                "install it",
            ],
        ),
        (
            "from prog_import_helper import x\n",
            ["importing prog_import_err failed at", "prog_import_helper.py:1", "'no_such_package_xyz'"],
        ),
        (
            "raise RuntimeError('config file\\nmissing')\n",
            ["importing prog_import_err raised RuntimeError: config file missing at", "prog_import_err.py:1"],
        ),
        ("from os import no_such_name\n", ["raised ImportError: cannot import name 'no_such_name'"]),
    ],
)
def test_program_that_fails_at_import_is_one_sentence(tmp_path, source, fragments):
    (tmp_path / "prog_import_helper.py").write_text("import no_such_package_xyz.sub\nx = 1\n")
    script = tmp_path / "prog_import_err.py"
    script.write_text(source + "\n\nasync def main(launch):\n    pass\n")
    _one_sentence_error(run_cli("local", "--program", f"{script}:main"), f"{script}:main", *fragments)


def test_program_import_failure_with_debug_shows_the_traceback(tmp_path):
    script = tmp_path / "prog_import_err.py"
    script.write_text("import no_such_package_xyz\n")
    result = run_cli("local", "--debug", "--program", f"{script}:main")
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert "ModuleNotFoundError: No module named 'no_such_package_xyz'" in result.stderr


NUMBER_CASES = [
    ("--startup-timeout", "inf", "'inf' is not a number of seconds"),
    ("--startup-timeout", "nan", "'nan' is not a number of seconds"),
    ("--startup-timeout", "-1", "'-1' is not a number of seconds"),
    ("--startup-timeout", "0", "'0' is outside 0 < seconds <= 86400"),
    ("--startup-timeout", "1e9", "'1e9' is outside 0 < seconds <= 86400"),
    ("--startup-timeout", "\u0663", "'\u0663' is not a number of seconds written in ASCII digits"),
    ("--port", "abc", "'abc' is not an integer written in ASCII digits"),
    ("--port", "\u0663", "'\u0663' is not an integer written in ASCII digits"),
    ("--port", "2\u00b2", "'2\u00b2' is not an integer"),
]


@pytest.mark.parametrize(
    "command,option,value,reason",
    [
        *(("local", *case) for case in NUMBER_CASES),
        # ssh and skypilot share the option types: one case each proves they use them
        ("ssh", "--startup-timeout", "inf", "'inf' is not a number of seconds"),
        ("skypilot", "--port", "\u0663", "'\u0663' is not an integer written in ASCII digits"),
    ],
)
def test_numeric_options_take_finite_ascii_numbers(command, option, value, reason):
    extra = ["--host", "127.0.0.1"] if command == "ssh" else []
    result = run_cli(command, *extra, option, value, "--program", "examples/multinode/program.py:main")
    _one_sentence_error(
        result,
        f"art-mega: error: {command}: Invalid value for '{option}': {reason}",
        f"see 'art-mega {command} --help'",
    )


@pytest.mark.parametrize(
    "ssh_arg,fragment",
    [
        ("-p \u00b2", "--ssh-arg -p '\u00b2' is not a port (1..65535)"),
        ("-p \u0663", "--ssh-arg -p '\u0663' is not a port"),
        (
            "-o Port=\u0663",
            "ssh config for 127.0.0.1: Port '\u0663' is not a port (1..65535 in ASCII digits)",
        ),
        ("-o ConnectTimeout=inf", "ConnectTimeout 'inf' is not a positive whole number of seconds"),
        ("-o ConnectTimeout=0", "ConnectTimeout '0' is not a positive whole number of seconds"),
    ],
)
def test_numeric_ssh_args_take_ascii_digits(ssh_arg, fragment):
    result = run_cli(
        "ssh", "--host", "127.0.0.1", "--ssh-arg", ssh_arg, "--program", "examples/multinode/program.py:main"
    )
    _one_sentence_error(result, fragment)


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["local", "--bogus"], ["art-mega: error: local: No such option: --bogus", "see 'art-mega local --help'"]),
        (["local"], ["art-mega: error: local: Missing option '--program'"]),
        (["launch"], ["art-mega: error: No such command 'launch'; see 'art-mega --help'"]),
        (["lcal"], ["art-mega: error: No such command 'lcal' (did you mean local?); see 'art-mega --help'"]),
        (["local", "--programm", "x.py:main"], ["local: No such option: --programm (did you mean --program?)"]),
        (["--versio"], ["art-mega: error: No such option: --versio (did you mean --version?)"]),
        (["ssh", "--program", "x.py:main"], ["Missing option '--host'"]),
    ],
)
def test_usage_errors_are_one_line_not_a_box(args, fragments):
    _one_sentence_error(run_cli(*args), *fragments)


def test_help_still_works():
    result = run_cli("local", "--help")
    assert result.returncode == 0 and "--startup-timeout" in result.stdout
    short = run_cli("local", "-h")
    assert short.returncode == 0 and short.stdout == result.stdout


def test_version():
    from art_mega import __version__

    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout == f"art-mega {__version__}\n"


def test_unicode_digit_skypilot_rank_is_refused():
    env = cli_env()
    env.update(
        SKYPILOT_NODE_RANK="\u00b2",
        SKYPILOT_NODE_IPS="10.0.0.1,10.0.0.2,10.0.0.3",
        SKYPILOT_NUM_NODES="3",
        ART_MEGA_SECRET="s" * 64,
    )
    result = run_cli("skypilot", "--program", "examples/multinode/program.py:main", env=env)
    _one_sentence_error(result, "SKYPILOT_NODE_RANK='\u00b2' is not a non-negative integer in ASCII digits")


def test_bad_launch_id_from_the_environment_is_refused():
    env = cli_env()
    env.update(ART_MEGA_SECRET="s" * 64, ART_MEGA_LAUNCH_ID="a b")
    result = run_cli("worker", "--address", "tcp://127.0.0.1:0", env=env)
    _one_sentence_error(result, "ART_MEGA_LAUNCH_ID 'a b' must be 1-64 characters")


@pytest.mark.parametrize(
    "first,advertised,how",
    [
        ("node-a=127.0.1.1", "127.0.1.1", "a loopback address (Debian's /etc/hosts"),
        ("node-a=127.0.257", "127.0.1.1", "the loopback address 127.0.257 resolves to here"),
        ("node-a=localhost", "127.0.0.1", "the loopback address localhost resolves to here"),
    ],
)
def test_multi_host_ssh_launch_with_a_loopback_worker_host_is_refused_before_ssh(first, advertised, how):
    with socket.socket() as sshd:  # stands in for the SSH server: nothing may connect to it
        sshd.bind(("127.0.0.1", 0))
        sshd.listen()
        sshd.setblocking(False)
        port = sshd.getsockname()[1]
        result = run_cli(
            "ssh",
            "--host",
            first,
            "--host",
            "node-b=10.0.0.2",
            "--ssh-arg",
            f"-o HostName=127.0.0.1 -p {port}",
            "--program",
            "examples/multinode/program.py:main",
        )
        with pytest.raises(BlockingIOError):
            sshd.accept()
    _one_sentence_error(
        result,
        f"--host '{first}' would advertise its agent at {advertised}, {how}",
        "other hosts of this 2-host launch cannot reach",
        "--host node-a=ADDRESS",
    )


def test_loopback_agent_is_refused_only_when_started_over_ssh_from_elsewhere():
    env = cli_env()
    env.update(SSH_CONNECTION="10.0.0.1 50000 10.0.0.2 22", ART_MEGA_SECRET="s" * 64)
    over_ssh = subprocess.run(
        [sys.executable, "-m", "art_mega", "worker", "--address", "tcp://127.0.0.1:0"]
        + ["--secret-stdin", "--exit-on-stdin-eof"],
        input="s" * 64 + "\n",
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    _one_sentence_error(
        over_ssh,
        "this agent would listen on 127.0.0.1",
        "the controller at 10.0.0.1",
        "--host SSH_TARGET=10.0.0.2",
    )
    # An agent started from a user's SSH login (art-mega local there) only inherits SSH_CONNECTION.
    agent = subprocess.Popen(
        [sys.executable, "-m", "art_mega", "worker", "--address", "tcp://127.0.0.1:0"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout.readline().startswith("ART_MEGA_READY ")
    finally:
        agent.terminate()
        agent.wait(10)


def test_attached_controller_with_a_loopback_worker_among_others_is_refused():
    env = cli_env()
    env["ART_MEGA_SECRET"] = "t" * 64
    workers = ["--worker", "tcp://127.0.0.1:9", "--worker", "tcp://10.0.0.2:9"]
    result = run_cli("controller", *workers, "--program", "examples/multinode/program.py:main", env=env)
    _one_sentence_error(result, "--worker 'tcp://127.0.0.1:9' would advertise its agent at 127.0.0.1")


def _processes_with(marker: str) -> list[int]:
    """Pids whose environment holds `marker` (every process the CLI started inherits it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize(
    "value,fragments",
    [
        (
            "^lo,docker",
            ["uses '^', NCCL_SOCKET_IFNAME's syntax, which gloo does not take", "GLOO_SOCKET_IFNAME=eth0"],
        ),
        ("nosuch0", ["names interface 'nosuch0', which this host does not have (it has ", "lo"]),
    ],
)
def test_gloo_interface_that_cannot_work_is_refused_before_any_rank_starts(value, fragments):
    marker = f"ART_MEGA_TEST_MARK={uuid.uuid4().hex}"
    env = cli_env()
    env["GLOO_SOCKET_IFNAME"] = value
    env.update([marker.split("=", 1)])
    result = run_cli("local", "--program", "examples/multinode/program.py:main", env=env)
    assert wait_gone(_processes_with(marker), 5) == []
    _one_sentence_error(result, f"host host0: GLOO_SOCKET_IFNAME={value!r} ", *fragments)
    assert "ART_MULTINODE_SMOKE_PASS" not in result.stdout


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
