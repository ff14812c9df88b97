"""`init_chat_model(...)`: the LangChain chat model a LangGraph agent runs on, serving the policy
of the rollout `wrap_rollout` wraps (ART's `art.langgraph.init_chat_model`).

It is LangChain's own `ChatOpenAI` (so `bind_tools`, `with_structured_output`, `invoke` /
`ainvoke` behave as LangChain documents them), pointed at one of the model's replicas and asking
for what training needs: `logprobs=True` and vLLM's `return_token_ids` (the sampled token ids
and the prompt's). Its HTTP clients carry a response hook that hands every answered chat
completion, raw, to the running `wrap_rollout` (`rollout.WrappedRollout.record`): the sampled
`Choice` is kept exactly as the server returned it, where LangChain's own parsing would drop the
token ids.
"""

from __future__ import annotations

import asyncio
import typing
import weakref
from typing import Any

from art_mega.errors import LangGraphUsageError, MissingExtraError
from art_mega.hyperparams import json_finite_problem
from art_mega.langgraph.rollout import CURRENT, current

_SET_HERE = {
    "model_name": "model",
    "openai_api_base": "base_url",
    "openai_api_key": "api_key",
    "openai_organization": "organization",
    "openai_proxy": "openai_proxy",
    "client": "client",
    "async_client": "async_client",
    "root_client": "root_client",
    "root_async_client": "root_async_client",
    "http_client": "http_client",
    "http_async_client": "http_async_client",
    "http_socket_options": "http_socket_options",
}
"""ChatOpenAI fields `init_chat_model` sets itself (field -> the keyword a caller would use):
the endpoint, the key and the HTTP clients that record the completions."""

_TRAINING_NEEDS = {
    "streaming": (False, "a streamed reply carries no token ids to train"),
    "use_responses_api": (False, "vLLM's chat completions carry the token ids, the Responses API does not"),
    "use_previous_response_id": (False, "it needs the Responses API"),
    "logprobs": (True, "training needs the sampling logprobs"),
}
"""ChatOpenAI fields whose value training fixes: field -> (the value it needs, why)."""

_AT_LEAST = {"temperature": 0, "max_tokens": 1, "max_completion_tokens": 1, "n": 1, "top_logprobs": 0}
"""Sampling options' lowest values: ChatOpenAI types them as plain numbers, so a negative one
would reach the replica (and vLLM answers HTTP 400 on the first turn of the rollout)."""


def _takes_bool(annotation: Any) -> bool:
    """Whether a ChatOpenAI field's type admits a bool (`bool`, `bool | None`, `Any`, ...)."""
    if annotation is bool or annotation is Any:
        return True
    return any(_takes_bool(arg) for arg in typing.get_args(annotation))


def _check_value(name: str, key: str, value: Any, annotation: Any) -> None:
    """Refuse a value ChatOpenAI would take but the request must not carry: NaN/inf anywhere in
    it (JSON has neither), a bool for a number (pydantic reads True as 1), a sampling option below
    its lowest value (`_AT_LEAST`)."""
    if json_finite_problem(value) is not None:
        raise _refuse(key, value, "give a finite number (JSON, and so the request, has no NaN or infinity)")
    if isinstance(value, bool) and not _takes_bool(annotation):
        raise _refuse(key, value, "give a number, not a bool")
    lowest = _AT_LEAST.get(name)
    if lowest is not None and isinstance(value, int | float) and value < lowest:
        raise _refuse(key, value, f"give {name} of at least {lowest}")


def _refuse(field: str, value: Any, fix: str) -> LangGraphUsageError:
    return LangGraphUsageError(
        f"init_chat_model: {field}={value!r} is refused; {fix}", "init_chat_model", field, value
    )


def _chat_openai() -> Any:
    """LangChain's ChatOpenAI class. Raises `MissingExtraError` when the `langgraph` extra is
    not installed."""
    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        raise MissingExtraError(
            "art_mega.langgraph.init_chat_model", "langchain-openai", "langgraph"
        ) from None
    return ChatOpenAI


