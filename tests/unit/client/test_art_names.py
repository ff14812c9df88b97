"""ART's public names and model constructors on art_mega (issue 16, classes 1 and 2): each name
resolves where ART programs import it, and each ART argument art-mega cannot honour is refused
with one sentence instead of being dropped."""

from __future__ import annotations

import asyncio
import logging

import pytest
from pydantic import BaseModel, ValidationError

import art_mega as art
from art_mega.errors import HyperParameterError, UnsupportedNameError, UserError


class Policy(BaseModel):
    """A program's own model config (ART's `config=PydanticPolicy(...)`)."""

    temperature: float = 0.7
    max_turns: int = 3


# ------------------------------------------------------------------ names


def test_art_submodules_and_names_resolve_where_art_programs_import_them():
    from art_mega.distributed import ArtLaunchContext, ArtRuntime, InstalledAsyncCallable, compile_topology
    from art_mega.local.backend import LocalBackend
    from art_mega.utils import iterate_dataset, limit_concurrency, retry

    assert art.local.LocalBackend is LocalBackend is art.LocalBackend
    assert art.utils.retry is retry is art.retry
    assert limit_concurrency is art.utils.limit_concurrency
    assert callable(iterate_dataset)
    assert (ArtRuntime, InstalledAsyncCallable, compile_topology, ArtLaunchContext) == (
        art.ArtRuntime,
        art.InstalledAsyncCallable,
        art.compile_topology,
        art.ArtLaunchContext,
    )
    assert {"dev", "local", "utils", "distributed", "Backend", "Messages", "Tools"} <= set(dir(art))
    with pytest.raises(UnsupportedNameError, match=r"^art.ServerlessBackend is not supported by art-mega: "):
        art.ServerlessBackend  # noqa: B018


def test_every_name_of_arts_all_but_the_serverless_ones_resolves():
    art_0_5_18_all = [
        "dev", "auto_trajectory", "capture_auto_trajectory", "gather_trajectories",
        "gather_trajectory_groups", "trajectory_group_batches", "Backend", "LocalBackend",
        "LocalTrainResult", "Messages", "MessagesAndChoices", "Tools", "Model", "TrainableModel",
        "retry", "TrainSFTConfig", "TrainConfig", "TrainResult", "Trajectory", "TrajectoryGroup",
        "capture_yielded_trajectory", "yield_trajectory",
    ]  # fmt: skip
    missing = [name for name in art_0_5_18_all if not hasattr(art, name)]
    assert missing == []
    assert callable(art.auto_trajectory) and callable(art.yield_trajectory)  # not their modules


def test_dev_train_config_has_arts_keys():
    art_0_5_18 = {
        "advantage_balance", "allow_training_without_logprobs", "epsilon", "epsilon_high",
        "importance_sampling_level", "kimi_k2_tau", "kl_penalty_coef", "kl_ref_adapter_path",
        "logprob_calculation_chunk_size", "mask_prob_ratio",
        "max_negative_advantage_importance_sampling_weight", "moe_routing_replay_bundle",
        "moe_routing_replay_path", "moe_routing_replay_strict",
        "num_trajectories_learning_rate_multiplier_power", "packed_sequence_length", "plot_tensors",
        "ppo", "precalculate_logprobs", "scale_learning_rate_by_reward_std_dev", "scale_rewards",
        "truncated_importance_sampling",
    }  # fmt: skip
    art_0_5_23 = art_0_5_18 | {"kl_penalty_reference_step", "kl_penalty_source", "kl_penalty_step_lag"}
    assert set(art.dev.TrainConfig.__annotations__) == art_0_5_23
    assert art.dev.TrainConfig(ppo=True) == {"ppo": True}  # a TypedDict: a dict at run time
    assert set(art.dev.TrainSFTConfig.__annotations__) == {"metric_logging"}
    assert {"max_seq_length", "revision", "gpu_memory_utilization"} <= set(art.dev.InitArgs.__annotations__)
    assert {"r", "lora_alpha", "target_modules"} <= set(art.dev.PeftArgs.__annotations__)
    assert {"tensor_parallel_size", "enable_sleep_mode"} <= set(art.dev.EngineArgs.__annotations__)
    assert "per_device_train_batch_size" in art.dev.TrainerArgs.__annotations__


