"""The cluster proof on three namespace hosts: each failure stops the start and names the host.

Agents are started by the test in each namespace (so one host can differ), and the program runs
through `art-mega controller` inside h0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, wait_gone
from tests.integration.netns import NetnsCluster

PROGRAM = "tests/integration/programs/prog_preflight.py:main"
SECRET = "p" * 64
PORT = 22400


@contextmanager
def agents(cluster: NetnsCluster, env_for=None, wrap_for=None):
    """One `art-mega worker` per host; `env_for(i)` adds env vars, `wrap_for(i)` wraps the argv."""
    started = []
    try:
        for i, host in enumerate(cluster.hosts):
            env = cli_env()
            env.update(ART_MEGA_SECRET=SECRET)
            env.update((env_for or (lambda i: {}))(i))
            argv = [
                sys.executable,
                "-m",
                "art_mega",
                "worker",
                "--address",
                f"tcp://{host.address}:{PORT}",
                "--launch-id",
                "pf",
            ]
            argv = (wrap_for or (lambda i, a: a))(i, argv)
            process = host.exec(
                argv, cwd="/", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            started.append(process)
        for process in started:
            line = process.stdout.readline()
            assert line.startswith("ART_MEGA_READY "), process.stderr.read()
        yield started
    finally:
        for process in started:
            process.terminate()
        for process in started:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def controller(cluster: NetnsCluster, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = cli_env()
    env.update(ART_MEGA_SECRET=SECRET, **env_vars)
    workers = [arg for h in cluster.hosts for arg in ("--worker", f"tcp://{h.address}:{PORT}")]
    return cluster.hosts[0].run(
        [sys.executable, "-m", "art_mega", "controller", *workers, "--program", PROGRAM],
        cwd=REPO,
        env=env,
        timeout=120,
    )


def _ok(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("PREFLIGHT_OK "))
    return json.loads(line.split(" ", 1)[1])


def _fails(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("art-mega: error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "PREFLIGHT_OK" not in result.stdout
    return errors[0]


@contextmanager
def only_agent_traffic(host, peer):
    """`host` may answer on its agent's port but cannot open any other TCP connection to `peer`."""
    if not shutil.which("iptables"):
        pytest.skip("iptables is not installed")
    rule = [
        "OUTPUT",
        "-d",
        peer.address,
        "-p",
        "tcp",
        "!",
        "--sport",
        str(PORT),
        "-j",
        "REJECT",
        "--reject-with",
        "tcp-reset",
    ]
    host.run(["iptables", "-A", *rule], check=True)
    try:
        yield
    finally:
        host.run(["iptables", "-D", *rule])


def _etcd_dirs() -> set[str]:
    """This file's launches' etcd data dirs (launch id "pf"; other launches on the machine differ)."""
    return {p.name for p in Path("/tmp").glob("art-mega-etcd-pf-*")}


