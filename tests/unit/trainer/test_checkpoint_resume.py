"""What a run resumes from (`checkpoint.read_resume_step`, called by `register`) and what a fork
copies (`check_adapter`): a committed step whose adapter is missing, truncated, not the
manifest's or unlike its own adapter_config.json, and step folders the commit pointer does not
account for, are refused with the path and the fix, before any rank or replica would fail on
them. Real files: the adapter config as the trainer writes it (`peft_io.adapter_config`), the
weights by `safetensors.torch.save_file`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path

import pytest

from art_mega.errors import CheckpointFileError
from art_mega.trainer import checkpoint as ckpt
from tests.helpers import save_checkpoint_step as save_step

pytest.importorskip("torch", reason="the weights are written by safetensors.torch")
from safetensors.torch import load_file  # noqa: E402

FIX = "; restore it from a copy, or give the model another name to start a new run"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A checkpoints folder with steps 0, 1 and 2 committed."""
    for step in range(3):
        save_step(tmp_path, step)
    return tmp_path


def refusal(root: Path) -> CheckpointFileError:
    with pytest.raises(CheckpointFileError) as caught:
        ckpt.read_resume_step(root)
    assert "\n" not in str(caught.value) and caught.value.exit_code == 2
    return caught.value


def test_a_whole_committed_run_resumes_at_its_commit(run: Path) -> None:
    assert ckpt.read_resume_step(run) == 2
    assert ckpt.read_resume_step(run / "none") is None  # a new run
    assert len(load_file(str(run / "0002" / "adapter_model.safetensors"))) == 14  # 7 modules, A and B


@pytest.mark.parametrize("name", ckpt.ADAPTER_FILES)
def test_a_committed_step_without_an_adapter_file_is_refused_naming_it(run: Path, name: str) -> None:
    (run / "0002" / name).unlink()
    error = refusal(run)
    assert str(error) == (
        f"{run / '0002' / name} is missing, so the adapter of {run / '0002'} cannot be loaded (a folder "
        f"holds both adapter_config.json and adapter_model.safetensors){FIX}"
    )
    assert error.path == str(run / "0002" / name)


def test_a_truncated_adapter_is_refused_where_safetensors_would_fail_to_load_it(run: Path) -> None:
    weights = run / "0002" / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-10])
    with pytest.raises(Exception, match="(?i)incomplete|invalid|truncat"):  # the library's own refusal
        load_file(str(weights))
    assert refusal(run).problem == (
        f"is {len(whole) - 10} bytes where its header describes {len(whole)}: it is truncated or was overwritten"
    )
    weights.write_bytes(whole[:20])  # cut inside the JSON header
    assert (
        refusal(run).problem.startswith("announces a ") and "-byte header in 20 bytes" in refusal(run).problem
    )
    weights.write_bytes(whole[:3])
    assert refusal(run).problem == "is 3 bytes, shorter than a safetensors header"
    weights.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    assert refusal(run).problem == "holds no tensors"


def test_an_adapter_of_the_right_size_that_is_not_the_manifests_is_refused(run: Path) -> None:
    weights = run / "0002" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the last tensor
    weights.write_bytes(bytes(data))
    manifest = ckpt.read_manifest(run / "0002")
    digest = hashlib.sha256(bytes(data)).hexdigest()
    assert refusal(run).problem == f"has sha256 {digest}, not the manifest's {manifest.adapter_sha256}"