def test_internal_config_fields_art_mega_reads_are_kept():
    config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=2048),
        engine_args=art.dev.EngineArgs(gpu_memory_utilization=0.5, max_model_len=2048),
        trainer_gpu_ids=[0],
        inference_gpu_ids=[1],
        rollout_weights_mode="lora",  # what art-mega does anyway
        peft_args={},
    )
    model = art.TrainableModel(name="m", project="p", base_model="b", _internal_config=config)
    assert model._internal_config == config
    assert model._internal_config is not config  # a copy: later edits of the caller's dict do not leak in
    assert art.TrainableModel(name="m", project="p", base_model="b")._internal_config == {}


@pytest.mark.parametrize(
    "config,fragments",
    [
        (
            {"peft_args": {"r": 16}},
            ["peft_args.r=16", "does not implement", "MegatronBackend(lora_rank=...)"],
        ),
        ({"trainer_args": {"learning_rate": 1e-5}}, ["trainer_args.learning_rate=1e-05", "art.TrainConfig"]),
        ({"engine_args": {"enforce_eagr": True}}, ["engine_args.enforce_eagr=True", "did you mean enforce_eager"]),
        ({"init_args": {"load_in_4bit": True}}, ["init_args.load_in_4bit=True", "leave it out"]),
        ({"rollout_weights_mode": "merged"}, ["rollout_weights_mode='merged'", "LoRA adapters"]),
        ({"chat_template": "{{ x }}"}, ["chat_template='{{ x }}'", "does not implement"]),
        ({"gpu_ids": [0]}, ["'gpu_ids'", "InternalModelConfig does not have", "trainer_gpu_ids"]),
        ({"trainer_gpu_ids": [0.5]}, ["trainer_gpu_ids[0]=0.5", "valid integer"]),
        ({"init_args": {"max_seq_length": True}}, ["init_args.max_seq_length=True", "a whole number"]),
        ([("trainer_gpu_ids", [0])], ["got list", "InternalModelConfig(...)"]),
    ],
)
def test_internal_config_fields_art_mega_does_not_read_are_refused(config, fragments):
    with pytest.raises(HyperParameterError) as caught:
        art.TrainableModel(name="m", project="p", base_model="b", _internal_config=config)
    message = str(caught.value)
    assert message.startswith("TrainableModel(_internal_config=...) ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


# ------------------------------------------------------------------ retry, limit_concurrency


def test_retry_calls_again_with_backoff_and_reraises_the_last_exception():
    seen: list[tuple[str, int]] = []
    calls = []

    @art.retry(max_attempts=3, delay=0, on_retry=lambda exc, attempt: seen.append((str(exc), attempt)))
    def flaky(x: int) -> int:
        calls.append(x)
        if len(calls) < 3:
            raise ValueError(f"try {len(calls)}")
        return x * 2

    assert flaky(21) == 42 and calls == [21, 21, 21]
    assert seen == [("try 1", 1), ("try 2", 2)]

    @art.retry(max_attempts=2, delay=0, exceptions=(KeyError,))
    async def always(kind: type[Exception]) -> None:
        calls.append(kind)
        raise kind("no")

    calls.clear()
    with pytest.raises(KeyError):
        asyncio.run(always(KeyError))
    assert calls == [KeyError, KeyError]
    calls.clear()
    with pytest.raises(ValueError):  # not one of `exceptions`: raised at once
        asyncio.run(always(ValueError))
    assert calls == [ValueError]


def test_retry_takes_one_exception_class_as_arts_except_does():
    # ART's 2048 notebook (art-notebooks examples/2048/2048.ipynb) writes
    # `@art.retry(exceptions=(requests.ReadTimeout))`: the parentheses make no tuple
    calls = []

    @art.retry(max_attempts=2, delay=0, exceptions=(TimeoutError))
    def slow(kind: type[Exception]) -> None:
        calls.append(kind)
        raise kind("no")

    with pytest.raises(TimeoutError):
        slow(TimeoutError)
    assert calls == [TimeoutError, TimeoutError]
    calls.clear()
    with pytest.raises(KeyError):  # not the class given: raised at once
        slow(KeyError)
    assert calls == [KeyError]


def test_retry_logs_a_warning_without_on_retry(caplog):
    attempts = []

    @art.retry(max_attempts=2, delay=0)
    async def once_then_fine() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise TimeoutError("slow")
        return "ok"

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(once_then_fine()) == "ok"
    assert "Retry 1/2 for once_then_fine after error: slow" in caplog.text


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"max_attempts": 0}, "retry(max_attempts=0)"),
        ({"max_attempts": 2.5}, "retry(max_attempts=2.5)"),
        ({"delay": -1}, "retry(delay=-1)"),
        ({"backoff_factor": float("nan")}, "retry(backoff_factor=nan)"),
        ({"exceptions": "ValueError"}, "an exception class or a tuple of them"),
        ({"exceptions": (ValueError, "KeyError")}, "an exception class or a tuple of them"),
        ({"on_retry": "print"}, "retry(on_retry='print')"),
    ],
)
def test_retry_refuses_options_that_mean_something_else(kwargs, fragment):
    with pytest.raises(HyperParameterError) as caught:
        art.retry(**kwargs)
    assert fragment in str(caught.value)


