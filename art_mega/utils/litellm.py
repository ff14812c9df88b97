"""ART's `art.utils.litellm.convert_litellm_choice_to_openai`: a LiteLLM completion's choice as
the OpenAI `Choice` a `Trajectory` holds, for rollouts that call
`litellm.acompletion(**model.litellm_completion_params(), messages=...)` (ART's email agent).

It reads the choice's attributes and imports nothing of LiteLLM: the caller's object already
is one, so this module needs no extra.
"""

from __future__ import annotations

from typing import Any

from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall, Function
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob

from art_mega.errors import HyperParameterError

WHERE = "convert_litellm_choice_to_openai"


def convert_litellm_choice_to_openai(litellm_choice: Any) -> Choice:
    """The OpenAI `Choice` of one non-streamed LiteLLM choice (`response.choices[i]`), as ART's:
    the assistant message's content and function tool calls, `finish_reason`, `index`, and the
    per-token logprobs (token, bytes, logprob, top logprobs) when the choice has them. LiteLLM's
    extra fields (`provider_specific_fields`, `reasoning_content`, ...) are not carried.

    Raises:
        HyperParameterError: not a LiteLLM `Choices` with a `message` (a streamed
            `StreamingChoices` holds a `delta`), a message whose role is not "assistant", a tool
            call that is not of type "function" or has no function name, or logprobs without
            their `content` list.
    """
    message = getattr(litellm_choice, "message", None)
    if message is None or not hasattr(litellm_choice, "finish_reason"):
        raise HyperParameterError(
            f"{WHERE}(litellm_choice) got a {type(litellm_choice).__name__} without a message; pass "
            "one of a non-streamed completion's choices, e.g. response.choices[0]",
            "litellm_choice",
            litellm_choice,
        )
    if message.role != "assistant":
        raise HyperParameterError(
            f"{WHERE}(litellm_choice) holds a message of role {message.role!r}; only a completion's "
            "assistant message converts",
            "litellm_choice",
            litellm_choice,
        )
    return Choice(
        message=ChatCompletionMessage(
            role="assistant", content=message.content, tool_calls=_tool_calls(message.tool_calls)
        ),
        finish_reason=litellm_choice.finish_reason,
        index=litellm_choice.index,
        logprobs=_logprobs(getattr(litellm_choice, "logprobs", None), litellm_choice),
    )


def _tool_calls(calls: Any) -> list[ChatCompletionMessageToolCall] | None:
    if not calls:
        return None
    converted = []
    for k, call in enumerate(calls):
        if call.type != "function" or call.function.name is None:
            raise HyperParameterError(
                f"{WHERE}(litellm_choice) tool call {k} is of type {call.type!r} with function name "
                f"{call.function.name!r}; only function calls with a name convert",
                "litellm_choice",
                call,
            )
        converted.append(
            ChatCompletionMessageToolCall(
                id=call.id,
                type="function",
                function=Function(name=call.function.name, arguments=call.function.arguments),
            )
        )
    return converted


def _logprobs(logprobs: Any, choice: Any) -> ChoiceLogprobs | None:
    if logprobs is None:
        return None
    if getattr(logprobs, "content", None) is None:
        raise HyperParameterError(
            f"{WHERE}(litellm_choice) has logprobs without their per-token content; ask for "
            "logprobs=True, or drop the choice's logprobs",
            "litellm_choice",
            choice,
        )
    return ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                token=lp.token,
                bytes=lp.bytes,
                logprob=lp.logprob,
                top_logprobs=[
                    TopLogprob(token=top.token, bytes=top.bytes, logprob=top.logprob)
                    for top in lp.top_logprobs or []
                ],
            )
            for lp in logprobs.content
        ]
    )
