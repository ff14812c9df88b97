"""Content parts reach the chat template as vLLM hands them over (issue 13, tokenization exact or
refused): text parts joined with newlines for templates that print `content`, the parts for
templates that iterate over them; image and other parts are refused naming the message. On the
tiny model's tokenizer with its own template and one that iterates over parts."""

from __future__ import annotations

import copy

import pytest

from art_mega import Trajectory, TrajectoryGroup
from art_mega.errors import TokenizationError
from art_mega.trainer.prepare.tokenize import content_format, grpo_documents, tokenize_history

ANSWER = {"role": "assistant", "content": "fine thanks"}
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


def rows(sequences) -> list[tuple[list[int], list[float]]]:  # noqa: ANN001
    return [(s.input_ids, s.loss_mask) for s in sequences]


def test_text_parts_train_as_the_joined_string_on_a_string_template(tiny_tokenizer) -> None:  # noqa: ANN001
    """The tiny template concatenates content: a list of parts failed its render (TypeError);
    vLLM joins text parts with newlines for such templates, and so does training now."""
    assert content_format(tiny_tokenizer) == "string"
    joined = tokenize_history(tiny_tokenizer, [{"role": "user", "content": "how are\nyou"}, ANSWER])
    split = tokenize_history(tiny_tokenizer, [{"role": "user", "content": parts("how are", "you")}, ANSWER])
    assert rows(split) == rows(joined) and split[0].trained_tokens > 0


def test_text_parts_reach_a_template_that_iterates_over_them(tiny_tokenizer) -> None:  # noqa: ANN001
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = PARTS_TEMPLATE
    assert content_format(tokenizer) == "openai"
    (sequence,) = tokenize_history(tokenizer, [{"role": "user", "content": parts("how are", "you")}, ANSWER])
    prompt = tokenizer.encode(
        "<|im_start|>user\n[how are][you]<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    answer = tokenizer.encode("fine thanks<|im_end|>", add_special_tokens=False)
    assert sequence.input_ids[: len(prompt)] == prompt and sum(sequence.loss_mask[: len(prompt)]) == 0
    assert [t for t, m in zip(sequence.input_ids, sequence.loss_mask) if m] == answer


@pytest.mark.parametrize(
    ("part", "shown"),
    [
        ({"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, "a part of type 'image_url'"),
        (
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
            "a part of type 'input_audio'",
        ),
        ({"type": 3}, "a part of type 3"),
        ({"type": "text"}, "not a text part with a string 'text'"),
        ({"type": "text", "text": 5}, "not a text part with a string 'text'"),
        ({"text": "no type"}, "not a text part with a string 'text'"),
    ],
)
def test_parts_that_are_not_text_are_refused_naming_message_and_part(tiny_tokenizer, part, shown) -> None:  # noqa: ANN001
    group = TrajectoryGroup(
        [
            Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, ANSWER], reward=1.0),
            Trajectory(
                messages_and_choices=[{"role": "user", "content": [*parts("look"), part]}, ANSWER], reward=0.0
            ),
        ]
    )
    with pytest.raises(
        TokenizationError,
        match=rf"trajectory 1 of group 0: messages_and_choices\[0\].content\[1\] is {shown}",
    ):
        grpo_documents(tiny_tokenizer, [group], scale_rewards=True)


def test_a_template_that_prints_content_gets_the_joined_text_not_the_list(tiny_tokenizer) -> None:  # noqa: ANN001
    """A Qwen2.5-style `{{ message['content'] }}` printed the parts' Python repr into the trained
    context in silence; vLLM (whose syntax-tree check also says "string" for this template)
    joins the text parts."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert content_format(tokenizer) == "string"
    split = tokenize_history(tokenizer, [{"role": "user", "content": parts("how are", "you")}, ANSWER])
    joined = tokenize_history(tokenizer, [{"role": "user", "content": "how are\nyou"}, ANSWER])
    assert rows(split) == rows(joined)
    assert "type" not in tokenizer.decode(split[0].input_ids)


def test_a_trajectory_without_assistant_turns_is_counted_apart(tiny_tokenizer) -> None:  # noqa: ANN001
    """A rollout that never appended its Choice trains nothing; it was counted as a zero
    advantage, so data/ metrics hid it. (ANSWER is a plain assistant dict, trained only with
    allow_training_without_logprobs, as in ART.)"""
    group = TrajectoryGroup(
        [
            Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, ANSWER], reward=1.0),
            Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.0),
        ]
    )
    documents, stats = grpo_documents(tiny_tokenizer, [group], allow_training_without_logprobs=True)
    metrics = stats.as_metrics()
    assert metrics["data/trajectories_dropped_no_assistant_tokens"] == 1.0
    assert metrics["data/trajectories_dropped_zero_advantage"] == 0.0
    assert metrics["data/trajectories_used"] == 1.0 and len(documents) == 1 and documents[0].advantage > 0
