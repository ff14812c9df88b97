"""What `backend.train` and `train_sft` refuse before anything runs (no trainer needed): arguments
that are not groups of trajectories, unknown roles, bad message contents, non-finite rewards,
sampling logprobs and advantages; and the valid ART inputs they must keep taking."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

import art_mega as art
from art_mega.backend import MegatronBackend, checked_groups
from art_mega.errors import NonFiniteValueError, TrainInputError
from art_mega.trainer.prepare.advantages import group_advantages
from art_mega.trajectories import History, check_sft_trajectories, check_train_groups

NAN, INF = float("nan"), float("inf")


def choice(content: str | None = "ok", logprobs: list[float] | None = None, **message: Any) -> Choice:
    data: dict[str, Any] = {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": content, **message},
    }
    if logprobs is not None:
        data["logprobs"] = {
            "content": [
                {"token": f"t{k}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for k, lp in enumerate(logprobs)
            ]
        }
    return Choice.model_validate(data)


def trajectory(reward: float = 1.0, *items: Any) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, *items], reward=reward)


def group(*rewards: float) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([trajectory(r, choice()) for r in rewards])


@pytest.fixture
def backend() -> MegatronBackend:
    """A backend with `model` registered in name only: every check runs, nothing can train."""
    backend = MegatronBackend()
    backend._model = art.TrainableModel(name="m", project="p", base_model="tiny")
    return backend


def train(backend: MegatronBackend, groups: Any, **options: Any) -> Any:
    return asyncio.run(backend.train(backend._model, groups, **options))


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        (
            [[trajectory(), trajectory()]],
            "backend.train(trajectory_groups): group 0 is a list, not an art.TrajectoryGroup; wrap its "
            "trajectories: art.TrajectoryGroup([...])",
        ),
        (
            "groups",
            "backend.train(trajectory_groups) got a str; pass a list of art.TrajectoryGroup (what "
            "art.gather_trajectory_groups returns)",
        ),
        ([], "backend.train(trajectory_groups) got an empty list; pass at least one TrajectoryGroup"),
        (
            [trajectory(), trajectory()],
            "backend.train(trajectory_groups): group 0 is a Trajectory, not an art.TrajectoryGroup; group "
            "the trajectories of one prompt: [art.TrajectoryGroup([t1, t2, ...]), ...]",
        ),
        (
            [group(1, 0), art.TrajectoryGroup([])],
            "backend.train(trajectory_groups): group 1 has no trajectories; leave it out or fill it",
        ),
        (
            group(1, 0),
            "backend.train(trajectory_groups) got one TrajectoryGroup; pass a list of groups, e.g. [group]",
        ),
        (42, "backend.train(trajectory_groups) got a int; pass a list of art.TrajectoryGroup"),
    ],
)
def test_arguments_that_are_not_groups_are_refused(
    backend: MegatronBackend, groups: Any, expected: str
) -> None:
    with pytest.raises(TrainInputError) as info:
        train(backend, groups)
    assert str(info.value).startswith(expected)
    assert info.value.argument == "trajectory_groups"


def test_an_unawaited_group_is_refused_naming_it(backend: MegatronBackend) -> None:
    async def rollout() -> art.Trajectory:
        return trajectory()

    async def run() -> None:
        pending = art.TrajectoryGroup(rollout() for _ in range(2))
        try:
            await backend.train(backend._model, [group(1, 0), pending])
        finally:
            await pending  # the rollouts ran: no "never awaited" warning

    with pytest.raises(TrainInputError, match=r"group 1 was never awaited; await it") as info:
        asyncio.run(run())
    assert info.value.group == 1


def test_an_unknown_role_is_refused_naming_group_trajectory_and_message(backend: MegatronBackend) -> None:
    robot = trajectory(0.0, {"role": "robot", "content": "beep"})
    with pytest.raises(TrainInputError) as info:
        train(backend, [group(1, 0), art.TrajectoryGroup([trajectory(1.0), robot])])
    assert str(info.value) == (
        "backend.train(trajectory_groups): trajectory 1 of group 1: messages_and_choices[1] has the "
        "unknown role 'robot'; use one of 'system', 'developer', 'user', 'assistant', 'tool', 'function', 'ipython'"
    )
    assert (info.value.group, info.value.trajectory) == (1, 1)
    nameless = trajectory(0.0, {"content": "who?"})
    with pytest.raises(
        TrainInputError, match=r"trajectory 0 of group 0: messages_and_choices\[1\] has no role"
    ):
        train(backend, [art.TrajectoryGroup([nameless])])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (42, "has a content of type int; content must be a string, a list of content parts or None"),
        ({"text": "hi"}, "has a content of type dict; content must be a string"),
        (["hi"], "has a content part 0 of type str; a part is an object such as"),
    ],
)
def test_a_content_that_is_no_string_parts_or_none_is_refused(
    backend: MegatronBackend, content: Any, expected: str
) -> None:
    bad = art.TrajectoryGroup([trajectory(1.0), trajectory(0.0, {"role": "assistant", "content": content})])
    with pytest.raises(TrainInputError) as info:
        train(backend, [bad])
    assert str(info.value).startswith(
        "backend.train(trajectory_groups): trajectory 1 of group 0: messages_and_choices[1] "
    )
    assert expected in str(info.value)


def test_additional_histories_are_checked_too() -> None:
    odd = trajectory(1.0)
    odd.additional_histories.append(History(messages_and_choices=[{"role": "narrator", "content": "x"}]))
    with pytest.raises(
        TrainInputError, match=r"additional_histories\[0\]\.messages_and_choices\[0\] has the unknown role"
    ):
        check_train_groups([art.TrajectoryGroup([odd])])


def test_valid_art_inputs_pass_the_checks() -> None:
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rich = trajectory(
        1.0,
        choice(None, tool_calls=[tool_call]),  # a Choice that calls a tool, content None
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},  # dict form, content None
        {"role": "assistant", "tool_calls": [tool_call]},  # content absent
        {"role": "user", "content": [{"type": "text", "text": "parts"}]},
        choice("done", logprobs=[-0.5, -1e-9, 0.0]),
    )
    rich.additional_histories.append(
        History(messages_and_choices=[{"role": "system", "content": "s"}, choice().model_dump()])
    )
    groups = [art.TrajectoryGroup([rich, trajectory(0.0)])]
    again = [art.TrajectoryGroup.model_validate_json(groups[0].model_dump_json())]  # a JSON round trip
    assert check_train_groups(groups) == groups and check_train_groups(again) == again
    assert check_train_groups(tuple(groups)) == groups  # any iterable of groups
    failed = art.TrajectoryGroup([], exceptions=[ValueError("judge down")])  # every rollout raised
    assert check_train_groups([failed, *groups])[0] is failed
    assert check_sft_trajectories([rich]) == [rich]


def test_sft_trajectories_are_checked(backend: MegatronBackend) -> None:
    def sft(value: Any) -> Any:
        return asyncio.run(backend.train_sft(backend._model, value))

    with pytest.raises(TrainInputError, match=r"^train_sft\(trajectories\) got an empty list"):
        sft([])
    with pytest.raises(TrainInputError, match=r"^train_sft\(trajectories\) got a str"):
        sft("rows.jsonl")
    with pytest.raises(
        TrainInputError, match=r"^train_sft\(trajectories\): trajectory 1 is a dict, not an art.Trajectory"
    ):
        sft([trajectory(), {"messages": []}])
    with pytest.raises(
        TrainInputError,
        match=r"^train_sft\(trajectories\): trajectory 0: messages_and_choices\[1\] has the unknown role",
    ):
        sft([trajectory(0.0, {"role": "robot", "content": "x"})])


def test_a_nonfinite_reward_is_refused_naming_group_and_trajectory(backend: MegatronBackend) -> None:
    with pytest.raises(NonFiniteValueError) as info:
        train(backend, [group(1, 0), group(1, NAN, 0), group(INF, 0)])
    assert str(info.value) == (
        "backend.train(trajectory_groups): trajectory 1 of group 1 has the reward nan (2 non-finite "
        "rewards in this call); rewards must be finite numbers: fix the reward, or pass "
        "drop_nonfinite_rewards=True to leave such trajectories out"
    )
    assert (info.value.quantity, info.value.group, info.value.trajectory) == ("reward", 1, 1)


def test_dropping_nonfinite_rewards_is_an_explicit_option_and_counted() -> None:
    groups = [group(1, 0), group(1, NAN, 0), group(-INF, 0.5)]
    kept, dropped = checked_groups(groups, drop_nonfinite_rewards=True)
    assert dropped == 2
    assert [[t.reward for t in g.trajectories] for g in kept] == [[1, 0], [1, 0], [0.5]]
    assert len(groups[1].trajectories) == 3  # the caller's groups are left as they were


def test_rewards_whose_advantages_overflow_are_refused_naming_the_group() -> None:
    with pytest.raises(
        NonFiniteValueError, match=r"group 1: advantage 0 of the group is not finite: its rewards overflow"
    ):
        checked_groups([group(1, 0), group(1e200, -1e200)], drop_nonfinite_rewards=False)


def test_group_advantages_refuses_nan_instead_of_returning_it() -> None:
    with pytest.raises(NonFiniteValueError) as info:
        group_advantages([1, NAN, 0])
    assert (info.value.quantity, info.value.trajectory) == ("reward", 1)
    with pytest.raises(NonFiniteValueError, match="reward 0 of the group is inf"):
        group_advantages([INF, INF])  # all equal: once skipped as zero-variance
    with pytest.raises(NonFiniteValueError, match="overflow"):
        group_advantages([1e308, -1e308])
    good = group_advantages([1.0, 0.0, 0.5])
    assert all(math.isfinite(a) for a in good.advantages) and not good.skipped


@pytest.mark.parametrize("bad", [NAN, -INF, INF])
def test_a_nonfinite_sampling_logprob_is_refused_naming_the_token(
    backend: MegatronBackend, bad: float
) -> None:
    sampled = trajectory(0.0, choice("ab", logprobs=[-0.1, bad]))
    with pytest.raises(NonFiniteValueError) as info:
        train(backend, [art.TrajectoryGroup([trajectory(1.0, choice()), sampled])])
    assert str(info.value).startswith(
        f"backend.train(trajectory_groups): trajectory 1 of group 0: messages_and_choices[1] has the "
        f"sampling logprob {bad!r} at token 1; training needs finite logprobs"
    )
    assert (info.value.quantity, info.value.group, info.value.trajectory) == ("logprob", 0, 1)
