"""RULER's judge calls: one request to an LLM, its on-disk cache, and what it cost and took.

A judge is a LiteLLM model name ("openai/o3", "hosted_vllm/Qwen3-32B" with `api_base` in the
extra parameters, ...; the `rewards` extra) or an `art_mega.Model`: a `TrainableModel` judges
with the policy its replicas serve now, a prompted `art.Model(inference_base_url=...,
inference_api_key=..., inference_model_name=...)` with any OpenAI-compatible endpoint (both
through the `openai` client, no extra needed).

The reply is constrained to RULER's JSON where the server can do it: vLLM servers (a
`TrainableModel`, a `hosted_vllm/` name) get vLLM's `structured_outputs` regex of the exact,
compact answer (so even a small or untrained judge cannot answer anything else); every other
judge gets an OpenAI `response_format` JSON schema.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from art_mega.errors import HyperParameterError, MissingExtraError, RulerJudgeError
from art_mega.inference.replies import reply_problem
from art_mega.model import Model

log = logging.getLogger(__name__)

Constraint = Literal["json_schema", "vllm_regex"]

RESERVED_PARAMS = frozenset({"model", "messages", "response_format"})
"""Request keys RULER sets itself; given in `extra_litellm_params` they would be a second value."""

ENDPOINT_PARAMS = frozenset({"api_base", "base_url", "api_key"})
"""LiteLLM's endpoint keys, which a Model judge takes from the model itself."""

CACHE_VERSION = 1
"""Bumped when the cache file's content changes meaning (old files are then asked anew)."""

_TEXT_CHAR = r'([^"\\\x00-\x1f]|\\["\\/nt])'
_SCORE = r"(0(\.[0-9]{1,4})?|1(\.0{1,4})?)"


def default_cache_dir() -> Path:
    """`<art-mega cache root>/ruler` (`$ART_MEGA_CACHE` or `~/.cache/art-mega`)."""
    from art_mega.launch.context import default_cache_root

    return Path(default_cache_root()) / "ruler"


