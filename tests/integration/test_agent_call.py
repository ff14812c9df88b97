"""`AgentClient.call` against a real agent process: replies validated as the route's response,
typed errors with fields (401, 4xx, wrong shape, unreachable), bodies typed before sending, and
the attached controller telling a refused secret by the error's class."""

import importlib
import secrets
from pathlib import Path

import pytest
import pytest_asyncio
from pydantic import ValidationError

import art_mega
from art_mega.agent.client import AgentClient
from art_mega.agent.ports import free_port
from art_mega.agent.protocol import (
    FREE_PORT,
    HEALTH,
    LEASE,
    FreePortRequest,
    FreePortResponse,
    HealthResponse,
    LeaseRequest,
)
from art_mega.agent.routes import Route
from art_mega.errors import (
    AgentRefusedError,
    AgentReplyError,
    AgentUnauthorizedError,
    AgentUnreachableError,
    UserError,
    format_validation_error,
)
from art_mega.launch.controller import run_attached
from art_mega.launch.program import parse_program
from art_mega.runtime.local_agent import start_local_agent
from art_mega.topology import EndpointSpec

SECRET = secrets.token_hex(32).encode()
LAUNCH = "launch-call"

in_module_loop = pytest.mark.asyncio(loop_scope="module")
"""The agent fixture lives for the module; its tests share the module's event loop."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent():
    started = await start_local_agent("host0", EndpointSpec(host="127.0.0.1", port=0), LAUNCH, SECRET, 30)
    yield started
    await started.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def client(agent):
    made = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, SECRET)
    yield made
    await made.aclose()


@in_module_loop
async def test_call_answers_with_the_route_response(agent, client):
    health = await client.call(HEALTH)
    assert type(health) is HealthResponse
    assert (health.launch_id, health.pid) == (LAUNCH, agent.pid)
    lease = await client.call(LEASE, LeaseRequest(hold=True), timeout_s=5.0)
    assert type(lease) is HealthResponse and lease.pid == agent.pid
    port = await client.call(FREE_PORT, FreePortRequest(host="127.0.0.1"))
    assert type(port) is FreePortResponse and 1024 <= port.port <= 65535


@in_module_loop
async def test_a_reply_of_another_shape_is_a_reply_error_naming_the_route(agent, client):
    # the agent answers its health; a client that expects a port there must not accept it
    misdeclared = Route("GET", "/health", None, FreePortResponse)
    with pytest.raises(AgentReplyError) as info:
        await client.call(misdeclared)
    error = info.value
    assert (error.host, error.address, error.route, error.status) == (
        "host0",
        agent.endpoint.address,
        "GET /v1/health",
        200,
    )
    assert error.reason.startswith("GET /v1/health answered with a body that is not a FreePortResponse: ")
    assert "port" in error.reason
    assert str(error) == f"host host0 ({agent.endpoint.address}): {error.reason}"


@in_module_loop
async def test_a_refused_secret_is_the_unauthorized_class_with_status_401(agent):
    wrong = AgentClient("host0", agent.endpoint.address, agent.endpoint.url, b"w" * 64)
    try:
        with pytest.raises(AgentUnauthorizedError) as info:
            await wrong.call(HEALTH)
    finally:
        await wrong.aclose()
    error = info.value
    assert (error.status, error.detail, error.route) == (401, "bad signature", "GET /v1/identity")
    assert error.reason == "HTTP 401: bad signature" and not error.timed_out


@in_module_loop
async def test_a_body_the_agent_refuses_is_the_refused_class_with_its_detail(client):
    # a FreePortRequest sent where the agent reads a LeaseRequest: 422, naming the field
    misdeclared = Route("POST", "/lease", FreePortRequest, HealthResponse)
    with pytest.raises(AgentRefusedError) as info:
        await client.call(misdeclared, FreePortRequest(host="127.0.0.1"))
    error = info.value
    assert (error.status, error.route) == (422, "POST /v1/lease")
    assert "extra_forbidden" in error.detail and "'host'" in error.detail


@in_module_loop
async def test_an_unreachable_agent_is_the_unreachable_class():
    port = free_port("127.0.0.1")  # nothing listens there
    lost = AgentClient("host7", f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{port}", SECRET, 5.0)
    try:
        with pytest.raises(AgentUnreachableError) as info:
            await lost.call(HEALTH)
    finally:
        await lost.aclose()
    assert info.value.status is None and not info.value.timed_out and info.value.host == "host7"
    assert info.value.reason.startswith("agent unreachable (")


@in_module_loop
async def test_a_misspelled_field_or_another_route_s_body_is_refused_before_anything_is_sent():
    with pytest.raises(ValidationError) as info:
        LeaseRequest.model_validate({"hodl": False})
    assert format_validation_error(info.value) == (
        "LeaseRequest.hodl=False is not a known field; remove it or correct its name."
    )
    # nothing listens at this address: a TypeError (not AgentUnreachableError) shows no request left
    port = free_port("127.0.0.1")
    lost = AgentClient("host7", f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{port}", SECRET, 5.0)
    try:
        with pytest.raises(TypeError, match=r"^POST /v1/lease takes a LeaseRequest, got FreePortRequest$"):
            await lost.call(LEASE, FreePortRequest(host="127.0.0.1"))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^GET /v1/health takes no body, got a LeaseRequest$"):
            await lost.call(HEALTH, LeaseRequest())  # type: ignore[arg-type]
    finally:
        await lost.aclose()


def test_every_route_request_model_refuses_an_unknown_field():
    package = Path(art_mega.__file__).parent
    routes = {}
    for path in sorted(package.rglob("protocol.py")):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for attr, value in vars(importlib.import_module(name)).items():
            if isinstance(value, Route):
                routes[f"{name}.{attr}"] = value
    assert {"art_mega.agent.protocol.LEASE", "art_mega.rollouts.protocol.RUN_ROLLOUT"} <= set(routes)
    assert len(routes) >= 25
    for where, route in routes.items():
        if route.request is None:
            continue
        with pytest.raises(ValidationError) as info:
            route.request.model_validate({"no_such_field": 1})
        assert any(
            e["type"] == "extra_forbidden" and e["loc"] == ("no_such_field",) for e in info.value.errors()
        ), where


@in_module_loop
async def test_the_attached_controller_tells_a_refused_secret_by_the_error_class(agent):
    program = parse_program("examples/multinode/program.py:main")
    with pytest.raises(UserError) as info:
        await run_attached(lambda _: None, program, [agent.endpoint.address], b"w" * 64, None)
    assert str(info.value) == (
        f"--worker {agent.endpoint.address} refused the launch secret; set ART_MEGA_SECRET to the "
        "secret the workers were started with"
    )
    port = free_port("127.0.0.1")
    with pytest.raises(UserError, match=r"does not answer; is `art-mega worker` running there\?"):
        await run_attached(lambda _: None, program, [f"tcp://127.0.0.1:{port}"], SECRET, None)