def test_limit_concurrency_bounds_concurrent_calls_per_key():
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    @art.utils.limit_concurrency(2, derive_key=lambda opponent, _i: opponent)
    async def play(opponent: str, _i: int) -> None:
        running[opponent] = running.get(opponent, 0) + 1
        peak[opponent] = max(peak.get(opponent, 0), running[opponent])
        await asyncio.sleep(0.01)
        running[opponent] -= 1

    async def main() -> None:
        await asyncio.gather(*(play(o, i) for o in ("a", "b") for i in range(6)))

    asyncio.run(main())
    asyncio.run(main())  # a second event loop gets its own semaphores
    assert peak == {"a": 2, "b": 2}


def test_limit_concurrency_refuses_bad_arguments():
    with pytest.raises(HyperParameterError, match=r"limit_concurrency\(n=0\)"):
        art.utils.limit_concurrency(0)
    with pytest.raises(HyperParameterError, match="decorates async functions; 'sync' is not one"):

        @art.utils.limit_concurrency(1)
        def sync() -> None:
            pass


# ------------------------------------------------------------------ yield_trajectory


def test_capture_yielded_trajectory_returns_what_the_rollout_yielded():
    async def agent_callback(reward: float) -> None:
        art.yield_trajectory(
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward)
        )

    async def rollout(reward: float) -> str:
        await agent_callback(reward)
        return "ignored"

    async def main() -> list[art.Trajectory]:
        return await asyncio.gather(*(art.capture_yielded_trajectory(rollout(r)) for r in (0.25, 0.5)))

    assert [t.reward for t in asyncio.run(main())] == [0.25, 0.5]


def test_yield_trajectory_outside_a_capture_or_never_yielding_is_an_error():
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=1.0)
    with pytest.raises(RuntimeError, match="outside capture_yielded_trajectory"):
        art.yield_trajectory(trajectory)

    async def silent() -> None:
        return None

    with pytest.raises(RuntimeError, match="No trajectory yielded"):
        asyncio.run(art.capture_yielded_trajectory(silent()))


# ------------------------------------------------------------------ model constructors


def test_trainable_model_takes_arts_constructor_fields_with_arts_defaults(tmp_path):
    model = art.TrainableModel(name="m", project="p", base_model="b")
    assert (model.entity, model.id, model.run_id, model.config, model.report_metrics) == (None,) * 5
    assert (model.inference_base_url, model.inference_api_key, model.inference_model_name) == (None,) * 3
    assert model.trainable is True and art.Model(name="m", project="p").trainable is False
    full = art.TrainableModel(
        name="m",
        project="p",
        entity="team",
        id="abc",
        run_id="run-1",
        base_path=str(tmp_path),
        report_metrics=[],
        base_model="b",
        config=Policy(temperature=0.2),
    )
    assert (full.entity, full.id, full.run_id, full.report_metrics) == ("team", "abc", "run-1", [])
    assert full.output_dir == tmp_path / "p" / "models" / "m"
    assert full.config == Policy(temperature=0.2)


