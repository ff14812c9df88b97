"""RULER (Relative Universal LLM-Elicited Rewards), as in ART: an LLM judge compares the
trajectories of one group with each other and scores each from 0 to 1; GRPO only needs the
scores' order and spacing within the group, so no labelled data or reward function is needed.

`ruler(message_lists, judge_model, ...)` scores plain message lists; `ruler_score_group(group,
judge_model, ...)` returns a copy of a `TrajectoryGroup` with the scores as rewards, made to be
`gather_trajectory_groups(after_each=...)`'s callback. The judge and its cache: `rewards.judge`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from textwrap import dedent
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from art_mega.errors import HyperParameterError, RulerJudgeError, TrainInputError
from art_mega.hyperparams import bool_problem, check, json_finite_problem, whole_problem
from art_mega.rewards import judge as judging
from art_mega.trajectories import TrajectoryGroup

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = dedent(
    """\
    - Reaching the goal matters most: an attempt that completes the task scores well above every attempt that does not.
    - Among attempts that complete the task, the more direct one (fewer wasted turns, failed tool calls or repeats) scores higher.
    - Let the gaps between scores follow the gaps in quality: near-equal attempts get near-equal scores, a clearly better attempt a clearly higher one.
    - An attempt that makes real progress toward the goal without reaching it earns partial credit.
    """
)
"""The rubric RULER grades with unless given another: generic, because the judge reads the task
from the trajectories themselves (their system prompt above all)."""

JUDGE_INSTRUCTIONS = """\
You grade AI agents. Every trajectory below is one attempt by an agent at the same task; read the \
task from the shared context and the conversations themselves (the system prompt states it, when \
there is one). Compare the attempts with each other and give each a score from 0 (no use at all) \
to 1 (the task done as well as it can be), following the rubric. Answer with JSON only: \
{{"scores": [{{"trajectory_id": "<id>", "explanation": "<one or two sentences on why>", \
"score": <0 to 1>}}, ...]}}, one entry per trajectory in the order given, the explanation before \
the score.

Rubric:
{rubric}"""
"""RULER's system message; `{rubric}` is the rubric in force."""

MAX_EXPLANATION_CHARS = 600
"""The longest explanation a vLLM judge may write (its regex constraint needs a bound)."""


class TrajectoryScore(BaseModel):
    """The judge's verdict on one trajectory.

    Attributes:
        trajectory_id: "1".."N", the trajectory's position (1-based) in the judged list.
        explanation: the judge's reason, in its words.
        score: from 0 to 1 (a JSON number: a bool or a string is not a score).
    """

    model_config = ConfigDict(extra="forbid")

    trajectory_id: str
    explanation: str
    # strict: lax pydantic would read a judge's `true` as 1.0 and "0.5" as 0.5, a reward the
    # judge never wrote as a number
    score: float = Field(ge=0.0, le=1.0, strict=True, allow_inf_nan=False)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scores: list[TrajectoryScore]


class _ReplyError(Exception):
    """A reply that does not parse as the scores asked for."""


def _common_prefix_len(message_lists: Sequence[Sequence[Any]]) -> int:
    first = message_lists[0]
    length = 0
    for index, message in enumerate(first):
        if all(len(other) > index and other[index] == message for other in message_lists):
            length += 1
        else:
            break
    return length


def _dumps(value: Any) -> str:
    def plain(item: Any) -> Any:
        if isinstance(item, BaseModel):
            return item.model_dump(mode="json")
        raise TypeError(f"a {type(item).__name__} in a message cannot be shown to the judge as JSON")

    return json.dumps(value, ensure_ascii=False, default=plain)


