"""Inference pieces that need no vLLM: naming, routing, launch options, argv, env, path checks."""

from __future__ import annotations

import json
import sys

import pytest
from pydantic import ValidationError

from art_mega.errors import NoReplicaUpError, ReplicaHTTPError, UserError
from art_mega.inference import (
    AdapterPublisher,
    PolicyRouter,
    ReplicaEndpoint,
    ReplicaLaunch,
    check_serving_mode,
    inference_name,
    lora_rank_slot,
)
from art_mega.inference.policy_client import served_step
from art_mega.inference.replica import VLLM_PLUGIN_DIR, plugins_problem, spawn_replica, vllm_argv, vllm_env
from tests.inference.common import replica_spec


def test_inference_name_and_round_robin() -> None:
    router = PolicyRouter(
        "tiny", [ReplicaEndpoint("vllm-0", "http://a:1"), ReplicaEndpoint("vllm-1", "http://b:2")]
    )
    assert router.served_step is None and router.inference_name() == "tiny"
    seen: list[int] = []
    router.on_advance(seen.append)
    router.advance(0)
    router.advance(3)
    assert seen == [0, 3] and router.inference_name() == "tiny@3" == inference_name("tiny", 3)
    routes = [router.route() for _ in range(3)]
    assert [r.replica for r in routes] == ["vllm-0", "vllm-1", "vllm-0"]
    assert routes[1].base_url == "http://b:2/v1" and {r.model for r in routes} == {"tiny@3"}
    assert {r.step for r in routes} == {3}
    with pytest.raises(ValueError, match="forward: 3 -> 3"):
        router.advance(3)
    with pytest.raises(ValueError, match="repeat"):
        PolicyRouter("tiny", [ReplicaEndpoint("x", "http://a:1")] * 2)


