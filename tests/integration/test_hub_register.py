"""`register` with a Hugging Face hub id through `art-mega local`, offline (HF_HUB_OFFLINE=1) with
an HF cache the test writes from the tiny model: the name resolves to the cached snapshot, which
is what register checks (here refused by tp=3, one sentence naming the tiny Llama's heads); a
name that is not cached is refused in its sentence. Both exit 2 before any trainer rank or
replica starts."""

from tests.conftest import cli_env, run_cli
from tests.unit.basemodels.test_hub_models import write_hf_cache

PROGRAM = "tests/integration/programs/prog_register_split.py:main"


def test_a_hub_id_resolves_from_the_offline_cache_at_register(tiny_llama_dir, tmp_path):
    hub = tmp_path / "hf" / "hub"
    write_hf_cache(hub, "Qwen/Qwen3-0.6B", tiny_llama_dir)
    base = {k: v for k, v in cli_env().items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env = {
        **base,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "REGISTER_ROOT": str(tmp_path / "artifacts"),
    }
    cached = run_cli("local", "--program", PROGRAM, env={**env, "REGISTER_MODEL": "Qwen/Qwen3-0.6B"})
    missing = run_cli("local", "--program", PROGRAM, env={**env, "REGISTER_MODEL": "Qwen/Qwen3-8B"})
    assert (cached.returncode, missing.returncode) == (2, 2), (cached.stderr, missing.stderr)
    assert [line for line in cached.stderr.splitlines() if line.strip()] == [
        "art-mega: error: TrainerSpec.tp=3 cannot split this llama model (4 attention heads, 2 KV heads, FFN size "
        "256); use tp in {1, 2, 4}."
    ], cached.stderr
    assert [line for line in missing.stderr.splitlines() if line.strip()] == [
        f"art-mega: error: base_model 'Qwen/Qwen3-8B' has no snapshot in the Hugging Face cache {hub} and "
        "downloads are off (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); download it once with a network and the "
        "same HF_HOME (hf download Qwen/Qwen3-8B), or unset HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE"
    ], missing.stderr
    assert not list((tmp_path / "artifacts").rglob("*.log"))  # no rank or replica wrote a log


async def test_every_host_agent_reads_a_hub_snapshot_through_its_links(tiny_llama_dir, tmp_path):
    from art_mega.agent.ports import free_port
    from art_mega.preflight.reach import check_hosts_see_model
    from art_mega.runtime.runtime import ArtRuntime
    from art_mega.topology import ClusterSpec, HostSpec, InferenceSpec, TrainerSpec, compile_topology

    snapshot = write_hf_cache(tmp_path / "hf" / "hub", "Qwen/Qwen3-0.6B", tiny_llama_dir)
    cluster = ClusterSpec(
        hosts=(HostSpec(host_id="local", node_rank=0, worker_address="tcp://127.0.0.1:0", cpu_slots=2),),
        controller_host_id="local",
        artifact_root=str(tmp_path / "artifacts"),
        cache_root=str(tmp_path / "cache"),
    )
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(cpu_ranks_per_host=1, master_port=free_port()),
        inference=InferenceSpec(replicas=1, api_port=free_port()),
    )
    runtime = await ArtRuntime.start_local(topology)
    try:
        links = sorted(p.name for p in snapshot.iterdir() if p.is_symlink())
        assert "model.safetensors" in links and "config.json" in links
        # the agent follows each link to its blob (a link it read as such would be "missing")
        await check_hosts_see_model(runtime, snapshot, hub_id="Qwen/Qwen3-0.6B")
    finally:
        await runtime.close()
