"""Control-plane inputs the issue-14 tests did not try: GPU ids in odd spellings against synthetic
host facts, and signature headers a secret holder could send malformed (pure checks)."""

from __future__ import annotations

import re
import secrets

import pytest
from pydantic import ValidationError

from art_mega.agent import auth
from art_mega.errors import HostMismatchError
from art_mega.preflight.admission import admit
from art_mega.topology import HostSpec
from tests.unit.preflight.test_admission import facts, gpu, topology

UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
MIG_PARENT = "GPU-2c0f0000-0000-4000-8000-000000000002"
SLICE = "MIG-aaaa0000-0000-5000-8000-000000000001"


def host_with_mig():
    """GPU 0 whole; GPU 1 in MIG mode with one slice (as NVML reports a MIG-enabled GPU)."""
    parent = gpu(1, MIG_PARENT, "00000000:4C:00.0")
    return (
        gpu(0, UUID, "00000000:19:00.0"),
        parent.model_copy(update={"mig_mode": True}),
        gpu(1, SLICE, "00000000:4C:00.0", parent=MIG_PARENT),
    )


def admit_on_host0(gpu_ids):
    report = {
        "host0": facts(boot="a", gpus=host_with_mig()),
        "host1": facts(boot="b"),
        "host2": facts(boot="c"),
    }
    admit(topology(gpu_ids={0: gpu_ids}), report)


@pytest.mark.parametrize("value", [-1, True, False, 1.0, float("nan"), "٣", " 0", "-1", "gpu-0", "GPU-"])
def test_a_gpu_id_that_is_no_index_or_uuid_is_refused_by_the_spec(value):
    with pytest.raises(ValidationError, match=r"must be an index >= 0 or a 'GPU-'/'MIG-' UUID"):
        HostSpec(host_id="h", node_rank=0, worker_address="tcp://10.0.0.1:22222", gpu_ids=(value,))


def test_a_uuid_in_another_case_is_named_not_called_missing():
    with pytest.raises(HostMismatchError) as raised:
        admit_on_host0((UUID, UUID.upper()))  # the spec takes both: they differ as strings
    assert str(raised.value) == (
        f"host host0: GPU {UUID.upper()!r} in gpu_ids is written in another case than the host reports it "
        f"({UUID!r}); write it as NVML does (nvidia-smi -L)"
    )
    assert (raised.value.host, raised.value.field, raised.value.value) == ("host0", "gpu_ids", UUID.upper())


@pytest.mark.parametrize("gpu_ids", [(1,), (MIG_PARENT,), (SLICE, 1)])
def test_a_whole_gpu_in_mig_mode_is_refused_naming_its_slices(gpu_ids):
    with pytest.raises(HostMismatchError) as raised:
        admit_on_host0(gpu_ids)
    named = gpu_ids[-1]
    assert str(raised.value) == (
        f"host host0: GPU {named!r} in gpu_ids is in MIG mode, so CUDA runs nothing on it whole; name its MIG "
        f"slices ({SLICE}) or disable MIG on it (nvidia-smi -i 1 -mig 0)"
    )


def test_slices_and_other_whole_gpus_are_admitted():
    admit_on_host0((0, SLICE))


def _verifier() -> tuple[bytes, auth.Verifier, auth.AgentIdentity]:
    secret = secrets.token_hex(32).encode()
    me = auth.AgentIdentity(address="tcp://10.0.0.1:22222", incarnation=auth.new_incarnation())
    return secret, auth.Verifier(secret, me), me


