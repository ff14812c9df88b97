import json
import math

import pytest

from art_mega.errors import UserError
from art_mega.sft import (
    create_lr_schedule,
    create_sft_dataset_iterator,
    iterate_dataset,
    read_sft_jsonl,
)

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
TOOL = {
    "messages": [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "get", "arguments": '{"city": "x"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        {"role": "assistant", "content": "sunny"},
    ],
    "tools": [{"type": "function", "function": {"name": "get", "parameters": {}}}],
}


def write(tmp_path, *rows):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_valid_rows_become_trajectories(tmp_path):
    rows = read_sft_jsonl(write(tmp_path, GOOD, "", TOOL))
    assert len(rows) == 2
    assert rows[1].tools and rows[1].messages()[-1]["content"] == "sunny"


@pytest.mark.parametrize(
    "bad,reason",
    [
        ("{not json", "not valid JSON"),
        ({"text": "x"}, "no 'messages' list"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "last message must be the assistant's"),
        (
            {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "unknown role 'wizard'",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "has no function name",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "arguments is not valid JSON",
        ),
    ],
)
def test_each_bad_row_names_its_line_and_reason(tmp_path, bad, reason):
    path = write(tmp_path, GOOD, bad)
    with pytest.raises(UserError, match=f"data.jsonl:2: .*{reason}"):
        read_sft_jsonl(path)


def test_lr_schedules_by_hand():
    assert create_lr_schedule(4, 1.0, "constant", warmup_steps=2) == [0.5, 1.0, 1.0, 1.0]
    assert create_lr_schedule(3, 1.0, "linear") == pytest.approx([1.0, 0.5, 0.0])
    cosine = create_lr_schedule(5, 2.0, "cosine", warmup_steps=0, min_lr=0.0)
    assert cosine == pytest.approx([2.0, 1 + math.cos(math.pi / 4), 1.0, 1 - math.cos(math.pi / 4), 0.0])
    with pytest.raises(UserError, match="schedule_type='step'"):
        create_lr_schedule(3, 1.0, "step")


def test_sft_iterator_steps_epochs_and_resume(tmp_path):
    rows = read_sft_jsonl(write(tmp_path, GOOD, GOOD, TOOL))
    chunks = list(
        create_sft_dataset_iterator(rows, epochs=2, batch_size=2, peak_lr=1.0, schedule_type="linear")
    )
    assert [(c.step, c.epoch, c.epoch_step, len(c.trajectories)) for c in chunks] == [
        (0, 0, 0, 2),
        (1, 0, 1, 1),
        (2, 1, 0, 2),
        (3, 1, 1, 1),
    ]
    assert [c.config.learning_rate for c in chunks] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    resumed = list(create_sft_dataset_iterator(rows, epochs=2, batch_size=2, initial_step=2))
    assert [c.step for c in resumed] == [2, 3]


def test_iterate_dataset():
    batches = list(iterate_dataset(list(range(5)), groups_per_step=2, num_epochs=2, shuffle=False))
    assert [b.items for b in batches] == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]
    assert [b.step for b in iterate_dataset(list(range(5)), 2, 2, initial_step=4)] == [4, 5]