def reply_schema(ids: list[str]) -> dict[str, Any]:
    """The JSON schema of a reply scoring trajectories `ids` (one entry each)."""
    return {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "minItems": len(ids),
                "maxItems": len(ids),
                "items": {
                    "type": "object",
                    "properties": {
                        "trajectory_id": {"type": "string", "enum": ids},
                        "explanation": {"type": "string"},
                        "score": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                    "required": ["trajectory_id", "explanation", "score"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    }


def reply_regex(ids: list[str], max_explanation_chars: int) -> str:
    """vLLM's regex of the compact reply: the entries in `ids` order, each explanation at most
    `max_explanation_chars` characters (plain or \\-escaped), each score a decimal in [0, 1]."""

    def entry(trajectory_id: str) -> str:
        return (
            r'\{"trajectory_id":"'
            + trajectory_id
            + r'","explanation":"'
            + _TEXT_CHAR
            + "{0,"
            + str(max_explanation_chars)
            + r'}","score":'
            + _SCORE
            + r"\}"
        )

    return r'\{"scores":\[' + ",".join(entry(i) for i in ids) + r"\]\}"


class JudgeRequest(BaseModel):
    """One judge request exactly as sent; `key()` names it in the cache.

    Attributes:
        judge: the LiteLLM model name, or "<base_url> <served model name>" for a Model judge.
        messages: the system and user messages.
        constraint: how the reply is constrained (see the module docstring).
        constraint_params: the request keys that carry the constraint.
        params: every other key sent (`extra_litellm_params`, and for a TrainableModel judge
            the switches that turn off its rollout defaults).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    judge: str
    messages: list[dict[str, str]]
    constraint: Constraint
    constraint_params: dict[str, Any]
    params: dict[str, Any]

    def key(self) -> str:
        """sha256 hex of the request's canonical JSON (keys sorted; a value JSON cannot hold, such
        as a client object, by its repr)."""
        text = json.dumps(
            {"version": CACHE_VERSION, **self.model_dump()},
            sort_keys=True,
            separators=(",", ":"),
            default=repr,
        )
        return hashlib.sha256(text.encode()).hexdigest()


class CachedReply(BaseModel):
    """A cache file: the judge's text for the request `key` and the usage it reported."""

    model_config = ConfigDict(extra="forbid")

    version: int
    key: str
    judge: str
    content: str
    usage: dict[str, Any] | None
    created: str


@dataclass
class JudgeReply:
    """The judge's answer text; `response` is the provider's response object (None from the
    cache); `latency_s` the seconds the request took (0 from the cache)."""

    content: str
    response: Any
    latency_s: float
    cached: bool


@dataclass(frozen=True)
class Judge:
    """A resolved judge: how to send to it and how to name and price it.

    Attributes:
        name: the LiteLLM model name, or a Model judge's served model name.
        model: the Model judge (None for a LiteLLM name).
        provider: the pricing provider (the LiteLLM prefix; "hosted_vllm" for a TrainableModel,
            "openai" for a prompted Model), None when the name has no provider prefix.
        constraint: see the module docstring.
    """

    name: str
    model: Model | None
    provider: str | None
    constraint: Constraint

    @property
    def shown(self) -> str:
        return self.name if self.model is None else f"{self.name} (model {self.model.name!r})"


def resolve_judge(judge_model: Any, extra_params: Mapping[str, Any], where: str) -> Judge:
    """The `Judge` for `judge_model` (a LiteLLM name or an `art_mega.Model`).

    Raises:
        HyperParameterError: `judge_model` is neither, an empty name, or `extra_params` holds a key
            RULER sets itself (or, for a Model judge, an endpoint key the model carries).
    """
    if isinstance(judge_model, Model):
        taken = sorted((RESERVED_PARAMS | ENDPOINT_PARAMS) & set(extra_params))
        if taken:
            raise HyperParameterError(
                f"{where}(extra_litellm_params) sets {taken}, which a Model judge takes from the model "
                f"{judge_model.name!r} (its endpoint) or RULER sets itself; leave them out",
                "extra_litellm_params",
                dict(extra_params),
            )
        if judge_model.trainable:
            return Judge(judge_model.get_inference_name(), judge_model, "hosted_vllm", "vllm_regex")
        judge_model._endpoint()
        return Judge(judge_model.get_inference_name(), judge_model, "openai", "json_schema")
    if not isinstance(judge_model, str) or not judge_model.strip():
        raise HyperParameterError(
            f"{where}(judge_model={judge_model!r}) must be a LiteLLM model name or an art_mega.Model; "
            "pass e.g. judge_model='openai/o4-mini', or judge_model=model to judge with its replicas",
            "judge_model",
            judge_model,
        )
    taken = sorted(RESERVED_PARAMS & set(extra_params))
    if taken:
        raise HyperParameterError(
            f"{where}(extra_litellm_params) sets {taken}, which RULER sets itself; leave them out",
            "extra_litellm_params",
            dict(extra_params),
        )
    provider, slash, _ = judge_model.partition("/")
    provider = provider.strip().lower() if slash and provider.strip() else None
    return Judge(judge_model, None, provider, "vllm_regex" if provider == "hosted_vllm" else "json_schema")


def build_request(
    judge: Judge,
    messages: list[dict[str, str]],
    ids: list[str],
    extra_params: Mapping[str, Any],
    max_explanation_chars: int,
    where: str,
) -> JudgeRequest:
    """The request for `messages` scoring `ids`.

    Raises:
        HyperParameterError: `extra_params["extra_body"]` is not a dict, or sets
            `structured_outputs`, which the vLLM constraint needs.
    """
    params = dict(extra_params)
    if judge.model is not None and judge.model.trainable:
        # the policy client's rollout defaults: a judge's reply is never trained on
        params.setdefault("logprobs", False)
        params["extra_body"] = {"return_token_ids": False, **dict(params.get("extra_body") or {})}
    if judge.constraint == "vllm_regex":
        body = params.pop("extra_body", None) or {}
        if not isinstance(body, dict) or "structured_outputs" in body:
            raise HyperParameterError(
                f"{where}(extra_litellm_params['extra_body']={body!r}) must be a dict without "
                "'structured_outputs' (RULER constrains a vLLM judge's reply with it)",
                "extra_litellm_params",
                dict(extra_params),
            )
        constraint = {
            "extra_body": {**body, "structured_outputs": {"regex": reply_regex(ids, max_explanation_chars)}}
        }
    else:
        constraint = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "ruler_scores", "schema": reply_schema(ids), "strict": True},
            }
        }
    judge_id = judge.name if judge.model is None else f"{judge.model.inference_base_url} {judge.name}"
    return JudgeRequest(
        judge=judge_id,
        messages=messages,
        constraint=judge.constraint,
        constraint_params=constraint,
        params=params,
    )