@pytest.mark.parametrize(
    "header,value,reason",
    [
        (auth.NONCE_HEADER, "A" * 32, "malformed x-art-nonce: expected 32 lowercase hex digits"),
        (auth.NONCE_HEADER, "a" * 33, "malformed x-art-nonce: expected 32 lowercase hex digits"),
        (auth.BODY_HASH_HEADER, "0" * 63, "malformed x-art-body-sha256: expected 64 lowercase hex digits"),
        (auth.SIGNATURE_HEADER, "z" * 64, "malformed x-art-signature: expected 64 lowercase hex digits"),
        (auth.TIMESTAMP_HEADER, "nan", "malformed timestamp: expected seconds since the epoch"),
        (auth.TIMESTAMP_HEADER, "1" * 400, "malformed timestamp: expected seconds since the epoch"),
    ],
)
def test_malformed_signature_headers_are_refused_before_the_hmac(header, value, reason):
    secret, verifier, me = _verifier()
    headers = {**auth.sign(secret, "GET", "/v1/health", b"", me), header: value}
    with pytest.raises(auth.AuthError, match=reason):
        verifier.verify_headers("GET", "/v1/health", headers)


@pytest.mark.parametrize("seconds", [-29.0, 29.0])
def test_a_clock_skew_inside_the_bound_is_accepted_and_outside_refused(seconds):
    import time

    secret, verifier, me = _verifier()
    now = time.time()
    verifier.verify_headers(
        "GET", "/v1/health", auth.sign(secret, "GET", "/v1/health", b"", me, now=now + seconds)
    )
    late = auth.sign(secret, "GET", "/v1/health", b"", me, now=now + 2 * seconds + (1 if seconds > 0 else -1))
    with pytest.raises(auth.AuthError, match="stale timestamp"):
        verifier.verify_headers("GET", "/v1/health", late)


PROGRAMS = {
    "exits_zero": (
        "import sys\nsys.exit(0)\n\n\nasync def main(launch):\n    pass\n",
        "called sys.exit(0) at {path}:2",
    ),
    "exits_message": ("import sys\nsys.exit('bye')\n", "called sys.exit('bye') at {path}:2"),
    "exits_none": ("raise SystemExit\n", "called sys.exit(None) at {path}:1"),
}


