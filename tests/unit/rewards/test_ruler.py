"""RULER without a judge: what the judge is shown, how its reply is read and constrained, the
cache's key and files, and every refused argument (tests/inference/test_ruler.py asks a real one)."""

from __future__ import annotations

import json
import re
import sys

import pytest

import art_mega as art
from art_mega.errors import HyperParameterError, MissingExtraError, TrainInputError
from art_mega.rewards import DEFAULT_RUBRIC, ruler, ruler_score_group
from art_mega.rewards import judge as judging
from art_mega.rewards.ruler import _ReplyError, judge_messages, parse_scores
from art_mega.trajectories import History

SYSTEM = {"role": "system", "content": "Answer yes or no."}
USER = {"role": "user", "content": "Is water wet?"}


def conversation(answer: str) -> list[dict[str, str]]:
    return [SYSTEM, USER, {"role": "assistant", "content": answer}]


def test_the_shared_prefix_is_shown_once_and_each_trajectory_after_it():
    messages, ids = judge_messages([conversation("yes"), conversation("no")], DEFAULT_RUBRIC, None)
    assert ids == ["1", "2"]
    system, user = messages
    assert system["role"] == "system" and DEFAULT_RUBRIC.strip() in system["content"]
    text = user["content"]
    assert text.count("Is water wet?") == 1
    context = text.split("<shared_context>\n")[1].split("\n</shared_context>")[0]
    assert json.loads(context) == [SYSTEM, USER]
    first = text.split('<trajectory id="1">\n')[1].split("\n</trajectory>")[0]
    second = text.split('<trajectory id="2">\n')[1].split("\n</trajectory>")[0]
    assert json.loads(first) == [{"role": "assistant", "content": "yes"}]
    assert json.loads(second) == [{"role": "assistant", "content": "no"}]
    assert "<tools_offered>" not in text


def test_identical_trajectories_are_shown_once_whole_and_tools_are_shown():
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    messages, ids = judge_messages([conversation("yes")] * 3, "- be right", tools)
    assert ids == ["1"]
    text = messages[1]["content"]
    assert "<shared_context>" not in text and '<trajectory id="2">' not in text
    assert json.loads(text.split('<trajectory id="1">\n')[1].split("\n</trajectory>")[0]) == conversation(
        "yes"
    )
    assert json.loads(text.split("<tools_offered>\n")[1].split("\n</tools_offered>")[0]) == tools


def test_trajectories_of_different_lengths_share_only_their_common_prefix():
    short = [SYSTEM]
    messages, ids = judge_messages([short, conversation("yes")], DEFAULT_RUBRIC, None)
    text = messages[1]["content"]
    assert json.loads(text.split("<shared_context>\n")[1].split("\n</shared_context>")[0]) == [SYSTEM]
    assert json.loads(text.split('<trajectory id="1">\n')[1].split("\n</trajectory>")[0]) == []


def reply(*entries: tuple[str, str, float]) -> str:
    return json.dumps(
        {"scores": [{"trajectory_id": i, "explanation": e, "score": s} for i, e, s in entries]},
        separators=(",", ":"),
    )


def test_scores_come_back_in_trajectory_order_whatever_the_reply_order():
    scores = parse_scores(reply(("2", "worse", 0.25), ("1", "better", 0.9)), ["1", "2"])
    assert [(s.trajectory_id, s.score, s.explanation) for s in scores] == [
        ("1", 0.9, "better"),
        ("2", 0.25, "worse"),
    ]


def test_a_raw_newline_inside_an_explanation_is_taken():
    content = '{"scores":[{"trajectory_id":"1","explanation":"line one\nline two","score":1}]}'
    assert parse_scores(content, ["1"])[0].explanation == "line one\nline two"


@pytest.mark.parametrize(
    "content, words",
    [
        ("not json", "is not RULER's scores"),
        ('{"scores": [{"trajectory_id": "1", "explanation": "x", "score": 1.5}]}', "less than or equal to 1"),
        (
            '{"scores": [{"trajectory_id": "1", "explanation": "x", "score": -0.1}]}',
            "greater than or equal to 0",
        ),
        ('{"ranking": []}', "is not RULER's scores"),
        (reply(("1", "a", 0.5), ("1", "b", 0.5)), "scores trajectories ['1', '1'], not ['1', '2']"),
        (reply(("1", "a", 0.5)), "scores trajectories ['1'], not ['1', '2']"),
        (reply(("1", "a", 0.5), ("3", "b", 0.5)), "not ['1', '2']"),
    ],
)
def test_a_reply_that_is_not_the_scores_asked_for_is_unusable(content, words):
    with pytest.raises(_ReplyError, match=re.escape(words)):
        parse_scores(content, ["1", "2"])


def test_the_vllm_regex_takes_exactly_the_compact_reply():
    pattern = re.compile(judging.reply_regex(["1", "2"], 10))
    good = reply(("1", "fine", 0.5), ("2", 'says "no"', 1.0))
    assert pattern.fullmatch(good)
    assert parse_scores(good, ["1", "2"])[1].explanation == 'says "no"'
    for bad in (
        reply(("2", "x", 0.5), ("1", "y", 0.5)),  # out of order
        reply(("1", "x", 1.5), ("2", "y", 0.5)),  # a score above 1
        reply(("1", "eleven char", 0.5), ("2", "y", 0.5)),  # an explanation over the bound
        reply(("1", "x", 0.5)),  # one entry missing
        reply(("1", "x", 0.5), ("2", "y", 0.5)).replace(",", ", "),  # whitespace
    ):
        assert not pattern.fullmatch(bad), bad