def test_trainable_model_is_generic_over_its_config():
    model = art.TrainableModel[Policy](name="m", project="p", base_model="b", config=Policy(max_turns=5))
    assert model.config.max_turns == 5
    again = art.TrainableModel[Policy].model_validate(model.model_dump())  # a dumped config comes back typed
    assert again.config == Policy(max_turns=5)

    class Other(BaseModel):
        other: int = 1

    with pytest.raises(ValidationError, match="instance of Policy"):
        art.TrainableModel[Policy](name="m", project="p", base_model="b", config=Other())


def test_model_config_must_be_a_serializable_pydantic_model():
    with pytest.raises(ValidationError, match="config must be a pydantic model instance .* not a dict"):
        art.TrainableModel(name="m", project="p", base_model="b", config={"temperature": 0.7})

    class Opaque(BaseModel):
        model_config = {"arbitrary_types_allowed": True}
        handle: object

    with pytest.raises(ValidationError, match="cannot be serialized to JSON"):
        art.Model(name="m", project="p", config=Opaque(handle=object()))


def test_report_metrics_names_only_what_art_mega_reports_to():
    assert art.Model(name="m", project="p", report_metrics=["wandb"]).report_metrics == ["wandb"]
    with pytest.raises(ValidationError, match=r"report_metrics names \['weave'\]"):
        art.Model(name="m", project="p", report_metrics=["weave"])


def test_prompted_model_points_its_clients_at_the_external_endpoint():
    model = art.Model(
        name="gpt-4.1",
        project="p",
        inference_base_url="http://127.0.0.1:9/v1",
        inference_api_key="sk-test",
        inference_model_name="openai/gpt-4.1",
    )
    assert model.get_inference_name() == "openai/gpt-4.1"
    assert model.get_inference_name(step=3) == "openai/gpt-4.1@3"
    assert model.litellm_completion_params() == {
        "model": "openai/gpt-4.1",
        "base_url": "http://127.0.0.1:9/v1",
        "api_key": "sk-test",
        "temperature": 1,
    }
    client = model.openai_client()
    assert str(client.base_url) == "http://127.0.0.1:9/v1/" and client.api_key == "sk-test"
    assert model.openai_client() is client
    bare = art.Model(name="gpt-4.1", project="p")
    assert bare.get_inference_name() == "gpt-4.1"
    with pytest.raises(UserError, match="has no inference endpoint: pass art.Model"):
        bare.openai_client()
    with pytest.raises(HyperParameterError, match=r"get_inference_name\(step=-1\)"):
        model.get_inference_name(step=-1)


def test_trainable_model_needs_register_for_its_endpoint():
    model = art.TrainableModel(name="m", project="p", base_model="b")
    with pytest.raises(RuntimeError, match="is not registered"):
        model.litellm_completion_params()
    with pytest.raises(RuntimeError, match="is not registered"):
        model.get_inference_name(step=1)


# ------------------------------------------------------------------ LocalBackend


def test_local_backend_takes_arts_arguments_and_refuses_what_has_no_meaning_here(tmp_path):
    backend = art.LocalBackend(path=str(tmp_path), seq_len=256)
    assert backend.path == str(tmp_path) and backend.seq_len == 256
    assert isinstance(backend, art.Backend) and isinstance(backend, art.MegatronBackend)
    for kwargs, fragment in [
        ({"in_process": 1}, "LocalBackend(in_process=1) must be True or False"),
        ({"path": ""}, "LocalBackend(path='') must be a directory path"),
        ({"gpu_cost_per_hour_usd": -3.0}, "LocalBackend(gpu_cost_per_hour_usd=-3.0) must be a finite number"),
        ({"runtime": object()}, "LocalBackend(runtime=...) is not accepted"),
    ]:
        with pytest.raises(UserError) as caught:
            art.LocalBackend(**kwargs)
        assert fragment in str(caught.value)


# ------------------------------------------------------------------ trajectory_group_batches


def _group(reward: float) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward)]
    )


