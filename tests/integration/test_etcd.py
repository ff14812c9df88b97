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
