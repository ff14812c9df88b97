"""A failed `register` without vLLM (cheap): a replica that cannot start (its interpreter, this
one, passes the preflight but has no vLLM, so the replica exits at once) stops the trainer rank
started beside it and leaves the backend free for the next register; `close()` after a refused
register closes an owned runtime, and the next register starts anew.

Before: the trainer rank went on loading the model and stayed up after `register` raised, a
second `register` on the backend said "this backend already trains model 'agent'", and a register
after `close()` reused the closed runtime."""

import asyncio
import os
import sys
from pathlib import Path

import pytest

from art_mega.agent.ports import free_port
from art_mega.backend import MegatronBackend
from art_mega.errors import ReplicaStartError
from art_mega.runtime.runtime import ArtRuntime
from art_mega.topology import ClusterSpec, HostSpec, InferenceSpec, TrainerSpec, compile_topology
from tests.conftest import pid_alive

pytestmark = pytest.mark.asyncio


async def _running(runtime) -> dict[str, int]:
    health = await runtime.health()
    return {
        c.child_id: c.pid
        for reply in health.values()
        for c in reply.children
        if c.role in ("trainer", "inference") and c.returncode is None
    }


def warm_interpreters() -> list[int]:
    """This test process's descendants that are warm replica interpreters still waiting for a
    start (`inference.warm`): its script runs them, and their stdin is still the agent's pipe
    (a replica that runs in one, e.g. another test's session replica, has /dev/null there)."""
    from art_mega.agent.supervisor import descendants

    found = []
    for pid, _ in descendants(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stdin = os.readlink(f"/proc/{pid}/fd/0")
        except OSError:
            continue
        if (
            any(a.endswith(b"art_mega_vllm_warm.py") for a in argv)
            and stdin.startswith("pipe:")
            and pid_alive(pid)
        ):
            found.append(pid)
    return found


async def _watch(runtime, seen: dict[str, int]) -> None:
    while True:
        seen.update(await _running(runtime))
        await asyncio.sleep(0.2)


async def test_a_replica_that_cannot_start_stops_the_trainer_rank_and_frees_the_backend(
    tiny_llama_dir, tmp_path
):
    import art_mega as art

    cluster = ClusterSpec(
        hosts=(HostSpec(host_id="local", node_rank=0, worker_address="tcp://127.0.0.1:0", cpu_slots=2),),
        controller_host_id="local",
        artifact_root=str(tmp_path / "artifacts"),
        cache_root=str(tmp_path / "cache"),
    )
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(cpu_ranks_per_host=1, master_port=free_port()),
        inference=InferenceSpec(replicas=1, api_port=free_port()),  # the backend's vllm_python runs it
    )
    runtime = await ArtRuntime.start_local(topology)
    backend = MegatronBackend(runtime, vllm_python=sys.executable, startup_timeout_s=300)
    model = art.TrainableModel(name="agent", project="p", base_model=str(tiny_llama_dir))
    logs = tmp_path / "artifacts" / "p" / "models" / "agent" / "logs"
    try:
        for attempt in range(2):  # the second register is not refused as "already trains"
            seen: dict[str, int] = {}
            watcher = asyncio.create_task(_watch(runtime, seen))
            try:
                with pytest.raises(ReplicaStartError, match="vllm-0"):
                    await model.register(backend)
            finally:
                watcher.cancel()
            assert (logs / "trainer-rank0.log").is_file(), attempt  # the rank had been started
            assert await _running(runtime) == {}
            assert [pid for pid in seen.values() if pid_alive(pid)] == []
            # the replica ran in the interpreter register warmed, which has no vLLM: its import
            # error is in the replica's log, and no warm interpreter is left
            log = (logs / "vllm-0.log").read_text().split("=== art-mega: starting replica")[-1]
            assert "its process is the warm interpreter" in log and "No module named 'vllm'" in log
            assert warm_interpreters() == []
    finally:
        await backend.close()
        await runtime.close()


async def test_close_after_a_failed_register_closes_an_owned_runtime_and_register_starts_anew(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """`MegatronBackend()` owns its local runtime: `close()` after a refused register closes it,
    and the next register starts a new one (it reused the closed one before)."""
    import json

    import art_mega as art
    from art_mega.errors import AdapterMismatchError

    monkeypatch.chdir(tmp_path)  # the default artifact_root is <cwd>/.art
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj"]}
    (adapter / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": str(tiny_llama_dir)})
    )
    backend = MegatronBackend(vllm_python=sys.executable)
    model = art.TrainableModel(name="agent", project="p", base_model=str(adapter))
    runtimes = []
    for _ in range(2):
        with pytest.raises(AdapterMismatchError, match="it has r=4 where the backend's lora_rank=8"):
            await model.register(backend)
        assert warm_interpreters() == []  # warmed before the adapter check, stopped after it
        runtimes.append(backend._runtime)
        await backend.close()
        with pytest.raises(RuntimeError, match="closed"):
            await runtimes[-1].health()
    assert runtimes[0] is not runtimes[1]


async def test_an_agents_close_stops_its_warm_interpreter(tmp_path):
    """A warm interpreter is no child the agent's health lists, but the agent's close (here the
    local runtime's, which owns its agent) stops it like one."""
    from art_mega.inference.protocol import INFERENCE_WARM, InferenceWarmRequest
    from art_mega.launch.local_topology import cpu_topology

    topology = cpu_topology(
        str(tmp_path / "artifacts"), str(tmp_path / "cache"), sys.executable, free_port(), free_port()
    )
    runtime = await ArtRuntime.start_local(topology)
    try:
        reply = await runtime.clients["local"].call(
            INFERENCE_WARM, InferenceWarmRequest(python=sys.executable)
        )
        assert reply.ok and warm_interpreters() == [reply.pid]
        again = await runtime.clients["local"].call(
            INFERENCE_WARM, InferenceWarmRequest(python=sys.executable)
        )
        assert again.pid == reply.pid  # the same interpreter and environment: the same process
        missing = await runtime.clients["local"].call(
            INFERENCE_WARM, InferenceWarmRequest(python=str(tmp_path / "no-python"))
        )
        assert not missing.ok and "no-python" in missing.error and "InferenceSpec.python" in missing.error
        assert warm_interpreters() == []  # the other interpreter's request stopped the first
        reply = await runtime.clients["local"].call(
            INFERENCE_WARM, InferenceWarmRequest(python=sys.executable)
        )
        assert warm_interpreters() == [reply.pid]
    finally:
        await runtime.close()
    assert warm_interpreters() == [] and not pid_alive(reply.pid)
