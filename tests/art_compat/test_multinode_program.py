"""ART's documented multinode program through `art-mega local`, as the docs run it (one loopback
agent, one rollout worker per host): the controller, the worker process and the model sent to it
are real; nothing is trained (the program has no training step)."""

from tests.conftest import REPO, run_cli

PROGRAM = REPO / "tests" / "art_compat" / "multinode_program.py"


def test_the_docs_multinode_program_passes_through_art_mega_local(tmp_path):
    result = run_cli(
        "local", "--program", f"{PROGRAM}:main", "--port", "0", "--startup-timeout", "90", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "ART_MULTINODE_SMOKE_PASS hosts=1 answers=['yes', 'no', 'maybe']"
    assert "Traceback" not in result.stderr
