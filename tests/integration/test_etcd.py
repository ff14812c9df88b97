"""The managed etcd on loopback: starts healthy, serves put/get, stops without a trace; bad binaries refused."""

import hashlib
import os
import shutil

import pytest

from art_mega.runtime.etcd import check_endpoint, find_binary, start_managed_etcd
from art_mega.runtime.protocol import EtcdCheckRequest, EtcdStartRequest
from tests.conftest import wait_gone

pytestmark = pytest.mark.skipif(
    shutil.which("etcd") is None, reason="etcd is not installed (Debian etcd-server)"
)


async def test_start_put_get_stop():
    etcd = await start_managed_etcd(EtcdStartRequest(advertise_host="127.0.0.1"), launch_id="pf")
    try:
        assert etcd.version.startswith("3.")
        # the preflight tests find what a launch left behind by this name
        assert os.path.basename(etcd.data_dir).startswith("art-mega-etcd-pf-")
        reply = check_endpoint(EtcdCheckRequest(endpoint=etcd.endpoint.url, key="/k", value="v1"))
        assert reply.ok, reply.error
        bad = check_endpoint(
            EtcdCheckRequest(endpoint="http://127.0.0.1:1", key="/k", value="v", timeout_s=1)
        )
        assert not bad.ok and "ConnectError" in bad.error
    finally:
        await etcd.stop()
    assert not os.path.exists(etcd.data_dir)
    assert wait_gone([etcd.process.pid], 5) == []


async def test_pinned_sha256_and_missing_binary_are_refused(tmp_path):
    binary = find_binary(None)
    good = hashlib.sha256(open(binary, "rb").read()).hexdigest()
    with pytest.raises(ValueError, match="not the pinned"):
        await start_managed_etcd(EtcdStartRequest(advertise_host="127.0.0.1", sha256="0" * 64))
    etcd = await start_managed_etcd(EtcdStartRequest(advertise_host="127.0.0.1", sha256=good))
    await etcd.stop()
    with pytest.raises(FileNotFoundError, match="no etcd binary"):
        await start_managed_etcd(EtcdStartRequest(advertise_host="127.0.0.1", binary=str(tmp_path / "etcd")))


async def test_a_binary_that_is_not_etcd_is_refused(tmp_path):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'hello'\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="did not print an etcd version"):
        await start_managed_etcd(EtcdStartRequest(advertise_host="127.0.0.1", binary=str(fake)))


def _etcd_pids(launch_id: str) -> list[int]:
    """Pids of the etcd processes whose data dir names this launch (`art-mega-etcd-<launch_id>-*`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if (
                argv
                and argv[0].endswith(b"etcd")
                and any(f"art-mega-etcd-{launch_id}-".encode() in a for a in argv)
            ):
                pids.append(int(entry))
    return pids


async def test_proving_again_reuses_the_managed_etcd_and_replaces_a_dead_one():
    import signal

    from art_mega import ArtRuntime, compile_topology
    from tests.helpers import loopback_cluster

    runtime = await ArtRuntime.start_local(compile_topology(loopback_cluster(1)), metadata_store=True)
    try:
        first = runtime.preflight.metadata_store
        (pid,) = _etcd_pids(runtime.launch_id)
        assert (await runtime.prove(metadata_store=True)).metadata_store == first
        assert _etcd_pids(runtime.launch_id) == [pid]  # no second etcd

        os.kill(pid, signal.SIGKILL)
        assert wait_gone([pid], 5) == []
        again = (await runtime.prove(metadata_store=True)).metadata_store
        (new_pid,) = _etcd_pids(runtime.launch_id)
        assert new_pid != pid
        assert check_endpoint(EtcdCheckRequest(endpoint=again, key="/k", value="v")).ok
    finally:
        await runtime.close()
    assert wait_gone(_etcd_pids(runtime.launch_id), 5) == []
    with pytest.raises(RuntimeError, match="this ArtRuntime is closed"):
        await runtime.prove()
