"""Control-plane inputs the issue-14 tests did not try: GPU ids in odd spellings against synthetic
host facts, and signature headers a secret holder could send malformed (pure checks)."""

from __future__ import annotations

import secrets

import pytest
from pydantic import ValidationError

from art_mega.errors import HostMismatchError
from art_mega.runtime import auth
from art_mega.runtime.admission import admit
from art_mega.topology import HostSpec
from tests.unit.test_admission import facts, gpu, topology

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