def _cache_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / key[:2] / f"{key}.json"


def read_cache(cache_dir: Path, request: JudgeRequest) -> CachedReply | None:
    """The cached reply of `request`, or None (absent, or written by another cache version; an
    unreadable file is reported and asked anew, then overwritten)."""
    key = request.key()
    path = _cache_path(cache_dir, key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        cached = CachedReply.model_validate_json(text)
    except ValueError as exc:
        log.warning("RULER cache file %s is unreadable (%s); asking the judge again", path, exc)
        return None
    if cached.version != CACHE_VERSION or cached.key != key:
        return None
    return cached


def write_cache(cache_dir: Path, request: JudgeRequest, content: str, usage: dict[str, Any] | None) -> Path:
    """Store a reply that parsed (temp file + rename: a reader never sees half a file)."""
    key = request.key()
    path = _cache_path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = CachedReply(
        version=CACHE_VERSION,
        key=key,
        judge=request.judge,
        content=content,
        usage=usage,
        created=datetime.datetime.now(datetime.UTC).isoformat(),
    )
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(entry.model_dump_json())
    os.replace(tmp, path)
    return path


def _litellm() -> Any:
    try:
        # LiteLLM fetches its price table from the network at import unless told to use the copy
        # it ships: a host without internet access would wait on retries for every import.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm
    except ImportError:
        raise MissingExtraError(
            "art_mega.rewards.ruler with a LiteLLM judge name", "litellm", "rewards"
        ) from None
    return litellm


def usage_of(response: Any) -> dict[str, Any] | None:
    usage = getattr(response, "usage", None)
    if usage is None:
        return None
    return usage.model_dump(mode="json") if hasattr(usage, "model_dump") else dict(usage)


async def send(judge: Judge, request: JudgeRequest) -> JudgeReply:
    """Send `request` once.

    Raises:
        RulerJudgeError: the judge could not be reached, refused the request, or answered with
            no choice, or a choice without its message (`inference.replies.reply_problem`; the
            transport's own exception is its cause).
        MissingExtraError: a LiteLLM judge without litellm installed.
    """
    options = {**request.params, **request.constraint_params}
    if judge.model is None:
        litellm = _litellm()
        call = litellm.acompletion(model=judge.name, messages=request.messages, caching=False, **options)
    else:
        client = judge.model.openai_client()
        call = client.chat.completions.create(model=judge.name, messages=request.messages, **options)
    started = time.monotonic()
    try:
        response = await call
    except Exception as exc:  # whatever the transport raises: the judge failed to answer
        # the first line only: LiteLLM's APIConnectionError text carries the whole traceback
        said = (str(exc).splitlines() or [""])[0]
        raise RulerJudgeError(judge.shown, f"{type(exc).__name__}: {said}", attempts=1) from exc
    latency = time.monotonic() - started
    problem = reply_problem(response)
    if problem is not None:
        raise RulerJudgeError(judge.shown, f"the judge answered with {problem}", attempts=1)
    return JudgeReply(response.choices[0].message.content or "", response, latency, cached=False)


def record_spend(judge: Judge, reply: JudgeReply) -> None:
    """Add the request's seconds to `time/step_judge_ruler_s` and, where a price is known, its
    cost to `costs/<context>/judge/ruler` of the active metrics builder (none active: nothing,
    as in ART). A judge without a price (a local server, a provider art-mega cannot price) adds
    no cost row."""
    from art_mega.metrics import MetricsBuilder, record_latency

    if reply.cached:
        return
    record_latency("judge_ruler", reply.latency_s)
    if judge.provider is None:
        return
    try:
        builder = MetricsBuilder.get_active()
    except LookupError:
        return
    model_name = judge.name if judge.model is None else f"{judge.provider}/{judge.name}"
    try:
        builder.add_response_cost(
            "judge/ruler", reply.response, provider=judge.provider, model_name=model_name
        )
    except HyperParameterError:
        return  # no pricing for this judge: ART records nothing either
