"""Tokenization for training on the tiny model's real tokenizer and ChatML template."""

import pytest
from openai.types.chat.chat_completion import Choice

from art_mega import Trajectory, TrajectoryGroup
from art_mega.errors import UserError
from art_mega.trainer.prepare.tokenize import grpo_documents, sft_documents, tokenize_history

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "hi there"}


def choice(token_ids, logprobs, text="hello"):
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": text},
            "token_ids": token_ids,
            "logprobs": {
                "content": [
                    {"token": str(t), "logprob": lp, "bytes": [], "top_logprobs": []}
                    for t, lp in zip(token_ids, logprobs)
                ]
            },
        }
    )


def template(tok, messages, gen):
    out = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_sampled_choice_uses_exact_ids_and_logprobs(tiny_tokenizer):
    prompt = template(tiny_tokenizer, [SYSTEM, USER], gen=True)
    (seq,) = tokenize_history(tiny_tokenizer, [SYSTEM, USER, choice([7, 8, 2], [-0.1, -0.2, -0.3])])
    assert seq.input_ids == prompt + [7, 8, 2]  # not re-tokenized: 7, 8 are not what "hello" encodes to
    assert seq.loss_mask == [0.0] * len(prompt) + [1.0, 1.0, 1.0]
    assert seq.old_logprobs[-3:] == pytest.approx([-0.1, -0.2, -0.3])


def test_choice_without_token_ids_is_refused(tiny_tokenizer):
    bare = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}
    )
    with pytest.raises(UserError, match="return_token_ids"):
        tokenize_history(tiny_tokenizer, [USER, bare])


def test_grpo_documents_skip_drop_and_weight(tiny_tokenizer):
    def traj(reward, ids):
        return Trajectory(messages_and_choices=[USER, choice(ids, [-0.5] * len(ids))], reward=reward)

    groups = [
        TrajectoryGroup(
            [traj(1.0, [5, 2]), traj(0.0, [6, 7, 2]), traj(0.5, [8, 2])]
        ),  # middle one has advantage 0
        TrajectoryGroup([traj(1.0, [5, 2]), traj(1.0, [6, 2])]),  # zero variance: skipped
    ]
    documents, stats = grpo_documents(tiny_tokenizer, groups)
    assert stats.groups_skipped_zero_variance == 1
    assert stats.trajectories_dropped_zero_advantage == 1
    assert stats.trajectories_used == 2 and len(documents) == 2
    assert [d.weight for d in documents] == [pytest.approx(1 / 2), pytest.approx(1 / 3)]
    assert documents[0].advantage > 0 > documents[1].advantage


def test_additional_histories_share_advantage_and_weight(tiny_tokenizer):
    main = [USER, choice([5, 2], [-0.1, -0.1])]
    extra = {"messages_and_choices": [USER, choice([9, 9, 2], [-0.2] * 3)]}
    t1 = Trajectory(messages_and_choices=main, additional_histories=[extra], reward=1.0)
    t2 = Trajectory(messages_and_choices=main, reward=0.0)
    documents, stats = grpo_documents(tiny_tokenizer, [TrajectoryGroup([t1, t2])])
    assert len(documents) == 3
    assert documents[0].weight == documents[1].weight == pytest.approx(1 / 5)
    assert documents[0].advantage == documents[1].advantage
    sft, _ = sft_documents(
        tiny_tokenizer, [Trajectory(messages_and_choices=[USER, {"role": "assistant", "content": "ok"}])]
    )
    assert sft[0].advantage == 0.0 and sum(sft[0].loss_mask) > 0


# ---------------------------------------------------------------- masks against hand-written spans

EOT = "<|im_end|>"

# Qwen2.5-Instruct's tool-calling chat template (tokenizer_config.json of Qwen/Qwen2.5-0.5B-Instruct),
# trimmed to the branches these conversations reach; the tiny model's own ChatML template has no tools.
QWEN_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools><|im_end|>\\n" }}'
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not (loop.first and tools))'
    ' or (message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    '{%- elif message.role == "assistant" %}'
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "look up",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_CONVERSATION = [
    {"role": "user", "content": "weather in paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "1", "content": "sunny"},
    {"role": "assistant", "content": "it is sunny"},
]
MULTI_TURN = [
    SYSTEM,
    USER,
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "bye"},
]


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with Qwen2.5's tool-calling template."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = QWEN_TOOL_TEMPLATE
    return tok


