"""A sampled turn trains on its sampled ids whatever vLLM's tool parser made of them; only the
messages a user writes (dicts) are held to the tool-call schema. Choices shaped as vLLM 0.32
returns them (hermes / llama3_json: `arguments=json.dumps(<the model's value>)`; a named tool
choice: the raw text; a required one cut off: no calls), on the tiny tokenizer with Qwen2.5's
tool template (which prints `arguments | tojson`). Before, tokenizing refused the whole step:
"... is the JSON int 3598, not an object". The replica-backed checks are in
tests/inference/test_malformed_tool_calls.py."""

import pytest

from art_mega import Trajectory, TrajectoryGroup
from art_mega.errors import TokenizationError
from art_mega.trainer.prepare.tokenize import grpo_documents, sft_documents, tokenize_history
from tests.helpers import trained_turns
from tests.unit.trainer.test_tokenize_exact import (
    WEATHER,
    choice,
    encode,
    qwen25_tokenizer,  # noqa: F401  (the fixture)
)

EOT = "<|im_end|>"
QUESTION = {"role": "user", "content": "weather in paris?"}
TOOLS_BLOCK = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": null, '
    '"parameters": {"type": "object"}}}\n</tools><|im_end|>\n'
)
PROMPT = TOOLS_BLOCK + "<|im_start|>user\nweather in paris?<|im_end|>\n<|im_start|>assistant\n"
RESULT = "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def tok(qwen25_tokenizer):  # noqa: F811
    """The tiny tokenizer with Qwen2.5's tool template."""
    return qwen25_tokenizer


def call(arguments, name="get_weather"):
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


# (the model's text, the tool calls vLLM's parser made of it, how vLLM renders the turn when the
# conversation is sent back: `_postprocess_messages` turns arguments that are not an object into {})
SHAPES = {
    "int": ('{"name": "get_weather", "arguments": 3598}', [call("3598")], '"arguments": {}'),
    "list": ('{"name": "get_weather", "arguments": [1, 2]}', [call("[1, 2]")], '"arguments": {}'),
    "string": ('{"name": "get_weather", "arguments": "paris"}', [call('"paris"')], '"arguments": {}'),
    "null": ('{"name": "get_weather", "arguments": null}', [call("null")], '"arguments": {}'),
    "bool": ('{"name": "get_weather", "arguments": true}', [call("true")], '"arguments": {}'),
    "named choice cut off": ('{"city": "pa', [call('{"city": "pa')], '"arguments": {}'),
    "not JSON": ("{city: paris}", [call("{city: paris}")], '"arguments": {}'),
    "unknown function": (
        '{"name": "launch", "arguments": {"x": 1}}',
        [call('{"x": 1}', name="launch")],
        '{"name": "launch", "arguments": {"x": 1}}',
    ),
    "two calls, one malformed": (
        "two calls",
        [call('{"city": "paris"}'), call("7")],
        '"arguments": {"city": "paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {}}',
    ),
}


def conversation(tok, text, calls, content=None):
    """[question, the sampled call turn, its tool result, the sampled answer], no prompt ids
    recorded (an ART-style client): the answer's context is rendered here."""
    call_ids = encode(tok, f"<tool_call>\n{text}\n</tool_call>{EOT}")
    answer_ids = encode(tok, "it is sunny" + EOT)
    return (
        [
            QUESTION,
            choice(call_ids, [-0.5] * len(call_ids), content, calls),
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            choice(answer_ids, [-0.25] * len(answer_ids), "it is sunny"),
        ],
        call_ids,
        answer_ids,
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_a_malformed_sampled_call_trains_its_ids_after_vllms_render(tok, shape) -> None:
    text, calls, rendered = SHAPES[shape]
    items, call_ids, answer_ids = conversation(tok, text, calls)
    (first, answer) = trained_turns(tokenize_history(tok, items, tools=[WEATHER]))
    # the call turn: exactly its sampled ids after the prompt; the answer: its sampled ids after
    # the conversation as vLLM renders it when it is sent back (the call by vLLM's rule)
    assert (first[0], first[1], first[2]) == (encode(tok, PROMPT), call_ids, [-0.5] * len(call_ids))
    assert (answer[1], answer[2]) == (answer_ids, [-0.25] * len(answer_ids))
    shown = tok.decode(answer[0])
    assert shown.startswith(PROMPT + "<tool_call>\n{") and shown.endswith("</tool_call><|im_end|>\n" + RESULT)
    assert rendered in shown


def test_content_beside_calls_and_a_required_choice_cut_off_train(tok) -> None:
    items, call_ids, answer_ids = conversation(
        tok, '{"name": "get_weather", "arguments": 5}', [call("5")], "sure"
    )
    (first, answer) = trained_turns(tokenize_history(tok, items, tools=[WEATHER]))
    assert (first[1], answer[1]) == (call_ids, answer_ids)
    assert "<|im_start|>assistant\nsure\n<tool_call>" in tok.decode(answer[0])
    # tool_choice="required" cut off by max_tokens: no calls parse, vLLM returns content None and
    # no tool calls; the turn renders as an empty assistant turn, and both turns train
    items, call_ids, answer_ids = conversation(tok, '[{"name": "get_wea', [], None)
    items[1].message.tool_calls = []
    del items[2]
    (first, answer) = trained_turns(tokenize_history(tok, items, tools=[WEATHER]))
    assert (first[1], answer[1]) == (call_ids, answer_ids)
    assert tok.decode(answer[0]).endswith(
        "<|im_start|>assistant\n<|im_end|>\n"
        + RESULT.replace("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n", "")
    )


def test_a_step_of_malformed_calls_trains_every_sampled_token(tok) -> None:
    trajectories = []
    for k, shape in enumerate(SHAPES):  # rewards 0, 1, 0, ...: no advantage is 0 (9 shapes)
        items, call_ids, answer_ids = conversation(tok, *SHAPES[shape][:2])
        trajectories.append(Trajectory(messages_and_choices=items, tools=[WEATHER], reward=float(k % 2)))
    documents, stats = grpo_documents(tok, [TrajectoryGroup(trajectories)])
    sampled = sum(len(item.token_ids) for t in trajectories for item in t.messages_and_choices[1::2])
    assert stats.trained_tokens == sampled > 0
    assert stats.trajectories_used == len(SHAPES) == 9
    # SFT on the same Choices trains them the same way (they were sampled, not written)
    _, sft = sft_documents(tok, trajectories)
    assert sft.trained_tokens == sampled


def test_the_same_call_written_by_hand_is_held_to_the_schema(tok) -> None:
    written = [
        QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call("3598")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "it is sunny"},
    ]
    with pytest.raises(TokenizationError) as caught:
        sft_documents(tok, [Trajectory(messages_and_choices=written, tools=[WEATHER])])
    assert str(caught.value) == (
        "trajectory 0: messages_and_choices[1].tool_calls[0].function.arguments is the JSON int 3598, "
        'not an object; tool arguments are a JSON object such as \'{"city": "Paris"}\''
    )
