"""Real agent processes refuse unsigned, tampered, stale, replayed and misdirected requests, executing
nothing, and refuse an unsigned body without reading it."""

import asyncio
import json
import secrets
import socket
import time

import httpx
import pytest

from art_mega.agent.auth import UNBOUND, AgentIdentity, sign
from art_mega.agent.client import AgentClient
from art_mega.agent.ports import free_port
from art_mega.agent.routes import DEFAULT_MAX_BODY_BYTES
from art_mega.preflight.fs_probe import files_missing
from art_mega.runtime.local_agent import LocalAgent, start_local_agent
from art_mega.topology import EndpointSpec

SECRET = secrets.token_hex(32).encode()
START = "/v1/rollout-workers/start"
JSON = {"content-type": "application/json"}


async def _start(port: int = 0, launch_id: str = "launch-auth") -> LocalAgent:
    return await start_local_agent("host0", EndpointSpec(host="127.0.0.1", port=port), launch_id, SECRET, 30)


@pytest.fixture
async def agent():
    started = await _start()
    yield started
    await started.stop()


def _identity(client: httpx.Client) -> AgentIdentity:
    reply = client.get("/v1/identity", headers=sign(SECRET, "GET", "/v1/identity", b"", UNBOUND))
    assert reply.status_code == 200, reply.text
    return AgentIdentity.model_validate_json(reply.content)


def _children(client: httpx.Client, target: AgentIdentity) -> int:
    path = "/v1/health"
    reply = client.get(path, headers=sign(SECRET, "GET", path, b"", target))
    assert reply.status_code == 200, reply.text
    return len(reply.json()["children"])


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


async def test_signed_requests_run_and_refused_ones_execute_nothing(agent):
    body = json.dumps({"count": 1}).encode()
    with httpx.Client(base_url=agent.endpoint.url, trust_env=False, timeout=30, headers=JSON) as client:
        me = _identity(client)
        assert me.address == agent.endpoint.address
        assert client.get("/v1/health").status_code == 401
        assert client.post(START, content=body).status_code == 401
        assert _children(client, me) == 0

        tampered = json.dumps({"count": 2}).encode()
        reply = client.post(START, content=tampered, headers=sign(SECRET, "POST", START, body, me))
        assert reply.status_code == 401 and "bad signature" in reply.text
        assert _children(client, me) == 0

        wrong_path = sign(SECRET, "POST", "/v1/rollout-workers/stop", body, me)
        assert client.post(START, content=body, headers=wrong_path).status_code == 401

        stale = sign(SECRET, "POST", START, body, me, now=time.time() - 120)
        reply = client.post(START, content=body, headers=stale)
        assert reply.status_code == 401 and "stale" in reply.text
        assert _children(client, me) == 0

        other = sign(b"x" * 64, "POST", START, body, me)
        assert client.post(START, content=body, headers=other).status_code == 401
        unbound = sign(SECRET, "POST", START, body, UNBOUND)
        assert client.post(START, content=body, headers=unbound).status_code == 401
        assert _children(client, me) == 0

        headers = sign(SECRET, "POST", START, body, me)
        reply = client.post(START, content=body, headers=headers)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["worker_ids"]) == 1
        assert _children(client, me) == 1

        replay = client.post(START, content=body, headers=headers)
        assert replay.status_code == 401 and "replayed" in replay.text
        assert _children(client, me) == 1


