"""Trajectories -> token sequences with trained-token masks and sampling logprobs -> Documents.

Every trained assistant turn is trained on exactly its own tokens, after exactly the context the
model saw when it produced that turn: for a Choice from `model.openai_client()`, the prompt ids
vLLM tokenized for it (`prompt_token_ids`, recorded on the choice, so vLLM's own message
handling, `chat_template_kwargs` included, is what trains); otherwise the chat template's render
of the conversation before it with the generation prompt, tokenized whole as vLLM does. Where the
conversation so far is not a prefix of that context (templates such as Qwen3's re-render earlier
turns without their `<think>` block; a sampled turn re-tokenizes differently), the turn starts a
new sequence: each turn is then trained in its own history, as ART's `additional_histories` do.

- A sampled turn (an openai `Choice`) is its token ids and logprobs exactly as the server returned
  them (request `logprobs=True` and `extra_body={"return_token_ids": True}`): never re-tokenized.
  A Choice with logprobs but no token ids (as litellm converts vLLM's replies) takes its ids from
  its logprobs' tokens, as ART does ("token_id:<id>", else the vocabulary token).
- A plain assistant message (a dict, not sampled here) is trained only where the caller asks
  (`plain_assistant`, see `tokenize_history`): in SFT always; in GRPO, as in ART, only with
  `allow_training_without_logprobs`, with its old logprobs unknown (`UNKNOWN_LOGPROB`: the loss
  takes the current policy's, so its ratio is 1); otherwise it is context for the turns after
  it. Its tokens are the text the template adds for it (its render through the turn minus the
  render before it with the generation prompt), tokenized on its own as the model would emit
  it, through the first end-of-turn token (`end_of_turn_ids`: where vLLM stops). A template
  whose render of a trained plain turn does not continue its generation prompt is refused,
  naming the message.
- Tool-call `arguments` given as a JSON string (OpenAI's wire format) are parsed once before
  rendering, as vLLM does, so templates that print them as an object (Qwen2.5's `| tojson`)
  never render a double-escaped string; missing or empty arguments render as `{}` (vLLM's rule).
  A message the user wrote (a dict) is held to that form: arguments that are not a JSON object
  are refused, naming the message. A sampled turn (a Choice) trains on its sampled ids whatever
  vLLM's tool parser made of them (arguments that are a JSON int, list, string or null, JSON
  that does not parse, a truncated call, an unknown function, content beside the calls): where
  a later turn's context is rendered, its message is rendered as vLLM 0.32 renders it when the
  conversation is sent back (`_sampled_message`: arguments that are not a JSON object become
  `{}`, a null content no content parts).
- A list `content` (content parts) reaches the template as vLLM hands it over
  (`content_format`): its text parts joined with newlines, or the parts themselves for a
  template that iterates over them; an image, audio or other part is refused (text only).
- Tools reach the template in the form vLLM gives them (`template_tools`): the same key order,
  a missing description as null, so the tools block renders as it did at sampling.
- `additional_histories` become more sequences; all of a trajectory's sequences share its
  advantage and its weight (1 / its trained tokens).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from art_mega.errors import TokenizationError
from art_mega.trainer.batch import Document
from art_mega.trainer.behaviour import SFT_SAMPLING, TokenSampling, choice_sampling
from art_mega.trainer.prepare.advantages import group_advantages, token_weight
from art_mega.trajectories import Trajectory, TrajectoryGroup

UNKNOWN_LOGPROB = float("nan")
"""The old logprob of a trained token that was not sampled (a plain assistant message trained in
GRPO with `allow_training_without_logprobs`): unknown, so `loss.grpo_loss` uses the current
policy's logprob, detached, in its place (ratio 1, as ART does with its NaN logprobs). Set only
here, after `trajectories` has refused non-finite sampling logprobs, and only on trained tokens."""

PlainAssistant = Literal["sft", "current_policy", "context"]
"""What `tokenize_history` does with a plain assistant message: "sft" trains it with old logprob
0.0 (SFT reads none); "current_policy" trains it with `UNKNOWN_LOGPROB`; "context" does not train
it: it is the context of the later turns only."""


@dataclass
class TokenizedSequence:
    """One sequence: token ids, 1.0 on trained tokens, and each trained token's sampling logprob.

    The three lists have one entry per token; `old_logprobs[t]` is the logprob token t was
    sampled with: 0.0 on prompt tokens and on plain assistant messages trained for SFT,
    `UNKNOWN_LOGPROB` (NaN) on plain assistant messages trained in GRPO. `sampling[t]` is what
    token t was sampled with (`trainer.behaviour.choice_sampling` of its Choice; `SFT_SAMPLING`
    where it was not sampled).
    """

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    sampling: list[TokenSampling] = field(default_factory=list)

    def extend(
        self,
        ids: Sequence[int],
        trained: bool,
        logprobs: Sequence[float] | None = None,
        sampling: TokenSampling = SFT_SAMPLING,
    ) -> None:
        self.input_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([1.0 if trained else 0.0] * len(ids))
        self.old_logprobs.extend(list(logprobs) if logprobs is not None else [0.0] * len(ids))
        self.sampling.extend([sampling] * len(ids))

    @property
    def trained_tokens(self) -> int:
        return int(sum(1 for m in self.loss_mask if m > 0))


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: Any,
    generation_prompt: bool,
    where: str,
    turn: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template's text for `messages` (the conversation before or through `turn`),
    rendered with `template_kwargs` as extra template variables (vLLM's chat_template_kwargs)."""
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # the model's own Jinja template: any error is about this input
        through = (
            f"through messages_and_choices[{len(messages) - 1}]"
            if messages
            else f"before messages_and_choices[{turn}]"
        )
        raise TokenizationError(
            f"{where}: the model's chat template could not render the conversation {through} "
            f"({type(exc).__name__}: {exc}); give that message the fields the template reads (a string "
            "'content') or train a model whose chat template supports it (tools, tool_calls)",
            where,
            turn,
        ) from None
    if not isinstance(text, str):
        raise TokenizationError(
            f"{where}: the model's chat template rendered a {type(text).__name__}, not text, for "
            f"messages[{turn}]; give the tokenizer a chat template that renders one conversation",
            where,
            turn,
        )
    return text


