"""A step publishes the adapter rank 0 reported (`AdapterReady`), checked against the committed
folder and its manifest's sha256 (issue 35: the hand-off typed and used)."""

from __future__ import annotations

import pytest

from art_mega.backend.step import published_adapter
from art_mega.errors import CheckpointFileError
from art_mega.trainer import checkpoint
from art_mega.trainer.protocol import AdapterReady, Done
from art_mega.trainer.remote import JobResult

SHA = "ab" * 32


def committed(tmp_path, sha: str = SHA):  # noqa: ANN001, ANN201
    folder = checkpoint.step_dir(tmp_path, 3)
    checkpoint.adapter_dir(folder).mkdir(parents=True)
    layout = checkpoint.ManifestLayout(world_size=1, tp=1, dp=1)
    manifest = checkpoint.Manifest(step=3, adapter_sha256=sha, base_model="m", layout=layout, written_at=1.0)
    checkpoint.write_manifest(folder, manifest)
    return folder


def result(*ready: AdapterReady) -> JobResult:
    return JobResult("j", {0: Done(job="j", metrics={})}, 1.0, list(ready))


def test_the_reported_adapter_of_the_committed_folder_is_published(tmp_path):
    folder = committed(tmp_path)
    ready = AdapterReady(job="j", path=str(checkpoint.adapter_dir(folder)), step=3, sha256=SHA)
    assert published_adapter(result(ready), 3, folder) == str(checkpoint.adapter_dir(folder))


def test_another_step_folder_or_sha256_is_refused_naming_both(tmp_path):
    folder = committed(tmp_path)
    path = str(checkpoint.adapter_dir(folder))
    with pytest.raises(CheckpointFileError, match=r"is step 3's adapter, but the trainer's rank 0 reported none"):
        published_adapter(result(), 3, folder)
    with pytest.raises(CheckpointFileError, match=r"reported \[\(2, "):
        published_adapter(result(AdapterReady(job="j", path=path, step=2, sha256=SHA)), 3, folder)
    elsewhere = AdapterReady(job="j", path=str(tmp_path / "other"), step=3, sha256=SHA)
    with pytest.raises(CheckpointFileError, match="other"):
        published_adapter(result(elsewhere), 3, folder)
    with pytest.raises(CheckpointFileError) as wrong:
        published_adapter(result(AdapterReady(job="j", path=path, step=3, sha256="cd" * 32)), 3, folder)
    assert f"records adapter sha256 {SHA}, but rank 0 exported {'cd' * 32}" in str(wrong.value)
