"""AgentClient (aiohttp) against an in-process aiohttp server: signing, keep-alive, errors, timeouts."""

import asyncio
import json

import pytest
from aiohttp import web

from art_mega.agent.auth import (
    NONCE_HEADER,
    REPLY_SIGNATURE_HEADER,
    AgentIdentity,
    AuthError,
    Verifier,
    new_incarnation,
)
from art_mega.agent.client import AgentClient
from art_mega.errors import (
    AgentError,
    AgentFailedError,
    AgentRefusedError,
    AgentReplyError,
    AgentUnreachableError,
    RemoteRolloutError,
    UserError,
)
from art_mega.rollouts.protocol import CallableRef, RunRolloutRequest
from art_mega.rollouts.remote import run_rollout

SECRET = b"0123456789abcdef0123456789abcdef"
REF = CallableRef(module="m", qualname="f", source_sha256="a" * 64)
HEALTH = {
    "launch_id": "L",
    "pid": 1,
    "hostname": "h",
    "address": "tcp://127.0.0.1:1",
    "boot_id": "b",
    "python": "py",
    "art_mega_version": "0",
    "started_at": 0.0,
}


class FakeAgent:
    """Verifies every request like the agent does; records bodies and connections."""

    def __init__(self) -> None:
        self.verifier: Verifier | None = None  # made once the port is known
        self.identity_calls = 0
        self.reply_secret = SECRET
        self.bodies: list[bytes] = []
        self.peers: set[object] = set()
        self.delay_s = 0.0
        self.status: int | None = None
        self.error_text = ""

    def restart(self, address: str) -> None:
        """A fresh incarnation at `address` with the same secret (what a restarted agent is)."""
        self.verifier = Verifier(SECRET, AgentIdentity(address=address, incarnation=new_incarnation()))

    async def identity(self, request: web.Request) -> web.Response:
        self.identity_calls += 1
        try:
            self.verifier.verify_headers(request.method, request.path, request.headers, unbound=True)
        except AuthError as exc:
            return web.json_response({"detail": str(exc)}, status=401)
        body = self.verifier.identity.model_dump_json().encode()
        mac = Verifier(self.reply_secret, self.verifier.identity).sign_reply(
            request.headers[NONCE_HEADER], body
        )
        return web.Response(body=body, content_type="application/json", headers={REPLY_SIGNATURE_HEADER: mac})

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bodies.append(body)
        self.peers.add(request.transport)
        try:
            self.verifier.verify(request.method, request.path, dict(request.headers), body)
        except AuthError as exc:
            return web.json_response({"detail": str(exc)}, status=401)
        if self.status is not None:
            return web.Response(status=self.status, text=self.error_text)
        await asyncio.sleep(self.delay_s)
        if request.path == "/v1/health":
            return web.json_response(HEALTH)
        run = RunRolloutRequest.model_validate_json(body)
        if run.args == ["fail"]:
            failure = {"kind": "error", "message": "ValueError: x", "exc_type": "ValueError"}
            return web.json_response({"ok": False, "failure": failure})
        if run.args == ["user"]:
            return web.json_response({"ok": False, "failure": {"kind": "user", "message": "changed"}})
        return web.json_response({"ok": True, "result": {"echo": run.args, "kw": run.kwargs}})


