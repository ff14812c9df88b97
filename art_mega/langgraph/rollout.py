"""`wrap_rollout(model, fn)`: run a LangGraph rollout and build its trajectory from the chat
completions its chat models made (ART's `art.langgraph.wrap_rollout`).

While a wrapped rollout runs, every chat completion a model from `init_chat_model` makes is
recorded here as the server answered it: the request's messages and tools and the sampled
`Choice`, with its token ids, logprobs, `prompt_token_ids` and `policy_step` (see
`art_mega.langgraph.chat_model`). When the rollout returns its `Trajectory`, the completions are
joined into conversations (`conversations`): the first becomes the trajectory's
`messages_and_choices` and `tools`, the others are appended to its `additional_histories`, so
every assistant turn that trains is a sampled `Choice`, never a re-serialized message.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from art_mega.errors import LangGraphUsageError
from art_mega.trajectories import History, Trajectory


@dataclass
class Completion:
    """One recorded chat completion: the request's `messages` and `tools` as sent (OpenAI wire
    dicts, None when no tools were offered) and the reply's `choices` (openai `Choice`s)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    choices: list[Any]


@dataclass
class WrappedRollout:
    """The state of one running `wrap_rollout` call: its model, the completions recorded so
    far, and how many streamed completions went by (refused when the rollout ends)."""

    model: Any
    completions: list[Completion] = field(default_factory=list)
    streamed: int = 0
    unreadable: list[str] = field(default_factory=list)
    """Why each answered completion that could not be recorded could not (refused at the end:
    raising inside the HTTP hook would reach the rollout as the SDK's connection error)."""

    def router(self) -> Any:
        """The `PolicyRouter` of the model's replicas; None for a model without a backend (a
        prompted `art.Model(inference_base_url=...)`)."""
        backend = getattr(self.model, "_backend", None)
        return None if backend is None else backend.policy_router(self.model)

    def record(self, request_body: bytes, response_body: bytes, url: str | None = None) -> None:
        """Record one answered (HTTP 200) chat completion from its raw request and response
        bodies (sent to `url`, None where not known); with a router, each choice is tagged with
        the step that served it and its prompt's token ids (`tag_choices`).

        A body that is not the JSON of a chat completion with choices (vLLM's answer always
        is; `inference.replies.reply_problem`) is noted in `unreadable` instead, naming the
        server and the model asked for.
        """
        from openai.types.chat import ChatCompletion
        from pydantic import ValidationError

        from art_mega.inference.policy_client import tag_choices
        from art_mega.inference.replies import reply_problem

        request = json.loads(request_body)  # the SDK's own JSON body
        try:
            data = json.loads(response_body)
        except ValueError as exc:
            problem: str | None = f"a body that is not JSON ({exc})"
        else:
            # construct: the SDK's own unvalidated build, whose fields reply_problem checks
            problem = reply_problem(ChatCompletion.construct(**data) if isinstance(data, dict) else data)
        if problem is None:
            try:
                completion = ChatCompletion.model_validate(data)
            except ValidationError as exc:
                first = exc.errors()[0]
                problem = f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}"
        if problem is not None:
            server = f"server {url}" if url else "the server"
            self.unreadable.append(f"{server} answered model {request.get('model')} with {problem}")
            return
        router = self.router()
        if router is not None:
            tag_choices(router, completion)
        self.completions.append(
            Completion(request["messages"], request.get("tools"), list(completion.choices))
        )


CURRENT: contextvars.ContextVar[WrappedRollout | None] = contextvars.ContextVar(
    "art_mega_langgraph_rollout", default=None
)
"""The `wrap_rollout` call running in this context (None outside one). LangGraph runs nodes in
tasks that copy the context, so they see (and record into) the same object."""