def _encode(tokenizer: Any, text: str) -> list[int]:
    """`text` as token ids, the way vLLM tokenizes a rendered chat (no added special tokens)."""
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def _is_choice(item: Any) -> bool:
    return hasattr(item, "message") and hasattr(item, "finish_reason")


def _check_ids(tokenizer: Any, ids: Any, name: str, where: str, turn: int) -> list[int]:
    """`ids` (a Choice's `name` field) checked to be token ids of the tokenizer's vocabulary."""
    vocabulary = len(tokenizer)
    if not isinstance(ids, list):
        raise TokenizationError(
            f"{where}: messages_and_choices[{turn}].{name} is a {type(ids).__name__}, not a list of "
            "token ids; train choices as the server returned them",
            where,
            turn,
        )
    for k, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocabulary:
            raise TokenizationError(
                f"{where}: messages_and_choices[{turn}] has {name}[{k}]={token!r}, not a token id "
                f"of this model's {vocabulary}-token vocabulary; train choices sampled from this model",
                where,
                turn,
            )
    return list(ids)


def _choice_prompt(tokenizer: Any, choice: Any, where: str, turn: int) -> list[int] | None:
    """The prompt ids the server tokenized for `choice` (`prompt_token_ids`, which
    `model.openai_client()` records on each choice), or None where the choice has none."""
    prompt = (getattr(choice, "model_extra", None) or {}).get("prompt_token_ids")
    if prompt is None:
        return None
    if prompt == []:  # a server prompt always has tokens: the turn would train without context
        raise TokenizationError(
            f"{where}: messages_and_choices[{turn}].prompt_token_ids is empty; train choices as the "
            "server returned them (or remove prompt_token_ids to train after the rendered conversation)",
            where,
            turn,
        )
    return _check_ids(tokenizer, prompt, "prompt_token_ids", where, turn)


_TOKEN_ID_PREFIX = "token_id:"
"""How vLLM names a logprob's token with `return_tokens_as_token_ids`: "token_id:<id>"."""