def _etcd_pids() -> list[int]:
    """etcd processes whose data dir belongs to this file's launches."""
    out = subprocess.run(["pgrep", "-f", "art-mega-etcd-pf-"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_correct_cluster_is_proved(netns3, tmp_path):
    with agents(netns3):
        report = _ok(controller(netns3, PREFLIGHT_ROOT=str(tmp_path / "artifacts")))
    assert report["hosts"] == ["host0", "host1", "host2"]
    assert set(report["phases"]) == {"admission", "fs_probe"}
    assert len(report["boot_ids"]) == 1  # namespaces share a kernel: allowed by allow_shared_kernel


def test_collective_proves_membership_and_measures_every_link(netns3, tmp_path):
    pytest.importorskip("torch", reason="the preflight collective runs in the trainer's environment (torch)")
    with agents(netns3):
        report = _ok(controller(netns3, PREFLIGHT_COLLECTIVE="1", PREFLIGHT_ROOT=str(tmp_path / "a")))
    assert "collective" in report["phases"]
    assert [(m["host"], m["rank"], m["backend"]) for m in report["members"]] == [
        ("host0", 0, "gloo"),
        ("host1", 1, "gloo"),
        ("host2", 2, "gloo"),
    ]
    assert [m["ip"] for m in report["members"]] == [h.address for h in netns3.hosts]
    assert all(m["interface"] == "eth0" for m in report["members"])
    # every rank ran in the warm probe its agent started when the proof began (torch pre-imported)
    assert [m["warm"] for m in report["members"]] == [True, True, True]
    assert set(report["bandwidth_gbps"]) == {"host0-host1", "host0-host2", "host1-host2"}
    assert all(v > 0 for v in report["bandwidth_gbps"].values())


def test_a_preflight_rank_that_never_arrives_is_named_and_bounded(netns3, tmp_path):
    pytest.importorskip("torch", reason="the preflight collective runs in the trainer's environment (torch)")
    with only_agent_traffic(netns3.hosts[2], netns3.hosts[0]), agents(netns3):
        started = time.monotonic()
        result = controller(
            netns3, PREFLIGHT_COLLECTIVE="1", PREFLIGHT_TIMEOUT="8", PREFLIGHT_ROOT=str(tmp_path / "a")
        )
        elapsed = time.monotonic() - started
        _fails(result, "host host2 (rank 2) did not arrive within 8 s")
        assert elapsed < 40
        assert _probes(netns3) == []


def _fails_at_once_naming_only_host1(result, started: float, *fragments: str) -> str:
    """A failed proof that named host1 alone and did not wait out its 90 s startup timeout."""
    elapsed = time.monotonic() - started
    error = _fails(result, "host1", *fragments)
    assert "host0" not in error and "host2" not in error, error
    assert elapsed < 45, f"{elapsed:.1f} s: the proof waited for its timeout ({error})"
    return error


def test_a_rank_whose_torch_cannot_be_imported_fails_the_proof_at_once(netns3, tmp_path):
    """The probe on host1 dies at once (its torch is broken there: admission sees the same package
    versions); the ranks on host0 and host2, waiting at the rendezvous, are stopped and not blamed."""
    pytest.importorskip("torch", reason="the preflight collective runs in the trainer's environment (torch)")
    shadow = tmp_path / "site" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        'raise ImportError("libtorch_cpu.so: cannot open shared object file")\n'
    )
    env_for = lambda i: {"PYTHONPATH": str(shadow.parent)} if i == 1 else {}  # noqa: E731
    with agents(netns3, env_for=env_for):
        started = time.monotonic()
        result = controller(
            netns3, PREFLIGHT_COLLECTIVE="1", PREFLIGHT_TIMEOUT="90", PREFLIGHT_ROOT=str(tmp_path / "a")
        )
        _fails_at_once_naming_only_host1(
            result,
            started,
            "failed on host host1 (rank 1): cannot import torch.distributed (ImportError: libtorch_cpu.so",
            "the other ranks' probes were stopped",
        )
        assert _probes(netns3) == []


def test_a_bad_interface_on_one_host_fails_the_proof_at_once(netns3, tmp_path):
    pytest.importorskip("torch", reason="the preflight collective runs in the trainer's environment (torch)")
    env_for = lambda i: {"GLOO_SOCKET_IFNAME": "bad0"} if i == 1 else {}  # noqa: E731
    with agents(netns3, env_for=env_for):
        started = time.monotonic()
        result = controller(
            netns3, PREFLIGHT_COLLECTIVE="1", PREFLIGHT_TIMEOUT="90", PREFLIGHT_ROOT=str(tmp_path / "a")
        )
        _fails_at_once_naming_only_host1(result, started, "GLOO_SOCKET_IFNAME", "bad0")
        assert _probes(netns3) == []


def test_different_art_mega_files_on_one_host(netns3, tmp_path):
    import art_mega

    copy = tmp_path / "other" / "art_mega"
    shutil.copytree(Path(art_mega.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "errors.py").write_text((copy / "errors.py").read_text() + "\n# a different build\n")
    env_for = lambda i: {"PYTHONPATH": str(copy.parent)} if i == 1 else {}  # noqa: E731
    with agents(netns3, env_for=env_for):
        error = _fails(controller(netns3), "art_mega_files_sha256", "host1=")
    assert "host0=" in error and "host2=" in error


def test_wrong_nccl_net_on_one_host(netns3):
    env_for = lambda i: {"NCCL_NET": "Socket" if i == 2 else "IB"}  # noqa: E731
    with agents(netns3, env_for=env_for):
        _fails(controller(netns3, PREFLIGHT_NCCL_NET="IB"), "host host2", "NCCL_NET is 'Socket'", "'IB'")


def test_a_gpu_named_by_the_topology_is_missing(netns3):
    with agents(netns3):
        _fails(controller(netns3, PREFLIGHT_GPU_HOST1="0"), "host host1", "GPU 0", "not present")


def private_folder_on_host1(folder: Path):
    """An `agents(wrap_for=...)` that starts host1's agent in its own mount namespace with an empty
    tmpfs over `folder`: host1 sees its own private folder at that path, the other hosts the real one."""

    def wrap(i, argv):
        if i != 1:
            return argv
        script = f"mount -t tmpfs tmpfs {folder} && exec " + " ".join(argv)
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]

    return wrap


def test_private_artifact_root_on_one_host(netns3, tmp_path):
    root = tmp_path / "shared-artifacts"
    root.mkdir()

    with agents(netns3, wrap_for=private_folder_on_host1(root)):
        _fails(controller(netns3, PREFLIGHT_ROOT=str(root)), "host host1", "not one shared filesystem")
        # the same hosts pass when artifact_root is declared host-local
        report = _ok(
            controller(netns3, PREFLIGHT_ROOT=str(root), PREFLIGHT_LOCAL_ROOT="1", PREFLIGHT_ETCD="0")
        )
    assert "fs_probe" in report["phases"]


def test_a_host_that_cannot_read_the_base_model_is_named_before_anything_starts(netns3, tmp_path):
    """cache_root is private on host1 (a tmpfs over it in host1's mount namespace): the controller
    builds tiny-qwen3 there, host1's trainer rank could not load it, and register says so first."""
    cache = tmp_path / "cache"
    cache.mkdir()

    with agents(netns3, wrap_for=private_folder_on_host1(cache)):
        error = _fails(
            controller(
                netns3,
                PREFLIGHT_REGISTER="1",
                PREFLIGHT_CACHE=str(cache),
                PREFLIGHT_ROOT=str(tmp_path / "a"),
                PREFLIGHT_ETCD="0",
            ),
            "host host1 cannot read the base model directory",
            str(cache),
            "ClusterSpec.cache_root",
        )
    assert "config.json" in error or "missing there" in error
    assert not list((tmp_path / "a").rglob("trainer-rank*.log"))  # no rank was started


def test_managed_etcd_serves_every_host_and_leaves_nothing(netns3, tmp_path):
    before_dirs, before_pids = _etcd_dirs(), set(_etcd_pids())
    with agents(netns3):
        report = _ok(
            controller(
                netns3, PREFLIGHT_ETCD="1", PREFLIGHT_ROOT=str(tmp_path / "a"), PREFLIGHT_PROVE_AGAIN="1"
            )
        )
    assert report["metadata_store"].startswith(f"http://{netns3.hosts[0].address}:")
    assert report["again"] == report["metadata_store"]  # a second proof re-checks the same etcd
    assert "metadata_store" in report["phases"]
    assert _etcd_dirs() == before_dirs
    assert wait_gone([p for p in _etcd_pids() if p not in before_pids], 5) == []


def test_etcd_unreachable_from_one_host_fails_and_cleans_up(netns3):
    before_dirs, before_pids = _etcd_dirs(), set(_etcd_pids())
    with only_agent_traffic(netns3.hosts[2], netns3.hosts[0]), agents(netns3):
        _fails(controller(netns3, PREFLIGHT_ETCD="1"), "metadata store", "host host2")
    assert _etcd_dirs() == before_dirs
    assert wait_gone([p for p in _etcd_pids() if p not in before_pids], 5) == []
    assert os.path.exists("/tmp")


def test_an_explicit_metadata_store_that_is_not_etcd_is_named_in_one_sentence(netns3, tmp_path):
    """NixlTransportSpec.metadata_store pointing at a plain HTTP server on host0: every host's
    check says what it is, in one sentence (was `Etcd3Exception: Not Found`)."""
    store = netns3.hosts[0].exec(
        [sys.executable, "-m", "http.server", "--bind", netns3.hosts[0].address, "22499"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    connect = (
        f"import socket; socket.create_connection(({netns3.hosts[0].address!r}, 22499), timeout=1).close()"
    )
    try:
        deadline = time.monotonic() + 20
        while netns3.hosts[0].run([sys.executable, "-I", "-S", "-c", connect]).returncode != 0:
            assert time.monotonic() < deadline, "the HTTP server did not start"
            time.sleep(0.1)
        with agents(netns3):
            url = f"http://{netns3.hosts[0].address}:22499"
            result = controller(netns3, PREFLIGHT_STORE=f"tcp://{netns3.hosts[0].address}:22499")
        error = _fails(result)
        assert error == (
            f"art-mega: error: the metadata store {url} is not usable from hosts host0, host1, host2: it is "
            "not etcd: GET /version answered HTTP 404 File not found"
        )
    finally:
        store.kill()
        store.wait(5)


def test_a_proof_refused_in_admission_stops_its_warm_probes(netns3, tmp_path):
    pytest.importorskip("torch", reason="the preflight collective runs in the trainer's environment (torch)")
    with agents(netns3):
        _fails(
            controller(
                netns3, PREFLIGHT_COLLECTIVE="1", PREFLIGHT_GPU_HOST1="0", PREFLIGHT_ROOT=str(tmp_path / "a")
            ),
            "host host1",
            "GPU 0",
        )
        # the agents live on (an attached launch); the warm probes the proof started do not
        assert _probes(netns3) == []


def _probes(cluster) -> list[int]:
    found = []
    for host in cluster.hosts:
        for pid in host.pids():
            try:
                if b"art_mega.preflight.probe" in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(pid)
            except OSError:  # exited meanwhile
                pass
    return found
