"""Hostile inputs to the rollout wire's generic model tags, a run's checkpoint folder and
`RolloutExecutor.set_workers`: each refused with its own error, never a bare ValueError/TypeError."""

from __future__ import annotations

import pytest

from art_mega.errors import CheckpointFileError, UserError
from art_mega.rollouts import wire
from art_mega.rollouts.remote import RolloutExecutor
from art_mega.trainer import checkpoint as ckpt
from tests.integration import distributed_for_tests as d

GENERIC = "art_mega.model:TrainableModel"


@pytest.mark.parametrize(
    "tag",
    [
        {"__model__": ":TrainableModel", "data": {}},
        {"__model__": "art_mega.model:", "data": {}},
        {"__model__": "..model:TrainableModel", "data": {}},
        {"__model__": ".model:TrainableModel", "data": {}},
        {"__model__": GENERIC, "args": [":Config"], "data": {}},
        {"__model__": GENERIC, "args": ["..x:Config"], "data": {}},
        {"__model__": GENERIC, "args": [{"__model__": ":X", "args": ["builtins:int"]}], "data": {}},
    ],
)
def test_a_class_reference_without_a_module_or_a_name_is_a_wire_error(tag):
    with pytest.raises(wire.WireError) as caught:
        wire.decode({"value": tag}, "result")
    assert "which is not a 'module:qualname' reference" in str(caught.value)
    assert str(caught.value).startswith("result['value'] names the class ")


def test_a_generic_tag_with_unknown_arguments_is_refused_not_parametrized():
    for args, said in [
        (["builtins:int", "builtins:str"], "cannot be parametrized here"),
        ([], "are not a list of classes"),
        ("builtins:int", "are not a list of classes"),
        (["no_such_module_here:Config"], "cannot be imported here"),
    ]:
        with pytest.raises(wire.WireError, match=said):
            wire.decode({"__model__": GENERIC, "args": args, "data": {}})


def test_step_folders_skip_names_that_are_digits_but_not_ascii(tmp_path):
    for name in ("0001", "0002", "²", "٣", "0003x"):
        (tmp_path / name).mkdir()
    assert ckpt.step_folders(tmp_path) == [1, 2]


@pytest.mark.parametrize("text", ["9" * 5000, "-1", "1.5", "", "3 4", "²"])
def test_a_pointer_that_is_not_a_step_number_is_a_checkpoint_file_error(tmp_path, text):
    (tmp_path / ckpt.COMMIT_FILE).write_text(text)
    with pytest.raises(CheckpointFileError) as caught:
        ckpt.read_commit(tmp_path)
    assert "not the number of the last committed step" in str(caught.value)


def test_set_workers_refuses_too_many_ids_before_looking_for_repeats():
    executor = RolloutExecutor({}, [("host0", 2)], [d.where], 2)
    ids = [7] * 5000  # repeats too: the count is what is refused
    with pytest.raises(UserError) as caught:
        executor.set_workers(ids)
    assert "names 5000 workers, but the executor has target_workers=2 processes" in str(caught.value)
    assert executor.worker_ids == (0, 1)


@pytest.mark.parametrize("written_at", ["NaN", "Infinity", "1e400"])
def test_a_committed_manifest_with_a_non_finite_time_is_malformed(tmp_path, written_at):
    folder = ckpt.step_dir(tmp_path, 1)
    folder.mkdir()
    ckpt.manifest_file(folder).write_text(
        '{"step": 1, "adapter_sha256": "' + "a" * 64 + '", "base_model": "m", '
        '"layout": {"world_size": 1, "tp": 1, "dp": 1}, "written_at": ' + written_at + "}"
    )
    ckpt.write_commit(tmp_path, 1)
    with pytest.raises(CheckpointFileError) as caught:
        ckpt.read_commit(tmp_path)
    assert str(caught.value).startswith(f"{ckpt.manifest_file(folder)} is not a checkpoint manifest: ")
    assert "written_at" in str(caught.value) and "\n" not in str(caught.value)