def judge_messages(
    message_lists: Sequence[Sequence[Mapping[str, Any]]], rubric: str, tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, str]], list[str]]:
    """The judge's two messages for `message_lists`, and the trajectory ids it is asked to score.

    Messages every trajectory begins with are shown once, as shared context. When all the
    trajectories are the same conversation, it is shown once, as trajectory "1" (the judge then
    scores it alone, and every copy gets that score).

    Raises:
        TypeError: a message holds a value JSON cannot show (not a str, number, list, dict or
            pydantic model).
    """
    prefix = _common_prefix_len(message_lists)
    identical = all(len(messages) == prefix for messages in message_lists)
    parts: list[str] = []
    if identical:
        shown = [list(message_lists[0])]
    else:
        if prefix:
            parts.append(f"<shared_context>\n{_dumps(list(message_lists[0][:prefix]))}\n</shared_context>")
        shown = [list(messages[prefix:]) for messages in message_lists]
    if tools:
        parts.append(f"<tools_offered>\n{_dumps(tools)}\n</tools_offered>")
    ids = [str(i) for i in range(1, len(shown) + 1)]
    trajectories = "\n\n".join(
        f'<trajectory id="{i}">\n{_dumps(messages)}\n</trajectory>' for i, messages in zip(ids, shown)
    )
    parts.append(f"Trajectories to score:\n\n{trajectories}")
    return (
        [
            {"role": "system", "content": JUDGE_INSTRUCTIONS.format(rubric=rubric.strip())},
            {"role": "user", "content": "\n\n".join(parts)},
        ],
        ids,
    )


def parse_scores(content: str, ids: list[str]) -> list[TrajectoryScore]:
    """The scores in a reply, in `ids` order.

    Control characters inside strings are taken (a judge's raw newline in an explanation).

    Raises:
        _ReplyError: not JSON, not `{"scores": [...]}`, a score outside [0, 1], or ids that are not
            exactly `ids` (each once).
    """
    try:
        reply = _Reply.model_validate(json.loads(content, strict=False))
    except (json.JSONDecodeError, ValidationError) as exc:
        shown = content if len(content) <= 200 else content[:200] + "..."
        raise _ReplyError(
            f"the reply {shown!r} is not RULER's scores ({type(exc).__name__}: {exc})"
        ) from None
    got = [score.trajectory_id for score in reply.scores]
    if sorted(got) != sorted(ids):
        raise _ReplyError(f"the reply scores trajectories {got}, not {ids} (each once)")
    by_id = {score.trajectory_id: score for score in reply.scores}
    return [by_id[i] for i in ids]


def _check_args(
    where: str,
    rubric: Any,
    extra_litellm_params: Any,
    max_explanation_chars: Any,
    cache_dir: Any,
    flags: Mapping[str, Any],
) -> dict[str, Any]:
    for name, value in flags.items():  # a string such as "false" would read as on
        check(where, name, value, bool_problem, "True")
    if not isinstance(rubric, str) or not rubric.strip():
        raise HyperParameterError(
            f"{where}(rubric={rubric!r}) must be a non-empty string of grading rules; pass e.g. "
            "rubric=art_mega.rewards.DEFAULT_RUBRIC",
            "rubric",
            rubric,
        )
    if extra_litellm_params is not None and not isinstance(extra_litellm_params, Mapping):
        raise HyperParameterError(
            f"{where}(extra_litellm_params={extra_litellm_params!r}) must be a dict of request "
            "options or None; pass e.g. extra_litellm_params={'temperature': 0}",
            "extra_litellm_params",
            extra_litellm_params,
        )
    check(where, "extra_litellm_params", extra_litellm_params, json_finite_problem, "{'temperature': 0}")
    check(where, "max_explanation_chars", max_explanation_chars, whole_problem(1), "600")
    if cache_dir is not None and not isinstance(cache_dir, str | Path):
        raise HyperParameterError(
            f"{where}(cache_dir={cache_dir!r}) must be a folder path or None (the default cache)",
            "cache_dir",
            cache_dir,
        )
    return dict(extra_litellm_params or {})


def _check_conversation(where: str, index: int, messages: Any) -> None:
    """Refuse a trajectory the judge could not read as a chat: not a list, empty (nothing to
    score), or holding something that is not a message dict with a "role"."""
    problem = None
    if not isinstance(messages, list):
        problem = f"is a {type(messages).__name__}, not a list of chat messages"
    elif not messages:
        problem = "is empty, so there is nothing to score"
    else:
        bad = next((k for k, m in enumerate(messages) if not isinstance(m, Mapping) or "role" not in m), None)
        if bad is not None:
            problem = f"[{bad}] is {messages[bad]!r:.80}, not a chat message dict with a 'role'"
    if problem is not None:
        raise HyperParameterError(
            f"{where}(message_lists[{index}]) {problem}; pass each trajectory's messages, e.g. "
            "trajectory.messages()",
            "message_lists",
            index,
        )