def _text(content: Any) -> str:
    """A message's content as text: a string as is, content parts' text joined, None as ""."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def echoes(message: dict[str, Any], choice: Any) -> bool:
    """Whether `message` (a request message) is `choice` sent back: an assistant message with
    the choice's text and the ids of its tool calls, in order (the arguments are not compared:
    LangChain re-serializes them from the parsed object)."""
    if message.get("role") != "assistant":
        return False
    sent_ids = [call.get("id") for call in message.get("tool_calls") or ()]
    sampled_ids = [call.id for call in choice.message.tool_calls or ()]
    return _text(message.get("content")) == _text(choice.message.content) and sent_ids == sampled_ids


def conversations(completions: list[Completion]) -> list[History]:
    """The recorded completions joined into conversations, in order of their first completion.

    A completion continues a conversation when it offers the same tools, the conversation's
    last request is a prefix of its messages, and the message right after that prefix echoes
    the conversation's last sampled choice (`echoes`): the conversation then grows by the
    messages after the echo (tool results, a new user turn) and the new choice, so each sampled
    turn is the `Choice` itself. Any other completion starts a new conversation (its messages and
    its choice); a reply's further choices (n > 1) are each their own conversation, as nothing
    continues them.
    """
    histories: list[History] = []
    ends: list[list[dict[str, Any]]] = []  # each history's last request
    for completion in completions:
        messages, first = completion.messages, completion.choices[0]
        for k, history in enumerate(histories):
            prefix = ends[k]
            n = len(prefix)
            if (
                history.tools == completion.tools
                and len(messages) > n
                and messages[:n] == prefix
                and echoes(messages[n], history.messages_and_choices[-1])
            ):
                history.messages_and_choices.extend([*messages[n + 1 :], first])
                ends[k] = messages
                break
        else:
            histories.append(History(messages_and_choices=[*messages, first], tools=completion.tools))
            ends.append(messages)
        for other in completion.choices[1:]:
            histories.append(History(messages_and_choices=[*messages, other], tools=completion.tools))
            ends.append(messages)
    return histories


def _unreadable_error(fn: Any, rollout: WrappedRollout) -> LangGraphUsageError:
    return LangGraphUsageError(
        f"the wrapped rollout {_name(fn)} got {len(rollout.unreadable)} chat completion "
        f"repl(ies) that are not an OpenAI chat completion ({rollout.unreadable[0]}); serve "
        "the chat model from an OpenAI-compatible server (the model's replica)",
        "wrap_rollout",
        "reply",
        rollout.unreadable[0],
    )


def current(call: str) -> WrappedRollout:
    """The running `wrap_rollout` call, for `call` (the caller's name, shown in the refusal).

    Raises:
        LangGraphUsageError: no wrapped rollout runs in this context.
    """
    rollout = CURRENT.get()
    if rollout is None:
        raise LangGraphUsageError(
            f"{call}() was called outside a wrapped rollout; call it inside the rollout you run as "
            "art_mega.langgraph.wrap_rollout(model, rollout)(...), which gives it the model to serve",
            call,
            "context",
            None,
        )
    return rollout


def wrap_rollout(model: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """ART's `wrap_rollout`: `fn` (an async rollout returning an `art.Trajectory`) wrapped so
    that the chat models it makes with `init_chat_model()` serve `model` and every completion
    they make lands in the trajectory it returns.

    The wrapper awaits `fn(*args, **kwargs)`; when completions were recorded, the returned
    trajectory's `messages_and_choices` and `tools` are replaced by the first conversation (as
    ART does) and the others appended to its `additional_histories` (see `conversations`);
    with none recorded the trajectory is returned as it is.

    Raises:
        LangGraphUsageError: `model` is not an `art.Model`, or `fn` is not callable (at wrap
            time); `fn` returned something other than an awaitable of a `Trajectory`, or
            streamed a chat completion (its reply carries no token ids), or a chat completion
            was answered with a body that is not one (also when `fn` then failed on it: that
            exception is the cause), when the wrapper runs.
        What `fn` raises.
    """
    from art_mega.model import Model

    if not isinstance(model, Model):
        raise LangGraphUsageError(
            f"wrap_rollout's model is a {type(model).__name__}, not an art.Model; pass the "
            "(registered) model whose replica the rollout's chat models should use",
            "wrap_rollout",
            "model",
            model,
        )
    if not callable(fn):
        raise LangGraphUsageError(
            f"wrap_rollout's fn is a {type(fn).__name__}, not a function; pass the async rollout "
            "function itself, e.g. wrap_rollout(model, rollout)(model, scenario)",
            "wrap_rollout",
            "fn",
            fn,
        )

    @functools.wraps(fn)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        rollout = WrappedRollout(model)
        token = CURRENT.set(rollout)
        try:
            pending = fn(*args, **kwargs)
            if not inspect.isawaitable(pending):
                raise LangGraphUsageError(
                    f"the wrapped rollout {_name(fn)} returned a {type(pending).__name__}, not an "
                    "awaitable; wrap an async def rollout that returns an art.Trajectory",
                    "wrap_rollout",
                    "fn",
                    fn,
                )
            try:
                result = await pending
            except Exception as exc:
                # LangChain reads an unreadable reply first and fails on it (an IndexError, a
                # TypeError): the sentence naming the server is the cause to report
                if rollout.unreadable:
                    raise _unreadable_error(fn, rollout) from exc
                raise
        finally:
            CURRENT.reset(token)
        if not isinstance(result, Trajectory):
            raise LangGraphUsageError(
                f"the wrapped rollout {_name(fn)} returned a {type(result).__name__}, not an "
                "art.Trajectory; return the trajectory (its reward set) for its completions to land in",
                "wrap_rollout",
                "result",
                result,
            )
        if rollout.streamed:
            raise LangGraphUsageError(
                f"the wrapped rollout {_name(fn)} streamed {rollout.streamed} chat completion(s), "
                "whose replies carry no token ids to train; call the chat model with ainvoke/invoke, "
                "not astream/stream, and without streaming=True",
                "wrap_rollout",
                "stream",
                rollout.streamed,
            )
        if rollout.unreadable:
            raise _unreadable_error(fn, rollout)
        histories = conversations(rollout.completions)
        if histories:
            result.messages_and_choices = histories[0].messages_and_choices
            result.tools = histories[0].tools
            result.additional_histories.extend(histories[1:])
        return result

    return wrapped


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