@pytest.mark.parametrize("stem", sorted(PROGRAMS))
def test_a_program_that_exits_at_import_is_one_sentence_exit_2(stem, tmp_path, capsys):
    from art_mega.launch.cli import main

    source, said = PROGRAMS[stem]
    path = tmp_path / f"{stem}.py"
    path.write_text(source)
    with pytest.raises(SystemExit) as exited:
        main(["local", "--program", f"{path}:main"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err == (
        f"art-mega: error: --program '{path}:main': importing {stem} {said.format(path=path)}, so main would "
        "never run; move that code into main or under if __name__ == '__main__': (--debug shows the traceback)\n"
    )


@pytest.mark.parametrize(
    "stem,source,said",
    [
        ("absent", None, "script {path} does not exist"),
        ("bad_syntax", "def main(:\n", "{path}:1: invalid syntax; fix the program's syntax"),
        ("not_async", "def main(launch):\n    pass\n", "main must be declared 'async def main(launch)'"),
        ("no_main", "x = 1\n", "no_main has no function 'main'"),
        ("main_int", "main = 5\n", "main must be a top-level function"),
    ],
)
def test_program_mistakes_are_one_sentence_exit_2(stem, source, said, tmp_path, capsys):
    from art_mega.launch.cli import main

    path = tmp_path / f"{stem}.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(SystemExit) as exited:
        main(["local", "--program", f"{path}:main"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err == f"art-mega: error: --program '{path}:main': {said.format(path=path)}\n"


@pytest.mark.parametrize(
    "value,said",
    [
        ("tcp://10.0.0.9:0", "has port 0, which no server listens on; give etcd's client port"),
        ("https://10.0.0.9:2379", "must start with tcp://"),
        ("tcp://10.0.0.9:2379/v3", "has port '2379/v3', not a number"),
        ("http://10.0.0.9:2379", "must start with tcp://"),
    ],
)
def test_a_metadata_store_address_that_cannot_be_an_etcd_endpoint_is_refused(value, said):
    from art_mega.topology import NixlTransportSpec

    with pytest.raises(ValidationError, match=said):
        NixlTransportSpec(metadata_store=value)


def test_a_gloo_list_with_one_interface_missing_on_one_host_names_that_host_and_interface():
    report = {
        "host0": facts(boot="a", env={"GLOO_SOCKET_IFNAME": "eth0,ib0"}, interfaces=("eth0", "ib0", "lo")),
        "host1": facts(boot="b", env={"GLOO_SOCKET_IFNAME": "eth0,ib0"}, interfaces=("eth0", "lo")),
        "host2": facts(boot="c"),
    }
    with pytest.raises(HostMismatchError) as raised:
        admit(topology(), report)
    assert str(raised.value) == (
        "host host1: GLOO_SOCKET_IFNAME='eth0,ib0' names interface 'ib0', which this host does not have "
        "(it has eth0, lo); name one of those or unset it"
    )


@pytest.mark.parametrize(
    "value,admitted",
    [("=eth", False), ("=eth0", True), ("^=eth0,lo", False), ("=^eth0", False), ("eth", True), ("^lo", True)],
)
def test_nccl_exact_match_takes_whole_names_only(value, admitted):
    gpus = (gpu(0, UUID, "00000000:19:00.0"),)
    report = {
        "host0": facts(boot="a", gpus=gpus, env={"NCCL_SOCKET_IFNAME": value}),
        "host1": facts(boot="b"),
        "host2": facts(boot="c"),
    }
    if admitted:
        admit(topology(gpu_ids={0: (0,)}), report)
        return
    with pytest.raises(
        HostMismatchError,
        match=rf"host host0: NCCL_SOCKET_IFNAME='{re.escape(value)}' selects none",
    ):
        admit(topology(gpu_ids={0: (0,)}), report)


@pytest.mark.parametrize(
    "argv,said",
    [
        (
            ["controller", "--worker", "tcp://0.0.0.0:22222", "--worker", "tcp://10.0.0.2:22222"],
            "--worker 'tcp://0.0.0.0:22222' would advertise its agent at 0.0.0.0, the unspecified address, which "
            "every other host of this 2-host launch reads as itself; give its network address: ",
        ),
        (
            ["ssh", "--host", "box=0.0.0.0", "--host", "other=10.0.0.2"],
            "--host 'box=0.0.0.0' would advertise its agent at 0.0.0.0, the unspecified address, which every "
            "other host of this 2-host launch reads as itself; give its network address: --host box=ADDRESS",
        ),
        (
            ["controller", "--worker", "tcp://[::]:22222", "--worker", "tcp://10.0.0.2:22222"],
            "--worker 'tcp://[::]:22222' would advertise its agent at ::, the unspecified address",
        ),
    ],
)
def test_an_unspecified_worker_address_in_a_multi_host_launch_is_one_sentence(
    argv, said, capsys, monkeypatch
):
    from art_mega.launch.cli import main

    monkeypatch.setenv("ART_MEGA_SECRET", "a" * 64)
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--program", "absent.py:main"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"art-mega: error: {said}"), err


@pytest.mark.parametrize("gpu_ids", ["01", "0,1", 0, None])
def test_homogeneous_cluster_refuses_gpu_ids_that_are_not_a_list(gpu_ids):
    from art_mega.errors import UserError
    from art_mega.launch.context import ArtLaunchContext

    launch = ArtLaunchContext(worker_addresses=("tcp://10.0.0.1:22222",), launch_id="l")
    with pytest.raises(UserError) as raised:
        launch.homogeneous_cluster(gpu_ids=gpu_ids)
    assert str(raised.value) == (
        f"homogeneous_cluster(gpu_ids={gpu_ids!r}) lists each host's GPUs; pass a tuple such as (0, 1) or "
        "('GPU-...',), or () for none"
    )


@pytest.mark.parametrize("field", ["artifact_root", "cache_root"])
def test_homogeneous_cluster_refuses_an_empty_root_instead_of_using_the_default(field):
    from art_mega.launch.context import ArtLaunchContext

    launch = ArtLaunchContext(worker_addresses=("tcp://10.0.0.1:22222",), launch_id="l")
    with pytest.raises(ValidationError, match=rf"{field} '' must be an absolute path"):
        launch.homogeneous_cluster(**{field: ""})