async def ruler(
    message_lists: list[list[dict[str, Any]]],
    judge_model: Any = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[dict[str, Any]] | None = None,
    *,
    debug: bool = False,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    max_explanation_chars: int = MAX_EXPLANATION_CHARS,
) -> list[TrajectoryScore]:
    """Score trajectories against each other with one judge call (ART's `ruler`).

    Args:
        message_lists: N conversations (chat message dicts) attempting the same task.
        judge_model: a LiteLLM model name ("openai/o3", "anthropic/...", "hosted_vllm/<name>"
            with `api_base` in `extra_litellm_params`; needs the `rewards` extra), or an
            `art_mega.Model`: a TrainableModel judges with the policy its replicas serve now, a
            prompted `art.Model(inference_base_url=, inference_api_key=, inference_model_name=)`
            with that OpenAI-compatible endpoint (e.g. the run's replica: its base model is
            served as the trainable model's `name`).
        extra_litellm_params: more request options (temperature, max_tokens, api_base, ...):
            LiteLLM's for a name, `chat.completions.create`'s for a Model judge.
        rubric: the grading rules (default `DEFAULT_RUBRIC`).
        tools: the tool schemas the agent was offered, shown to the judge.
        debug: print the judge's parsed reply.
        cache: read and write the on-disk cache: a reply is stored under the sha256 of the
            exact request, and the same request again is answered from it without a call.
        cache_dir: the cache folder (default `$ART_MEGA_CACHE/ruler`, `~/.cache/art-mega/ruler`).
        max_explanation_chars: the bound on each explanation of a vLLM judge (see `judge`).

    Returns:
        N `TrajectoryScore`s in `message_lists` order (trajectory_id "1".."N"); [] for no lists.

    The request's seconds go to `time/step_judge_ruler_s` and, where a price is known, its cost
    to `costs/<context>/judge/ruler` of the active `model.metrics_builder()` (nothing when no
    builder is active or the reply came from the cache).

    Raises:
        RulerJudgeError: the judge could not be reached or refused, or answered twice with a
            reply that is not the scores asked for (one retry).
        HyperParameterError: an argument out of range or of the wrong type.
        MissingExtraError: a LiteLLM name without the `rewards` extra installed.
    """
    where = "ruler"
    extra = _check_args(
        where, rubric, extra_litellm_params, max_explanation_chars, cache_dir, {"debug": debug, "cache": cache}
    )
    if not isinstance(message_lists, list):
        raise HyperParameterError(
            f"{where}(message_lists=...) must be a list of message lists, not a {type(message_lists).__name__}",
            "message_lists",
            type(message_lists).__name__,
        )
    for index, messages in enumerate(message_lists):
        _check_conversation(where, index, messages)
    if not message_lists:
        return []
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise HyperParameterError(
            f"{where}(tools={tools!r:.80}) must be a list of tool schema dicts or None; pass the "
            "trajectory's tools, e.g. trajectory.tools",
            "tools",
            tools,
        )
    judge = judging.resolve_judge(judge_model, extra, where)
    try:
        messages, ids = judge_messages(message_lists, rubric, tools)
    except TypeError as exc:  # a value in a message or a tool that JSON cannot show
        raise HyperParameterError(
            f"{where}(message_lists / tools): {exc}; give plain JSON values (str, number, list, dict) "
            "or pydantic models",
            "message_lists",
            str(exc),
        ) from None
    if len(ids) == 1 and len(message_lists) > 1:
        log.warning(
            "RULER: all %d trajectories are the same conversation; the judge scores it alone "
            "(no comparison to ground the score)",
            len(message_lists),
        )
    request = judging.build_request(judge, messages, ids, extra, max_explanation_chars, where)
    folder = Path(cache_dir) if cache_dir is not None else judging.default_cache_dir()
    scores = await _judge(judge, request, ids, folder if cache else None, debug)
    if len(ids) == 1:
        return [
            scores[0].model_copy(update={"trajectory_id": str(i)}) for i in range(1, len(message_lists) + 1)
        ]
    return scores


