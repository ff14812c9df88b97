"""The one exit-code table, `art_mega.errors.EXIT_CODES`: every exception class in errors.py has
its row, and the CLI (`cli._guarded`) and the controller (`controller.describe_failure`) report
each exception the same way (code, sentence or traceback). A few go through the real CLI."""

from __future__ import annotations

import ast
import inspect
import re
import socket
from pathlib import Path

import pytest
import typer
from pydantic import BaseModel, ConfigDict, ValidationError

from art_mega import errors
from art_mega.errors import EXIT_CODES, Exit
from art_mega.launch import cli, controller
from art_mega.rollouts.protocol import RemoteFailure
from tests.conftest import cli_env, run_cli

CLASSES = sorted(
    (
        c
        for c in vars(errors).values()
        if inspect.isclass(c) and issubclass(c, BaseException) and c.__module__ == errors.__name__
    ),
    key=lambda c: c.__name__,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")
    port: int


def _validation_error() -> ValidationError:
    try:
        _Model.model_validate({"port": "abc"})
    except ValidationError as exc:
        return exc
    raise AssertionError("the model took 'abc' as a port")


_HTTP = errors.ReplicaHTTPError("vllm-0", "http://127.0.0.1:9", "loading adapter tiny@1", 500, "boom")
SAMPLES: dict[type[BaseException], BaseException] = {
    ValidationError: _validation_error(),
    RuntimeError: RuntimeError("a bug 42"),  # not art-mega's: a bug, reported with its traceback
    errors.HostLostError: errors.HostLostError(
        "host1", "tcp://10.0.0.2:22222", "no heartbeat answer for 4 s"
    ),
    errors.AgentStartError: errors.AgentStartError("host0", "tcp://127.0.0.1:7", "agent not ready after 2 s"),
    errors.AgentUnreachableError: errors.AgentUnreachableError(
        "host1", "tcp://10.0.0.2:1", "connection refused"
    ),
    errors.TrainerJobError: errors.TrainerJobError(
        "trainer rank 0 died", rank=0, host="host0", log_path="/l"
    ),
    errors.RankRefusedStepError: errors.RankRefusedStepError(
        "training step 3 was aborted", "NonFiniteStepError", 0, "host0", "/l", True
    ),
    errors.RemoteRolloutError: errors.RemoteRolloutError(
        "host1",
        "w0",
        RemoteFailure(kind="error", message="ValueError: x", exc_type="ValueError", traceback="tb"),
    ),
    errors.ReplicaHTTPError: _HTTP,
    errors.ReplicaRequestError: errors.ReplicaRequestError(
        "vllm-0", "http://127.0.0.1:9", "tiny@2", ConnectionResetError("reset")
    ),
    errors.NoReplicaUpError: errors.NoReplicaUpError("tiny", "vllm-0 (http://127.0.0.1:9): exited 1"),
    errors.ReplicaSleepError: errors.ReplicaSleepError("sleeping failed", [_HTTP]),
    errors.ReplicaStartError: errors.ReplicaStartError("replica vllm-0: cannot run 'x'", "vllm-0"),
    errors.AdapterPublishError: errors.AdapterPublishError(4, "tiny@4", {"vllm-0": _HTTP}),
    errors.AdapterTransferError: errors.AdapterTransferError(5, "host host0: offering failed"),
    errors.ArtifactFileError: errors.ArtifactFileError("host1", "a/b", "a/b is outside the artifact root"),
    errors.NonFiniteStepError: errors.NonFiniteStepError("loss/policy", float("nan"), 3),
    errors.TopologyError: errors.TopologyError(
        "host_id 'h9' is not in ClusterSpec.hosts ('h0'); use one of those ids.", "host_id"
    ),
}


def _sample(cls: type[BaseException]) -> BaseException:
    """A real instance where SAMPLES has one, else one made without its constructor."""
    if cls in SAMPLES:
        return SAMPLES[cls]
    exc = cls.__new__(cls)
    exc.args = (f"a {cls.__name__} naming host h1 and step 3",)
    return exc


def _cli_report(exc: BaseException, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    def body() -> None:
        raise exc

    with pytest.raises(typer.Exit) as info:
        cli._guarded(False, body)
    return info.value.exit_code, capsys.readouterr().err


def test_every_exception_class_in_errors_has_its_own_row():
    assert len(CLASSES) >= 40
    assert [c.__name__ for c in CLASSES if c not in EXIT_CODES] == []
    assert EXIT_CODES[ValidationError] == Exit(2, traceback=False)
    assert EXIT_CODES[KeyboardInterrupt].code == 130


def test_user_errors_exit_2_in_one_sentence_and_the_rest_exit_1():
    for cls in CLASSES:
        row = EXIT_CODES[cls]
        if issubclass(cls, errors.UserError):
            assert row == Exit(2, traceback=False), cls
        else:
            assert row.code == 1, cls
    lost = errors.HostLostError("h", "tcp://a:1", "r")
    assert errors.exit_code_for(lost) == lost.exit_code == 1 and errors.describe(lost) == str(lost)
    assert SAMPLES[errors.RankRefusedStepError].exit_code == 2  # a TrainerJobError, but the user's


@pytest.mark.parametrize("cls", [*CLASSES, ValidationError, RuntimeError], ids=lambda c: c.__name__)
def test_cli_and_controller_report_every_exception_alike(cls, capsys):
    exc = _sample(cls)
    row = errors.exit_row(exc)
    code, err = _cli_report(exc, capsys)
    controller_code, message = controller.describe_failure(exc, debug=False)
    assert code == controller_code == row.code == errors.exit_code_for(exc)
    if row.traceback:
        assert errors.describe(exc) is None
        assert err.startswith("Traceback (most recent call last):") and str(exc) in err
        assert message.startswith("the program failed:\nTraceback (most recent call last):")
    else:
        assert message == f"error: {errors.describe(exc)}" and err == f"art-mega: {message}\n"
        assert "\n" not in message


def test_the_messages_are_built_from_the_fields():
    assert str(SAMPLES[errors.AgentStartError]) == "host host0 (tcp://127.0.0.1:7): agent not ready after 2 s"
    assert (
        str(SAMPLES[errors.NoReplicaUpError])
        == "no replica of tiny is up: vllm-0 (http://127.0.0.1:9): exited 1"
    )
    assert str(SAMPLES[errors.ArtifactFileError]) == "host host1: a/b is outside the artifact root"
    assert str(SAMPLES[errors.AdapterTransferError]) == "step 5: host host0: offering failed"
    assert str(SAMPLES[errors.ReplicaRequestError]) == (
        "request to replica vllm-0 (http://127.0.0.1:9) for model tiny@2 failed: ConnectionResetError: reset"
    )
    assert SAMPLES[errors.AdapterPublishError].model == "tiny@4"
    from art_mega.topology import ClusterSpec, HostSpec, TrainerSpec, compile_topology

    one = ClusterSpec(
        hosts=(HostSpec(host_id="h0", node_rank=0, worker_address="tcp://10.0.0.1:22222"),),
        controller_host_id="h0",
        artifact_root="/shared/art",
        cache_root="/var/cache/art",
    )
    with pytest.raises(errors.TopologyError) as info:
        compile_topology(one, trainer=TrainerSpec(host_ids=("h7",)))
    assert info.value.field == "TrainerSpec.host_ids" and info.value.exit_code == 2
    assert str(info.value).startswith(
        "TrainerSpec.host_ids names host 'h7', which is not in ClusterSpec.hosts"
    )
    assert (
        errors.describe(_validation_error())
        == "_Model.port='abc' is invalid: Input should be a valid integer, unable to parse string as an integer."
    )


def test_a_subclass_defined_elsewhere_takes_its_base_row_and_a_bare_interrupt_is_named():
    class MyMistake(errors.UserError):
        pass

    assert errors.exit_code_for(MyMistake("x")) == 2 and errors.describe(MyMistake("x")) == "x"
    assert controller.describe_failure(KeyboardInterrupt(), debug=False) == (
        130,
        "the program raised KeyboardInterrupt; every host was stopped",
    )
    assert errors.describe(KeyboardInterrupt()) == "KeyboardInterrupt"


def _program(tmp_path: Path, body: str) -> str:
    script = tmp_path / "prog_errors_table.py"
    script.write_text(f"from art_mega import errors\n\n\nasync def main(launch):\n    {body}\n")
    return f"{script}:main"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "make_args,cls,line",
    [
        pytest.param(
            lambda tmp: ["local", "--program", _program(tmp, "launch.homogeneous_cluster().host('h9')")],
            errors.TopologyError,
            "art-mega: error: host_id 'h9' is not in ClusterSpec.hosts ('host0'); use one of those ids.",
            id="bad-topology",
        ),
        pytest.param(
            lambda tmp: ["local", "--program", "examples/multinode/program.py:main", "--port", "70000"],
            errors.UserError,
            "art-mega: error: --port 70000",
            id="bad-option",
        ),
        pytest.param(
            lambda tmp: [
                "controller",
                "--program",
                "examples/multinode/program.py:main",
                "--worker",
                f"tcp://127.0.0.1:{_free_port()}",
            ],
            errors.UserError,
            "does not answer; is `art-mega worker` running there?",
            id="no-worker",
        ),
        pytest.param(
            lambda tmp: [
                "local",
                "--program",
                _program(tmp, "raise errors.HostLostError('host9', 'tcp://10.0.0.9:1', 'no heartbeat')"),
            ],
            errors.HostLostError,
            "art-mega: error: host host9 (tcp://10.0.0.9:1) was lost: no heartbeat",
            id="lost-host",
        ),
        pytest.param(
            lambda tmp: [
                "local",
                "--program",
                _program(tmp, "raise errors.TrainerJobError('trainer rank 0 on host host0 died', rank=0)"),
            ],
            errors.TrainerJobError,
            "TrainerJobError: trainer rank 0 on host host0 died",
            id="rank-died",
        ),
    ],
)
def test_the_real_cli_exits_as_the_table_says(tmp_path, make_args, cls, line):
    """`python -m art_mega ...`: the exit code and the report are `cls`'s row (bad topology: 2)."""
    row = EXIT_CODES[cls]
    env = cli_env()
    env["ART_MEGA_SECRET"] = "ab" * 32
    result = run_cli(*make_args(tmp_path), env=env)
    assert result.returncode == row.code, result.stderr
    lines = [text for text in result.stderr.splitlines() if text.strip()]
    if row.traceback:
        assert lines[0] == "art-mega: the program failed:" and line in lines[-1], result.stderr
    else:
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert line in lines[0], lines[0]


def _exception_classes_outside_errors() -> set[str]:
    """`module.Class` (below art_mega) of every class deriving from an exception, found by ast."""
    package = Path(errors.__file__).parent
    found: set[str] = set()
    for path in package.rglob("*.py"):
        if path.name == "errors.py" and path.parent == package:
            continue
        module = ".".join(path.relative_to(package).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
                if any(re.search(r"(Error|Exception|Exceeded)$", base) for base in bases):
                    found.add(f"{module}.{node.name}")
    return found


def test_the_exceptions_left_in_their_modules_are_the_ones_errors_names_as_internal():
    internal = set(
        re.findall(r"`([a-z_.]+\.[A-Za-z_]+(?:Error|Refused))`", errors.__doc__.split("stay in")[1])
    )
    assert internal and _exception_classes_outside_errors() == internal


def test_every_importer_takes_the_exceptions_from_errors_itself():
    """No module hands an exception of errors.py on (a re-export left behind by a move)."""
    names = {c.__name__ for c in CLASSES}
    root = Path(errors.__file__).parent.parent
    through = []
    for path in [*(root / "art_mega").rglob("*.py"), *(root / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("art_mega"):
                if node.module != "art_mega.errors" and names & {alias.name for alias in node.names}:
                    through.append(f"{path.relative_to(root)}:{node.lineno} from {node.module}")
    assert through == []
