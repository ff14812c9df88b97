"""The parts of the NIXL adapter transport that need no NIXL: manifests, paths, verified writes,
and when a runtime needs a transport at all."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from art_mega.backend import remote_trainer_hosts
from art_mega.errors import UserError
from art_mega.preflight.reach import check_artifact_root_reach
from art_mega.topology import InferenceSpec, TrainerSpec, compile_topology
from art_mega.transfer.nixl import (
    AdapterTransfers,
    TransferError,
    inside,
    read_adapter,
    remove_copies,
    write_verified,
)
from art_mega.transfer.protocol import AdapterFile, AdapterOffer, MetadataStore, PruneRequest
from art_mega.transfer.remote import (
    AdapterTransport,
    TransferReport,
    adapter_transport_for,
    transfer_metrics,
)
from art_mega.transfer.worker import handle
from tests.helpers import loopback_cluster

STORE = MetadataStore(endpoint="http://10.0.0.1:2379", namespace="/art-mega/abc/nixl")


def make_tree(folder: Path) -> dict[str, bytes]:
    content = {
        "adapter_config.json": b'{"r": 8}',
        "adapter_model.safetensors": bytes(range(256)) * 3,
        "sub/x.txt": b"",
    }
    for name, data in content.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return content


def offer_for(folder: Path) -> tuple[bytearray, AdapterOffer]:
    buffer, files = read_adapter(folder)
    offer = AdapterOffer(
        transfer_id="t1",
        host="host0",
        agent_name="a",
        label="t1",
        address=0,
        size=len(buffer),
        source=str(folder),
        files=files,
    )
    return buffer, offer


def test_a_checkpoint_step_folder_sends_only_its_adapter_files(tmp_path):
    """The backend's transport names `checkpoint.ADAPTER_FILES`: the rank state and manifest in
    the same step folder (ART's layout) stay on the trainer's host."""
    from art_mega.trainer import checkpoint

    content = make_tree(tmp_path / "0003")
    (tmp_path / "0003" / "rank00000.pt").write_bytes(b"optimizer state")
    (tmp_path / "0003" / "manifest.json").write_text("{}")
    buffer, files = read_adapter(tmp_path / "0003", checkpoint.ADAPTER_FILES)
    assert [f.name for f in files] == ["adapter_config.json", "adapter_model.safetensors"]
    assert bytes(buffer) == content["adapter_config.json"] + content["adapter_model.safetensors"]


def test_read_adapter_lays_files_back_to_back_with_their_sha256(tmp_path):
    content = make_tree(tmp_path / "adapter")
    buffer, files = read_adapter(tmp_path / "adapter")
    assert [f.name for f in files] == ["adapter_config.json", "adapter_model.safetensors", "sub/x.txt"]
    assert [f.offset for f in files] == [0, 8, 8 + 768]
    assert len(buffer) == 8 + 768
    for entry in files:
        assert bytes(buffer[entry.offset : entry.offset + entry.size]) == content[entry.name]
        assert entry.sha256 == hashlib.sha256(content[entry.name]).hexdigest()
    with pytest.raises(TransferError, match="is not a directory"):
        read_adapter(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TransferError, match="holds no file"):
        read_adapter(tmp_path / "empty")
    (tmp_path / "empty" / "zero.bin").write_bytes(b"")
    with pytest.raises(TransferError, match="holds only empty files"):
        read_adapter(tmp_path / "empty")


def test_write_verified_writes_a_new_folder_and_refuses_to_reuse_one(tmp_path):
    content = make_tree(tmp_path / "adapter")
    buffer, offer = offer_for(tmp_path / "adapter")
    final = tmp_path / "copy"
    write_verified(memoryview(buffer), offer, final, "host1")
    assert {
        p.relative_to(final).as_posix(): p.read_bytes() for p in final.rglob("*") if p.is_file()
    } == content
    with pytest.raises(
        TransferError, match=r"host host1: .*copy exists already; every received adapter needs a new path"
    ):
        write_verified(memoryview(buffer), offer, final, "host1")


def test_a_corrupted_byte_names_host_transfer_file_and_digests_and_leaves_nothing(tmp_path):
    make_tree(tmp_path / "adapter")
    buffer, offer = offer_for(tmp_path / "adapter")
    weights = offer.files[1]
    buffer[weights.offset + 5] ^= 1
    final = tmp_path / "copy"
    with pytest.raises(TransferError) as caught:
        write_verified(memoryview(buffer), offer, final, "host1")
    message = str(caught.value)
    assert message.startswith(
        "host host1: file adapter_model.safetensors of transfer t1 from host host0 has sha256 "
    )
    assert message.endswith(f"not {weights.sha256} as the sender's manifest says")
    assert not final.exists() and not (tmp_path / "copy.partial").exists()


def test_paths_from_the_network_stay_inside_the_root(tmp_path):
    assert inside(str(tmp_path), "a/b", "destination") == tmp_path.resolve() / "a" / "b"
    assert inside(str(tmp_path), str(tmp_path / "a"), "adapter path") == tmp_path.resolve() / "a"
    with pytest.raises(TransferError, match=r"destination '\.\./x' is not inside the artifact root"):
        inside(str(tmp_path), "../x", "destination")
    with pytest.raises(TransferError, match="adapter path '/etc' is not inside"):
        inside(str(tmp_path), "/etc", "adapter path")


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/./b", ""])
def test_manifest_file_names_must_be_plain_relative_paths(name):
    with pytest.raises(ValidationError):
        AdapterFile(name=name, size=1, offset=0, sha256="0" * 64)


def test_manifest_digests_and_labels_are_checked():
    with pytest.raises(ValidationError, match="64 lowercase hex"):
        AdapterFile(name="a", size=1, offset=0, sha256="ABC")
    with pytest.raises(ValidationError, match="transfer id"):
        AdapterOffer(
            transfer_id="a b",
            host="h",
            agent_name="a",
            label="l",
            address=0,
            size=1,
            source="/s",
            files=(AdapterFile(name="a", size=1, offset=0, sha256="0" * 64),),
        )
    with pytest.raises(ValidationError):
        MetadataStore(endpoint="http://x:1", namespace="no-leading-slash")


def runtime_like(
    shared: bool,
    replica_hosts: tuple[str, ...],
    store: str | None = "http://127.0.0.1:2379",
    trainer_hosts: tuple[str, ...] = ("host0",),
):
    cluster = loopback_cluster(3, shared_artifact_root=shared)
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(host_ids=trainer_hosts),
        inference=InferenceSpec(replicas=len(replica_hosts), host_ids=replica_hosts),
    )
    clients = {h: object() for h in cluster.host_ids}
    return SimpleNamespace(
        topology=topology, clients=clients, launch_id="L1", preflight=SimpleNamespace(metadata_store=store)
    )


def test_a_transport_only_where_a_replica_cannot_read_the_exporters_root():
    assert adapter_transport_for(runtime_like(True, ("host1", "host2"))) is None
    assert adapter_transport_for(runtime_like(False, ("host0",))) is None
    transport = adapter_transport_for(runtime_like(False, ("host0", "host1", "host2")))
    assert isinstance(transport, AdapterTransport)
    assert transport.exporter_host == "host0"
    assert transport.receiving_hosts == ["host1", "host2"]
    assert transport.replica_hosts == {"vllm-0": "host0", "vllm-1": "host1", "vllm-2": "host2"}
    assert transport.store == MetadataStore(endpoint="http://127.0.0.1:2379", namespace="/art-mega/L1/nixl")


def test_a_host_local_root_without_a_metadata_store_is_a_user_error():
    with pytest.raises(
        UserError, match=r"metadata_store=False.*shared_artifact_root=False.*host0.*metadata_store=None"
    ):
        adapter_transport_for(runtime_like(False, ("host1",), store=None))


async def test_replicas_on_the_exporters_host_read_the_exported_folder():
    transport = AdapterTransport({"host0": object()}, "host0", {"vllm-0": "host0"}, "/r", STORE)
    assert await transport(3, "/r/a/adapter") == {"vllm-0": "/r/a/adapter"}
    with pytest.raises(ValueError, match=r"no agent client for hosts \['host9'\]"):
        AdapterTransport({"host0": object()}, "host0", {"vllm-0": "host9"}, "/r", STORE)


def test_the_nixl_process_answers_release_and_refuses_unknown_ops():
    transfers = AdapterTransfers()
    assert handle(transfers, "release", {"transfer_id": "never-offered"}) == {"released": False}
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        handle(transfers, "nope", {})


@pytest.mark.parametrize("trainer_hosts", [("host1",), ("host1", "host2")])
def test_trainer_rank_0_off_the_controllers_host_is_refused_with_a_host_local_root(trainer_hosts):
    topology = runtime_like(False, ("host1",), trainer_hosts=trainer_hosts).topology
    with pytest.raises(UserError) as caught:
        check_artifact_root_reach(topology)
    assert str(caught.value) == (
        "ClusterSpec.shared_artifact_root=False, but trainer rank 0 runs on host host1 while the "
        "controller runs on host host0, so the controller cannot read its checkpoints under the "
        "host-local artifact_root /tmp/art-mega-test/artifacts; include host host0 in "
        "TrainerSpec.host_ids with the lowest node_rank among them (ranks follow node-rank order), "
        "name host host1 as ClusterSpec.controller_host_id, or set ClusterSpec.shared_artifact_root=True"
    )
    check_artifact_root_reach(runtime_like(True, ("host1",), trainer_hosts=trainer_hosts).topology)


@pytest.mark.parametrize("trainer_hosts", [("host0",), ("host0", "host2"), ("host0", "host1", "host2")])
def test_trainer_ranks_on_other_hosts_are_accepted_when_rank_0_is_on_the_controllers(trainer_hosts):
    topology = runtime_like(False, ("host1",), trainer_hosts=trainer_hosts).topology
    check_artifact_root_reach(topology)
    assert remote_trainer_hosts(topology) == {h: [i] for i, h in enumerate(trainer_hosts) if h != "host0"}
    assert remote_trainer_hosts(runtime_like(True, ("host1",), trainer_hosts=trainer_hosts).topology) == {}


def test_prune_deletes_received_copies_and_their_emptied_step_folders_only(tmp_path):
    checkpoints = tmp_path / "proj" / "models" / "m" / "checkpoints"
    for name in ("0001/adapter.nixl-a", "0002/adapter", "0002/adapter.nixl-b", "0003/adapter.nixl-c"):
        make_tree(checkpoints / name)
    paths = [
        str(checkpoints / "0001" / "adapter.nixl-a"),
        str(checkpoints / "0002" / "adapter.nixl-b"),
        str(checkpoints / "0009" / "adapter.nixl-gone"),  # pruned before: counts as removed
        str(checkpoints / "0002" / "adapter"),  # the exported adapter itself: refused
        "/etc/x.nixl-1",  # outside the root: refused
    ]
    reply = remove_copies(PruneRequest(host="host1", root=str(tmp_path), paths=tuple(paths)))
    assert reply.removed == tuple(paths[:3])
    assert reply.error == (
        f"host host1: pruning {paths[3]}: {paths[3]} is not a received adapter copy (<adapter>.nixl-<id>); "
        "host host1: pruning /etc/x.nixl-1: adapter copy '/etc/x.nixl-1' is not inside the artifact root "
        f"{tmp_path}"
    )
    remaining = sorted(p.relative_to(checkpoints).as_posix() for p in checkpoints.glob("*/*"))
    assert remaining == ["0002/adapter", "0003/adapter.nixl-c"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["0002", "0003"]


def test_the_transfer_time_is_a_metric_only_of_a_step_that_was_transferred():
    assert transfer_metrics(adapter_transport_for(runtime_like(False, ("host0",))), 1) == {}
    assert transfer_metrics(adapter_transport_for(runtime_like(True, ("host1",))), 1) == {}
    transport = adapter_transport_for(runtime_like(False, ("host1",)))
    assert transfer_metrics(transport, 1) == {}  # nothing transferred yet
    transport.last = TransferReport(step=3, transfer_id="step0003-x", total_s=0.25)
    assert transfer_metrics(transport, 3) == {"time/adapter_transfer_s": 0.25}
    assert transfer_metrics(transport, 4) == {}  # step 4 did not reach any host


async def test_the_publisher_prunes_all_but_the_kept_steps_after_each_publication():
    """Nothing listens at port 9 and the only replica is down, so publications make no call; the
    prune hook still learns, after each, which steps a replica may load."""
    from art_mega.inference.adapters import AdapterPublisher
    from art_mega.inference.router import PolicyRouter, ReplicaEndpoint

    router = PolicyRouter("tiny", [ReplicaEndpoint("vllm-0", "http://127.0.0.1:9")])
    router.mark_down("vllm-0", "exited with code -9")
    kept: list[set[int]] = []

    async def prune(keep: set[int]) -> None:
        kept.append(set(keep))

    async with AdapterPublisher(router, keep=2, prune=prune) as publisher:
        for step in (1, 2, 3, 4):
            await publisher.publish(step, f"/ckpt/{step:04d}/adapter")
    assert kept == [{1}, {1, 2}, {2, 3}, {3, 4}]