def _logprob_token_ids(tokenizer: Any, content: Sequence[Any], where: str, turn: int) -> list[int]:
    """The token ids of a Choice that has logprobs but no `token_ids` (litellm's conversion of a
    vLLM reply drops them), read from its logprobs as ART does: an entry's token "token_id:<id>"
    (vLLM's `return_tokens_as_token_ids`) is that id, another token is its id in the vocabulary
    (`convert_tokens_to_ids`).

    Raises:
        TokenizationError: an entry whose token is neither (a decoded text such as " hello";
            ART trains the eos token in its place), or names an id outside the vocabulary,
            naming the entry.
    """
    vocabulary = len(tokenizer)
    ids = []
    for k, entry in enumerate(content):
        token = getattr(entry, "token", None)
        token = token if isinstance(token, str) else ""
        found: Any = None
        digits = token[len(_TOKEN_ID_PREFIX) :]
        if token.startswith(_TOKEN_ID_PREFIX) and digits.isascii() and digits.isdigit():
            found = int(digits)
            if found >= vocabulary:
                raise TokenizationError(
                    f"{where}: messages_and_choices[{turn}] has logprobs.content[{k}].token {token!r}, "
                    f"not a token id of this model's {vocabulary}-token vocabulary; train choices "
                    "sampled from this model",
                    where,
                    turn,
                )
        elif token:
            found = tokenizer.convert_tokens_to_ids(token)
            # an unknown piece maps to the unk id (or None): only a round trip is the token
            found = (
                found if isinstance(found, int) and tokenizer.convert_ids_to_tokens(found) == token else None
            )
        if found is None:
            raise TokenizationError(
                f"{where}: messages_and_choices[{turn}] is a sampled Choice without token_ids whose "
                f"logprobs.content[{k}].token {token!r} is neither 'token_id:<id>' nor a token of "
                "this model's vocabulary; request completions with extra_body={'return_token_ids': True} "
                "(model.openai_client() does) or with return_tokens_as_token_ids",
                where,
                turn,
            )
        ids.append(found)
    return ids


def _choice_tokens(tokenizer: Any, choice: Any, where: str, turn: int) -> tuple[list[int], list[float]]:
    """The sampled token ids of `choice` and their logprobs, checked to pair up one to one.

    A Choice without `token_ids` but with logprobs gets its ids from them (`_logprob_token_ids`)."""
    token_ids = getattr(choice, "token_ids", None)
    if token_ids is None and getattr(choice, "model_extra", None):
        token_ids = choice.model_extra.get("token_ids")
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if token_ids is None and content:
        token_ids = _logprob_token_ids(tokenizer, content, where, turn)
    if not token_ids:
        raise TokenizationError(
            f"{where}: messages_and_choices[{turn}] is a sampled Choice without token_ids; request "
            "completions with extra_body={'return_token_ids': True} (model.openai_client() does) so "
            "training never re-tokenizes",
            where,
            turn,
        )
    token_ids = _check_ids(tokenizer, token_ids, "token_ids", where, turn)
    if not content or len(content) != len(token_ids):
        raise TokenizationError(
            f"{where}: messages_and_choices[{turn}] is a sampled Choice with {len(content or [])} "
            f"logprobs for {len(token_ids)} tokens; request logprobs=True (model.openai_client() does)",
            where,
            turn,
        )
    return token_ids, [float(c.logprob) for c in content]


def parse_tool_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """One tool call's `arguments` as the object a chat template prints: a dict as given, a JSON
    string parsed, None or "" as {} (vLLM's rule for them).

    Raises:
        ValueError: "`where` is ...": a string that is not JSON or not a JSON object, or
            another type.
    """
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise ValueError(
                f"{where} is not valid JSON ({exc.msg} at character {exc.pos}); give the arguments "
                'as a JSON object string such as \'{"city": "Paris"}\' or as a dict'
            ) from None
        if not isinstance(arguments, dict):
            raise ValueError(
                f"{where} is the JSON {type(arguments).__name__} {json.dumps(arguments)[:40]}, "
                'not an object; tool arguments are a JSON object such as \'{"city": "Paris"}\''
            )
        return arguments
    if isinstance(arguments, dict):
        return arguments
    raise ValueError(
        f"{where} is a {type(arguments).__name__}; give the arguments as a JSON object string or a dict"
    )


