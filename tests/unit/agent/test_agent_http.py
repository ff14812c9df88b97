"""The agent's HTTP layer in-process: the hand-parsed health/run routes and the model routes, same auth,
the identity handshake, and body caps (refusals before the body is read)."""

import json

import httpx
import pytest

from art_mega.agent.app import AgentState, create_app
from art_mega.agent.auth import (
    NONCE_HEADER,
    REPLY_SIGNATURE_HEADER,
    UNBOUND,
    AgentIdentity,
    new_incarnation,
    reply_is_signed,
    sign,
)
from art_mega.agent.protocol import HealthResponse, LeaseRequest
from art_mega.agent.routes import API_PREFIX, DEFAULT_MAX_BODY_BYTES, Route
from art_mega.rollouts.protocol import CallableRef, RunRolloutRequest, RunRolloutResponse
from art_mega.rollouts.routes import RolloutWorkers, register

SECRET = b"0123456789abcdef0123456789abcdef"
REF = CallableRef(module="m", qualname="f", source_sha256="a" * 64)
RUN = "/v1/rollouts/run"
STOP = "/v1/rollout-workers/stop"
JSON = {"content-type": "application/json"}


class FakeWorker:
    def __init__(self, reply: dict) -> None:
        self.reply = reply
        self.messages: list[dict] = []

    async def call(self, message: dict) -> dict:
        self.messages.append(message)
        return self.reply


@pytest.fixture
def rollouts():
    """The test agent's rollout service (a list: filled once the agent is built)."""
    return []


@pytest.fixture
async def agent(rollouts):
    state = AgentState("launch-x", SECRET, "tcp://127.0.0.1:1")
    rollouts.append(RolloutWorkers(state.supervisor))
    transport = httpx.ASGITransport(app=create_app(state, [lambda router, _: rollouts[0].add_routes(router)]))
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
        yield state, http


def run_body(worker_id: str = "rollout-0", args: list | None = None) -> bytes:
    return (
        RunRolloutRequest(worker_id=worker_id, callable=REF, args=args or [], kwargs={})
        .model_dump_json()
        .encode()
    )


def signed(state: AgentState, method: str, path: str, body: bytes = b"", secret: bytes = SECRET) -> dict:
    return {**JSON, **sign(secret, method, path, body, state.identity)}


async def post(
    state: AgentState, http: httpx.AsyncClient, path: str, body: bytes, secret: bytes = SECRET
) -> httpx.Response:
    return await http.post(path, content=body, headers=signed(state, "POST", path, body, secret))


async def test_health_needs_a_signature_and_refuses_a_replay(agent):
    state, http = agent
    reply = await http.get("/v1/health")
    assert reply.status_code == 401 and reply.json() == {"detail": "unsigned request"}
    headers = signed(state, "GET", "/v1/health")
    reply = await http.get("/v1/health", headers=headers)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert HealthResponse.model_validate_json(reply.content).launch_id == "launch-x"
    reply = await http.get("/v1/health", headers=headers)
    assert reply.status_code == 401 and reply.json() == {"detail": "replayed nonce"}
    assert (await http.post("/v1/health", headers=signed(state, "POST", "/v1/health"))).status_code == 405


async def test_identity_answers_whom_to_sign_for_with_a_reply_signature(agent):
    state, http = agent
    headers = {**JSON, **sign(SECRET, "GET", "/v1/identity", b"", UNBOUND)}
    reply = await http.get("/v1/identity", headers=headers)
    assert reply.status_code == 200
    identity = AgentIdentity.model_validate_json(reply.content)
    assert identity == state.identity and identity.address == "tcp://127.0.0.1:1"
    assert len(identity.incarnation) == 32
    assert reply_is_signed(
        SECRET, headers[NONCE_HEADER], reply.content, reply.headers[REPLY_SIGNATURE_HEADER]
    )
    assert (await http.get("/v1/identity", headers=headers)).json() == {"detail": "replayed nonce"}
    other = {**JSON, **sign(b"z" * 32, "GET", "/v1/identity", b"", UNBOUND)}
    assert (await http.get("/v1/identity", headers=other)).status_code == 401
    # only the identity route takes a request signed for no agent
    unbound = {**JSON, **sign(SECRET, "GET", "/v1/health", b"", UNBOUND)}
    reply = await http.get("/v1/health", headers=unbound)
    assert reply.status_code == 401 and "no address" in reply.json()["detail"]