@pytest.fixture
async def agent():
    fake = FakeAgent()
    app = web.Application()
    app.router.add_get("/v1/identity", fake.identity)
    app.router.add_get("/v1/health", fake.handle)
    app.router.add_post("/v1/rollouts/run", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fake.url = f"http://127.0.0.1:{port}"
    fake.address = f"tcp://127.0.0.1:{port}"
    fake.restart(fake.address)
    yield fake
    await runner.cleanup()


def client_for(agent: FakeAgent, secret: bytes = SECRET, timeout_s: float = 30.0) -> AgentClient:
    return AgentClient("host0", agent.address, agent.url, secret, timeout_s)


async def test_signed_calls_parse_replies_and_reuse_one_connection(agent):
    client = client_for(agent)
    try:
        health = await client.health()
        assert health.launch_id == "L" and health.children == ()
        for i in range(3):
            assert await run_rollout(client, "rollout-0", REF, [i], {"k": "v"}) == {
                "echo": [i],
                "kw": {"k": "v"},
            }
    finally:
        await client.aclose()
    assert agent.identity_calls == 1 and agent.bodies[0] == b""
    sent = RunRolloutRequest.model_validate_json(agent.bodies[1])
    assert agent.bodies[1] == sent.model_dump_json().encode()  # signed over these exact bytes
    assert len(agent.peers) == 1  # keep-alive


async def test_remote_failures_raise_like_before(agent):
    client = client_for(agent)
    try:
        with pytest.raises(RemoteRolloutError, match="ValueError: x") as info:
            await run_rollout(client, "rollout-0", REF, ["fail"], {})
        assert info.value.host == "host0" and info.value.worker_id == "rollout-0"
        with pytest.raises(UserError, match="changed"):
            await run_rollout(client, "rollout-0", REF, ["user"], {})
    finally:
        await client.aclose()


async def test_refused_request_is_an_agent_error_with_the_detail(agent):
    client = client_for(agent, secret=b"x" * 32)
    try:
        with pytest.raises(
            AgentError, match=r"^host host0 \(tcp://127\.0\.0\.1:\d+\): HTTP 401: bad signature$"
        ) as info:
            await client.health()
        assert info.value.host == "host0" and info.value.address == agent.address
    finally:
        await client.aclose()


async def test_non_json_error_body_is_kept_as_text(agent):
    agent.status, agent.error_text = 500, "Internal Server Error"
    client = client_for(agent)
    try:
        with pytest.raises(AgentError, match="HTTP 500: Internal Server Error$"):
            await run_rollout(client, "rollout-0", REF, [], {})
    finally:
        await client.aclose()


async def test_unreachable_agent_is_an_agent_error(agent):
    client = AgentClient("host9", "tcp://127.0.0.1:9", "http://127.0.0.1:9", SECRET, timeout_s=5.0)
    try:
        with pytest.raises(
            AgentError, match=r"host host9 \(tcp://127\.0\.0\.1:9\): agent unreachable \("
        ) as info:
            await client.health()
        assert info.value.address == "tcp://127.0.0.1:9"
    finally:
        await client.aclose()


async def test_timeouts_apply_to_control_calls_but_not_to_rollouts(agent):
    agent.delay_s = 0.6
    client = client_for(agent, timeout_s=0.2)
    try:
        with pytest.raises(AgentError, match="agent unreachable"):
            await client.health()
        with pytest.raises(AgentError, match="agent unreachable"):
            await client.health(timeout_s=0.1)
        assert (await client.health(timeout_s=5.0)).launch_id == "L"
        assert await run_rollout(client, "rollout-0", REF, [1], {}) == {"echo": [1], "kw": {}}
    finally:
        await client.aclose()


async def test_aclose_closes_the_session_and_is_idempotent(agent):
    client = client_for(agent)
    await client.health()
    session = client._session
    await client.aclose()
    assert session is not None and session.closed
    await client.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await client.health()
    await AgentClient("h", "a", agent.url, SECRET).aclose()  # never used: nothing to close


async def test_the_client_learns_the_agent_identity_once_and_signs_for_it(agent):
    client = client_for(agent)
    try:
        identity = await client.identity()
        assert identity == agent.verifier.identity and identity.address == agent.address
        await asyncio.gather(*(client.health() for _ in range(5)))
        assert agent.identity_calls == 1
        assert await client.identity() is identity
    finally:
        await client.aclose()


async def test_a_restarted_agent_refuses_the_client_and_is_not_relearnt(agent):
    client = client_for(agent)
    try:
        await client.health()
        agent.restart(agent.address)
        with pytest.raises(AgentError, match="HTTP 401: signed for another incarnation of this agent"):
            await client.health()
        assert agent.identity_calls == 1
    finally:
        await client.aclose()


async def test_an_identity_answer_without_the_launch_reply_signature_is_refused(agent):
    agent.reply_secret = b"q" * 32
    client = client_for(agent)
    try:
        with pytest.raises(AgentError, match="identity answer is not signed with this launch's secret"):
            await client.health()
        assert agent.bodies == []  # nothing was sent to an agent that did not prove the secret
    finally:
        await client.aclose()


async def test_each_failure_is_its_own_class_with_status_detail_and_route(agent):
    client = client_for(agent, timeout_s=0.2)
    try:
        agent.status, agent.error_text = 503, json.dumps({"detail": "draining"})
        with pytest.raises(AgentFailedError) as failed:
            await client.health()
        agent.status, agent.error_text = 404, json.dumps({"detail": "no worker rollout-9"})
        with pytest.raises(AgentRefusedError) as refused:
            await run_rollout(client, "rollout-9", REF, [], {})
        agent.status, agent.delay_s = None, 0.6
        with pytest.raises(AgentUnreachableError) as slow:
            await client.health()
    finally:
        await client.aclose()
    assert (failed.value.status, failed.value.detail, failed.value.route) == (
        503,
        "draining",
        "GET /v1/health",
    )
    assert failed.value.reason == "HTTP 503: draining"
    assert (refused.value.status, refused.value.detail, refused.value.route) == (
        404,
        "no worker rollout-9",
        "POST /v1/rollouts/run",
    )
    assert slow.value.timed_out and slow.value.status is None and slow.value.route == "GET /v1/health"


async def test_an_unsigned_identity_answer_is_a_reply_error(agent):
    agent.reply_secret = b"q" * 32
    client = client_for(agent)
    try:
        with pytest.raises(AgentReplyError) as info:
            await client.health()
    finally:
        await client.aclose()
    assert (info.value.status, info.value.route, info.value.host) == (200, "GET /v1/identity", "host0")