async def _judge(
    judge: judging.Judge, request: judging.JudgeRequest, ids: list[str], cache_dir: Path | None, debug: bool
) -> list[TrajectoryScore]:
    if cache_dir is not None:
        cached = judging.read_cache(cache_dir, request)
        if cached is not None:
            try:
                scores = parse_scores(cached.content, ids)
            except _ReplyError as exc:
                log.warning(
                    "RULER cache entry %s does not parse (%s); asking the judge again", cached.key, exc
                )
            else:
                _show(debug, scores, cached=True)
                return scores
    problem = ""
    for attempt in (1, 2):
        try:
            reply = await judging.send(judge, request)
        except RulerJudgeError as exc:
            raise RulerJudgeError(judge.shown, exc.detail, attempts=attempt) from exc.__cause__
        judging.record_spend(judge, reply)
        try:
            scores = parse_scores(reply.content, ids)
        except _ReplyError as exc:
            problem = str(exc)
            log.warning("RULER judge %s, attempt %d: %s", judge.shown, attempt, problem)
            continue
        if cache_dir is not None:
            judging.write_cache(cache_dir, request, reply.content, judging.usage_of(reply.response))
        _show(debug, scores, cached=False)
        return scores
    raise RulerJudgeError(judge.shown, f"{problem} (asked twice)", attempts=2)


def _show(debug: bool, scores: list[TrajectoryScore], cached: bool) -> None:
    if debug:
        from rich import print as rich_print

        rich_print(f"[RULER] judge reply{' (from the cache)' if cached else ''}:")
        rich_print([score.model_dump() for score in scores])


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: Any = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    max_explanation_chars: int = MAX_EXPLANATION_CHARS,
) -> TrajectoryGroup | None:
    """A copy of `group` with RULER's scores as rewards (ART's `ruler_score_group`): each
    trajectory keeps its old reward as `metrics["independent_reward"]`, gets the score as
    `reward` and `metrics["ruler_score"]`, and the judge's explanation as a last `logs` line
    ("RULER explanation: ..."). The group's exceptions, metadata, metrics and logs are kept.

    One judge call for the group (see `ruler`; the judge sees the first trajectory's tools).
    With `swallow_exceptions=True` a judge that fails (`RulerJudgeError`) gives None instead,
    so `gather_trajectory_groups(after_each=lambda g: ruler_score_group(g, ...,
    swallow_exceptions=True))` leaves that group out; argument mistakes are raised either way.

    Raises:
        TrainInputError: a trajectory has `additional_histories` (RULER judges one
            conversation per trajectory, as in ART).
        RulerJudgeError, HyperParameterError, MissingExtraError: see `ruler`.
    """
    where = "ruler_score_group"
    check(where, "swallow_exceptions", swallow_exceptions, bool_problem, "True")
    if not isinstance(group, TrajectoryGroup):
        raise HyperParameterError(
            f"{where}(group=...) must be a TrajectoryGroup, not a {type(group).__name__}; pass one "
            "finished group (gather_trajectory_groups(after_each=...) passes each)",
            "group",
            type(group).__name__,
        )
    for index, trajectory in enumerate(group.trajectories):
        if trajectory.additional_histories:
            raise TrainInputError(
                f"{where}: trajectory {index} has additional_histories, which RULER does not judge; "
                "score such trajectories with your own reward",
                "group",
                trajectory=index,
            )
    trajectories = [t.model_copy(deep=True) for t in group.trajectories]
    for trajectory in trajectories:
        trajectory.metrics["independent_reward"] = trajectory.reward
    try:
        scores = await ruler(
            [t.messages() for t in trajectories],
            judge_model,
            extra_litellm_params,
            rubric,
            trajectories[0].tools if trajectories else None,
            debug=debug,
            cache=cache,
            cache_dir=cache_dir,
            max_explanation_chars=max_explanation_chars,
        )
    except RulerJudgeError as exc:
        if not swallow_exceptions:
            raise
        log.warning("RULER: the group is left out (swallow_exceptions=True): %s", exc)
        return None
    for trajectory, score in zip(trajectories, scores):
        trajectory.reward = score.score
        trajectory.metrics["ruler_score"] = score.score
        trajectory.log(f"RULER explanation: {score.explanation}")
    return TrajectoryGroup(
        trajectories,
        exceptions=list(group.exceptions),
        metadata=dict(group.metadata),
        metrics=dict(group.metrics),
        logs=list(group.logs),
    )