def check_options(chat_openai: Any, kwargs: dict[str, Any], token_ids: bool) -> dict[str, Any]:
    """`kwargs` of `init_chat_model` checked against `chat_openai`'s fields and returned with
    what training needs filled in (`temperature` 1.0 unless given, as ART; `logprobs`, no
    streaming, chat completions; with `token_ids`, for a replica, `extra_body` gains vLLM's
    `return_token_ids`).

    Raises:
        LangGraphUsageError: a keyword that is not a ChatOpenAI field (or alias), one this
            function sets itself (`_SET_HERE`), one whose value training cannot use
            (`_TRAINING_NEEDS`), `extra_body` that is not a dict or turns `return_token_ids` off.
    """
    names = {}
    for name, info in chat_openai.model_fields.items():
        names[name] = name
        if info.alias:
            names[info.alias] = name
    options: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = names.get(key)
        if name is None:
            raise _refuse(
                key,
                value,
                "it is not an option of LangChain's ChatOpenAI; give a server option (such as vLLM's "
                f"top_k) in extra_body={{{key!r}: ...}}",
            )
        if name in _SET_HERE:
            raise _refuse(
                key,
                value,
                "init_chat_model sets it itself (the wrapped model's replica and the clients that "
                "record each completion for training); leave it out",
            )
        needed = _TRAINING_NEEDS.get(name)
        if needed is not None and value is not None and value != needed[0]:
            raise _refuse(key, value, f"{needed[1]}: leave it out or give {needed[0]!r}")
        _check_value(name, key, value, chat_openai.model_fields[name].annotation)
        options[name] = value
    extra_body = options.get("extra_body")
    if extra_body is None:
        extra_body = {}
    if not isinstance(extra_body, dict):
        raise _refuse("extra_body", extra_body, "give a dict of server options, e.g. {'top_k': 20}")
    if extra_body.get("return_token_ids", True) is not True:
        raise _refuse(
            "extra_body",
            extra_body,
            "training needs the sampled token ids: leave return_token_ids out or give True",
        )
    options["extra_body"] = {**extra_body, "return_token_ids": True} if token_ids else extra_body
    options.setdefault("temperature", 1.0)
    for name, (value, _) in _TRAINING_NEEDS.items():
        if options.get(name) is None:
            options[name] = value
    return options


def init_chat_model(
    model: str | None = None,
    *,
    model_provider: str | None = None,
    configurable_fields: None = None,
    config_prefix: str | None = None,
    **kwargs: Any,
) -> Any:
    """A LangChain `ChatOpenAI` serving the model of the running `wrap_rollout`, whose every
    chat completion is recorded into that rollout's trajectory.

    Args:
        model: the served name to ask for, e.g. `model.get_inference_name()` (ART's notebooks
            pass it); None: the latest served step's `<name>@<step>`.
        model_provider: None or "openai" (the replicas speak OpenAI's API).
        configurable_fields, config_prefix: LangChain's runtime-configurable models; art-mega's
            chat model is fixed to the wrapped model, so only None is taken.
        kwargs: ChatOpenAI options (`temperature`, default 1.0 as in ART; `max_tokens`, `seed`,
            `top_p`, `stop`, `extra_body`, `max_retries`, `timeout`, ...); see `check_options`.

    Returns:
        A `langchain_openai.ChatOpenAI` on one replica of the model (round-robin over those up,
        one pick per chat model), or on the model's `inference_base_url` for a model without a
        backend (`art.Model(inference_base_url=...)`, whose choices are not step-tagged).

    Raises:
        LangGraphUsageError: called outside a wrapped rollout; `model` not a string;
            `model_provider`, `configurable_fields` or `config_prefix` given; a refused keyword
            (`check_options`); a model with neither a backend nor an `inference_base_url`.
        MissingExtraError: the `langgraph` extra (langchain-openai) is not installed.
        NoReplicaUpError: every replica of the model is down.
    """
    rollout = current("init_chat_model")
    if model is not None and not isinstance(model, str):
        raise _refuse(
            "model", model, "give the served model name, e.g. model.get_inference_name(), or leave it out"
        )
    if model_provider not in (None, "openai"):
        raise _refuse(
            "model_provider",
            model_provider,
            "the wrapped model is served over OpenAI's API: leave it out or give 'openai'",
        )
    if configurable_fields is not None:
        raise _refuse(
            "configurable_fields",
            configurable_fields,
            "the chat model serves the wrapped model only and has no configurable fields; leave it out",
        )
    if config_prefix is not None:
        raise _refuse(
            "config_prefix",
            config_prefix,
            "it names configurable fields, which this chat model has none of; leave it out",
        )
    chat_openai = _chat_openai()
    served = rollout.model
    router = rollout.router()
    if router is not None:
        route = router.route()
        base_url, api_key, name = route.base_url, "art-mega", route.model
    elif served.inference_base_url:
        base_url = served.inference_base_url
        api_key = served.inference_api_key or "art-mega"
        name = served.inference_model_name or served.name
    else:
        raise LangGraphUsageError(
            f"init_chat_model: model {served.name!r} has no endpoint; register it "
            "(await model.register(backend)) or give art.Model(inference_base_url=...)",
            "init_chat_model",
            "model",
            served.name,
        )
    # another server than a replica may refuse vLLM's return_token_ids
    options = check_options(chat_openai, kwargs, token_ids=router is not None)
    from pydantic import ValidationError

    try:
        return chat_openai(
            model=model or name,
            base_url=base_url,
            api_key=api_key,
            http_client=_sync_client(),
            http_async_client=_async_client(),
            **options,
        )
    except ValidationError as exc:  # a value of the wrong type for its ChatOpenAI field
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "kwargs"
        raise _refuse(field, error.get("input"), f"{error['msg'][:1].lower()}{error['msg'][1:]}") from None


