"""A real agent process refuses unsigned, tampered, stale and replayed requests, executing nothing."""

import json
import secrets
import time

import httpx
import pytest

from art_mega.runtime.auth import sign
from art_mega.runtime.local_agent import start_local_agent
from art_mega.topology import EndpointSpec

SECRET = secrets.token_hex(32).encode()


@pytest.fixture
async def agent():
    started = await start_local_agent(
        "host0", EndpointSpec(host="127.0.0.1", port=0), "launch-auth", SECRET, 30
    )
    yield started
    await started.stop()


def _children(client: httpx.Client) -> int:
    path = "/v1/health"
    reply = client.get(path, headers=sign(SECRET, "GET", path, b""))
    assert reply.status_code == 200
    return len(reply.json()["children"])


async def test_signed_requests_run_and_refused_ones_execute_nothing(agent):
    path = "/v1/rollout-workers/start"
    body = json.dumps({"count": 1}).encode()
    json_type = {"content-type": "application/json"}
    with httpx.Client(base_url=agent.endpoint.url, trust_env=False, timeout=30, headers=json_type) as client:
        assert client.get("/v1/health").status_code == 401
        assert client.post(path, content=body).status_code == 401
        assert _children(client) == 0

        headers = sign(SECRET, "POST", path, body)
        tampered = json.dumps({"count": 2}).encode()
        reply = client.post(path, content=tampered, headers=headers)
        assert reply.status_code == 401 and "bad signature" in reply.text
        assert _children(client) == 0

        wrong_path = sign(SECRET, "POST", "/v1/rollout-workers/stop", body)
        assert client.post(path, content=body, headers=wrong_path).status_code == 401

        stale = sign(SECRET, "POST", path, body, now=time.time() - 120)
        reply = client.post(path, content=body, headers=stale)
        assert reply.status_code == 401 and "stale" in reply.text
        assert _children(client) == 0

        other = sign(b"x" * 64, "POST", path, body)
        assert client.post(path, content=body, headers=other).status_code == 401
        assert _children(client) == 0

        reply = client.post(path, content=body, headers=headers)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["worker_ids"]) == 1
        assert _children(client) == 1

        replay = client.post(path, content=body, headers=headers)
        assert replay.status_code == 401 and "replayed" in replay.text
        assert _children(client) == 1


async def test_health_names_the_launch_and_the_agent_pid(agent):
    with httpx.Client(base_url=agent.endpoint.url, trust_env=False) as client:
        reply = client.get("/v1/health", headers=sign(SECRET, "GET", "/v1/health", b""))
    data = reply.json()
    assert data["launch_id"] == "launch-auth"
    assert data["pid"] == agent.pid
    assert data["address"] == agent.endpoint.address
    assert agent.endpoint.port != 0


async def test_files_check_names_what_this_host_cannot_read(agent, tmp_path):
    from art_mega.runtime.client import AgentClient

    readable = tmp_path / "config.json"
    readable.write_text("{}")
    paths = (str(readable), str(tmp_path / "gone.safetensors"), "relative/config.json", str(tmp_path))
    client = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, SECRET)
    try:
        assert await client.files_missing(paths) == paths[1:]  # a folder is not a readable file
        assert await client.files_missing((str(readable),)) == ()
    finally:
        await client.aclose()
