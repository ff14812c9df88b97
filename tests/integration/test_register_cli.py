"""`register` refuses a model the trainer's tensor parallel size cannot split, through `art-mega
local`: one sentence, exit code 2, before any trainer rank or replica starts.

Before: the three trainer ranks started, loaded megatron-core and failed one by one; the user saw
a `TrainerJobError` traceback (with the vLLM replica starting beside them)."""

from tests.conftest import cli_env, run_cli


def test_heads_that_tp_cannot_split_are_refused_at_register_with_exit_2(tiny_llama_dir, tmp_path):
    env = {**cli_env(), "REGISTER_ROOT": str(tmp_path / "artifacts"), "REGISTER_MODEL": str(tiny_llama_dir)}
    result = run_cli("local", "--program", "tests/integration/programs/prog_register_split.py:main", env=env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        "art-mega: error: TrainerSpec.tp=3 cannot split this llama model (4 attention heads, 2 KV heads, FFN size "
        "256); use tp in {1, 2, 4}."
    ], result.stderr
    assert not list((tmp_path / "artifacts").rglob("*.log"))  # no rank or replica wrote a log
