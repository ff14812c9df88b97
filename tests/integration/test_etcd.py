"""The managed etcd on loopback: starts healthy, serves put/get, stops without a trace; bad binaries
refused; an endpoint that is not etcd >= 3.4 with its v3 JSON gateway is named in one sentence."""

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from art_mega.errors import PreflightError
from art_mega.preflight.etcd import check_endpoint, check_from_every_host, find_binary, start_managed_etcd
from art_mega.preflight.protocol import EtcdCheckRequest, EtcdStartRequest
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


def _probe_keys(endpoint: str) -> list[bytes]:
    """Keys under /art-mega/ in the etcd at `endpoint` (the proof's probe keys live there)."""
    import etcd3gw

    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    client = etcd3gw.client(host=host, port=int(port), api_path="/v3/")
    return [meta["key"] for _, meta in client.get_prefix("/art-mega/")]


async def test_proving_again_reuses_the_managed_etcd_and_replaces_a_dead_one():
    import signal

    from art_mega import ArtRuntime, compile_topology
    from tests.helpers import loopback_cluster

    runtime = await ArtRuntime.start_local(compile_topology(loopback_cluster(1)), metadata_store=True)
    try:
        first = runtime.preflight.metadata_store
        assert _probe_keys(first) == []  # the proof removed the keys it wrote
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


class _NotEtcd(BaseHTTPRequestHandler):
    """An HTTP server that is not (quite) etcd: `version` is what GET /version answers (None: 404)."""

    version: str | None = None

    def _answer(self, status: int, body: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b"404 page not found\n"
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/version" and self.version is not None:
            self._answer(200, {"etcdserver": self.version, "etcdcluster": self.version})
        elif self.path == "/health" and self.version is not None:
            self._answer(200, {"health": "true"})
        else:
            self._answer(404)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(404)  # no /v3/ gateway

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def not_etcd(version: str | None) -> Iterator[str]:
    """The URL of a loopback HTTP server answering like `_NotEtcd` with `version`."""
    handler = type("Handler", (_NotEtcd,), {"version": version})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("version", "error"),
    [
        (None, "it is not etcd: GET /version answered HTTP 404 Not Found"),
        ("3.3.27", "it is etcd 3.3.27, and art-mega needs etcd >= 3.4 (the v3 JSON gateway at /v3/)"),
        ("3.5.0", "its v3 JSON gateway refused a put at /v3/kv/put (Etcd3Exception: Not Found)"),
    ],
)
def test_an_endpoint_that_is_not_etcd_3_4_says_so(version, error):
    with not_etcd(version) as url:
        reply = check_endpoint(EtcdCheckRequest(endpoint=url, key="/k", value="v", timeout_s=2))
    assert not reply.ok and reply.error == error


async def test_an_explicit_store_that_is_not_etcd_is_named_in_one_sentence():
    """Through every host's agent, as `ArtRuntime.prove` checks an explicit metadata_store."""
    from art_mega import ArtRuntime, compile_topology
    from tests.helpers import loopback_cluster

    runtime = await ArtRuntime.start_local(compile_topology(loopback_cluster(2)))
    try:
        with not_etcd(None) as url, pytest.raises(PreflightError) as raised:
            await check_from_every_host(runtime.clients, url, runtime.launch_id)
    finally:
        await runtime.close()
    assert str(raised.value) == (
        f"the metadata store {url} is not usable from hosts host0, host1: "
        "it is not etcd: GET /version answered HTTP 404 Not Found"
    )
