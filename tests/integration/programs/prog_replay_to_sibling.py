"""Over two hosts: replays a signed `/v1/shutdown` made for host0's agent to host1's agent, and sends
host1's agent an unsigned 300 MB body; prints what happened as `REPLAY {json}`, then ends normally."""

import asyncio
import json
import socket

import aiohttp

from art_mega import ArtRuntime, compile_topology
from art_mega.agent.auth import sign
from art_mega.topology import EndpointSpec
from tests.integration.rollouts_for_tests import echo

BODY_BYTES = 300 << 20


def rss_kib(pid: int) -> int:
    """The agent's resident set from /proc (namespace hosts share the pid namespace)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def unsigned_upload(endpoint: EndpointSpec) -> tuple[str, int]:
    """Send only the headers of a 300 MB unsigned POST, read the answer, then offer the body;
    (status line, body bytes the agent let through before closing)."""
    head = f"POST /v1/rollout-workers/start HTTP/1.1\r\nHost: a\r\nContent-Length: {BODY_BYTES}\r\n\r\n"
    sent = 0
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
        sock.sendall(head.encode())
        reply = b""
        while part := sock.recv(65536):
            reply += part
        sock.settimeout(2)
        try:
            while sent < BODY_BYTES:
                sock.sendall(b"x" * (1 << 20))
                sent += 1 << 20
        except OSError:
            pass
    return reply.split(b"\r\n", 1)[0].decode(), sent


async def main(launch):
    runtime = await ArtRuntime.start(
        launch, compile_topology(launch.homogeneous_cluster(cpu_slots=1, allow_shared_kernel=True))
    )
    try:
        executor = await runtime.rollout_executor(echo)
        assert await executor.run(executor.workers[-1], echo, "before") == "before"
        a, b = runtime.clients["host0"], runtime.clients["host1"]
        before = await b.health()
        shutdown = sign(launch._secret_bytes(), "POST", "/v1/shutdown", b"", await a.identity())
        url = EndpointSpec.parse(b.address).url
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/shutdown", headers=shutdown) as reply:
                status, detail = reply.status, (await reply.json())["detail"]
        rss_before = rss_kib(before.pid)
        status_line, sent = await asyncio.to_thread(unsigned_upload, EndpointSpec.parse(b.address))
        grown = rss_kib(before.pid) - rss_before
        after = await b.health()
        result = {
            "status": status,
            "detail": detail,
            "host0": a.address,
            "children_before": len(before.children),
            "children_after": len([c for c in after.children if c.returncode is None]),
            "same_pid": after.pid == before.pid,
            "echo_after": await executor.run(executor.workers[-1], echo, "after"),
            "upload_status": status_line,
            "upload_sent": sent,
            "rss_grown_kib": grown,
        }
        print("REPLAY " + json.dumps(result), flush=True)
    finally:
        await runtime.close()
