"""Tokenization is exact or refused: the trained tokens of every assistant turn are that turn's
own, after exactly the context it was sampled in (issue 13), on the tiny model's tokenizer with
the chat templates built here (Qwen2.5-style tools, Qwen3-style `<think>` stripping)."""

import json
import math

import pytest
from openai.types.chat.chat_completion import Choice

from art_mega import Trajectory, TrajectoryGroup
from art_mega.errors import TokenizationError
from art_mega.trainer.batch import pack
from art_mega.trainer.prepare.tokenize import grpo_documents, sft_documents, tokenize_history

USER = {"role": "user", "content": "hi there"}
EOT = "<|im_end|>"
HEAD = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"


def choice(token_ids, logprobs, text, tool_calls=None):
    """A Choice as vLLM returns it with logprobs=True and return_token_ids=True."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": message,
            "token_ids": token_ids,
            "logprobs": {
                "content": [
                    {"token": f"token_id:{t}", "logprob": lp, "bytes": [], "top_logprobs": []}
                    for t, lp in zip(token_ids, logprobs)
                ]
            },
        }
    )


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def trained(seq):
    return [t for t, m in zip(seq.input_ids, seq.loss_mask) if m]


def untrained_prefix(seq):
    """The ids before the first trained token: the context of the sequence's first turn."""
    first = seq.loss_mask.index(1.0)
    assert not any(seq.loss_mask[:first])
    return seq.input_ids[:first]


# ------------------------------------------------- a BPE that merges "\n\n", as real tokenizers do