async def test_a_request_for_another_agent_or_incarnation_is_refused(agent):
    state, http = agent
    sibling = AgentIdentity(address="tcp://127.0.0.2:1", incarnation=state.identity.incarnation)
    earlier = AgentIdentity(address=state.identity.address, incarnation=new_incarnation())
    for target, reason in ((sibling, "signed for the agent at tcp://127.0.0.2:1"), (earlier, "incarnation")):
        headers = {**JSON, **sign(SECRET, "POST", "/v1/shutdown", b"", target)}
        reply = await http.post("/v1/shutdown", headers=headers)
        assert reply.status_code == 401 and reason in reply.json()["detail"]
    assert not state.shutdown_requested.is_set()


async def test_run_refused_requests_execute_nothing(agent, rollouts):
    state, http = agent
    worker = FakeWorker({"ok": True, "result": 1})
    rollouts[0].workers["rollout-0"] = worker
    body = run_body()
    assert (await http.post(RUN, content=body, headers=JSON)).json() == {"detail": "unsigned request"}
    reply = await http.post(RUN, content=run_body(args=[2]), headers=signed(state, "POST", RUN, body))
    assert reply.status_code == 401 and reply.json() == {
        "detail": "bad signature: the body is not the one signed"
    }
    assert (await post(state, http, RUN, body, secret=b"y" * 32)).status_code == 401
    wrong_path = signed(state, "POST", "/v1/health", body)
    assert (await http.post(RUN, content=body, headers=wrong_path)).status_code == 401
    assert (
        await post(state, http, RUN, b"{bad")
    ).status_code == 422  # signed, but not a request: still nothing run
    assert worker.messages == []


async def test_run_forwards_to_the_worker_and_answers_its_reply(agent, rollouts):
    state, http = agent
    worker = FakeWorker({"id": 0, "ok": True, "result": {"x": [1, 2.5]}})
    rollouts[0].workers["rollout-0"] = worker
    for i in range(2):
        reply = await post(state, http, RUN, run_body(args=[i]))
        assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
        assert RunRolloutResponse.model_validate_json(reply.content) == RunRolloutResponse(
            ok=True, result={"x": [1, 2.5]}
        )
    assert worker.messages[0] == {"callable": REF.model_dump(), "args": [0], "kwargs": {}}
    assert worker.messages[1]["args"] == [1]
    assert worker.messages[0]["callable"] is worker.messages[1]["callable"]  # dumped once

    failure = {"kind": "error", "message": "ValueError: boom", "exc_type": "ValueError", "traceback": "tb"}
    worker.reply = {"id": 2, "ok": False, "failure": failure}
    reply = RunRolloutResponse.model_validate_json((await post(state, http, RUN, run_body())).content)
    assert not reply.ok and reply.failure is not None and reply.failure.traceback == "tb"


async def test_run_errors_have_the_detail_shapes_the_client_reads(agent):
    state, http = agent
    reply = await post(state, http, RUN, run_body("rollout-9"))
    assert reply.status_code == 404 and reply.json() == {
        "detail": "no rollout worker 'rollout-9' on this agent"
    }
    bad = json.dumps({"worker_id": "rollout-0", "callable": {**REF.model_dump(), "extra": 1}}).encode()
    reply = await post(state, http, RUN, bad)
    assert reply.status_code == 422
    assert [(e["type"], e["loc"]) for e in reply.json()["detail"]] == [
        ("extra_forbidden", ["body", "callable", "extra"])
    ]
    reply = await post(state, http, RUN, b"")
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"][0] == "body"


