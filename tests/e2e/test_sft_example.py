"""examples/multinode/sft.py runs unchanged under `art-mega local` on the tiny model: SFT from the
shipped JSONL lowers the SFT loss, then one GRPO step completes on top of the SFT policy."""

import json
import re
from pathlib import Path

import pytest

from tests.conftest import cli_env, run_cli

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")

DONE = re.compile(
    r"ART_MEGA_SFT_DONE sft_loss first_epoch=(?P<first>[\d.]+) last_epoch=(?P<last>[\d.]+) "
    r"sft_steps=(?P<sft_steps>\d+) grpo_step=(?P<grpo_step>\d+)"
)


@pytest.mark.timeout(900)
def test_sft_then_grpo_example_under_art_mega_local(tmp_path):
    from art_mega.backend import default_vllm_python
    from art_mega.errors import UserError

    try:
        vllm_python = default_vllm_python()
    except UserError as exc:
        pytest.skip(str(exc))
    env = cli_env()
    env.update(
        ART_MEGA_SFT_EPOCHS="2",
        ART_MEGA_SFT_BATCH_SIZE="16",
        ART_MEGA_SFT_LR="2e-3",
        ART_MEGA_GROUP_SIZE="4",
        ART_MEGA_BASE_MODEL="tiny-llama",
        ART_MEGA_VLLM_PYTHON=vllm_python,
        ART_MEGA_CACHE=str(Path.home() / ".cache" / "art-mega"),
    )
    repo = Path(__file__).resolve().parents[2]
    result = run_cli(
        "local", "--program", f"{repo}/examples/multinode/sft.py:main", cwd=tmp_path, env=env, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done = DONE.search(result.stdout)
    assert done, result.stdout[-3000:]
    print(next(line for line in result.stdout.splitlines() if "ART_MEGA_SFT_DONE" in line))
    assert float(done["last"]) < float(done["first"]), done.group(0)
    rows = sum(1 for _ in (repo / "examples" / "multinode" / "sft_yes_no.jsonl").open())
    sft_steps = 2 * -(-rows // 16)  # 2 epochs of ceil(rows / 16) batches
    assert int(done["sft_steps"]) == sft_steps
    # ART: one train_sft_from_file call is one step (one per epoch here), then the GRPO step
    assert int(done["grpo_step"]) == 2 + 1
    run = tmp_path / ".art" / "art-mega-quickstart" / "models" / "yes-no-sft"
    assert (run / "checkpoints" / "LATEST").read_text().strip() == str(2 + 1)
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert any("train/reward" in h and "loss/train" in h for h in history)
