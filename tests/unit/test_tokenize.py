"""Tokenization for training on the tiny model's real tokenizer and ChatML template."""

import pytest
from openai.types.chat.chat_completion import Choice

from art_mega import Trajectory, TrajectoryGroup
from art_mega.errors import UserError
from art_mega.trainer.tokenize import grpo_documents, sft_documents, tokenize_history

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
    seq = tokenize_history(tiny_tokenizer, [SYSTEM, USER, choice([7, 8, 2], [-0.1, -0.2, -0.3])])
    assert seq.input_ids == prompt + [7, 8, 2]  # not re-tokenized: 7, 8 are not what "hello" encodes to
    assert seq.loss_mask == [0.0] * len(prompt) + [1.0, 1.0, 1.0]
    assert seq.old_logprobs[-3:] == pytest.approx([-0.1, -0.2, -0.3])


def test_plain_assistant_turns_all_and_last(tiny_tokenizer):
    messages = [
        SYSTEM,
        USER,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "bye"},
    ]
    seq = tokenize_history(tiny_tokenizer, messages)
    full = template(tiny_tokenizer, messages, gen=False)
    assert seq.input_ids == full[: len(seq.input_ids)]
    trained = [t for t, m in zip(seq.input_ids, seq.loss_mask) if m]
    hello = template(tiny_tokenizer, messages[:3], gen=False)[
        len(template(tiny_tokenizer, messages[:2], gen=True)) :
    ]
    eos = tiny_tokenizer.eos_token_id
    assert (
        trained[: hello.index(eos) + 1] == hello[: hello.index(eos) + 1]
    )  # through <|im_end|>, not the newline
    assert trained.count(eos) == 2
    last = tokenize_history(tiny_tokenizer, messages, assistant_turns="last")
    assert [t for t, m in zip(last.input_ids, last.loss_mask) if m].count(eos) == 1
    assert tiny_tokenizer.decode([t for t, m in zip(last.input_ids, last.loss_mask) if m]).startswith("bye")


def test_tool_calls_and_tools_are_part_of_the_prompt(tiny_tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "look up",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    messages = [USER, {"role": "assistant", "content": "sunny"}]
    with_tools = tokenize_history(tiny_tokenizer, messages, tools=tools)
    without = tokenize_history(tiny_tokenizer, messages)
    assert sum(with_tools.loss_mask) == sum(without.loss_mask)
    assert len(with_tools.input_ids) >= len(without.input_ids)


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