async def test_model_routes_check_the_signature_and_parse_the_body(agent):
    state, http = agent
    body = b'{"worker_ids": []}'
    reply = await http.post(STOP, content=body, headers=JSON)
    assert reply.status_code == 401 and reply.json() == {"detail": "unsigned request"}
    reply = await post(state, http, STOP, body)
    assert reply.status_code == 200 and reply.json() == {"stopped": []}
    reply = await http.post(STOP, content=body, headers=signed(state, "POST", STOP, b"{}"))
    assert reply.status_code == 401 and reply.json() == {
        "detail": "bad signature: the body is not the one signed"
    }
    reply = await post(state, http, STOP, b'{"worker_ids": "rollout-0"}')  # signed, but not the model
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "worker_ids"]
    reply = await post(state, http, "/v1/no-such-route", body)
    assert reply.status_code == 404


async def call_app(app, path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, dict, int]:
    """One POST straight through ASGI; (status, reply headers, body chunks the app pulled)."""
    pulled = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal pulled
        if pulled < len(chunks):
            pulled += 1
            return {"type": "http.request", "body": chunks[pulled - 1], "more_body": pulled < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 1),
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, pulled


async def test_refusals_on_the_headers_and_over_the_cap_read_no_body():
    state = AgentState("launch-x", SECRET, "tcp://127.0.0.1:1")
    app = create_app(state, [register])
    chunk = b"x" * 65536
    try:
        big = {**JSON, "content-length": str(300 << 20)}
        status, headers, pulled = await call_app(app, STOP, big, [chunk] * 8)
        assert (status, headers["connection"], pulled) == (401, "close", 0)

        declared = {**signed(state, "POST", STOP, b"{}"), "content-length": str(DEFAULT_MAX_BODY_BYTES + 1)}
        status, headers, pulled = await call_app(app, STOP, declared, [chunk] * 8)
        assert (status, headers["connection"], pulled) == (413, "close", 0)

        chunked = signed(state, "POST", STOP, b"{}")  # no content-length: refused once past the cap
        status, _, pulled = await call_app(app, STOP, chunked, [chunk] * 40)
        assert status == 413 and pulled == DEFAULT_MAX_BODY_BYTES // len(chunk) + 1
    finally:
        await state.close()


async def test_only_bound_requests_renew_the_controller_lease(agent):
    state, http = agent
    state.lease.hold()
    state.lease._last_heard -= 5.0  # five seconds without a word from the controller
    headers = {**JSON, **sign(SECRET, "GET", "/v1/identity", b"", UNBOUND)}
    assert (await http.get("/v1/identity", headers=headers)).status_code == 200
    assert state.lease.silent_s() >= 5.0  # a (possibly replayed) identity call is not the controller
    assert (await http.get("/v1/health")).status_code == 401
    assert state.lease.silent_s() >= 5.0
    assert (await http.get("/v1/health", headers=signed(state, "GET", "/v1/health"))).status_code == 200
    assert state.lease.silent_s() < 5.0


def test_a_get_route_takes_no_body():
    with pytest.raises(ValueError, match="route GET /x: a GET takes no body"):
        Route("GET", "/x", LeaseRequest, HealthResponse)


async def test_a_served_route_holds_its_own_body_cap():
    state = AgentState("launch-x", SECRET, "tcp://127.0.0.1:1")
    small = Route("POST", "/small", LeaseRequest, LeaseRequest, max_body_bytes=16)

    def service(router, _) -> None:
        @router.serve(small)
        async def echo(body: LeaseRequest) -> LeaseRequest:
            return body

    app = create_app(state, [service])
    path = API_PREFIX + small.path
    fits = b'{"hold": false}'
    status, _, _ = await call_app(
        app, path, {**signed(state, "POST", path, fits), "content-length": "15"}, [fits]
    )
    assert status == 200
    over = b'{"hold":  false}!'
    headers = {**signed(state, "POST", path, over), "content-length": str(len(over))}
    status, headers, pulled = await call_app(app, path, headers, [over])
    assert (status, headers["connection"], pulled) == (413, "close", 0)
