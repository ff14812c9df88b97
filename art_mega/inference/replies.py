"""Checks of an OpenAI-compatible server's non-streamed completion reply before art-mega reads
it: a reply without choices, or a choice without its message (chat) or its text (completions),
is one sentence naming the server and the model, not an IndexError or AttributeError wherever
the reply is first read.
"""

from __future__ import annotations

from typing import Any

from art_mega.errors import CompletionReplyError

SHOWN_CHARS = 120
"""How much of a value that came back a problem quotes (its repr, cut with "...")."""


def is_chat_completions_path(path: str) -> bool:
    """True for a URL path of the OpenAI chat completions route (`.../chat/completions`): the
    requests a capture reads; other APIs with a messages list (Anthropic's /v1/messages,
    Ollama's /api/chat) are not chat completions."""
    return path.endswith("/chat/completions")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}..."


def reply_problem(reply: Any, chat: bool = True) -> str | None:
    """What keeps `reply` from being read, worded to follow "answered ... with" (what came back
    and what was expected); None when it reads.

    `reply` is what the openai SDK's `chat.completions.create` (`chat`) or `completions.create`
    returned, or LiteLLM's `ModelResponse`. The SDK builds its object without validating the
    body: a body of another shape comes back as itself (a list, a str) or with fields of other
    types. A readable reply has a non-empty list `choices`; each chat choice a `message` whose
    `content` is a string or None and whose `tool_calls` is None or a list of calls that each
    have an `id` and a `function`; each completions choice a string `text`.
    """
    kind = "chat completion" if chat else "completion"
    if not hasattr(reply, "choices"):
        return f"a {type(reply).__name__} ({_shown(reply)}) where a {kind} with choices was expected"
    choices = reply.choices
    if not isinstance(choices, list) or not choices:
        return f"no choices (choices={_shown(choices)}) where a list of at least one choice was expected"
    for k, choice in enumerate(choices):
        if not chat:
            text = getattr(choice, "text", None)
            if not isinstance(text, str):
                return f"choices[{k}].text={_shown(text)} where the sampled text (a string) was expected"
            continue
        message = getattr(choice, "message", None)
        if message is None or not hasattr(message, "content"):
            return f"choices[{k}].message={_shown(message)} where the sampled assistant message was expected"
        content = message.content
        if content is not None and not isinstance(content, str):
            return (
                f"choices[{k}].message.content={_shown(content)} where a string (or null beside "
                "tool calls) was expected"
            )
        calls = getattr(message, "tool_calls", None)
        if calls is not None and not (
            isinstance(calls, list) and all(hasattr(c, "id") and hasattr(c, "function") for c in calls)
        ):
            return (
                f"choices[{k}].message.tool_calls={_shown(calls)} where a list of tool calls, each "
                "with its id and function, was expected"
            )
    return None


def checked_reply(reply: Any, server: str, model: str, chat: bool = True) -> Any:
    """`reply`, once `reply_problem` finds nothing wrong with it.

    Args:
        server: who answered, e.g. "replica vllm-0 (http://127.0.0.1:8400)".
        model: the model the request asked for.

    Raises:
        CompletionReplyError: `reply_problem`'s problem, naming `server` and `model`.
    """
    problem = reply_problem(reply, chat)
    if problem is not None:
        raise CompletionReplyError(server, model, problem)
    return reply