def expected(tok, pieces):
    """(ids, mask) of hand-written (text, trained) pieces, each piece tokenized on its own."""
    ids, mask = [], []
    for text, trained in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [1.0 if trained else 0.0] * len(piece)
    return ids, mask


def assert_spans(tok, sequences, pieces):
    (seq,) = sequences
    ids, mask = expected(tok, pieces)
    assert tok.decode(seq.input_ids) == "".join(text for text, _ in pieces)
    assert seq.input_ids == ids
    assert seq.loss_mask == mask
    assert seq.old_logprobs == [0.0] * len(ids)


def test_multi_turn_masks_all_and_last_by_hand(tiny_tokenizer):
    head = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    middle = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    # every assistant turn through its <|im_end|>; the newline after it and the role header are prompt
    assert_spans(
        tiny_tokenizer,
        tokenize_history(tiny_tokenizer, MULTI_TURN, assistant_turns="all"),
        [(head, False), ("hello" + EOT, True), (middle, False), ("bye" + EOT, True)],
    )
    assert_spans(
        tiny_tokenizer,
        tokenize_history(tiny_tokenizer, MULTI_TURN, assistant_turns="last"),
        [(head + "hello" + EOT + middle, False), ("bye" + EOT, True)],
    )
    hello_eot = tiny_tokenizer.encode("hello" + EOT, add_special_tokens=False)
    assert hello_eot[-1] == tiny_tokenizer.eos_token_id and len(hello_eot) == 3  # "h", "ello", <|im_end|>


def test_tool_call_conversation_masks_by_hand(tool_tokenizer):
    import json

    tools_block = (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>\n"
        + json.dumps(WEATHER)
        + "\n</tools><|im_end|>\n"
    )
    prompt = tools_block + "<|im_start|>user\nweather in paris?<|im_end|>\n<|im_start|>assistant\n"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>' + EOT
    result = "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    answer = "it is sunny" + EOT
    # the tools and the tool result are prompt; the tool call and the answer are trained
    assert_spans(
        tool_tokenizer,
        tokenize_history(tool_tokenizer, TOOL_CONVERSATION, tools=[WEATHER], assistant_turns="all"),
        [(prompt, False), (call, True), (result, False), (answer, True)],
    )
    assert_spans(
        tool_tokenizer,
        tokenize_history(tool_tokenizer, TOOL_CONVERSATION, tools=[WEATHER], assistant_turns="last"),
        [(prompt + call + result, False), (answer, True)],
    )
    # without tools the system block is the default one: same trained tokens, a shorter prompt
    (plain,) = tokenize_history(tool_tokenizer, TOOL_CONVERSATION)
    assert tool_tokenizer.decode(plain.input_ids).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    )
    trained = [t for t, m in zip(plain.input_ids, plain.loss_mask) if m]
    assert tool_tokenizer.decode(trained) == call + answer


def test_sft_documents_weight_by_the_turns_trained(tool_tokenizer):
    trajectory = Trajectory(messages_and_choices=TOOL_CONVERSATION, tools=[WEATHER])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>' + EOT
    n_call = len(tool_tokenizer.encode(call, add_special_tokens=False))
    n_answer = len(tool_tokenizer.encode("it is sunny" + EOT, add_special_tokens=False))
    (everything,), stats = sft_documents(tool_tokenizer, [trajectory], "all")
    assert stats.trained_tokens == n_call + n_answer
    assert everything.weight == 1.0  # ART: every trained token of a batch weighs the same
    (last,), stats = sft_documents(tool_tokenizer, [trajectory], "last")
    assert stats.trained_tokens == n_answer and last.weight == 1.0


def test_a_template_that_cannot_render_a_turn_is_named(tiny_tokenizer):
    # the tiny model's ChatML template concatenates message['content']: a tool call without content fails
    call = {**TOOL_CONVERSATION[1], "content": None}
    with pytest.raises(
        UserError, match="chat template could not render the conversation through messages_and_choices\\[1\\]"
    ):
        tokenize_history(tiny_tokenizer, [USER, call])