@pytest.fixture(scope="module")
def newline_tokenizer(tiny_tokenizer, tmp_path_factory):
    """The tiny tokenizer plus one BPE merge, "\\n" + "\\n" -> "\\n\\n" (Qwen2.5's and SmolLM2's
    vocabularies have it; the tiny corpus has no blank lines, so the tiny vocabulary does not)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("newline-tokenizer")
    tiny_tokenizer.save_pretrained(folder)
    state = json.loads((folder / "tokenizer.json").read_text())
    newline = "\u010a"  # byte-level BPE's printable form of "\n"
    state["model"]["vocab"][newline * 2] = len(tiny_tokenizer)
    state["model"]["merges"].insert(0, [newline, newline])
    (folder / "tokenizer.json").write_text(json.dumps(state))
    tok = AutoTokenizer.from_pretrained(folder)
    assert encode(tok, "\n\n") == [len(tiny_tokenizer)]
    return tok


def test_leading_newlines_of_an_assistant_message_are_all_trained(newline_tokenizer):
    tok = newline_tokenizer
    # the whole render tokenizes "assistant\n" + "\n\nHello" as "assistant", "\n\n", "\n", "Hello":
    # the prompt's last token "\n" is not a prefix of it, and slicing the whole render at the
    # prompt's length (what art-mega did) trained "\nHello world": one newline lost
    whole = encode(tok, HEAD + "\n\nHello world" + EOT + "\n")
    prompt = encode(tok, HEAD)
    assert whole[: len(prompt)] != prompt
    (seq,) = tokenize_history(tok, [USER, {"role": "assistant", "content": "\n\nHello world"}])
    turn = encode(tok, "\n\nHello world" + EOT)  # what the model emits after the prompt
    assert seq.input_ids == prompt + turn
    assert seq.loss_mask == [0.0] * len(prompt) + [1.0] * len(turn)
    assert tok.decode(trained(seq)) == "\n\nHello world" + EOT
    assert tok.decode(whole[len(prompt) :]).startswith("\nHello world")  # the old slice


def test_a_plain_turn_ends_where_vllm_stops_not_at_a_misnamed_eos(tiny_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    # as SmolLM2's converted tokenizer: eos_token is <|im_start|>, the generation config ends
    # turns with <|im_end|> (id 2), and vLLM stops on both
    tiny_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = AutoTokenizer.from_pretrained(tmp_path, eos_token="<|im_start|>")
    assert tok.eos_token_id == 1
    (seq,) = tokenize_history(tok, [USER, {"role": "assistant", "content": "hello"}])
    # through <|im_end|>; the newline after it (trained before: the eos alone never matched) is not
    assert trained(seq) == encode(tok, "hello" + EOT)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(TokenizationError, match="generation_config.json is not valid JSON"):
        tokenize_history(
            AutoTokenizer.from_pretrained(tmp_path), [USER, {"role": "assistant", "content": "x"}]
        )


def test_a_turn_whose_context_retokenizes_is_trained_in_its_own_sequence(newline_tokenizer):
    tok = newline_tokenizer
    conversation = [
        USER,
        {"role": "assistant", "content": "\n\nHello world"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "bye"},
    ]
    first, second = tokenize_history(tok, conversation)
    second_context = (
        HEAD + "\n\nHello world" + EOT + "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    # turn 3 was sampled after the whole context tokenized at once (the "\n\n\n" merged as vLLM
    # tokenizes it), not after turn 1's own tokens: so it is trained after that context
    assert first.input_ids == encode(tok, HEAD) + encode(tok, "\n\nHello world" + EOT)
    assert untrained_prefix(second) == encode(tok, second_context)
    assert second.input_ids == encode(tok, second_context) + encode(tok, "bye" + EOT)
    assert tok.decode(trained(second)) == "bye" + EOT
    (document_1, document_2), stats = sft_documents(tok, [Trajectory(messages_and_choices=conversation)])
    n_trained = len(trained(first)) + len(trained(second))
    assert stats.trained_tokens == n_trained
    assert document_1.weight == document_2.weight == 1.0  # ART: one weight per trained token


def test_sampled_choices_train_their_ids_exactly_after_the_context_they_were_sampled_in(newline_tokenizer):
    tok = newline_tokenizer
    hello = encode(tok, "\n\nHello world" + EOT)
    sampled = [*(encode(tok, c)[0] for c in "hello"), tok.eos_token_id]  # not the canonical "hello"
    assert sampled != encode(tok, "hello" + EOT)
    conversation = [
        USER,
        choice(hello, [-0.5 - k / 10 for k in range(len(hello))], "\n\nHello world"),
        {"role": "user", "content": "again"},
        choice(sampled, [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], "hello"),
    ]
    trajectories = [
        Trajectory(messages_and_choices=conversation, reward=1.0),
        Trajectory(messages_and_choices=conversation[:2], reward=0.0),
    ]
    documents, stats = grpo_documents(tok, [TrajectoryGroup(trajectories)])
    first, second, alone = documents
    context = HEAD + "\n\nHello world" + EOT + "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert first.input_ids == encode(tok, HEAD) + hello
    assert second.input_ids == encode(tok, context) + sampled
    assert second.loss_mask == [0.0] * len(encode(tok, context)) + [1.0] * 6
    assert second.old_logprobs[-6:] == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    assert first.old_logprobs[-len(hello) :] == pytest.approx([-0.5 - k / 10 for k in range(len(hello))])
    assert first.weight == second.weight == pytest.approx(1 / (len(hello) + 6))
    assert first.advantage == second.advantage > 0 > alone.advantage
    assert stats.trajectories_used == 2 and stats.trained_tokens == 2 * len(hello) + 6
    # packed into one row, every trained token keeps its sampled id and logprob at its own position
    (batch,) = pack(documents, seq_len=512)
    assert batch.shape == (1, 512)
    mask = batch.loss_mask[0] > 0
    expected = [
        (token, logprob)
        for d in sorted(documents, key=len, reverse=True)
        for token, logprob, m in zip(d.input_ids, d.old_logprobs, d.loss_mask)
        if m
    ]
    assert batch.input_ids[0, mask].tolist() == [token for token, _ in expected]
    assert batch.old_logprobs[0, mask].tolist() == pytest.approx([logprob for _, logprob in expected])


def test_a_choice_trains_after_the_prompt_ids_vllm_recorded_on_it(qwen3_tokenizer):
    # sampled with chat_template_kwargs={"enable_thinking": False}: vLLM's prompt ends with an
    # empty think block this tokenizer's default render does not have
    tok = qwen3_tokenizer
    first_prompt = encode(tok, FIRST_CONTEXT + "<think>\n\n</think>\n\n")
    first_ids = encode(tok, "4" + EOT)
    first = choice(first_ids, [-0.1] * len(first_ids), "4")
    first.prompt_token_ids = first_prompt  # what model.openai_client() records (tag_choices)
    second_prompt = (
        first_prompt
        + first_ids
        + encode(tok, "\n<|im_start|>user\n3 plus 3?<|im_end|>\n<|im_start|>assistant\n")
    )
    second_ids = encode(tok, "6" + EOT)
    second = choice(second_ids, [-0.2] * len(second_ids), "6")
    second.prompt_token_ids = second_prompt
    returned = Trajectory.model_validate_json(
        Trajectory(messages_and_choices=thinking_conversation(first, second)).model_dump_json()
    )
    (seq,) = tokenize_history(tok, returned.messages_and_choices)  # one sequence: prompt 2 extends it
    assert seq.input_ids == second_prompt + second_ids
    assert trained(seq) == first_ids + second_ids
    assert [lp for lp, m in zip(seq.old_logprobs, seq.loss_mask) if m] == [-0.1] * len(first_ids) + [
        -0.2
    ] * len(second_ids)
    # without the recorded ids the default render would have been the context
    del first.model_extra["prompt_token_ids"]
    (alone,) = tokenize_history(tok, [thinking_conversation(first, None)[0], first])
    assert alone.input_ids == encode(tok, FIRST_CONTEXT) + first_ids
    second.prompt_token_ids = [0, len(tok)]
    with pytest.raises(
        TokenizationError, match=rf"messages_and_choices\[3\] has prompt_token_ids\[1\]={len(tok)}"
    ):
        tokenize_history(tok, thinking_conversation(first, second))


def test_choice_token_ids_outside_the_vocabulary_or_unpaired_logprobs_are_refused(tiny_tokenizer):
    vocabulary = len(tiny_tokenizer)
    bad = Trajectory(messages_and_choices=[USER, choice([5, vocabulary], [-0.1, -0.2], "x")], reward=1.0)
    good = Trajectory(messages_and_choices=[USER, choice([5, 2], [-0.1, -0.2], "x")], reward=0.0)
    with pytest.raises(
        TokenizationError,
        match=rf"trajectory 1 of group 0: messages_and_choices\[1\] has token_ids\[1\]={vocabulary}, "
        rf"not a token id of this model's {vocabulary}-token vocabulary",
    ) as caught:
        grpo_documents(tiny_tokenizer, [TrajectoryGroup([good, bad])])
    assert (caught.value.where, caught.value.message_index) == ("trajectory 1 of group 0", 1)
    unpaired = choice([5, 2], [-0.1, -0.2], "x")
    unpaired.logprobs.content.pop()
    with pytest.raises(
        TokenizationError, match=r"messages_and_choices\[1\] is a sampled Choice with 1 logprobs for 2"
    ):
        tokenize_history(tiny_tokenizer, [USER, unpaired])


def test_choices_in_additional_histories_survive_a_json_round_trip(tiny_tokenizer):
    extra = {"messages_and_choices": [USER, choice([9, 9, 2], [-0.2, -0.3, -0.4], "x")]}
    trajectory = Trajectory(
        messages_and_choices=[USER, choice([5, 2], [-0.1, -0.1], "y")], additional_histories=[extra]
    )
    # the rollout worker sends trajectories as JSON: the choice inside the History comes back a Choice
    returned = Trajectory.model_validate_json(trajectory.model_dump_json())
    assert isinstance(returned.additional_histories[0].messages_and_choices[1], Choice)
    (_, history), _ = sft_documents(tiny_tokenizer, [returned])
    prompt = encode(tiny_tokenizer, HEAD)
    assert history.input_ids == prompt + [9, 9, 2]
    assert history.old_logprobs == pytest.approx([0.0] * len(prompt) + [-0.2, -0.3, -0.4])


# ------------------------------------------------------------- tool-call arguments as JSON strings

# Qwen2.5-Instruct's tool-calling chat template, trimmed to the branches these conversations reach:
# it prints `tool_call.arguments | tojson`, so a JSON string would be printed as an escaped string.
QWEN25_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n<tools>' }}"
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools><|im_end|>\\n" }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    '{%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}'
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
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def qwen25_tokenizer(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = QWEN25_TOOL_TEMPLATE
    return tok


def tool_call(arguments):
    return [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]


def weather_conversation(arguments):
    return [
        {"role": "user", "content": "weather in paris?"},
        {"role": "assistant", "content": "", "tool_calls": tool_call(arguments)},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "it is sunny"},
    ]


# vLLM 0.32 hands the template `ChatCompletionToolsParam.model_dump()`: type, then function with
# name, description (null when absent) and parameters, in that order; other keys dropped.
WEATHER_AS_VLLM_RENDERS_IT = (
    '{"type": "function", "function": {"name": "get_weather", "description": null, '
    '"parameters": {"type": "object"}}}'
)
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'


def test_json_string_arguments_render_as_the_object_not_an_escaped_string(qwen25_tokenizer):
    tok = qwen25_tokenizer
    as_string = tokenize_history(tok, weather_conversation('{"city": "paris"}'), tools=[WEATHER])
    as_object = tokenize_history(tok, weather_conversation({"city": "paris"}), tools=[WEATHER])
    (seq,) = as_string
    assert seq.input_ids == as_object[0].input_ids and seq.loss_mask == as_object[0].loss_mask
    assert tok.decode(trained(seq)) == CALL_TEXT + EOT + "it is sunny" + EOT
    assert '\\"city\\"' not in tok.decode(seq.input_ids)


def test_a_sampled_tool_call_is_rendered_parsed_in_the_next_turns_context(qwen25_tokenizer):
    tok = qwen25_tokenizer
    call_ids = encode(tok, CALL_TEXT + EOT)
    answer_ids = encode(tok, "it is sunny" + EOT)
    conversation = [
        {"role": "user", "content": "weather in paris?"},
        # vLLM returns the arguments of a sampled tool call as a JSON string
        choice(call_ids, [-0.1] * len(call_ids), None, tool_call('{"city": "paris"}')),
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        choice(answer_ids, [-0.2] * len(answer_ids), "it is sunny"),
    ]
    (seq,) = tokenize_history(tok, conversation, tools=[WEATHER])
    tools_block = (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>\n"
        + WEATHER_AS_VLLM_RENDERS_IT
        + "\n</tools><|im_end|>\n"
    )
    prompt = tools_block + "<|im_start|>user\nweather in paris?<|im_end|>\n<|im_start|>assistant\n"
    between = (
        "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # one sequence: the re-rendered (parsed) call is token for token the sampled one
    assert seq.input_ids == encode(tok, prompt) + call_ids + encode(tok, between) + answer_ids
    assert trained(seq) == call_ids + answer_ids
    assert [lp for lp, m in zip(seq.old_logprobs, seq.loss_mask) if m] == [-0.1] * len(call_ids) + [
        -0.2
    ] * len(answer_ids)


def test_tools_render_as_vllm_renders_them(qwen25_tokenizer):
    # key order, a missing description and an extra key as a user may write them: rendered as
    # given, the tools block would differ from the prompt the model sampled after
    tools = [
        {
            "function": {"parameters": {"type": "object"}, "name": "get_weather", "x-note": "mine"},
            "type": "function",
        }
    ]
    bare = [{"name": "get_weather", "parameters": {"type": "object"}}]  # ART's bare schema
    for given in (tools, bare, [WEATHER]):
        (seq,) = tokenize_history(qwen25_tokenizer, weather_conversation({"city": "paris"}), tools=given)
        assert f"<tools>\n{WEATHER_AS_VLLM_RENDERS_IT}\n</tools>" in qwen25_tokenizer.decode(seq.input_ids)
    strict = [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}, "strict": True}}
    ]
    (seq,) = tokenize_history(qwen25_tokenizer, [USER, {"role": "assistant", "content": "ok"}], tools=strict)
    assert '{"name": "f", "description": "d", "parameters": {}, "strict": true}' in qwen25_tokenizer.decode(
        seq.input_ids
    )
    with pytest.raises(TokenizationError, match=r"^the conversation: tools\[0\] is not a function tool"):
        tokenize_history(qwen25_tokenizer, [USER], tools=[{"type": "retrieval"}])


@pytest.mark.parametrize(
    "arguments,reason",
    [
        (
            "{city: paris}",
            r"is not valid JSON \(Expecting property name enclosed in double quotes at character 1\)",
        ),
        ('["paris"]', r"is the JSON list \[\"paris\"\], not an object"),
        (42, "is a int; give the arguments as a JSON object string or a dict"),
    ],
)
def test_tool_arguments_that_are_not_a_json_object_are_refused_naming_the_turn(
    qwen25_tokenizer, arguments, reason
):
    trajectory = Trajectory(messages_and_choices=weather_conversation(arguments), tools=[WEATHER])
    with pytest.raises(
        TokenizationError,
        match=rf"^trajectory 0: messages_and_choices\[1\]\.tool_calls\[0\]\.function\.arguments {reason}",
    ) as caught:
        sft_documents(qwen25_tokenizer, [trajectory])
    assert caught.value.message_index == 1


# --------------------------------------------------------- Qwen3-style templates that strip <think>

# Qwen3's chat template (tokenizer_config.json of Qwen/Qwen3-0.6B), trimmed to system/user/assistant:
# an assistant turn before the last user query is rendered without its <think> block; the last
# turns keep it (and the final one always gets one).
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FIRST = "<think>\nadd two\n</think>\n\n4"
SECOND = "<think>\nadd three\n</think>\n\n6"
SECOND_CONTEXT = (
    "<|im_start|>user\n2 plus 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    "<|im_start|>user\n3 plus 3?<|im_end|>\n<|im_start|>assistant\n"
)
FIRST_CONTEXT = "<|im_start|>user\n2 plus 2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3_tokenizer(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def thinking_conversation(first, second):
    return [
        {"role": "user", "content": "2 plus 2?"},
        first,
        {"role": "user", "content": "3 plus 3?"},
        second,
    ]


def test_qwen3_multi_turn_choices_train_each_turn_as_sampled(qwen3_tokenizer):
    tok = qwen3_tokenizer
    first_ids = encode(tok, FIRST + EOT)
    second_ids = encode(tok, SECOND + EOT)
    conversation = thinking_conversation(
        choice(first_ids, [-0.01 * (k + 1) for k in range(len(first_ids))], FIRST),
        choice(second_ids, [-0.02 * (k + 1) for k in range(len(second_ids))], SECOND),
    )
    # the template renders turn 1 without its <think> block in turn 3's context: the sequence of
    # turn 1 is not a prefix of it (art-mega refused this conversation before)
    plain = thinking_conversation({"role": "assistant", "content": FIRST}, None)[:3]
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == SECOND_CONTEXT
    rival = Trajectory(messages_and_choices=conversation[:2], reward=0.0)
    documents, stats = grpo_documents(
        tok, [TrajectoryGroup([Trajectory(messages_and_choices=conversation, reward=1.0), rival])]
    )
    first, second, _ = documents
    assert first.input_ids == encode(tok, FIRST_CONTEXT) + first_ids
    assert first.loss_mask == [0.0] * len(encode(tok, FIRST_CONTEXT)) + [1.0] * len(first_ids)
    assert second.input_ids == encode(tok, SECOND_CONTEXT) + second_ids
    assert second.loss_mask == [0.0] * len(encode(tok, SECOND_CONTEXT)) + [1.0] * len(second_ids)
    assert second.old_logprobs[-len(second_ids) :] == pytest.approx(
        [-0.02 * (k + 1) for k in range(len(second_ids))]
    )
    assert first.weight == second.weight == pytest.approx(1 / (len(first_ids) + len(second_ids)))
    assert first.advantage == second.advantage
    assert math.isclose(stats.trained_tokens, 2 * len(first_ids) + len(second_ids))


def test_qwen3_multi_turn_sft_messages_train_every_think_block(qwen3_tokenizer):
    tok = qwen3_tokenizer
    conversation = thinking_conversation(
        {"role": "assistant", "content": FIRST}, {"role": "assistant", "content": SECOND}
    )
    first, second = tokenize_history(tok, conversation, assistant_turns="all")
    assert first.input_ids == encode(tok, FIRST_CONTEXT) + encode(tok, FIRST + EOT)
    assert second.input_ids == encode(tok, SECOND_CONTEXT) + encode(tok, SECOND + EOT)
    assert tok.decode(trained(first)) == FIRST + EOT and tok.decode(trained(second)) == SECOND + EOT
    (last,) = tokenize_history(tok, conversation, assistant_turns="last")
    assert last.input_ids == second.input_ids and last.loss_mask == second.loss_mask


# A QwQ / DeepSeek-R1-style template: the generation prompt opens "<think>\n", and every assistant
# message is rendered without its thinking, so the render of a plain assistant message does not
# continue its generation prompt.
OPENS_THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def test_a_template_that_opens_think_in_the_prompt_trains_choices_and_refuses_plain_messages(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = OPENS_THINK_TEMPLATE
    with pytest.raises(
        TokenizationError,
        match=r"trajectory 0: the chat template renders the assistant message messages_and_choices\[1\] "
        r"so that it does not continue the generation prompt before it \(templates that strip or add "
        r"<think> blocks do this\).*train what the model sampled",
    ):
        sft_documents(
            tok,
            [
                Trajectory(
                    messages_and_choices=[USER, {"role": "assistant", "content": "add two\n</think>\n\n4"}]
                )
            ],
        )
    # sampled, the same turn trains: its ids follow the prompt's "<think>\n" exactly
    sampled = encode(tok, "add two\n</think>\n\n4" + EOT)
    (seq,) = tokenize_history(tok, [USER, choice(sampled, [-0.3] * len(sampled), "add two\n</think>\n\n4")])
    assert seq.input_ids == encode(tok, HEAD + "<think>\n") + sampled
    assert trained(seq) == sampled
