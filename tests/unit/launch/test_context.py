import pytest
from pydantic import ValidationError

from art_mega.launch.context import ArtLaunchContext


def test_homogeneous_cluster_builds_numbered_hosts():
    launch = ArtLaunchContext(
        worker_addresses=("tcp://10.0.0.1:22222", "tcp://[fd00::2]:22222"),
        launch_id="abc",
        controller_rank=1,
        _secret=b"s" * 32,
    )
    cluster = launch.homogeneous_cluster(cpu_slots=3, gpu_ids=(0, 1), artifact_root="/shared/art")
    assert launch.host_count == 2
    assert [h.host_id for h in cluster.hosts] == ["host0", "host1"]
    assert [h.node_rank for h in cluster.hosts] == [0, 1]
    assert cluster.hosts[1].worker_address.host == "fd00::2"
    assert cluster.hosts[1].worker_address.url == "http://[fd00::2]:22222"
    assert all(h.cpu_slots == 3 and h.gpu_ids == (0, 1) for h in cluster.hosts)
    assert cluster.controller_host_id == "host1"
    assert cluster.artifact_root == "/shared/art"
    assert "s" * 32 not in repr(launch)


def test_homogeneous_cluster_validates():
    launch = ArtLaunchContext(worker_addresses=("tcp://127.0.0.1:1",), launch_id="x")
    with pytest.raises(ValidationError, match="cpu_slots"):
        launch.homogeneous_cluster(cpu_slots=0)
    with pytest.raises(ValidationError, match="artifact_root"):
        launch.homogeneous_cluster(artifact_root="relative/path")


def test_one_gpu_spelled_alike_twice_is_refused_by_the_spec():
    # The spec sees spellings only: 0 and "0" are one spelling; an index and a UUID of one GPU
    # are told apart by host admission, which knows the host's GPUs (tests/unit/preflight/test_admission.py).
    launch = ArtLaunchContext(worker_addresses=("tcp://127.0.0.1:1",), launch_id="x")
    with pytest.raises(ValidationError, match="gpu_ids lists GPU 0 twice"):
        launch.homogeneous_cluster(gpu_ids=(0, "0"))
    assert launch.homogeneous_cluster(gpu_ids=(0, "GPU-a")).hosts[0].gpu_ids == (0, "GPU-a")