def test_lora_rank_slot() -> None:
    assert [lora_rank_slot(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    for bad in (0, 513):
        with pytest.raises(ValueError, match="outside"):
            lora_rank_slot(bad)


def test_launch_validation() -> None:
    with pytest.raises(ValidationError, match="lora_rank_slot"):
        ReplicaLaunch(model="/m", served_model_name="tiny", log_dir="/tmp", max_lora_rank=4)
    with pytest.raises(ValidationError, match="'@'"):
        ReplicaLaunch(model="/m", served_model_name="tiny@1", log_dir="/tmp")


def test_argv_and_env(tmp_path) -> None:
    spec = replica_spec(port=8123)
    launch = ReplicaLaunch(
        model="/models/tiny",
        served_model_name="tiny",
        python="/opt/vllm/bin/python",
        log_dir=str(tmp_path),
        extra_args=("--seed", "1"),
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
    )
    argv = vllm_argv(spec, launch)
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(argv)
    for part in (
        "--model /models/tiny",
        "--served-model-name tiny",
        "--host 127.0.0.1",
        "--port 8123",
        "--dtype float32",
        "--max-model-len 512",
        "--enable-lora --max-lora-rank 8 --max-loras 2",
        "--distributed-executor-backend uni",
    ):
        assert part in text
    assert argv[-2:] == ["--seed", "1"]
    env = vllm_env(launch, {"ART_MEGA_SECRET": "s", "PYTHONPATH": "/agent", "HOME": "/root"})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "ART_MEGA_SECRET" not in env and env["HOME"] == "/root"
    assert env["PYTHONPATH"] == str(VLLM_PLUGIN_DIR)  # the agent's own is dropped, the middleware's added
    same = launch.model_copy(update={"python": sys.executable})
    assert vllm_env(same, {"PYTHONPATH": "/agent"})["PYTHONPATH"] == f"{VLLM_PLUGIN_DIR}:/agent"
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in env  # GPU replicas keep vLLM's spawn
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # and its separate engine process
    cpu = vllm_env(launch, {}, on_cpu=True)
    assert cpu["VLLM_WORKER_MULTIPROC_METHOD"] == "fork" and cpu["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # a method the environment names wins, whether the agent's or the launch's
    method = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert vllm_env(launch, method, on_cpu=True)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    launch_spawn = launch.model_copy(update={"env": method})
    assert vllm_env(launch_spawn, {}, on_cpu=True)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "--enable-sleep-mode" not in argv and "--gpu-memory-utilization" not in argv
    assert "VLLM_SERVER_DEV_MODE" not in env


async def test_a_vllm_plugins_list_without_art_megas_plugin_is_refused_before_the_spawn(
    tmp_path, monkeypatch
) -> None:
    """vLLM loads only the plugins VLLM_PLUGINS names: one that leaves out art_mega_lora would
    serve base-model tokens with an adapter's delta on CPU, so the replica is not started."""
    from art_mega.agent.ports import free_port
    from art_mega.errors import ReplicaStartError

    assert plugins_problem({}) is None
    assert plugins_problem({"VLLM_PLUGINS": "mine,art_mega_lora"}) is None
    assert plugins_problem({"VLLM_PLUGINS": "art_mega_lora"}) is None  # without the fork: spawn
    for chosen in ("mine", "", " art_mega_lora", "none"):  # vLLM matches exact names
        assert plugins_problem({"VLLM_PLUGINS": chosen}) == (
            f"VLLM_PLUGINS={chosen!r} in the replica's environment leaves out art-mega's vLLM plugin "
            "'art_mega_lora', without which vLLM's CPU LoRA ops serve base-model requests batched with "
            "adapter requests with an adapter's weights; add art_mega_lora,art_mega_fork to it (exact names, "
            "comma separated) or unset it"
        )
    spec = replica_spec(port=free_port())
    marker = tmp_path / "ran"
    launch = ReplicaLaunch(  # an interpreter that would leave a mark if it ran
        model="/models/tiny",
        served_model_name="tiny",
        python=str(tmp_path / "python"),
        log_dir=str(tmp_path / "logs"),
        env={"VLLM_PLUGINS": "mine"},
    )
    (tmp_path / "python").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (tmp_path / "python").chmod(0o755)
    with pytest.raises(ReplicaStartError) as caught:
        await spawn_replica(spec, launch)
    assert str(caught.value).startswith("replica vllm-0: VLLM_PLUGINS='mine' in the replica's environment")
    assert not marker.exists() and not (tmp_path / "logs").exists()
    monkeypatch.setenv("VLLM_PLUGINS", "mine")  # the agent's own environment counts too
    with pytest.raises(ReplicaStartError):
        await spawn_replica(spec, launch.model_copy(update={"env": {}}))
    gpu = replica_spec(port=free_port()).model_copy(update={"gpu_ids": (("host0", (0,)),)})
    replica = await spawn_replica(gpu, launch)  # a GPU replica runs vLLM's own LoRA kernels: started
    assert await replica.process.wait() == 0 and marker.exists()


def test_shared_gpu_replicas_get_sleep_mode(tmp_path) -> None:
    spec = replica_spec(port=8123).model_copy(update={"shared_gpus": True})
    launch = ReplicaLaunch(
        model="/models/tiny", served_model_name="tiny", log_dir=str(tmp_path), gpu_memory_utilization=0.4
    )
    argv = vllm_argv(spec, launch)
    assert "--enable-sleep-mode" in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    assert vllm_env(launch, {}, sleep_mode=True)["VLLM_SERVER_DEV_MODE"] == "1"
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        ReplicaLaunch(model="/m", served_model_name="tiny", log_dir="/tmp", gpu_memory_utilization=1.5)


async def test_publish_refuses_bad_steps_and_paths_before_any_call() -> None:
    router = PolicyRouter("tiny", [ReplicaEndpoint("vllm-0", "http://127.0.0.1:9")])
    async with AdapterPublisher(router) as publisher:
        with pytest.raises(ValueError, match="absolute"):
            await publisher.publish(1, "relative/dir")
        with pytest.raises(ValueError, match="no adapter path for replicas"):
            await publisher.publish(1, {"other": "/a"})
        router.advance(4)
        with pytest.raises(ValueError, match="above the served step 4"):
            await publisher.publish(4, "/a")
    with pytest.raises(ValueError, match="keep"):
        AdapterPublisher(router, keep=0)


def test_down_replicas_get_no_traffic_until_marked_up() -> None:
    router = PolicyRouter(
        "tiny", [ReplicaEndpoint("vllm-0", "http://a:1"), ReplicaEndpoint("vllm-1", "http://b:2")]
    )
    router.mark_down("vllm-1", "exited with code -9")
    assert [router.route().replica for _ in range(3)] == ["vllm-0"] * 3
    assert [r.name for r in router.up()] == ["vllm-0"] and router.down() == {"vllm-1": "exited with code -9"}
    router.mark_down("vllm-0", "exited with code 1")
    with pytest.raises(NoReplicaUpError) as info:
        router.route()
    assert str(info.value) == (
        "no replica of tiny is up: vllm-0 (http://a:1): exited with code 1; "
        "vllm-1 (http://b:2): exited with code -9"
    )
    router.mark_up("vllm-1")
    assert router.route().replica == "vllm-1"
    with pytest.raises(ValueError, match="no replica 'vllm-9'"):
        router.mark_down("vllm-9", "?")


async def test_publication_skips_a_down_replica_and_restore_waits_for_its_loads() -> None:
    """Nothing listens at port 9: a publication with the only replica down advances without a
    call; restoring it fails (connection refused, after one retry) and leaves it down."""
    router = PolicyRouter("tiny", [ReplicaEndpoint("vllm-0", "http://127.0.0.1:9")])
    router.mark_down("vllm-0", "exited with code -9")
    async with AdapterPublisher(router, retry_delay_s=0.0) as publisher:
        report = await publisher.publish(1, "/ckpt/0001/adapter")
        assert router.served_step == 1 and report.load_s == {} and publisher.window() == [1]
        with pytest.raises(
            ReplicaHTTPError, match=r"replica vllm-0 \(http://127.0.0.1:9\): loading adapter tiny@1"
        ):
            await publisher.restore("vllm-0")
    assert "vllm-0" in router.down()


async def test_unload_takes_steps_out_of_the_window_and_keeps_what_a_replica_still_holds() -> None:
    """`model.delete_checkpoints` unloads the steps it deletes first: out of the window (a
    restarted replica never loads them again), the served step refused; a replica that cannot
    unload (nothing listens at port 9) keeps the step recorded as loaded and names itself."""
    router = PolicyRouter("tiny", [ReplicaEndpoint("vllm-0", "http://127.0.0.1:9")])
    router.mark_down("vllm-0", "exited with code -9")
    async with AdapterPublisher(router, retry_delay_s=0.0) as publisher:
        for step in (1, 2):
            await publisher.publish(step, f"/ckpt/000{step}")
        assert publisher.window() == [1, 2]
        with pytest.raises(ValueError, match="step 2 is the served step"):
            await publisher.unload({2})
        assert await publisher.unload({1}) == {} and publisher.window() == [2]
        with pytest.raises(ReplicaHTTPError, match=r"loading adapter tiny@2"):  # not tiny@1
            await publisher.restore("vllm-0")
        router.mark_up("vllm-0")
        publisher._loaded["vllm-0"][1] = "/ckpt/0001"  # as if its unload had failed before
        failures = await publisher.unload({1})
        (error,) = failures[1]
        assert "replica vllm-0 (http://127.0.0.1:9): unloading adapter tiny@1" in str(error)
        assert publisher.loaded("vllm-0") == {1: "/ckpt/0001"}


def test_policy_step_of_a_reply() -> None:
    router = PolicyRouter("tiny", [ReplicaEndpoint("vllm-0", "http://a:1")])
    assert [served_step(router, m) for m in ("tiny@3", "tiny", "tiny@x", "other@3", "tiny@12")] == [
        3,
        None,
        None,
        None,
        12,
    ]


def test_shared_mode_on_cpu_is_refused_before_any_start() -> None:
    spec = replica_spec(port=8123).model_copy(update={"shared_gpus": True})
    with pytest.raises(UserError) as info:
        check_serving_mode([spec])
    assert str(info.value) == (
        "InferenceSpec(name='vllm').shared_gpus=True, but replica vllm-0 runs on CPU, where replicas "
        "cannot sleep and wake around training; set shared_gpus=False."
    )
    check_serving_mode([replica_spec(port=8123)])


def _serve_module():
    """art-mega's serving middleware, loaded by its path (vLLM's interpreter imports it by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "art_mega_vllm_serve", VLLM_PLUGIN_DIR / "art_mega_vllm_serve.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_middleware_writes_the_fields_art_mega_reads() -> None:
    from art_mega.inference.replica import SERVE_MIDDLEWARE
    from art_mega.trajectories import POLICY_STEP_FIELD, SAMPLING_FIELD, SamplingRecord

    serve = _serve_module()
    assert (serve.POLICY_STEP_FIELD, serve.SAMPLING_FIELD) == (POLICY_STEP_FIELD, SAMPLING_FIELD)
    assert SERVE_MIDDLEWARE == f"{serve.__name__}.{serve.TrainableCompletions.__name__}"
    fields = {"temperature", "top_p", "top_k", "min_p", "constrained", "processed"}
    assert set(SamplingRecord.model_fields) == fields
    assert fields <= set(serve.sampling_record.__doc__.replace('"', " ").split())


def test_names_resolve_to_the_latest_loaded_step_and_unknown_names_are_named() -> None:
    serve = _serve_module()
    bases = ["agent", "Qwen/Qwen2.5-0.5B"]
    assert serve.resolve_model("agent", bases, []) == ("agent", {"policy_step": None})
    assert serve.resolve_model(None, bases, ["agent@2", "agent@10", "other"]) == (
        "agent@10",
        {"policy_step": 10},
    )
    assert serve.resolve_model("agent@2", bases, ["agent@2", "agent@10"]) == ("agent@2", {"policy_step": 2})
    assert serve.resolve_model("Qwen/Qwen2.5-0.5B", bases, ["agent@3"]) == (
        "Qwen/Qwen2.5-0.5B",
        {"policy_step": None},
    )
    assert serve.resolve_model("other", bases, ["other"]) == ("other", {})
    assert serve.resolve_model("agent@1", bases, ["agent@2"]) is None
    assert serve.not_served("agent-001@0", bases, ["agent@2", "agent@3"]) == (
        "The model `agent-001@0` does not exist on this replica; it serves `agent` (the latest step, "
        "now `agent@3`), `agent@2`, `agent@3`, `Qwen/Qwen2.5-0.5B` (the base model)."
    )


def test_stream_events_are_tagged_choice_by_choice() -> None:
    serve = _serve_module()
    events = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5]}],"prompt_token_ids":[1,2]}\n\n'
        b"data: [DONE]\n\n"
    )
    tagged = serve.tag_events(events, {"policy_step": 3})
    first, done = tagged.split(b"\n\n")[:2]
    assert json.loads(first[6:])["choices"][0] == {
        "index": 0,
        "delta": {"content": "a"},
        "token_ids": [5],
        "policy_step": 3,
        "prompt_token_ids": [1, 2],
    }
    assert done == b"data: [DONE]"


def test_base_model_samples_are_on_policy_only_while_it_is_the_expected_step() -> None:
    from openai.types.chat.chat_completion import Choice

    import art_mega as art
    from art_mega.trajectories import off_policy

    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "hi"},
            "policy_step": None,
        }
    )
    groups = [
        art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, choice])])
    ]
    assert off_policy(groups, 0, base_is_expected=True) == []
    assert off_policy(groups, 0) == [(0, 0, [None])]
    assert off_policy(groups, 1, base_is_expected=False) == [(0, 0, [None])]
