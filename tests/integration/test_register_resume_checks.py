"""`register` resumes through `checkpoint.read_resume_step`: a run whose committed step's adapter
is truncated is refused with the file's path before any trainer rank or replica starts (before,
the rank failed on it while the replica started beside it). The runtime is real (one local
agent); nothing else starts."""

import sys

import pytest

from art_mega.errors import CheckpointFileError
from art_mega.trainer import checkpoint as ckpt
from tests.helpers import save_checkpoint_step

pytestmark = pytest.mark.asyncio


async def test_register_refuses_a_committed_step_whose_adapter_is_truncated(tiny_llama_dir, tmp_path):
    import art_mega as art
    from art_mega.local import LocalBackend

    root = ckpt.checkpoints_dir(ckpt.run_dir(tmp_path, "p", "agent"))
    root.mkdir(parents=True)
    save_checkpoint_step(root, 0)
    weights = save_checkpoint_step(root, 1) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    backend = LocalBackend(path=str(tmp_path), vllm_python=sys.executable)
    try:
        with pytest.raises(CheckpointFileError) as caught:
            await art.TrainableModel(name="agent", project="p", base_model=str(tiny_llama_dir)).register(
                backend
            )
        assert caught.value.path == str(weights) and "it is truncated or was overwritten" in str(caught.value)
        assert not (root.parent / "logs").exists()  # no rank or replica was started
    finally:
        await backend.close()
