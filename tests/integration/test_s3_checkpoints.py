"""ART's `_experimental_push_to_s3` / `_pull_from_s3` / `_fork_checkpoint` against a real
S3-compatible server (moto's server mode on loopback, reached by boto3 through AWS_ENDPOINT_URL):
committed checkpoints of real PEFT adapters of the tiny Llama go up and come back byte-equal and
committed (LATEST last), a fork picks the newest step <= not_after_step, and every refusal is one
sentence. No trainer rank runs: the backends are never registered."""

import asyncio
import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest

from art_mega.errors import CheckpointFileError, UserError
from art_mega.trainer import checkpoint as ckpt

pytest.importorskip("boto3", reason="S3 checkpoints need boto3 (the test extra)")
pytest.importorskip("moto.server", reason="the S3 server is moto's (moto[server], the test extra)")

PROJECT = "proj"
BUCKET = "art-backups"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """A moto S3 server on 127.0.0.1 for this module; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A boto3 client of the server, its bucket created empty; the backend's boto3 reads the same env."""
    import boto3

    for name, value in {
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("BACKUP_BUCKET", raising=False)
    client = boto3.client("s3")
    if _exists(client):
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
        for key in keys:
            client.delete_object(Bucket=BUCKET, Key=key)
    else:
        client.create_bucket(Bucket=BUCKET)
    return client


def _exists(client) -> bool:
    return any(b["Name"] == BUCKET for b in client.list_buckets().get("Buckets", []))


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[int, Path]:
    """Real PEFT adapters of the tiny Llama (peft's own save_pretrained), one per step 1, 2, 4,
    each with other random LoRA weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for step in (1, 2, 4):
        torch.manual_seed(step)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param)  # B starts at zero; make the steps differ
        folder = tmp_path_factory.mktemp(f"adapter{step}")
        model.save_pretrained(folder)
        out[step] = folder
    return out


def commit_step(run_dir: Path, step: int, adapter: Path) -> Path:
    """Save step `step` as the trainer does: staging folder (adapter, a rank state file, the
    manifest), placed, then LATEST."""
    root = ckpt.checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = ckpt.step_dir(root, step)
    staging = ckpt.prepare_staging(final)
    shutil.copytree(adapter, ckpt.adapter_dir(staging), dirs_exist_ok=True)
    ckpt.rank_state_file(staging, 0).write_bytes(b"rank 0 state of step %d" % step)
    weights = (ckpt.adapter_dir(staging) / "adapter_model.safetensors").read_bytes()
    ckpt.write_manifest(
        staging,
        ckpt.Manifest(
            step=step,
            adapter_sha256=hashlib.sha256(weights).hexdigest(),
            base_model="/models/tiny-llama",
            layout=ckpt.ManifestLayout(world_size=1, tp=1, dp=1),
            written_at=1.0,
        ),
    )
    ckpt.place_folder(staging, final)
    ckpt.write_commit(root, step)
    return final


def trained_run(root: Path, name: str, adapters: dict[int, Path], steps=(1, 2, 4)) -> Path:
    run = root / PROJECT / "models" / name
    for step in steps:
        commit_step(run, step, adapters[step])
    (run / "history.jsonl").write_text('{"step": 4, "val/reward": 0.5}\n')
    return run


def files_of(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


class M:
    """What the backend reads of a model before register: its name and project."""

    def __init__(self, name: str, project: str = PROJECT):
        self.name, self.project = name, project


def backend_at(path: Path):
    from art_mega.local import LocalBackend

    return LocalBackend(path=str(path))


def run(coro):
    return asyncio.run(coro)


def test_push_then_pull_brings_the_committed_checkpoints_back_byte_equal(tmp_path, s3, adapters):
    here = trained_run(tmp_path / "a", "m1", adapters)
    root = ckpt.checkpoints_dir(here)
    ckpt.prepare_staging(ckpt.step_dir(root, 5))  # a save in progress: never pushed
    run(backend_at(tmp_path / "a")._experimental_push_to_s3(M("m1"), s3_bucket=BUCKET, prefix="team/"))

    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"])
    assert "team/proj/models/m1/checkpoints/LATEST" in keys
    assert "team/proj/models/m1/checkpoints/0004/adapter_model.safetensors" in keys
    assert not [k for k in keys if ".staging" in k]

    run(backend_at(tmp_path / "b")._experimental_pull_from_s3(M("m1"), s3_bucket=BUCKET, prefix="team"))
    there = tmp_path / "b" / PROJECT / "models" / "m1"
    pulled = ckpt.checkpoints_dir(there)
    assert ckpt.read_commit(pulled) == 4
    assert ckpt.step_folders(pulled) == [1, 2, 4]
    for step in (1, 2, 4):
        assert files_of(ckpt.step_dir(pulled, step)) == files_of(ckpt.step_dir(root, step))
    assert (there / "history.jsonl").read_text() == (here / "history.jsonl").read_text()
    assert not list(pulled.glob(".*"))  # no staging or temp file left behind


def test_pull_of_one_step_commits_that_step_only(tmp_path, s3, adapters, monkeypatch):
    trained_run(tmp_path / "a", "m1", adapters)
    monkeypatch.setenv("BACKUP_BUCKET", BUCKET)  # ART's default bucket
    run(backend_at(tmp_path / "a")._experimental_push_to_s3(M("m1")))
    run(backend_at(tmp_path / "b")._experimental_pull_from_s3(M("m1"), only_step=2))
    pulled = ckpt.checkpoints_dir(tmp_path / "b" / PROJECT / "models" / "m1")
    assert ckpt.step_folders(pulled) == [2]
    assert ckpt.read_commit(pulled) == 2
    assert not (tmp_path / "b" / PROJECT / "models" / "m1" / "history.jsonl").exists()
    # the later full pull moves the pointer forward and keeps step 2 as it is
    run(backend_at(tmp_path / "b")._experimental_pull_from_s3(M("m1"), only_step="latest"))
    assert ckpt.step_folders(pulled) == [2, 4] and ckpt.read_commit(pulled) == 4


@pytest.mark.parametrize(("not_after", "expected"), [(None, 4), (3, 2), (2, 2), (1, 1)])
def test_fork_takes_the_newest_step_not_after_the_bound(tmp_path, adapters, not_after, expected):
    src = trained_run(tmp_path, "base", adapters)
    backend = backend_at(tmp_path)
    run(backend._experimental_fork_checkpoint(M("fork"), from_model="base", not_after_step=not_after))
    root = ckpt.checkpoints_dir(tmp_path / PROJECT / "models" / "fork")
    assert ckpt.read_commit(root) == expected
    assert ckpt.step_folders(root) == [expected]
    assert files_of(ckpt.step_dir(root, expected)) == files_of(
        ckpt.step_dir(ckpt.checkpoints_dir(src), expected)
    )


def test_fork_from_s3_of_another_project_downloads_only_the_chosen_step(tmp_path, s3, adapters):
    trained_run(tmp_path / "a", "base", adapters)
    run(backend_at(tmp_path / "a")._experimental_push_to_s3(M("base"), s3_bucket=BUCKET))
    backend = backend_at(tmp_path / "b")
    run(
        backend._experimental_fork_checkpoint(
            M("fork", project="other"),
            from_model="base",
            from_project=PROJECT,
            from_s3_bucket=BUCKET,
            not_after_step=3,
        )
    )
    root = ckpt.checkpoints_dir(tmp_path / "b" / "other" / "models" / "fork")
    assert ckpt.read_commit(root) == 2 and ckpt.step_folders(root) == [2]
    source = ckpt.step_dir(ckpt.checkpoints_dir(tmp_path / "a" / PROJECT / "models" / "base"), 2)
    assert files_of(ckpt.step_dir(root, 2)) == files_of(source)
    assert not (tmp_path / "b" / PROJECT).exists()  # the source run is not pulled beside it


def _refusal(coro) -> str:
    with pytest.raises(UserError) as info:
        run(coro)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_fork_refuses_an_unknown_source_model_or_project(tmp_path, adapters):
    trained_run(tmp_path, "base", adapters)
    backend = backend_at(tmp_path)
    text = _refusal(backend._experimental_fork_checkpoint(M("fork"), from_model="nope"))
    assert "model 'nope' of project 'proj' has no committed checkpoint" in text
    text = _refusal(backend._experimental_fork_checkpoint(M("fork"), from_model="base", from_project="x"))
    assert "model 'base' of project 'x' has no committed checkpoint" in text
    assert not (tmp_path / PROJECT / "models" / "fork" / "checkpoints" / "LATEST").exists()


def test_fork_refuses_a_bound_before_every_step(tmp_path, adapters):
    trained_run(tmp_path, "base", adapters, steps=(2, 4))
    text = _refusal(
        backend_at(tmp_path)._experimental_fork_checkpoint(M("fork"), from_model="base", not_after_step=1)
    )
    assert "no checkpoint at or before step 1 (its committed steps: [2, 4]); pass not_after_step >= 2" in text


def test_fork_refuses_a_model_that_already_has_checkpoints(tmp_path, adapters):
    trained_run(tmp_path, "base", adapters)
    trained_run(tmp_path, "fork", adapters, steps=(1,))
    text = _refusal(backend_at(tmp_path)._experimental_fork_checkpoint(M("fork"), from_model="base"))
    assert "already has checkpoints (committed step 1" in text
    assert ckpt.read_commit(ckpt.checkpoints_dir(tmp_path / PROJECT / "models" / "fork")) == 1


def test_fork_refuses_a_malformed_manifest_and_commits_nothing(tmp_path, adapters):
    src = trained_run(tmp_path, "base", adapters)
    manifest = ckpt.manifest_file(ckpt.step_dir(ckpt.checkpoints_dir(src), 2))
    good = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**good, "adapter_sha256": "00" * 32}))
    with pytest.raises(
        CheckpointFileError, match=r"adapter_model.safetensors has sha256 [0-9a-f]{64}, not the"
    ):
        run(
            backend_at(tmp_path)._experimental_fork_checkpoint(M("fork"), from_model="base", not_after_step=2)
        )
    manifest.write_text(json.dumps({**good, "layout": "tp2"}))
    with pytest.raises(CheckpointFileError, match="is not a checkpoint manifest"):
        run(
            backend_at(tmp_path)._experimental_fork_checkpoint(M("fork"), from_model="base", not_after_step=3)
        )
    root = ckpt.checkpoints_dir(tmp_path / PROJECT / "models" / "fork")
    assert ckpt.read_commit(root) is None and ckpt.step_folders(root) == []
    assert not list(root.iterdir())  # the staging folder is gone too


def test_a_missing_bucket_is_refused(tmp_path, s3, adapters):
    trained_run(tmp_path, "base", adapters)
    backend = backend_at(tmp_path)
    text = _refusal(backend._experimental_push_to_s3(M("base"), s3_bucket="no-such-bucket"))
    assert "S3 bucket 'no-such-bucket' does not exist at http://127.0.0.1:" in text
    text = _refusal(
        backend._experimental_fork_checkpoint(M("f"), from_model="base", from_s3_bucket="no-such-bucket")
    )
    assert "S3 bucket 'no-such-bucket' does not exist" in text
    text = _refusal(backend._experimental_pull_from_s3(M("base")))
    assert "names no bucket and $BACKUP_BUCKET is not set" in text


def test_an_unreachable_endpoint_is_refused(tmp_path, s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    text = _refusal(backend_at(tmp_path)._experimental_pull_from_s3(M("m1"), s3_bucket=BUCKET))
    assert f"S3 bucket '{BUCKET}' is unreachable at http://127.0.0.1:" in text


def test_pull_of_a_run_the_bucket_does_not_hold_pulls_nothing_with_a_logged_line(tmp_path, s3, caplog):
    """ART's pull of an empty prefix syncs nothing, so a pull-then-train program's first run goes
    on; art-mega's does too, in every spelling (all steps, only_step=int, 'latest', latest_only)."""
    calls = [{}, {"only_step": 3}, {"only_step": "latest"}, {"latest_only": True}]
    for kwargs in calls:
        with caplog.at_level("WARNING", logger="art_mega.trainer.s3"):
            run(backend_at(tmp_path)._experimental_pull_from_s3(M("ghost"), s3_bucket=BUCKET, **kwargs))
    lines = [r.getMessage() for r in caplog.records if r.name == "art_mega.trainer.s3"]
    assert lines == [
        f"_experimental_pull_from_s3: s3://{BUCKET}/proj/models/ghost holds no committed checkpoint (no "
        "checkpoints/LATEST), so nothing is pulled and the run starts from its base model, as in ART "
        "(check the model name, project and prefix if it should)"
    ] * len(calls)
    checkpoints = tmp_path / PROJECT / "models" / "ghost" / "checkpoints"
    assert not checkpoints.exists()  # nothing written: a later register starts the run afresh


def test_pull_refuses_a_step_the_bucket_does_not_hold(tmp_path, s3, adapters):
    trained_run(tmp_path / "a", "m1", adapters)
    run(backend_at(tmp_path / "a")._experimental_push_to_s3(M("m1"), s3_bucket=BUCKET))
    text = _refusal(
        backend_at(tmp_path / "b")._experimental_pull_from_s3(M("m1"), s3_bucket=BUCKET, only_step=3)
    )
    assert "holds the committed steps [1, 2, 4]; pass one of them" in text
    assert not (tmp_path / "b" / PROJECT / "models" / "m1").exists()


def test_pull_refuses_a_local_step_that_differs_from_the_bucket_and_keeps_the_local_run(
    tmp_path, s3, adapters
):
    trained_run(tmp_path / "a", "m1", adapters, steps=(1, 2))
    run(backend_at(tmp_path / "a")._experimental_push_to_s3(M("m1"), s3_bucket=BUCKET))
    local = trained_run(tmp_path / "b", "m1", {1: adapters[4]}, steps=(1,))  # another step 1
    before = files_of(ckpt.checkpoints_dir(local))
    text = _refusal(backend_at(tmp_path / "b")._experimental_pull_from_s3(M("m1"), s3_bucket=BUCKET))
    assert "hold different checkpoints of step 1; pull into a model of another name" in text
    assert files_of(ckpt.checkpoints_dir(local)) == before


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (
            lambda b: b._experimental_push_to_s3(M("m1"), s3_bucket=BUCKET, delete=True),
            "delete=True) is not supported",
        ),
        (
            lambda b: b._experimental_pull_from_s3(M("m1"), exclude=["logs"]),
            "exclude=['logs']) is not supported",
        ),
        (
            lambda b: b._experimental_pull_from_s3(M("m1"), only_step=True),
            "(only_step=True) must be a step number",
        ),
        (
            lambda b: b._experimental_pull_from_s3(M("m1"), only_step=-1),
            "(only_step=-1) must be a step number",
        ),
        (
            lambda b: b._experimental_fork_checkpoint(M("f"), from_model="m1", not_after_step="3"),
            "(not_after_step='3') must be a step number >= 0 or None",
        ),
        (lambda b: b._experimental_push_to_s3(M("ghost"), s3_bucket=BUCKET), "the run folder"),
    ],
)
def test_arguments_art_mega_does_not_take_are_refused(tmp_path, s3, call, expected):
    assert expected in _refusal(call(backend_at(tmp_path)))
