"""Replica fleet routing through `model.openai_client()`'s client (`inference.policy_client`):
two real HTTP servers stand in for two replicas' OpenAI endpoint (only the router's choice is
under test; each server records which requests reached it and can hold replies open), for
least-loaded routing under skewed load, affinity of a multi-turn trajectory and of a group's
identical prompts, an explicit `affinity` block, and a replica that is down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from aiohttp import web

from art_mega.agent.ports import free_port
from art_mega.errors import HyperParameterError, NoReplicaUpError
from art_mega.inference.fleet import PINNED_KEYS, FleetLoad, affinity, affinity_key
from art_mega.inference.policy_client import policy_client
from art_mega.inference.router import PolicyRouter, ReplicaEndpoint

SYSTEM = {"role": "system", "content": "Answer in one word."}


@dataclass
class Stand:
    """One stand-in replica: the user contents it was asked, and an event that holds replies
    to prompts containing "hold" until set."""

    name: str
    url: str
    seen: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)


async def _serve(name: str) -> tuple[Stand, web.AppRunner]:
    port = free_port()
    stand = Stand(name, f"http://127.0.0.1:{port}")

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        last = body["messages"][-1]["content"]
        stand.seen.append(last)
        if "hold" in last:
            await stand.release.wait()
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": f"{body['model']}",
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": name}}
                ],
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return stand, runner


@pytest_asyncio.fixture
async def fleet() -> AsyncIterator[tuple[PolicyRouter, Stand, Stand]]:
    (a, ra), (b, rb) = await _serve("vllm-0"), await _serve("vllm-1")
    router = PolicyRouter("tiny", [ReplicaEndpoint(a.name, a.url), ReplicaEndpoint(b.name, b.url)])
    router.advance(2)
    try:
        yield router, a, b
    finally:
        a.release.set()
        b.release.set()
        await ra.cleanup()
        await rb.cleanup()


async def ask(client, messages: list[dict]) -> str:
    reply = await client.chat.completions.create(model="tiny@2", messages=messages, max_tokens=1)
    assert reply.choices[0].policy_step == 2
    return reply.choices[0].message.content


async def test_new_prompts_go_to_the_replica_with_fewer_requests_in_flight(fleet) -> None:
    router, a, b = fleet
    client = policy_client(router)
    held = [
        asyncio.create_task(ask(client, [SYSTEM, {"role": "user", "content": f"hold {i}"}])) for i in range(3)
    ]
    while len(a.seen) + len(b.seen) < 3:
        await asyncio.sleep(0.01)
    # three distinct prompts, no load yet: round-robin, vllm-0 twice
    assert router.load.in_flight() == {"vllm-0": 2, "vllm-1": 1}
    answers = [await ask(client, [SYSTEM, {"role": "user", "content": f"new {i}"}]) for i in range(3)]
    assert answers == ["vllm-1", "vllm-1", "vllm-1"]  # skewed load: the less loaded one, every time
    a.release.set()
    b.release.set()
    assert sorted(await asyncio.gather(*held)) == ["vllm-0", "vllm-0", "vllm-1"]
    assert router.load.in_flight() == {"vllm-0": 0, "vllm-1": 0}


async def test_a_trajectorys_turns_and_a_groups_prompts_stay_on_one_replica(fleet) -> None:
    router, a, b = fleet
    client = policy_client(router)
    first = {"role": "user", "content": "what is 2+2?"}
    group = await asyncio.gather(*(ask(client, [SYSTEM, first]) for _ in range(4)))
    assert len(set(group)) == 1  # the group's identical prompt: one prefix cache
    turns = [SYSTEM, first]
    for turn in range(3):
        answer = await ask(client, turns)
        assert answer == group[0]
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and turn {turn}?"}]
    other = await ask(client, [SYSTEM, {"role": "user", "content": "a different scenario"}])
    assert other != group[0]  # a new key goes to the other (idle, next in turn) replica
    with affinity("episode-7"):
        pinned = {await ask(client, [{"role": "user", "content": f"unrelated {i}"}]) for i in range(3)}
    assert len(pinned) == 1


async def test_a_replica_that_is_down_is_skipped_and_its_keys_move(fleet) -> None:
    router, a, b = fleet
    client = policy_client(router)
    turns = [SYSTEM, {"role": "user", "content": "long task"}]
    home = await ask(client, turns)
    router.mark_down(home, "restarting after a crash")
    moved = {await ask(client, turns) for _ in range(3)}
    assert moved == ({"vllm-1"} if home == "vllm-0" else {"vllm-0"})
    assert {await ask(client, [SYSTEM, {"role": "user", "content": f"n{i}"}]) for i in range(3)} == moved
    router.mark_up(home)
    assert await ask(client, turns) == moved.pop()  # the key stays where it moved
    router.mark_down("vllm-0", "loading")
    router.mark_down("vllm-1", "loading")
    with pytest.raises(NoReplicaUpError):
        await ask(client, turns)


def test_affinity_keys_and_the_pin_limit() -> None:
    one = affinity_key({"messages": [SYSTEM, {"role": "user", "content": "q"}]})
    later = affinity_key(
        {
            "messages": [
                SYSTEM,
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"},
            ]
        }
    )
    assert one == later and one != affinity_key({"messages": [SYSTEM, {"role": "user", "content": "r"}]})
    assert (
        affinity_key({"prompt": "abc"}) == affinity_key({"prompt": "abc"}) != affinity_key({"prompt": "abd"})
    )
    assert affinity_key({}) is None
    with affinity("k"):
        assert affinity_key({"prompt": "abc"}) == "k"
    with pytest.raises(
        HyperParameterError, match=r"^affinity\(key=''\) must be a non-empty string; name the"
    ):
        with affinity(""):
            pass
    load = FleetLoad(["r0", "r1"])
    first = load.pick(["r0", "r1"], "key-0")
    for i in range(1, PINNED_KEYS + 1):
        load.pick(["r0", "r1"], f"key-{i}")
    assert (
        first == "r0" and len(load._pins) == PINNED_KEYS and "key-0" not in load._pins
    )  # least recent forgotten
