"""A group's identical prompts hit the replica's prefix cache (CPU replicas start with 32-token
blocks; vLLM's CPU default of 128 never filled a block for a chat prompt), and the backend
reports the hit rate of each step's prompts from the replicas' own /metrics."""

from __future__ import annotations

import asyncio

from art_mega.backend import MegatronBackend
from art_mega.inference.replica import CPU_BLOCK_SIZE
from art_mega.inference.router import PolicyRouter, ReplicaEndpoint
from art_mega.inference.server_api import ReplicaClient
from tests.inference.conftest import MODEL_NAME, Served

GROUP = 8
PROMPT = "Count the sheep in the field and answer with one number: " + "one sheep, " * 30


async def test_a_groups_identical_prompts_hit_the_prefix_cache(served: Served) -> None:
    endpoint = ReplicaEndpoint.from_spec(served.spec)
    backend = MegatronBackend()
    # the session replica and one that does not answer (left out of the rate, counted)
    backend._router = PolicyRouter(MODEL_NAME, [endpoint, ReplicaEndpoint("vllm-9", "http://127.0.0.1:9")])
    before = await backend._prefix_cache_metrics()  # whatever earlier tests sent
    assert before["inference/prefix_cache_unread_replicas"] == 1.0
    async with ReplicaClient(endpoint.name, endpoint.url) as client:
        replies = await asyncio.gather(
            *(client.complete(MODEL_NAME, PROMPT, max_tokens=2, temperature=1.0) for _ in range(GROUP))
        )
    tokens = replies[0]["usage"]["prompt_tokens"]
    assert tokens > 2 * CPU_BLOCK_SIZE and tokens % CPU_BLOCK_SIZE  # full blocks and a partial one
    metrics = await backend._prefix_cache_metrics()
    rate = metrics["inference/prefix_cache_hit_rate"]
    # at best every request but the first finds each full block of the prompt cached
    best = (GROUP - 1) * (tokens // CPU_BLOCK_SIZE * CPU_BLOCK_SIZE) / (GROUP * tokens)
    print(
        f"\nprefix-cache hit rate of {GROUP} identical {tokens}-token prompts: {rate:.3f} (best {best:.3f})"
    )
    assert 0.5 < rate <= best + 1e-9
    assert metrics["inference/prefix_cache_unread_replicas"] == 1.0
    # nothing was sent since: no rate (not a stale one)
    assert "inference/prefix_cache_hit_rate" not in await backend._prefix_cache_metrics()
