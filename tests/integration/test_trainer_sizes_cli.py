"""Trainer sizes the trainer cannot run yet (pp > 1 with cp > 1) are refused
through `art-mega local` when the program compiles its topology: one sentence, exit code 2, and
nothing started (no run folder, no log).

Before: `compile_topology(TrainerSpec(pp=2))` compiled, and every started trainer rank failed in
`init_parallel` (with the vLLM replica starting beside them), reported as a TrainerJobError."""

import pytest

from tests.conftest import cli_env, run_cli
from tests.unit.topology.test_topology_compile import PP_REFUSED


@pytest.mark.parametrize(
    ("sizes", "sentence"),
    [("pp=2,cp=2", PP_REFUSED)],
)
def test_unsupported_trainer_sizes_exit_2_before_anything_starts(sizes, sentence, tiny_llama_dir, tmp_path):
    root = tmp_path / "artifacts"
    env = {**cli_env(), "REGISTER_ROOT": str(root), "REGISTER_MODEL": str(tiny_llama_dir), "TRAINER_SIZES": sizes}
    result = run_cli("local", "--program", "tests/integration/programs/prog_trainer_sizes.py:main", env=env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"art-mega: error: {sentence}"], result.stderr
    assert not root.exists()  # no run folder, no rank or replica log