def test_tensors_unlike_their_adapter_config_are_refused(tmp_path: Path) -> None:
    save_step(tmp_path, 0, rank=4, config_rank=8)
    weights = tmp_path / "0000" / "adapter_model.safetensors"
    error = refusal(tmp_path)
    assert str(error).startswith(
        f"{weights} does not match {tmp_path / '0000' / 'adapter_config.json'}: tensor "
        "base_model.model.model.layers.0."
    )
    assert " has LoRA rank 4, but the config's r is 8" + FIX in str(error)
    save_step(tmp_path, 0, rank=4)
    config_path = tmp_path / "0000" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = [m for m in config["target_modules"] if m != "v_proj"]
    config_path.write_text(json.dumps(config))
    assert refusal(tmp_path).problem.endswith(
        "v_proj.lora_A.weight adapts 'v_proj', which is not in the config's target_modules "
        f"{config['target_modules']}"
    )
    config_path.write_text("[1]")
    assert str(refusal(tmp_path)) == f"{config_path} holds a JSON list, not an adapter config{FIX}"


def test_the_one_save_a_crash_leaves_uncommitted_is_logged_and_resumed_past(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_step(run, 3, commit=False)  # placed, but the controller died before the commit
    with caplog.at_level(logging.WARNING, logger="art_mega.trainer.checkpoint"):
        assert ckpt.read_resume_step(run) == 2
    assert f"{run / '0003'} is a save of step 3 that was not committed (the commit is 2)" in caplog.text
    ckpt.prepare_staging(run / "0004")  # a save in progress is no step folder: clean_uncommitted's
    assert ckpt.read_resume_step(run) == 2


def test_step_folders_the_commit_does_not_account_for_are_refused(run: Path) -> None:
    save_step(run, 4, commit=False)
    error = refusal(run)
    assert str(error) == (
        f"{run / '0004'} holds a saved step 4, more than one step above the committed step (2, "
        f"{run / 'LATEST'}), which a pointer older than the run or one set back by hand leaves; to "
        f"resume from step 2, move the step folders above 3 out of {run}, else write the step to "
        f"resume from into the pointer{FIX}"
    )
    ckpt.delete_step(run, 4)
    (run / "0003").mkdir()  # not a save of this trainer (an ART run's folder has no manifest)
    (run / "0003" / "adapter_model.safetensors").write_bytes(b"ART's")
    assert str(refusal(run)) == (
        f"{run / '0003'} is a step folder above the committed step (2, {run / 'LATEST'}) without the "
        f"manifest.json this trainer saves (e.g. a run of ART's), which training would replace; move "
        f"it out of {run}{FIX}"
    )


def test_a_pointer_to_a_removed_step_with_saved_steps_beside_it_is_refused(run: Path) -> None:
    ckpt.write_commit(run, 7)
    assert ckpt.read_commit(run) is None  # read_commit alone: a fresh start
    assert str(refusal(run)) == (
        f"{run / 'LATEST'} names step 7, whose folder {run / '0007'} holds no manifest.json, while "
        f"the step folders [0, 1, 2] are there (a fresh start would replace them); write the step to "
        f"resume from into it{FIX}"
    )
    (run / "LATEST").unlink()  # no pointer: step 0 would be the one crashed save, but 1 and 2 are there
    assert refusal(run).problem.startswith(
        "holds a saved step 1, more than one step above the committed step (None"
    )


def test_a_fork_refuses_a_source_step_whose_adapter_would_not_load(tmp_path: Path) -> None:
    from art_mega.local import LocalBackend

    class Model:
        name, project = "fork", "proj"

    source = ckpt.checkpoints_dir(ckpt.run_dir(tmp_path, "proj", "base"))
    source.mkdir(parents=True)
    save_step(source, 0)
    save_step(source, 1)
    weights = source / "0001" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    backend = LocalBackend(path=str(tmp_path))
    with pytest.raises(CheckpointFileError) as caught:
        asyncio.run(backend._experimental_fork_checkpoint(Model(), from_model="base"))
    assert caught.value.path == str(weights) and "it is truncated" in str(caught.value)
    fork = ckpt.checkpoints_dir(ckpt.run_dir(tmp_path, "proj", "fork"))
    assert not fork.exists() or ckpt.step_folders(fork) == []  # nothing copied
    asyncio.run(backend._experimental_fork_checkpoint(Model(), from_model="base", not_after_step=0))
    assert ckpt.read_resume_step(fork) == 0
