"""A real agent against requests the issue-14 tests did not try: a NaN timestamp, malformed
signature headers, megabytes of unsigned headers, a signed body whose sender leaves early.

Before: a timestamp 'nan' passed the skew check (any comparison with NaN is false); a nonce of
any length was remembered; httptools buffered unsigned headers without bound (300 MB of headers
took the agent from 51 to 345 MB); a client that disconnected mid-body left a ClientDisconnect
traceback in the agent's log.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import secrets
import socket

import httpx
import pytest

from art_mega.agent import auth
from art_mega.agent.auth import UNBOUND, AgentIdentity, sign
from art_mega.agent.routes import MAX_HEAD_BYTES
from art_mega.runtime.local_agent import LocalAgent, start_local_agent
from art_mega.topology import EndpointSpec

SECRET = secrets.token_hex(32).encode()
STOP = "/v1/rollout-workers/stop"


@pytest.fixture
async def agent():
    started = await start_local_agent("host0", EndpointSpec(host="127.0.0.1", port=0), "adv", SECRET, 30)
    yield started
    await started.stop()


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _identity(client: httpx.Client) -> AgentIdentity:
    reply = client.get("/v1/identity", headers=sign(SECRET, "GET", "/v1/identity", b"", UNBOUND))
    return AgentIdentity.model_validate_json(reply.content)


def _resigned(headers: dict[str, str], me: AgentIdentity, **changed: str) -> dict[str, str]:
    """`headers` with fields changed and signed again with the launch secret (a secret holder's
    malformed request: only the format check can refuse it)."""
    headers = {**headers, **changed}
    message = auth._message(
        "GET",
        "/v1/health",
        headers[auth.TIMESTAMP_HEADER],
        headers[auth.NONCE_HEADER],
        headers[auth.BODY_HASH_HEADER],
        me,
    )
    headers[auth.SIGNATURE_HEADER] = hmac.new(SECRET, message, hashlib.sha256).hexdigest()
    return headers


async def test_a_timestamp_that_is_not_a_finite_number_is_refused_even_when_signed(agent: LocalAgent):
    with httpx.Client(base_url=agent.endpoint.url, trust_env=False, timeout=30) as client:
        me = _identity(client)
        for timestamp in ("nan", "NaN", "inf", "-inf", "1e400"):
            headers = _resigned(
                sign(SECRET, "GET", "/v1/health", b"", me), me, **{auth.TIMESTAMP_HEADER: timestamp}
            )
            reply = client.get("/v1/health", headers=headers)
            assert (reply.status_code, reply.json()["detail"]) == (
                401,
                "malformed timestamp: expected seconds since the epoch, e.g. 1767225600.000000",
            ), timestamp
        long_nonce = _resigned(
            sign(SECRET, "GET", "/v1/health", b"", me), me, **{auth.NONCE_HEADER: "a" * 4096}
        )
        reply = client.get("/v1/health", headers=long_nonce)
        assert reply.json()["detail"] == "malformed x-art-nonce: expected 32 lowercase hex digits"
        # header names in another case and the same header twice: the first value is the one checked
        upper = {k.upper(): v for k, v in sign(SECRET, "GET", "/v1/health", b"", me).items()}
        assert client.get("/v1/health", headers=upper).status_code == 200
        first = sign(SECRET, "GET", "/v1/health", b"", me)
        doubled = [*first.items(), (auth.SIGNATURE_HEADER, "0" * 64)]
        assert client.get("/v1/health", headers=doubled).status_code == 200
        doubled = [(auth.SIGNATURE_HEADER, "0" * 64), *sign(SECRET, "GET", "/v1/health", b"", me).items()]
        assert client.get("/v1/health", headers=doubled).json()["detail"] == "bad signature"


async def test_megabytes_of_unsigned_headers_are_refused_at_the_cap_unbuffered(agent: LocalAgent):
    before = _rss_kib(agent.pid)
    sock = socket.create_connection(("127.0.0.1", agent.endpoint.port), timeout=10)
    sent = 0
    try:
        sock.sendall(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n")
        for i in range(400):  # 40 MB, if the agent kept reading
            sock.sendall(b"x-pad-%d: " % i + b"a" * 100_000 + b"\r\n")
            sent += 100_000
    except OSError:  # the agent closed the connection
        pass
    answer = b""
    try:
        while chunk := sock.recv(4096):
            answer += chunk
    except OSError:
        pass
    sock.close()
    assert sent < 10_000_000
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:100]
    assert f"the request line and headers take at most {MAX_HEAD_BYTES} bytes".encode() in answer
    assert _rss_kib(agent.pid) - before < 8 * 1024
    with httpx.Client(base_url=agent.endpoint.url, trust_env=False, timeout=30) as client:
        me = _identity(client)  # still serving, and a normal signed request on a kept-alive connection
        for _ in range(3):
            assert (
                client.get("/v1/health", headers=sign(SECRET, "GET", "/v1/health", b"", me)).status_code
                == 200
            )


async def test_a_signed_body_whose_sender_leaves_early_runs_nothing_and_logs_no_traceback(tmp_path):
    log = tmp_path / "agent.log"
    saved = os.dup(2)
    with open(log, "wb") as sink:  # the agent inherits stderr: its log goes to `log`
        os.dup2(sink.fileno(), 2)
        try:
            agent = await start_local_agent(
                "host0", EndpointSpec(host="127.0.0.1", port=0), "adv", SECRET, 30
            )
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    try:
        with httpx.Client(base_url=agent.endpoint.url, trust_env=False, timeout=30) as client:
            me = _identity(client)
            body = json.dumps({"worker_ids": []}).encode()
            head = f"POST {STOP} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in sign(SECRET, "POST", STOP, body, me).items())
            with socket.create_connection(("127.0.0.1", agent.endpoint.port), timeout=10) as sock:
                sock.sendall(head.encode() + b"\r\n" + body)  # 1000 declared, fewer sent, then gone
                sock.settimeout(0.5)  # while the route waits for the rest of the body
                with pytest.raises(TimeoutError):
                    sock.recv(1)
            reply = client.get("/v1/health", headers=sign(SECRET, "GET", "/v1/health", b"", me))
            assert reply.status_code == 200 and reply.json()["children"] == []
    finally:
        await agent.stop()
    text = log.read_text()
    assert "Traceback" not in text and "ClientDisconnect" not in text, text


async def test_a_metadata_store_port_that_closes_at_once_or_refuses_is_one_sentence(agent: LocalAgent):
    from art_mega.agent.client import AgentClient
    from art_mega.errors import PreflightError
    from art_mega.preflight.etcd import check_from_every_host

    closing = socket.socket()
    closing.bind(("127.0.0.1", 0))
    closing.listen()
    port = closing.getsockname()[1]

    async def close_each() -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(closing)
            conn.close()

    closer = asyncio.create_task(close_each())
    closing.setblocking(False)
    client = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, SECRET, 30)
    try:
        with pytest.raises(PreflightError) as raised:
            await check_from_every_host({"host0": client}, f"http://127.0.0.1:{port}", "adv")
        # a FIN or an RST, whichever the kernel sends for a request still unread at close
        assert str(raised.value) in {
            f"the metadata store http://127.0.0.1:{port} is not usable from host host0: it answered no HTTP "
            f"(the connection was {how} without a response); give etcd's client port (2379 by default), "
            "not its peer port"
            for how in ("closed", "reset")
        }
        closer.cancel()
        closing.close()  # now nothing listens there
        with pytest.raises(PreflightError) as raised:
            await check_from_every_host({"host0": client}, f"http://127.0.0.1:{port}", "adv")
        assert str(raised.value).startswith(
            f"the metadata store http://127.0.0.1:{port} is not usable from host host0: cannot connect "
            "(ConnectError: [Errno 111] Connection refused); check that etcd serves clients at that port"
        )
    finally:
        closer.cancel()
        closing.close()
        await client.aclose()


async def test_an_artifact_root_in_a_symlink_loop_is_named_not_an_agent_500(tmp_path):
    from art_mega.errors import PreflightError
    from art_mega.runtime.runtime import ArtRuntime
    from art_mega.topology import ClusterSpec, HostSpec, compile_topology

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    cluster = ClusterSpec(
        hosts=(HostSpec(host_id="local", node_rank=0, worker_address="tcp://127.0.0.1:0", cpu_slots=1),),
        controller_host_id="local",
        artifact_root=str(loop),
        cache_root=str(tmp_path / "cache"),
        startup_timeout_s=30,
    )
    with pytest.raises(PreflightError) as raised:
        await ArtRuntime.start_local(compile_topology(cluster))
    assert str(raised.value).startswith(
        f"host local: artifact_root {loop} cannot be used (write failed: RuntimeError: Symlink loop from "
        f"'{loop}/.art-mega-probe')"
    )