async def test_a_shutdown_for_one_agent_replayed_to_its_sibling_is_refused_and_runs_nothing():
    a, b = await asyncio.gather(_start(), _start())
    try:
        with (
            httpx.Client(base_url=a.endpoint.url, trust_env=False, timeout=30, headers=JSON) as to_a,
            httpx.Client(base_url=b.endpoint.url, trust_env=False, timeout=30, headers=JSON) as to_b,
        ):
            id_a, id_b = _identity(to_a), _identity(to_b)
            assert id_a.incarnation != id_b.incarnation
            started = to_b.post(
                START, content=b'{"count": 1}', headers=sign(SECRET, "POST", START, b'{"count": 1}', id_b)
            )
            assert started.status_code == 200, started.text
            shutdown = sign(SECRET, "POST", "/v1/shutdown", b"", id_a)
            replayed = to_b.post("/v1/shutdown", headers=shutdown)
            assert replayed.status_code == 401
            assert replayed.json() == {
                "detail": f"signed for the agent at {a.endpoint.address}, not this one"
            }
            assert _children(to_b, id_b) == 1 and b.process.returncode is None
            assert to_a.post("/v1/shutdown", headers=shutdown).status_code == 200  # the agent it was for
        assert await asyncio.wait_for(a.process.wait(), 15) == 0
        assert b.process.returncode is None
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def test_a_request_replayed_to_the_restarted_agent_is_refused():
    port = free_port()
    first = await _start(port)
    body = b'{"count": 1}'
    try:
        with httpx.Client(base_url=first.endpoint.url, trust_env=False, timeout=30, headers=JSON) as client:
            captured = sign(SECRET, "POST", START, body, _identity(client))
            assert client.post(START, content=body, headers=captured).status_code == 200
    finally:
        await first.stop()
    second = await _start(port)  # same address, same secret, same launch id: a new incarnation
    try:
        with httpx.Client(base_url=second.endpoint.url, trust_env=False, timeout=30, headers=JSON) as client:
            reply = client.post(START, content=body, headers=captured)
            assert reply.status_code == 401 and "another incarnation of this agent" in reply.json()["detail"]
            assert _children(client, _identity(client)) == 0
    finally:
        await second.stop()


def _send_headers_then_body(port: int, head: bytes, total: int) -> tuple[bytes, int]:
    """Send `head` alone and read the reply until the agent closes the connection (it answers on
    the headers), then offer up to `total` body bytes; (reply, body bytes sent)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sent = 0
    chunk = b"x" * (1 << 20)
    try:
        sock.sendall(head)
        reply = b""
        while part := sock.recv(65536):  # until the agent closes the connection
            reply += part
        sock.settimeout(2)
        try:
            while sent < total:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the agent closed the connection: the rest of the body is never read
            pass
    finally:
        sock.close()
    return reply, sent


async def test_an_oversized_unsigned_body_is_refused_unread(agent):
    pid, port = agent.pid, agent.endpoint.port
    client = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, SECRET)
    try:
        await client.health()  # warm the agent's request path before measuring it
        before = _rss_kib(pid)
        total = 300 << 20
        head = f"POST {START} HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {total}\r\n\r\n"
        reply, sent = await asyncio.to_thread(_send_headers_then_body, port, head.encode(), total)
        assert reply.startswith(b"HTTP/1.1 401 ") and b"unsigned request" in reply, reply
        assert sent < total // 4, sent  # the agent closed the connection long before 300 MB
        grown = _rss_kib(pid) - before
        assert grown < 2 * 1024, f"the agent grew by {grown} KiB reading a body it refused"

        target = await client.identity()  # signed, but over the route's cap: 413 before reading
        signed = sign(SECRET, "POST", START, b"{}", target)
        head = f"POST {START} HTTP/1.1\r\nHost: a\r\nContent-Length: {total}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in signed.items()) + "\r\n"
        reply, _ = await asyncio.to_thread(_send_headers_then_body, port, head.encode(), total)
        assert reply.startswith(b"HTTP/1.1 413 "), reply
        assert f"takes at most {DEFAULT_MAX_BODY_BYTES} bytes of body".encode() in reply
        assert _rss_kib(pid) - before < 2 * 1024
        assert (await client.health()).pid == pid
    finally:
        await client.aclose()


async def test_health_names_the_launch_and_the_agent_pid(agent):
    client = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, SECRET)
    try:
        health = await client.health()
    finally:
        await client.aclose()
    assert health.launch_id == "launch-auth"
    assert health.pid == agent.pid
    assert health.address == agent.endpoint.address
    assert agent.endpoint.port != 0


async def test_files_check_names_what_this_host_cannot_read(agent, tmp_path):
    readable = tmp_path / "config.json"
    readable.write_text("{}")
    paths = (str(readable), str(tmp_path / "gone.safetensors"), "relative/config.json", str(tmp_path))
    client = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, SECRET)
    try:
        assert await files_missing(client, paths) == paths[1:]  # a folder is not a readable file
        assert await files_missing(client, (str(readable),)) == ()
    finally:
        await client.aclose()