def template_tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    """`tools` as vLLM hands a chat request's tools to the chat template, so the tools block
    renders here as it did when the model sampled: {"type": "function", "function": {"name",
    "description", "parameters"}} in that order, a missing description or parameters as None,
    `strict` and `defer_loading` only where set, other keys dropped. A bare function schema
    ({"name": ..., "parameters": ...}, as ART also accepts) is wrapped first.

    Raises:
        TokenizationError: `tools` is not a list, or a tool is not a function tool with a name.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise TokenizationError(
            f"{where}: tools is a {type(tools).__name__}; give the list of tools the request was sent with",
            where,
            None,
        )
    rendered = []
    for k, tool in enumerate(tools):
        if isinstance(tool, Mapping) and "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(function, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
        ):
            raise TokenizationError(
                f"{where}: tools[{k}] is not a function tool; give tools as the request did: "
                "{'type': 'function', 'function': {'name': ..., 'description': ..., 'parameters': {...}}}",
                where,
                None,
            )
        defer = function.get("defer_loading", tool.get("defer_loading"))
        schema = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        schema.update(
            {
                key: value
                for key, value in (("strict", function.get("strict")), ("defer_loading", defer))
                if value is not None
            }
        )
        entry: dict[str, Any] = {"type": "function", "function": schema}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        rendered.append(entry)
    return rendered


def _sampled_arguments(arguments: Any) -> Any:
    """A sampled tool call's `arguments` as vLLM 0.32 hands them to the chat template when the
    conversation comes back (`vllm/renderers/chat_utils.py::_postprocess_messages`): an object
    as it is; a JSON string parsed; JSON that does not parse, a value that is not an object
    (3598, [1], "x", true, null) and a missing or empty value as {}."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _sampled_message(choice: Any) -> dict[str, Any]:
    """A Choice's message as vLLM 0.32 renders it when it is sent back (a later turn's context):
    a null content as no content parts (`_text_contents` makes that "" for a template that takes
    a string, [] for one that iterates over parts), an empty tool_calls list dropped, and every
    call's arguments as `_sampled_arguments` gives them. Calls that are not
    {"function": {...}} objects stay as they are (`_chat_message` names them)."""
    message = choice.message.model_dump(exclude_none=True)
    if message.get("content") is None:
        message["content"] = []
    calls = message.get("tool_calls")
    if isinstance(calls, list) and not calls:
        del message["tool_calls"]
    elif isinstance(calls, list):
        message["tool_calls"] = [
            {
                **call,
                "function": {
                    **call["function"],
                    "arguments": _sampled_arguments(call["function"].get("arguments")),
                },
            }
            if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping)
            else call
            for call in calls
        ]
    return message


def _chat_message(item: Any, where: str, turn: int) -> dict[str, Any]:
    """`item` (a message dict or a Choice) as the message dict the template renders: a copy,
    with every tool call's arguments parsed to an object (a Choice's as vLLM renders them, see
    `_sampled_message`; a dict's held to the form, see `parse_tool_arguments`)."""
    sampled = _is_choice(item)
    message = _sampled_message(item) if sampled else dict(item)
    calls = message.get("tool_calls")
    if not calls:
        return message
    if not isinstance(calls, list):
        raise TokenizationError(
            f"{where}: messages_and_choices[{turn}].tool_calls is a {type(calls).__name__}; "
            "tool_calls is a list of {'type': 'function', 'function': {'name', 'arguments'}}",
            where,
            turn,
        )
    parsed = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise TokenizationError(
                f"{where}: messages_and_choices[{turn}].tool_calls[{k}] has no 'function' object; a tool "
                "call is {'type': 'function', 'function': {'name': ..., 'arguments': ...}}",
                where,
                turn,
            )
        if sampled:  # already as vLLM renders it
            parsed.append(call)
            continue
        try:
            arguments = parse_tool_arguments(
                function.get("arguments"),
                f"{where}: messages_and_choices[{turn}].tool_calls[{k}].function.arguments",
            )
        except ValueError as exc:
            raise TokenizationError(str(exc), where, turn) from None
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}


_PROBE_TEXT = "art-mega content probe"


