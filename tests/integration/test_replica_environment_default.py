"""The replicas' interpreter is proved before any replica starts on the default paths too.

One loopback host (the embedded backend's shape): an `InferenceSpec.python` is proved at start by
a world-size-1 probe, and an `InferenceSpec` without `python` (the backend's `vllm_python`) is
proved by `register` before it starts a trainer rank or a replica. The interpreter is a wrapper
script whose torch cannot import torch.distributed.

Before: `proof_environments(None)` proved only environments over two or more hosts, and the
backend's vLLM interpreter was never proved, so the replica failed minutes later in vLLM.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from art_mega.agent.ports import free_port
from art_mega.backend import MegatronBackend
from art_mega.errors import PreflightError
from art_mega.runtime.runtime import ArtRuntime
from art_mega.topology import ClusterSpec, HostSpec, InferenceSpec, TrainerSpec, compile_topology
from tests.integration.test_preflight_environments import broken_torch_interpreter

pytestmark = pytest.mark.asyncio

BROKEN = "cannot import torch.distributed (ImportError: this torch was built without torch.distributed)"


def one_host(tmp: Path, python: str | None):
    cluster = ClusterSpec(
        hosts=(HostSpec(host_id="local", node_rank=0, worker_address="tcp://127.0.0.1:0", cpu_slots=2),),
        controller_host_id="local",
        artifact_root=str(tmp / "artifacts"),
        cache_root=str(tmp / "cache"),
        startup_timeout_s=60,
    )
    return compile_topology(
        cluster,
        trainer=TrainerSpec(cpu_ranks_per_host=1, master_port=free_port()),
        inference=InferenceSpec(replicas=1, api_port=free_port(), python=python),
    )


async def test_a_one_host_replica_environment_is_proved_at_start(tmp_path):
    python = broken_torch_interpreter(tmp_path)
    with pytest.raises(PreflightError) as raised:
        await ArtRuntime.start_local(one_host(tmp_path, str(python)))
    error = str(raised.value)
    assert error.startswith(f"preflight collective in the vllm environment ({python}) failed on host local")
    assert BROKEN in error and "Traceback" not in error


async def test_the_backends_vllm_python_is_proved_before_any_rank_or_replica(tiny_llama_dir, tmp_path):
    import art_mega as art

    python = broken_torch_interpreter(tmp_path)
    runtime = await ArtRuntime.start_local(one_host(tmp_path, None))
    try:
        assert runtime.preflight.collectives == ()  # one host, the agents' own interpreter only
        backend = MegatronBackend(runtime, vllm_python=str(python), startup_timeout_s=60)
        model = art.TrainableModel(name="agent", project="p", base_model=str(tiny_llama_dir))
        started: set[str] = set()

        async def watch() -> None:
            while True:
                for reply in (await runtime.health()).values():
                    started.update(c.child_id for c in reply.children if c.role in ("trainer", "inference"))
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        try:
            for _ in range(2):  # refused again the same way: the failure is not cached as a pass
                with pytest.raises(PreflightError) as raised:
                    await model.register(backend)
                error = str(raised.value)
                assert error.startswith(
                    f"preflight collective in the vllm environment ({python}) failed on host local"
                )
                assert BROKEN in error
        finally:
            watcher.cancel()
        assert started == set()
        logs = tmp_path / "artifacts" / "p" / "models" / "agent" / "logs"
        assert not (logs / "trainer-rank0.log").exists() and not (logs / "vllm-0.log").exists()
        # the agents' own interpreter passes, once, and is then cached
        report = await runtime.prove_replicas(sys.executable)
        assert (report.environment, report.python, report.host_ids) == ("vllm", sys.executable, ("local",))
        assert await runtime.prove_replicas(sys.executable) is report
        await backend.close()
    finally:
        await runtime.close()


async def test_the_start_proof_of_the_replica_environment_serves_the_backends_check(tmp_path):
    runtime = await ArtRuntime.start_local(one_host(tmp_path, sys.executable))
    try:
        (report,) = runtime.preflight.collectives
        assert (report.environment, report.python, report.host_ids) == ("vllm", sys.executable, ("local",))
        assert [(m["host"], m["rank"]) for m in report.members] == [("local", 0)]
        assert await runtime.prove_replicas(sys.executable) is report  # cached: no second probe
    finally:
        await runtime.close()


async def test_a_vllm_plugins_without_art_megas_plugin_is_refused_before_any_rank_or_replica(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """The agent's VLLM_PLUGINS (which its replicas inherit) is in its host facts: one that leaves
    out art-mega's plugin fails the replicas' proof, before the trainer rank starts."""
    import art_mega as art

    monkeypatch.setenv("VLLM_PLUGINS", "my_plugin")  # the agent inherits it
    runtime = await ArtRuntime.start_local(one_host(tmp_path, None))
    try:
        assert runtime.host_facts["local"].env["VLLM_PLUGINS"] == "my_plugin"
        backend = MegatronBackend(runtime, vllm_python=sys.executable, startup_timeout_s=60)
        model = art.TrainableModel(name="agent", project="p", base_model=str(tiny_llama_dir))
        with pytest.raises(PreflightError) as raised:
            await model.register(backend)
        assert str(raised.value) == (
            "replica vllm-0: VLLM_PLUGINS='my_plugin' in the agent's environment on host local leaves out "
            "art-mega's vLLM plugin 'art_mega_lora', without which vLLM's CPU LoRA ops serve base-model "
            "requests batched with adapter requests with an adapter's weights; add "
            "art_mega_lora,art_mega_fork to it (exact names, comma separated) or unset it"
        )
        assert raised.value.hosts == ("local",)
        assert all(not reply.children for reply in (await runtime.health()).values())
        logs = tmp_path / "artifacts" / "p" / "models" / "agent" / "logs"
        assert not (logs / "trainer-rank0.log").exists() and not (logs / "vllm-0.log").exists()
        await backend.close()
    finally:
        await runtime.close()
