import json
import math

import pytest

from art_mega.errors import SFTFileError, UserError
from art_mega.sft import (
    create_lr_schedule,
    create_sft_dataset_iterator,
    iterate_dataset,
    read_sft_jsonl,
    train_sft_from_file,
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
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not valid JSON",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]},
                    {"role": "assistant", "content": "y"},
                ]
            },
            r"arguments is the JSON list \[1, 2\], not an object",
        ),
        # a content the chat template cannot render fails here, before any SFT step runs
        (
            {"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "y"}]},
            r"messages\[0\]\.content is the int 42, not a string; SFT message content must be a string",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": {"text": "y"}},
                ]
            },
            r"messages\[1\]\.content is the dict \{\"text\": \"y\"\}, not a string",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "not a string; SFT message content must be a string; join its text parts into one string",
        ),
        (
            {"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]},
            r"messages\[0\] has no content; give it a string",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi", "tool_calls": []},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "is a 'user' message with tool_calls; only assistant messages carry them",
        ),
        ({**GOOD, "tools": ["get"]}, r"tools\[0\] is not a function tool; give tools as the request did"),
        (
            {**GOOD, "tools": {"name": "get"}},
            "tools is a dict; give the list of tools the request was sent with",
        ),
    ],
)
def test_each_bad_row_names_its_line_and_reason(tmp_path, bad, reason):
    path = write(tmp_path, GOOD, bad)
    with pytest.raises(SFTFileError, match=f"data.jsonl:2: .*{reason}") as caught:
        read_sft_jsonl(path)
    assert (caught.value.path, caught.value.line) == (str(path), 2)


def test_a_file_with_a_utf8_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\r\n" + json.dumps(TOOL) + "\r\n").encode())
    rows = read_sft_jsonl(path)
    assert [r.messages()[0]["content"] for r in rows] == ["hi", "weather?"]


def test_bytes_that_are_not_utf8_are_refused_with_their_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        (json.dumps(GOOD) + "\n").encode()
        + '{"messages": [{"role": "user", "content": "caf\xe9"'.encode("latin-1")
    )
    with pytest.raises(
        SFTFileError, match=r"latin1.jsonl:2: byte 47 of the line is not UTF-8; save the file as UTF-8"
    ):
        read_sft_jsonl(path)


def test_missing_empty_and_unreadable_files_are_refused(tmp_path):
    with pytest.raises(SFTFileError, match="does not exist"):
        read_sft_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(SFTFileError, match="does not exist"):
        read_sft_jsonl(tmp_path)
    with pytest.raises(SFTFileError, match="has no rows"):
        read_sft_jsonl(write(tmp_path, "", "  "))


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
        create_sft_dataset_iterator(
            rows, chunk_size=1, epochs=2, batch_size=2, peak_lr=1.0, schedule_type="linear"
        )
    )
    assert [(c.step, c.epoch, c.epoch_step, len(c.trajectories)) for c in chunks] == [
        (0, 0, 0, 2),
        (1, 0, 1, 1),
        (2, 1, 0, 2),
        (3, 1, 1, 1),
    ]
    assert [r for c in chunks for r in c.config.learning_rate] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    # ART's default chunk_size=10: one train_sft call per epoch here, one rate per batch
    chunks = list(create_sft_dataset_iterator(rows, epochs=2, batch_size=2, peak_lr=1.0))
    assert [(c.step, c.epoch, c.epoch_step, len(c.trajectories)) for c in chunks] == [(0, 0, 0, 3), (2, 1, 0, 3)]
    assert [r for c in chunks for r in c.config.learning_rate] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    resumed = list(create_sft_dataset_iterator(rows, chunk_size=1, epochs=2, batch_size=2, initial_step=2))
    assert [c.step for c in resumed] == [2, 3]


def test_iterate_dataset():
    batches = list(iterate_dataset(list(range(5)), groups_per_step=2, num_epochs=2, shuffle=False))
    assert [b.items for b in batches] == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]
    assert [b.step for b in iterate_dataset(list(range(5)), 2, 2, initial_step=4)] == [4, 5]


async def test_train_sft_from_file_refuses_a_bad_row_before_the_first_step(tmp_path):
    import art_mega as art

    # an unregistered model: its first SFT step would raise "not registered", so only a check made
    # while the file loads can name line 4 (today rows 1-3 trained before line 4 failed)
    model = art.TrainableModel(name="m", project="p", base_model="tiny")
    with pytest.raises(RuntimeError, match="model 'm' is not registered"):
        await train_sft_from_file(model, write(tmp_path, GOOD))
    rows = [GOOD] * 3 + [
        {"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "y"}]}
    ]
    with pytest.raises(SFTFileError, match=r"data.jsonl:4: messages\[0\].content is the int 7, not a string"):
        await train_sft_from_file(model, write(tmp_path, *rows), batch_size=1)