def content_format(tokenizer: Any) -> Literal["string", "openai"]:
    """How vLLM hands a list of content parts to this tokenizer's chat template: "openai" (the
    list of parts) when the template iterates over a message's content, else "string" (the text
    parts joined with newlines). vLLM decides from the template's syntax tree; here a one-message
    render with a list content tells: a template that does not iterate over the parts fails on it
    or prints the list itself."""
    probe = [{"role": "user", "content": [{"type": "text", "text": _PROBE_TEXT}]}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    except Exception:  # the template cannot take a list: vLLM's "string" format is what it gets
        return "string"
    if not isinstance(text, str) or _PROBE_TEXT not in text or "'type'" in text or '"type"' in text:
        return "string"
    return "openai"


def _text_contents(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """`messages` with list contents (content parts) as vLLM renders them for this template (see
    `content_format`): joined text for "string" templates, the parts for "openai" ones.

    Raises:
        TokenizationError: a part that is not a text part with a string `text` (an image or audio
            part: the trainer takes text only), naming the message and the part.
    """
    if not any(isinstance(m.get("content"), list) for m in messages):
        return messages
    form = content_format(tokenizer)
    out = []
    for turn, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                shown = (
                    f"a part of type {kind!r}"
                    if kind not in (None, "text")
                    else "not a text part with a string 'text'"
                )
                raise TokenizationError(
                    f"{where}: messages_and_choices[{turn}].content[{k}] is {shown}; art-mega trains "
                    "text only: give the content as a string or as {'type': 'text', 'text': '...'} parts",
                    where,
                    turn,
                )
            texts.append(part["text"])
        content = "\n".join(texts) if form == "string" else [{"type": "text", "text": t} for t in texts]
        out.append({**message, "content": content})
    return out


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """The token ids that end a sampled turn, as vLLM stops on them: the tokenizer's eos token
    and the `eos_token_id` (an int or a list) of `generation_config.json` in the tokenizer's
    model directory, where there is one (SmolLM2's converted tokenizer names `<|im_start|>` its
    eos token while its generation config ends turns with `<|im_end|>`).

    Raises:
        TokenizationError: `generation_config.json` is there but is not JSON.
    """
    found = {tokenizer.eos_token_id} - {None}
    config = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token_id")
        except ValueError as exc:
            raise TokenizationError(
                f"{config} is not valid JSON ({exc}); fix or remove the model's generation config",
                str(config),
                None,
            ) from None
        found |= {int(e) for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)}
    return found


def _assistant_span(eos_ids: set[int], ids: list[int]) -> int:
    """How many tokens of an assistant turn to train: through the first end-of-turn token."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return i + 1
    return len(ids)


def tokenize_history(
    tokenizer: Any,
    messages_and_choices: Sequence[Any],
    tools: Any = None,
    assistant_turns: Literal["all", "last"] = "all",
    where: str = "the conversation",
    plain_assistant: PlainAssistant = "sft",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[TokenizedSequence]:
    """One conversation as the sequences that train each of its assistant turns exactly.

    Consecutive turns share one sequence while the sequence so far is a token prefix of the
    next turn's context; a turn whose context differs (see the module docstring) starts a new
    sequence holding that context (untrained) and the turn. `assistant_turns="last"` trains
    only the last assistant turn (one sequence). No assistant turn: no sequence.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages_and_choices: message dicts and sampled openai `Choice` objects, in order.
        tools: the tool schemas the conversation was sampled with (passed to the template in
            vLLM's form, see `template_tools`).
        where: how errors name the conversation, e.g. "trajectory 3 of group 0".
        plain_assistant: how plain assistant messages (dicts) train (see `PlainAssistant`);
            with "context" only Choices are assistant turns here.
        template_kwargs: extra chat-template variables (ART's `chat_template_kwargs`, e.g.
            `enable_thinking`), the ones the replica renders every request with.

    Returns:
        the sequences in turn order; each trained assistant turn is trained in exactly one of them.

    Raises:
        TokenizationError: names `where` and the message index: tools that are not function
            tools (see `template_tools`), a Choice without token ids or with a logprob count
            that does not match them, or with a token or prompt id outside the vocabulary; a
            plain message's tool call whose arguments are not a JSON object (a sampled turn's
            are rendered as vLLM renders them, see `_sampled_message`); a chat template that
            fails on the conversation; a plain assistant message whose render does not continue
            the generation prompt before it (templates that strip `<think>` blocks do this).
    """
    items = list(messages_and_choices)
    tools = template_tools(tools, where)
    messages = _text_contents(
        tokenizer, [_chat_message(item, where, turn) for turn, item in enumerate(items)], where
    )
    plain_trained = plain_assistant != "context"
    turns = [
        t
        for t, item in enumerate(items)
        if _is_choice(item) or (plain_trained and messages[t].get("role") == "assistant")
    ]
    if assistant_turns == "last":
        turns = turns[-1:]
    sequences: list[TokenizedSequence] = []
    sequence = TokenizedSequence()
    eos_ids: set[int] | None = None  # read once, at the first plain assistant message
    for turn in turns:
        sampled = _is_choice(items[turn])
        prompt = _choice_prompt(tokenizer, items[turn], where, turn) if sampled else None
        if prompt is None:
            prompt_text = _render(tokenizer, messages[:turn], tools, True, where, turn, template_kwargs)
            prompt = _encode(tokenizer, prompt_text)
        if not sequences or prompt[: len(sequence.input_ids)] != sequence.input_ids:
            sequence = TokenizedSequence()
            sequences.append(sequence)
        sequence.extend(prompt[len(sequence.input_ids) :], trained=False)
        if sampled:
            ids, logprobs = _choice_tokens(tokenizer, items[turn], where, turn)
            sampling = choice_sampling(items[turn], where, turn)
            sequence.extend(ids, trained=True, logprobs=logprobs, sampling=sampling)
            continue
        full_text = _render(tokenizer, messages[: turn + 1], tools, False, where, turn, template_kwargs)
        if not full_text.startswith(prompt_text):
            raise TokenizationError(
                f"{where}: the chat template renders the assistant message messages_and_choices[{turn}] "
                "so that it does not continue the generation prompt before it (templates that strip "
                "or add <think> blocks do this), so its trained tokens cannot be exactly that turn's; "
                "train what the model sampled (the Choice from model.openai_client(), trained token for "
                "token) or use a chat template whose render of an assistant turn starts with its "
                "generation prompt",
                where,
                turn,
            )
        ids = _encode(tokenizer, full_text[len(prompt_text) :])
        eos_ids = end_of_turn_ids(tokenizer) if eos_ids is None else eos_ids
        ids = ids[: _assistant_span(eos_ids, ids)]
        old = UNKNOWN_LOGPROB if plain_assistant == "current_policy" else 0.0
        sequence.extend(ids, trained=True, logprobs=[old] * len(ids))
    return sequences


def tokenize_trajectory(
    tokenizer: Any,
    trajectory: Trajectory,
    assistant_turns: Literal["all", "last"] = "all",
    where: str = "the trajectory",
    plain_assistant: PlainAssistant = "sft",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[TokenizedSequence]:
    """The sequences of the trajectory's main history, then of each `additional_histories` entry
    (`History` objects, validated as the trajectory was); plain assistant messages train as
    `plain_assistant` says, the template renders with `template_kwargs` (see `tokenize_history`)."""
    sequences = tokenize_history(
        tokenizer,
        trajectory.messages_and_choices,
        trajectory.tools,
        assistant_turns,
        where,
        plain_assistant,
        template_kwargs,
    )
    for h, history in enumerate(trajectory.additional_histories):
        name = f"{where}, additional_histories[{h}]"
        sequences += tokenize_history(
            tokenizer,
            history.messages_and_choices,
            history.tools,
            assistant_turns,
            name,
            plain_assistant,
            template_kwargs,
        )
    return sequences


@dataclass
class BatchStats:
    """What building a GRPO batch kept and dropped."""

    groups: int = 0
    groups_skipped_zero_variance: int = 0
    trajectories_used: int = 0
    trajectories_dropped_zero_advantage: int = 0
    trajectories_dropped_no_assistant_tokens: int = 0
    """Kept by their advantage, but with no assistant turn to train (e.g. the sampled Choice was
    never appended to the conversation, or in GRPO its only assistant turns are plain messages
    without `allow_training_without_logprobs`): counted apart so that this shows in the metrics."""
    trained_tokens: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {f"data/{k}": float(v) for k, v in self.__dict__.items()}


def grpo_documents(
    tokenizer: Any,
    groups: Sequence[TrajectoryGroup],
    scale_rewards: bool = True,
    allow_training_without_logprobs: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[Document], BatchStats]:
    """Advantages per group, zero-variance groups skipped, zero-advantage trajectories dropped
    (and those without assistant tokens, counted apart), then each kept trajectory tokenized with
    weight 1 / (its trained tokens): one Document per sequence (see `tokenize_history`), all of a
    trajectory's with its advantage and weight.

    As in ART, the sampled Choices are trained; a plain assistant message (a dict) is context
    only, unless `allow_training_without_logprobs`: then it is trained too, with old logprobs
    `UNKNOWN_LOGPROB` (the loss uses the current policy's). A trajectory with nothing to train
    counts in `trajectories_dropped_no_assistant_tokens`; when no trajectory is left the
    documents are empty (the step trains nothing and reports `loss/nothing_trainable`). The
    chat template renders with `template_kwargs` (ART's `chat_template_kwargs`).

    Raises:
        TokenizationError: a conversation that cannot be tokenized exactly (names group,
            trajectory and message).
    """
    stats = BatchStats(groups=len(groups))
    documents: list[Document] = []
    for g, group in enumerate(groups):
        advantages = group_advantages([t.reward for t in group.trajectories], scale_rewards)
        if advantages.skipped:
            stats.groups_skipped_zero_variance += 1
            continue
        for t, (trajectory, advantage) in enumerate(zip(group.trajectories, advantages.advantages)):
            if advantage == 0.0:
                stats.trajectories_dropped_zero_advantage += 1
                continue
            sequences = tokenize_trajectory(
                tokenizer,
                trajectory,
                where=f"trajectory {t} of group {g}",
                plain_assistant="current_policy" if allow_training_without_logprobs else "context",
                template_kwargs=template_kwargs,
            )
            weight = token_weight(sum(s.trained_tokens for s in sequences))
            if weight == 0.0:
                stats.trajectories_dropped_no_assistant_tokens += 1
                continue
            stats.trajectories_used += 1
            for s in sequences:
                stats.trained_tokens += s.trained_tokens
                documents.append(
                    Document(s.input_ids, s.loss_mask, s.old_logprobs, advantage, weight, s.sampling)
                )
    return documents, stats


def balance_advantages(documents: Sequence[Document], advantage_balance: float = 0.0) -> list[Document]:
    """GRPO `documents` with their advantages shaped as ART's packing shapes them
    (`art/preprocessing/pack.py`): with `advantage_balance` b > 0 each negative advantage is
    multiplied by 1 - b, with b < 0 each positive one by 1 + b (b = 1: positive ones only; -1:
    negative ones only); then every advantage is divided by mean_t |A_t| w_t over all trained
    tokens, w_t being the token weights scaled to mean 1 (ART's weights), which is
    sum_d n_d w_d |A_d| / sum_d n_d w_d over documents d with n_d trained tokens. Left as they
    are when that mean is 0 (every advantage 0: nothing to scale, the step's loss is 0).

    Args:
        documents: `grpo_documents`' output (advantage and weight per document).
        advantage_balance: b in [-1, 1] (`backend.check_grpo_options` checks it).
    """
    shaped = []
    for d in documents:
        a = d.advantage
        if advantage_balance > 0 and a < 0:
            a *= 1.0 - advantage_balance
        elif advantage_balance < 0 and a > 0:
            a *= 1.0 + advantage_balance
        shaped.append((d, a))
    tokens = [float(sum(1 for m in d.loss_mask if m > 0)) * d.weight for d, _ in shaped]
    total = sum(tokens)
    scale = sum(n * abs(a) for n, (_, a) in zip(tokens, shaped)) / total if total > 0 else 0.0
    if scale == 0.0:
        return [dataclasses.replace(d, advantage=a) for d, a in shaped]
    return [dataclasses.replace(d, advantage=a / scale) for d, a in shaped]


def sft_documents(
    tokenizer: Any,
    trajectories: Sequence[Trajectory],
    assistant_turns: Literal["all", "last"] = "all",
    first_index: int = 0,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[Document], BatchStats]:
    """Each trajectory's assistant tokens as SFT documents (advantage 0, weight 1 per token: as
    in ART, a batch's loss is its summed token cross-entropy over its trained-token count, so a
    long answer weighs more than a short one), one per sequence (see `tokenize_history`): plain
    assistant messages are trained (what SFT is), with old logprob 0.0 (SFT reads none). The
    chat template renders with `template_kwargs` (ART's `chat_template_kwargs`).

    Raises:
        TokenizationError: a conversation that cannot be tokenized exactly (names the
            trajectory by `first_index` + its index in `trajectories`, and the message).
    """
    stats = BatchStats()
    documents: list[Document] = []
    for t, trajectory in enumerate(trajectories, start=first_index):
        sequences = tokenize_trajectory(
            tokenizer, trajectory, assistant_turns, f"trajectory {t}", template_kwargs=template_kwargs
        )
        stats.trajectories_used += 1
        for s in sequences:
            stats.trained_tokens += s.trained_tokens
            documents.append(Document(s.input_ids, s.loss_mask, s.old_logprobs, 0.0, 1.0))
    return documents, stats