def test_the_json_schema_pins_the_count_the_ids_and_the_score_range():
    schema = judging.reply_schema(["1", "2", "3"])["properties"]["scores"]
    assert schema["minItems"] == schema["maxItems"] == 3
    item = schema["items"]["properties"]
    assert item["trajectory_id"]["enum"] == ["1", "2", "3"]
    assert (item["score"]["minimum"], item["score"]["maximum"]) == (0, 1)
    assert list(item) == ["trajectory_id", "explanation", "score"]  # reason first, then the score


def request(**changes) -> judging.JudgeRequest:
    judge = judging.resolve_judge("hosted_vllm/tiny", {"api_base": "http://127.0.0.1:9/v1"}, "ruler")
    messages, ids = judge_messages([conversation("yes"), conversation("no")], DEFAULT_RUBRIC, None)
    params = {"api_base": "http://127.0.0.1:9/v1", **changes}
    return judging.build_request(judge, messages, ids, params, 50, "ruler")


def test_the_cache_key_is_the_exact_request(tmp_path):
    assert request().key() == request().key()
    assert (
        len({request().key(), request(temperature=0).key(), request(api_base="http://127.0.0.1:8/v1").key()})
        == 3
    )
    assert request().constraint == "vllm_regex"
    assert "regex" in request().constraint_params["extra_body"]["structured_outputs"]
    path = judging.write_cache(
        tmp_path, request(), reply(("1", "a", 1.0), ("2", "b", 0.0)), {"total_tokens": 7}
    )
    assert path.parent.parent == tmp_path and path.name == f"{request().key()}.json"
    cached = judging.read_cache(tmp_path, request())
    assert cached is not None and cached.usage == {"total_tokens": 7} and cached.judge == "hosted_vllm/tiny"
    assert judging.read_cache(tmp_path, request(temperature=0)) is None
    path.write_text("{broken")
    assert judging.read_cache(tmp_path, request()) is None  # reported, then asked anew


def test_a_non_vllm_name_gets_a_json_schema_response_format():
    judge = judging.resolve_judge("openai/o4-mini", {}, "ruler")
    assert (judge.provider, judge.constraint) == ("openai", "json_schema")
    built = judging.build_request(judge, [{"role": "user", "content": "x"}], ["1"], {}, 50, "ruler")
    assert built.constraint_params["response_format"]["json_schema"]["strict"] is True
    assert judging.resolve_judge("my-local-model", {}, "ruler").provider is None


def test_a_prompted_model_judges_through_its_endpoint_with_a_json_schema():
    judge_model = art.Model(
        name="judge", project="p", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k"
    )
    judge = judging.resolve_judge(judge_model, {}, "ruler")
    assert (judge.name, judge.provider, judge.constraint) == ("judge", "openai", "json_schema")
    assert judging.build_request(judge, [], ["1"], {}, 5, "ruler").judge == "http://127.0.0.1:9/v1 judge"


async def test_refused_arguments_name_the_field_and_the_fix():
    lists = [conversation("yes"), conversation("no")]
    cases = [
        (dict(judge_model=""), "judge_model"),
        (dict(judge_model=3), "judge_model"),
        (dict(rubric="  "), "rubric"),
        (dict(extra_litellm_params=[("temperature", 0)]), "extra_litellm_params"),
        (dict(extra_litellm_params={"messages": []}), "extra_litellm_params"),
        (dict(extra_litellm_params={"response_format": {}}), "extra_litellm_params"),
        (dict(max_explanation_chars=0), "max_explanation_chars"),
        (dict(cache_dir=3), "cache_dir"),
        (
            dict(
                judge_model="hosted_vllm/x", extra_litellm_params={"extra_body": {"structured_outputs": {}}}
            ),
            "extra_litellm_params",
        ),
    ]
    for kwargs, field in cases:
        with pytest.raises(HyperParameterError) as caught:
            await ruler(lists, **{"judge_model": "hosted_vllm/x", **kwargs})
        assert caught.value.name == field, kwargs
        assert str(caught.value).startswith(f"ruler({field}")
    prompted = art.Model(
        name="j", project="p", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k"
    )
    with pytest.raises(
        HyperParameterError, match=r"\['api_base'\], which a Model judge takes from the model"
    ):
        await ruler(lists, prompted, {"api_base": "http://x"})
    with pytest.raises(HyperParameterError, match="must be a list of message lists"):
        await ruler("yes", "hosted_vllm/x")
    assert await ruler([], "hosted_vllm/x") == []


async def test_a_group_with_additional_histories_or_not_a_group_is_refused():
    history = History(messages_and_choices=conversation("again"))
    group = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=conversation("yes")),
            art.Trajectory(messages_and_choices=conversation("no"), additional_histories=[history]),
        ]
    )
    with pytest.raises(TrainInputError, match="trajectory 1 has additional_histories") as caught:
        await ruler_score_group(group, "hosted_vllm/x", swallow_exceptions=True)
    assert caught.value.trajectory == 1
    with pytest.raises(HyperParameterError, match="must be a TrajectoryGroup, not a list"):
        await ruler_score_group([conversation("yes")], "hosted_vllm/x")


async def test_a_litellm_name_without_the_rewards_extra_says_which_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "litellm", None)  # what `import litellm` meets when it is absent
    with pytest.raises(MissingExtraError) as caught:
        await ruler([conversation("yes"), conversation("no")], "openai/o4-mini", cache_dir=tmp_path)
    assert caught.value.extra == "rewards"
    assert str(caught.value) == (
        "art_mega.rewards.ruler with a LiteLLM judge name needs the 'litellm' package, which is not "
        "installed; pip install 'art-mega[rewards]'"
    )


def test_importing_the_rewards_module_loads_no_judge_client():
    import subprocess

    probe = "import sys, art_mega.rewards; print(sorted(m for m in ('litellm', 'torch', 'vllm') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
