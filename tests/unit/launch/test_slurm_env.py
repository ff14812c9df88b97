"""`art-mega slurm`'s reading of Slurm's variables and its hostlist expander (checked against
`scontrol show hostnames` where Slurm's client is installed)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from art_mega.errors import LoopbackAddressError, UserError
from art_mega.launch.slurm import expand_hostlist, launch_id_for_job, prepare, read_slurm_env

ADDRESSES = {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}
GOOD = {
    "SLURM_JOB_NODELIST": "n[1-3]",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "3",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_JOB_ID": "42",
    "SLURMD_NODENAME": "n2",
    "SLURM_SUBMIT_DIR": "/",
}

EXPANSIONS = [
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[01-10]", [f"n{i:02d}" for i in range(1, 11)]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
    ("n[01-3]", ["n01", "n02", "n03"]),
    ("n[1-03]", ["n1", "n2", "n3"]),
    ("a[1-2]-b[3-4],c", ["a1-b3", "a1-b4", "a2-b3", "a2-b4", "c"]),
    ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
    ("n[5]", ["n5"]),
    ("n,,m", ["n", "m"]),
    ("gpu-a100-[1,3,5-6],cpu.x", ["gpu-a100-1", "gpu-a100-3", "gpu-a100-5", "gpu-a100-6", "cpu.x"]),
    ("node1", ["node1"]),
]
MALFORMED = [
    "n[1-3",
    "n[3-1]",
    "n[a-b]",
    "n[1-2]]",
    "n[1-10-12]",
    "n[1-]",
    "n[]",
    "",
    "n [1-2]",
    "n[[1]]",
    "n[0-70000]",
]


def resolve(name: str) -> str:
    if name not in ADDRESSES:
        raise OSError(-2, "Name or service not known")
    return ADDRESSES[name]


@pytest.mark.parametrize(("expression", "names"), EXPANSIONS)
def test_expand_hostlist(expression, names):
    assert expand_hostlist(expression) == names


@pytest.mark.parametrize("expression", MALFORMED)
def test_expand_hostlist_refuses(expression):
    with pytest.raises(ValueError):
        expand_hostlist(expression)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's client (scontrol) is not installed")
def test_expander_agrees_with_scontrol(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1\n")
    for expression, names in EXPANSIONS:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", expression],
            env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert out.stdout.split() == names, (expression, out.stdout, out.stderr)
    for expression in ("n[3-1]", "n[a-b]", "n[1-2]]", "n[1-10-12]", "n[]"):  # Slurm refuses these too
        out = subprocess.run(
            ["scontrol", "show", "hostnames", expression],
            env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert "Invalid hostlist" in out.stdout + out.stderr, expression


def test_read_good_env():
    node = read_slurm_env(GOOD, resolve)
    assert (node.job_id, node.rank, node.names, node.addresses) == (
        "42",
        1,
        ("n1", "n2", "n3"),
        tuple(ADDRESSES.values()),
    )
    assert node.as_group().node_ips == ("10.0.0.1", "10.0.0.2", "10.0.0.3") and node.as_group().rank == 1
    other = read_slurm_env(dict(GOOD, SLURM_JOB_ID="43"), resolve)
    assert launch_id_for_job(b"s" * 32, node) != launch_id_for_job(b"s" * 32, other)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            {"SLURM_JOB_NODELIST": "n[1-3"},
            "SLURM_JOB_NODELIST='n[1-3' is not a Slurm hostlist (a '[' is never closed)",
        ),
        ({"SLURM_JOB_NODELIST": "n[3-1]"}, "runs backwards"),
        ({"SLURM_JOB_NODELIST": "n1,n1,n2"}, "lists n1 twice"),
        ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x' is not a non-negative integer"),
        ({"SLURM_NODEID": "٣"}, "SLURM_NODEID='٣' is not a non-negative integer"),
        ({"SLURM_NODEID": "3", "SLURMD_NODENAME": "n3"}, "SLURM_NODEID=3 is out of range for the 3 nodes"),
        ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not a Slurm job id"),
        ({"SLURM_JOB_NUM_NODES": "4"}, "SLURM_JOB_NUM_NODES=4 but SLURM_JOB_NODELIST='n[1-3]' names 3 nodes"),
        ({"SLURMD_NODENAME": "n3"}, "SLURMD_NODENAME='n3' is not node 1 (n2)"),
        ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID=1 means a second task on node n2"),
        ({"SLURM_NTASKS": "6"}, "SLURM_NTASKS=6 for 3 nodes"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 differs from SLURM_NODEID=1"),
        (
            {"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"},
            "SLURM_GPUS_ON_NODE=2 but CUDA_VISIBLE_DEVICES='0' lists 1",
        ),
        ({"SLURM_GPUS_ON_NODE": "two"}, "SLURM_GPUS_ON_NODE='two' is not a non-negative integer"),
        ({"CUDA_VISIBLE_DEVICES": "0,zero"}, "CUDA_VISIBLE_DEVICES='0,zero' lists 'zero'"),
        (
            {"SLURM_SUBMIT_DIR": "relative/dir"},
            "SLURM_SUBMIT_DIR='relative/dir' is not an absolute directory",
        ),
        (
            {"SLURM_JOB_NODELIST": "n[1-2],nx", "SLURM_NTASKS": "3"},
            "node nx of SLURM_JOB_NODELIST does not resolve on n2",
        ),
    ],
)
def test_malformed_variable_is_one_sentence(change, fragment):
    with pytest.raises(UserError) as caught:
        read_slurm_env({**GOOD, **change}, resolve)
    message = str(caught.value)
    assert fragment in message, message
    assert "\n" not in message


def test_gpus_as_slurm_sets_them():
    node = read_slurm_env(dict(GOOD, SLURM_GPUS_ON_NODE="2", CUDA_VISIBLE_DEVICES="2,3"), resolve)
    assert node.gpus == ("2", "3")


def test_loopback_node_refused():
    with pytest.raises(LoopbackAddressError, match="node n2 of SLURM_JOB_NODELIST resolves to 127.0.1.1"):
        read_slurm_env(GOOD, lambda name: "127.0.1.1" if name == "n2" else ADDRESSES[name])


def test_prepare_removes_variables_and_secret():
    environ = dict(
        GOOD, ART_MEGA_SECRET="ab" * 32, CUDA_VISIBLE_DEVICES="0", SLURM_GPUS_ON_NODE="1", KEEP="1"
    )
    node, secret = prepare(environ, resolve)
    assert secret and node.rank == 1
    assert set(environ) == {"CUDA_VISIBLE_DEVICES", "KEEP"}
    with pytest.raises(
        UserError, match="ART_MEGA_SECRET is not set on node n2; export it in the batch script"
    ):
        prepare(dict(GOOD), resolve)
