"""The agent's HTTP layer in-process: the hand-parsed health/run routes and the model routes, same auth."""

import json

import httpx
import pytest

from art_mega.runtime.agent import AgentState, create_app
from art_mega.runtime.auth import sign
from art_mega.runtime.protocol import CallableRef, HealthResponse, RunRolloutRequest, RunRolloutResponse

SECRET = b"0123456789abcdef0123456789abcdef"
REF = CallableRef(module="m", qualname="f", source_sha256="a" * 64)
RUN = "/v1/rollouts/run"
JSON = {"content-type": "application/json"}


class FakeWorker:
    def __init__(self, reply: dict) -> None:
        self.reply = reply
        self.messages: list[dict] = []

    async def call(self, message: dict) -> dict:
        self.messages.append(message)
        return self.reply


@pytest.fixture
async def agent():
    state = AgentState("launch-x", SECRET, "tcp://127.0.0.1:1")
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
        yield state, http
    state.fs_probe.close()


def run_body(worker_id: str = "rollout-0", args: list | None = None) -> bytes:
    return (
        RunRolloutRequest(worker_id=worker_id, callable=REF, args=args or [], kwargs={})
        .model_dump_json()
        .encode()
    )


async def post(http: httpx.AsyncClient, path: str, body: bytes, secret: bytes = SECRET) -> httpx.Response:
    return await http.post(path, content=body, headers={**JSON, **sign(secret, "POST", path, body)})


async def test_health_needs_a_signature_and_refuses_a_replay(agent):
    state, http = agent
    reply = await http.get("/v1/health")
    assert reply.status_code == 401 and reply.json() == {"detail": "unsigned request"}
    headers = sign(SECRET, "GET", "/v1/health", b"")
    reply = await http.get("/v1/health", headers=headers)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert HealthResponse.model_validate_json(reply.content).launch_id == "launch-x"
    reply = await http.get("/v1/health", headers=headers)
    assert reply.status_code == 401 and reply.json() == {"detail": "replayed nonce"}
    assert (await http.post("/v1/health", headers=sign(SECRET, "POST", "/v1/health", b""))).status_code == 405


async def test_run_refused_requests_execute_nothing(agent):
    state, http = agent
    worker = FakeWorker({"ok": True, "result": 1})
    state.workers["rollout-0"] = worker
    body = run_body()
    assert (await http.post(RUN, content=body, headers=JSON)).json() == {"detail": "unsigned request"}
    reply = await http.post(
        RUN, content=run_body(args=[2]), headers={**JSON, **sign(SECRET, "POST", RUN, body)}
    )
    assert reply.status_code == 401 and reply.json() == {"detail": "bad signature"}
    assert (await post(http, RUN, body, secret=b"y" * 32)).status_code == 401
    wrong_path = sign(SECRET, "POST", "/v1/health", body)
    assert (await http.post(RUN, content=body, headers={**JSON, **wrong_path})).status_code == 401
    assert (await post(http, RUN, b"{bad")).status_code == 422  # signed, but not a request: still nothing run
    assert worker.messages == []


async def test_run_forwards_to_the_worker_and_answers_its_reply(agent):
    state, http = agent
    worker = FakeWorker({"id": 0, "ok": True, "result": {"x": [1, 2.5]}})
    state.workers["rollout-0"] = worker
    for i in range(2):
        reply = await post(http, RUN, run_body(args=[i]))
        assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
        assert RunRolloutResponse.model_validate_json(reply.content) == RunRolloutResponse(
            ok=True, result={"x": [1, 2.5]}
        )
    assert worker.messages[0] == {"callable": REF.model_dump(), "args": [0], "kwargs": {}}
    assert worker.messages[1]["args"] == [1]
    assert worker.messages[0]["callable"] is worker.messages[1]["callable"]  # dumped once

    failure = {"kind": "error", "message": "ValueError: boom", "exc_type": "ValueError", "traceback": "tb"}
    worker.reply = {"id": 2, "ok": False, "failure": failure}
    reply = RunRolloutResponse.model_validate_json((await post(http, RUN, run_body())).content)
    assert not reply.ok and reply.failure is not None and reply.failure.traceback == "tb"


async def test_run_errors_have_the_detail_shapes_the_client_reads(agent):
    _, http = agent
    reply = await post(http, RUN, run_body("rollout-9"))
    assert reply.status_code == 404 and reply.json() == {
        "detail": "no rollout worker 'rollout-9' on this agent"
    }
    bad = json.dumps({"worker_id": "rollout-0", "callable": {**REF.model_dump(), "extra": 1}}).encode()
    reply = await post(http, RUN, bad)
    assert reply.status_code == 422
    assert [(e["type"], e["loc"]) for e in reply.json()["detail"]] == [
        ("extra_forbidden", ["body", "callable", "extra"])
    ]
    reply = await post(http, RUN, b"")
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"][0] == "body"


async def test_model_routes_check_the_signature_and_parse_the_body(agent):
    state, http = agent
    path = "/v1/rollout-workers/stop"
    body = b'{"worker_ids": []}'
    reply = await http.post(path, content=body, headers=JSON)
    assert reply.status_code == 401 and reply.json() == {"detail": "unsigned request"}
    reply = await post(http, path, body)
    assert reply.status_code == 200 and reply.json() == {"stopped": []}
    reply = await http.post(path, content=body, headers={**JSON, **sign(SECRET, "POST", path, b"{}")})
    assert reply.status_code == 401 and reply.json() == {"detail": "bad signature"}
    reply = await post(http, path, b'{"worker_ids": "rollout-0"}')  # signed, but not the model
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "worker_ids"]
    reply = await post(http, "/v1/no-such-route", body)
    assert reply.status_code == 404
