"""A misspelled or unknown trainer message is refused where it is received, naming the field:
by a real agent's /trainer/job route (422), by a real trainer rank reading its socket (a `Failed`
event, the rank stays clean and runs the next job), and by the agent reading a rank's events (the
controller's `TrainerJobError` names the rank and the event's kind)."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys

import httpx
import pytest

from art_mega import ArtRuntime, TrainerSpec, compile_topology
from art_mega.agent.auth import UNBOUND, AgentIdentity, sign
from art_mega.agent.ports import free_port
from art_mega.agent.supervisor import Supervisor
from art_mega.errors import TrainerJobError
from art_mega.runtime.local_agent import start_local_agent
from art_mega.topology import EndpointSpec
from art_mega.trainer.protocol import (
    Done,
    Failed,
    PingJob,
    Ready,
    TrainerEvent,
    TrainerJobRequest,
    TrainerRankLaunch,
    TrainerStartRequest,
)
from art_mega.trainer.remote import TrainerService
from art_mega.trainer.routes import TrainerRanks
from tests.helpers import loopback_cluster

SECRET = secrets.token_hex(32).encode()
MISSPELLED = {
    "id": "ab12",
    "job": {
        "kind": "rl",
        "step": 1,
        "batch_dir": "/run/batches/0001",
        "checkpoint_dir": "/run/checkpoints/0001",
        "learnig_rate": 1e-5,
    },
}


async def test_the_agent_route_refuses_a_misspelled_or_unknown_job_naming_it():
    agent = await start_local_agent("host0", EndpointSpec(host="127.0.0.1", port=0), "msg", SECRET, 30)
    try:
        with httpx.Client(base_url=agent.endpoint.url, trust_env=False, timeout=30) as client:
            reply = client.get("/v1/identity", headers=sign(SECRET, "GET", "/v1/identity", b"", UNBOUND))
            me = AgentIdentity.model_validate_json(reply.content)

            def post(body: dict) -> httpx.Response:
                raw = json.dumps(body).encode()
                headers = {
                    **sign(SECRET, "POST", "/v1/trainer/job", raw, me),
                    "content-type": "application/json",
                }
                return client.post("/v1/trainer/job", content=raw, headers=headers)

            refused = post(MISSPELLED)
            assert refused.status_code == 422
            extra = [e for e in refused.json()["detail"] if e["type"] == "extra_forbidden"]
            assert [e["loc"] for e in extra] == [["body", "job", "rl", "learnig_rate"]]
            refused = post({"id": "ab12", "job": {"kind": "dance"}})
            assert refused.status_code == 422
            (tag,) = refused.json()["detail"]
            assert tag["loc"] == ["body", "job"] and tag["msg"].startswith(
                "Input tag 'dance' found using 'kind'"
            )
            accepted = post({"id": "ab12", "job": {"kind": "ping"}})
            assert accepted.status_code == 200 and accepted.json() == {"sent": 0}  # no rank runs
    finally:
        await agent.stop()


async def test_an_event_a_rank_sends_that_is_no_rank_event_fails_the_start_naming_it(tmp_path):
    # a stand-in for the rank's interpreter: reads its config, sends one invalid event, waits
    fake = tmp_path / "fake-python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import socket, sys\n"
        "channel = socket.socket(fileno=int(sys.argv[sys.argv.index('--fd') + 1]))\n"
        "reader = channel.makefile('rb')\n"
        "reader.readline()\n"
        'channel.sendall(b\'{"kind": "progress", "fraction": 0.5}\\n\')\n'
        "reader.read()\n"
    )
    fake.chmod(0o755)
    topology = compile_topology(
        loopback_cluster(1, tmp=str(tmp_path)),
        trainer=TrainerSpec(cpu_ranks_per_host=1, master_port=free_port()),
    )
    runtime = await ArtRuntime.start_local(topology)
    service = TrainerService(runtime.clients, topology, tmp_path / "logs")
    try:
        with pytest.raises(TrainerJobError) as info:
            await service.start(python=str(fake), timeout_s=60)
        assert str(info.value).endswith(
            "failed: InvalidEvent: trainer rank 0's event: unknown kind 'progress'; use one of "
            "'starting', 'ready', 'accepted', 'adapter_ready', 'done', 'failed', 'exited'."
        )
        assert info.value.rank == 0 and service.dirty
    finally:
        await service.stop()
        await runtime.close()


async def _next_event(ranks: TrainerRanks, seen: list[TrainerEvent], kind: type) -> TrainerEvent:
    while True:
        reply = await ranks.wait_events(len(seen), 30)
        assert reply.events, f"no {kind.__name__} event within 30 s; got {seen}"
        for event in reply.events:
            seen.append(event)
            if isinstance(event.event, kind):
                return event


async def test_a_real_rank_refuses_a_misspelled_job_line_and_stays_clean(tmp_path):
    pytest.importorskip("megatron.core", reason="trainer ranks need megatron-core (the trainer-cpu extra)")
    topology = compile_topology(
        loopback_cluster(1, tmp=str(tmp_path)),
        trainer=TrainerSpec(cpu_ranks_per_host=1, master_port=free_port()),
    )
    config = TrainerService({}, topology, tmp_path).rank_config(None)
    ranks = TrainerRanks(Supervisor("msg"))
    log = tmp_path / "trainer-rank0.log"
    await ranks.start(
        TrainerStartRequest(
            ranks=(TrainerRankLaunch(rank=0, env={"OMP_NUM_THREADS": "1"}, log_path=str(log)),), config=config
        )
    )
    seen: list[TrainerEvent] = []
    try:
        await _next_event(ranks, seen, Ready)
        # past the agent's check: the line goes to the rank's socket as it came
        ranks.ranks[0].writer.write(json.dumps(MISSPELLED).encode() + b"\n")
        refused = (await _next_event(ranks, seen, Failed)).event
        assert refused.message == (
            "trainer job: job.learnig_rate=1e-05 is not a known field; did you mean learning_rate?"
        )
        assert refused.job is None and not refused.dirty and refused.error_type == "InvalidMessageError"
        assert await ranks.send_job(TrainerJobRequest(id="cd34", job=PingJob())) == 1
        done = (await _next_event(ranks, seen, Done)).event
        assert done.job == "cd34" and done.metrics == {"sum": 1.0, "world_size": 1.0}
    finally:
        await asyncio.wait_for(ranks.stop(), 60)
