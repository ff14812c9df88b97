"""Hostile inputs to RULER (no judge runs): a reply whose scores are not JSON numbers in [0, 1] is
not a reward, and switches that are not bools are refused before any judge is asked."""

from __future__ import annotations

import asyncio
import json

import pytest

from art_mega.errors import HyperParameterError
from art_mega.rewards import ruler, ruler_score_group
from art_mega.rewards.ruler import _ReplyError, parse_scores
from art_mega.trajectories import Trajectory, TrajectoryGroup

CONVERSATION = [{"role": "user", "content": "Is water wet?"}, {"role": "assistant", "content": "yes"}]


def reply(score: str, trajectory_id: str = '"1"') -> str:
    return (
        '{"scores": [{"trajectory_id": ' + trajectory_id + ', "explanation": "ok", "score": ' + score + "}]}"
    )


@pytest.mark.parametrize(
    "score", ["true", "false", '"0.5"', "NaN", "Infinity", "-Infinity", "1.5", "-0.1", "null"]
)
def test_a_score_that_is_not_a_number_in_0_1_is_not_a_reward(score):
    with pytest.raises(_ReplyError) as caught:
        parse_scores(reply(score), ["1"])
    assert "is not RULER's scores" in str(caught.value)


def test_scores_that_are_numbers_are_read_as_floats():
    assert [s.score for s in parse_scores(reply("1"), ["1"])] == [1.0]
    assert [s.score for s in parse_scores(reply("0.25"), ["1"])] == [0.25]


def test_a_reply_with_a_missing_an_extra_or_a_repeated_id_is_refused():
    two = json.dumps({"scores": [{"trajectory_id": "1", "explanation": "a", "score": 0.5}] * 2})
    for content, ids in [(reply("0.5"), ["1", "2"]), (reply("0.5", '"3"'), ["1"]), (two, ["1", "2"])]:
        with pytest.raises(_ReplyError, match="each once"):
            parse_scores(content, ids)
    with pytest.raises(_ReplyError):  # an int id is not the string id asked for
        parse_scores(reply("0.5", "1"), ["1"])


@pytest.mark.parametrize("name", ["debug", "cache"])
@pytest.mark.parametrize("value", ["false", 0, None])
def test_ruler_refuses_a_switch_that_is_not_a_bool(name, value):
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(ruler([CONVERSATION, CONVERSATION], "openai/o3", **{name: value}))
    assert (
        str(caught.value)
        == f"ruler({name}={value!r}) must be True or False (a {type(value).__name__}); pass e.g. {name}=True"
    )
    assert caught.value.name == name and caught.value.value == value


def test_ruler_score_group_refuses_a_swallow_exceptions_that_is_not_a_bool():
    group = TrajectoryGroup([Trajectory(messages_and_choices=CONVERSATION, reward=0.0)])
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(ruler_score_group(group, "openai/o3", swallow_exceptions="yes"))
    assert str(caught.value) == (
        "ruler_score_group(swallow_exceptions='yes') must be True or False (a str); pass e.g. swallow_exceptions=True"
    )


def test_extra_litellm_params_with_nan_never_reach_the_judge():
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(ruler([CONVERSATION], "openai/o3", {"temperature": float("-inf")}))
    assert str(caught.value) == (
        "ruler(extra_litellm_params={'temperature': -inf}) holds a NaN or infinity, which a JSON request "
        "cannot carry; pass e.g. extra_litellm_params={'temperature': 0}"
    )


@pytest.mark.parametrize(
    ("lists", "says"),
    [
        ([CONVERSATION, "yes"], "ruler(message_lists[1]) is a str, not a list of chat messages"),
        ([CONVERSATION, []], "ruler(message_lists[1]) is empty, so there is nothing to score"),
        ([[], CONVERSATION], "ruler(message_lists[0]) is empty, so there is nothing to score"),
        ([["hi"]], "ruler(message_lists[0]) [0] is 'hi', not a chat message dict with a 'role'"),
        (
            [[CONVERSATION[0], {"content": "x"}]],
            "ruler(message_lists[0]) [1] is {'content': 'x'}, not a chat",
        ),
    ],
)
def test_a_trajectory_the_judge_cannot_read_as_a_chat_is_refused_before_it_is_asked(lists, says):
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(ruler(lists, "openai/o3"))
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)
    assert str(caught.value).endswith("; pass each trajectory's messages, e.g. trajectory.messages()")


def test_a_group_with_an_empty_trajectory_is_refused_even_when_failures_are_swallowed():
    group = TrajectoryGroup(
        [Trajectory(messages_and_choices=CONVERSATION, reward=0.0), Trajectory(messages_and_choices=[])]
    )
    with pytest.raises(HyperParameterError, match=r"ruler\(message_lists\[1\]\) is empty"):
        asyncio.run(ruler_score_group(group, "openai/o3", swallow_exceptions=True))


def test_tools_or_message_values_json_cannot_show_are_refused_in_one_sentence():
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(ruler([CONVERSATION], "openai/o3", tools="add"))
    assert str(caught.value) == (
        "ruler(tools='add') must be a list of tool schema dicts or None; pass the trajectory's tools, "
        "e.g. trajectory.tools"
    )
    odd = [{"role": "user", "content": {1, 2}}, {"role": "assistant", "content": "yes"}]
    with pytest.raises(HyperParameterError) as caught:
        asyncio.run(ruler([odd, CONVERSATION], "openai/o3"))
    assert str(caught.value) == (
        "ruler(message_lists / tools): a set in a message cannot be shown to the judge as JSON; give "
        "plain JSON values (str, number, list, dict) or pydantic models"
    )