async def _group_after(
    reward: float, gate: asyncio.Event | None = None, fail: bool = False
) -> art.TrajectoryGroup:
    if gate is not None:
        await gate.wait()
    if fail:
        raise ValueError(f"group {reward} failed")
    return _group(reward)


async def _batches(groups, between=None, **options) -> list[list[float]]:
    got = []
    async for batch in art.trajectory_group_batches(groups, pbar_desc=None, **options):
        got.append([g.trajectories[0].reward for g in batch])
        if between is not None:
            between()
    return got


def test_trajectory_group_batches_yield_a_batch_while_later_groups_still_run():
    async def main() -> list[list[float]]:
        slow = asyncio.Event()  # set only once the first batch arrived: it cannot be in it
        groups = [_group_after(0.0, slow), _group_after(1.0), _group_after(2.0), _group_after(3.0)]
        return await _batches(groups, between=slow.set, batch_size=2)

    assert asyncio.run(main()) == [[1.0, 2.0], [3.0, 0.0]]


def test_trajectory_group_batches_skip_resumed_batches_and_bound_groups_in_flight():
    rewards = [0.0, 1.0, 2.0, 3.0, 4.0]
    resumed = asyncio.run(_batches([_group_after(r) for r in rewards], batch_size=2, skip_batches=1))
    assert resumed == [[2.0, 3.0], [4.0]]  # the first two groups never ran

    async def main() -> list[list[float]]:
        gates = {r: asyncio.Event() for r in rewards}
        running: list[float] = []

        async def tracked(reward: float) -> art.TrajectoryGroup:
            running.append(reward)
            return await _group_after(reward, gates[reward])

        def release_next() -> None:
            waiting = len(running) - sum(g.is_set() for g in gates.values())
            assert waiting <= 2, running  # batch_size 1 x max_concurrent_batches 2 in flight
            for gate in gates.values():
                if not gate.is_set():
                    gate.set()
                    return

        gates[0.0].set()
        return await _batches(
            [tracked(r) for r in rewards], between=release_next, batch_size=1, max_concurrent_batches=2
        )

    assert asyncio.run(main()) == [[0.0], [1.0], [2.0], [3.0], [4.0]]


def test_trajectory_group_batches_leave_out_groups_within_the_limit_and_raise_past_it():
    groups = [_group_after(0.0), _group_after(1.0, fail=True), _group_after(2.0)]
    assert asyncio.run(_batches(groups, batch_size=2, max_batch_exceptions=1)) == [[0.0, 2.0]]
    groups = [_group_after(0.0, fail=True), _group_after(1.0), _group_after(2.0, fail=True)]
    with pytest.raises(ValueError, match="group 2.0 failed"):  # ART raises the rollout's own exception
        asyncio.run(_batches(groups, batch_size=3, max_batch_exceptions=1))
    with pytest.raises(HyperParameterError, match=r"trajectory_group_batches\(batch_size=0\)"):
        asyncio.run(_batches([], batch_size=0))


def test_local_train_result_is_a_train_result_with_the_checkpoint_path():
    result = art.LocalTrainResult(
        step=2, metrics={"loss/train": 0.5}, checkpoint_path="/runs/m/checkpoints/0002"
    )
    assert isinstance(result, art.TrainResult)
    assert (result.step, result.checkpoint_path) == (2, "/runs/m/checkpoints/0002")


def test_a_prompted_model_logs_its_evaluation_under_base_path(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = art.Model(name="gpt-4.1", project="p", base_path=str(tmp_path), report_metrics=[])
    group = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=r)
            for r in (0.25, 0.75)
        ]
    )
    row = asyncio.run(model.log([group], split="val"))
    assert row["val/reward"] == 0.5 and row["step"] == 0
    assert (tmp_path / "p" / "models" / "gpt-4.1" / "history.jsonl").read_text().count("\n") == 1
    wants_wandb = art.Model(name="gpt-4.1", project="p", base_path=str(tmp_path), report_metrics=["wandb"])
    with pytest.raises(UserError, match=r"report_metrics=\['wandb'\] but WANDB_API_KEY is not set"):
        asyncio.run(wants_wandb.log([group], split="val"))