def _is_chat_completion(request: Any) -> bool:
    from art_mega.inference.replies import is_chat_completions_path

    return request.method == "POST" and is_chat_completions_path(request.url.path)


def _streamed(request: Any) -> bool:
    # the SDK sends a JSON body; `"stream": true` is what a streamed call adds to it
    import json

    try:
        return bool(json.loads(request.content).get("stream"))
    except (ValueError, AttributeError):
        return False


def _record_sync(response: Any) -> None:
    """httpx response hook (sync clients): record an answered chat completion into the running
    `wrap_rollout` (nothing outside one; an error reply is the SDK's to raise)."""
    rollout = _wanted(response)
    if rollout is not None:
        response.read()
        rollout.record(response.request.content, response.content, str(response.request.url))


async def _record_async(response: Any) -> None:
    """`_record_sync` for async clients."""
    rollout = _wanted(response)
    if rollout is not None:
        await response.aread()
        rollout.record(response.request.content, response.content, str(response.request.url))


def _wanted(response: Any) -> Any:
    """The running `WrappedRollout` when `response` answers a chat completion it records (a
    streamed one is only counted), else None."""
    rollout = CURRENT.get()
    if rollout is None or not _is_chat_completion(response.request):
        return None
    if _streamed(response.request):
        rollout.streamed += 1
        return None
    return rollout if response.status_code == 200 else None


_ASYNC_CLIENTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""The recording async HTTP client of each event loop (an httpx pool belongs to its loop)."""
_SYNC_CLIENT: list[Any] = []


def _async_client() -> Any:
    """The recording `openai.DefaultAsyncHttpxClient` of the running event loop: one pool for
    every chat model of the loop (init_chat_model runs once per rollout)."""
    import openai

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return openai.DefaultAsyncHttpxClient(event_hooks={"response": [_record_async]})
    if loop not in _ASYNC_CLIENTS:
        _ASYNC_CLIENTS[loop] = openai.DefaultAsyncHttpxClient(event_hooks={"response": [_record_async]})
    return _ASYNC_CLIENTS[loop]


def _sync_client() -> Any:
    """The recording `openai.DefaultHttpxClient` (for `invoke`; one per process)."""
    import openai

    if not _SYNC_CLIENT:
        _SYNC_CLIENT.append(openai.DefaultHttpxClient(event_hooks={"response": [_record_sync]}))
    return _SYNC_CLIENT[0]
