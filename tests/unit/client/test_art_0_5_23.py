"""ART 0.5.23's additions (issue 30, points 6-8): the capture API (`art.trajectory`,
`art.trajectory_group`, `art.current_trajectory`, `art.no_capture`) records what
`capture_auto_trajectory` records, plus `Trajectory.exchanges` and its history views;
`TrainableModel(lora_config=...)`; `InternalModelConfig`'s 0.5.23 fields;
`art.utils.strip_logprobs`, `art.get_tokenizer`, `art.LocalServingUnavailableError`;
`model.log(trajectories=..., split=...)`; and every name art-mega does not provide raising the
ART table's sentence (docs/art-compatibility.md) through its module's `__getattr__`."""

from __future__ import annotations

import asyncio
import importlib
import logging

import pytest
from openai.types.chat.chat_completion import Choice

import art_mega as art
from art_mega.errors import HyperParameterError, NoReplicaUpError, UnsupportedNameError, UserError
from art_mega.unsupported import NOT_PROVIDED
from tests.unit.client.test_auto_trajectory import _agent, _model, endpoint  # noqa: F401 (a fixture)

# ------------------------------------------------------------------ capture API


def test_art_trajectory_records_what_capture_auto_trajectory_records(endpoint):  # noqa: F811
    model = _model(endpoint)

    async def main() -> tuple[art.Trajectory, art.Trajectory]:
        return (
            await art.trajectory(_agent(model, 0.5)),
            await art.capture_auto_trajectory(_agent(model, 0.5)),
        )

    new, old = asyncio.run(main())
    assert new.model_dump(exclude={"metrics"}) == old.model_dump(exclude={"metrics"})  # same turns, histories
    assert set(new.metrics) == set(old.metrics) == {"duration"}
    assert [type(i).__name__ for i in new.messages_and_choices] == ["dict", "Choice", "dict", "Choice"]
    exchanges = new.exchanges.chat_completions
    assert [len(e.request["messages"]) for e in exchanges] == [1, 3, 1]
    assert [e.response.choices[0].message.content for e in exchanges] == ["heard 1", "heard 3", "heard 1"]
    assert all(isinstance(e.response.choices[0], Choice) for e in exchanges)
    assert {e.request["model"] for e in exchanges} == {"echo"}
    main_history = new.history()
    assert main_history.messages_and_choices == new.messages_and_choices
    assert new.chat_completions_history(model="echo") == main_history
    assert new.histories() == [main_history, *new.additional_histories]
    assert new.chat_completions_histories() == new.histories()
    with pytest.raises(
        HyperParameterError, match=r"history\(model='other'\) names no captured request's model"
    ):
        new.history(model="other")
    with pytest.raises(TypeError, match="takes a raw coroutine"):
        asyncio.run(_task_to_trajectory())


async def _task_to_trajectory() -> art.Trajectory:
    async def nothing() -> None:
        return None

    return await art.trajectory(asyncio.ensure_future(nothing()))


def test_current_trajectory_and_no_capture(endpoint):  # noqa: F811
    model = _model(endpoint)
    assert art.current_trajectory() is None
    with pytest.raises(RuntimeError, match="must run inside art.capture_auto_trajectory"):
        art.current_trajectory(require=True)

    async def rollout() -> None:
        client = model.openai_client()
        art.current_trajectory(require=True).reward = 0.75
        await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "kept"}])
        with art.no_capture():
            assert art.current_trajectory() is None
            await client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "hidden"}]
            )

    captured = asyncio.run(art.trajectory(rollout()))
    assert captured.reward == 0.75
    assert captured.messages() == [
        {"role": "user", "content": "kept"},
        {"role": "assistant", "content": "heard 1"},
    ]
    assert captured.additional_histories == [] and len(captured.exchanges.chat_completions) == 1


def test_trajectory_group_awaits_in_input_order_and_keeps_or_raises_exceptions(endpoint):  # noqa: F811
    model = _model(endpoint)

    async def fails() -> art.Trajectory:
        raise ValueError("rollout broke")

    async def main(return_exceptions: bool) -> art.TrajectoryGroup:
        ready = art.Trajectory(messages_and_choices=[{"role": "user", "content": "given"}], reward=0.25)
        return await art.trajectory_group(
            [art.trajectory(_agent(model, 1.0)), ready, fails()],
            metadata={"scenario": "s1"},
            return_exceptions=return_exceptions,
        )

    group = asyncio.run(main(True))
    assert [t.reward for t in group.trajectories] == [1.0, 0.25]
    assert [(e.type, e.message) for e in group.exceptions] == [("<class 'ValueError'>", "rollout broke")]
    assert group.metadata == {"scenario": "s1"}
    with pytest.raises(ValueError, match="rollout broke"):
        asyncio.run(main(False))


# ------------------------------------------------------------------ lora_config, InternalModelConfig


def test_lora_config_is_the_lora_setting_and_none_means_the_defaults(caplog):
    from art_mega.dev.lora import lora_settings

    assert art.LoRAConfig is art.dev.LoRAConfig
    assert art.TrainableModel(name="m", project="p", base_model="b", lora_config=None).lora_config is None
    config = art.dev.LoRAConfig(rank=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj"], dropout=0.0)
    model = art.TrainableModel(name="m", project="p", base_model="b", lora_config=config)
    assert model.lora_config == config
    with caplog.at_level(logging.INFO, logger="art_mega.dev.lora"):
        settings = lora_settings({**config, "random_state": 3407, "use_gradient_checkpointing": "unsloth"})
    assert settings == {"lora_rank": 16, "lora_alpha": 32, "lora_targets": ("q_proj", "k_proj", "v_proj")}
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "TrainableModel(lora_config=...) sets random_state=3407",
        "TrainableModel(lora_config=...) sets use_gradient_checkpointing='unsloth'",
    ]
    assert lora_settings({"bias": "none", "use_rslora": False, "modules_to_save": None}) == {}


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"dropout": 0.05},
            "TrainableModel(lora_config=...) sets dropout=0.05, which art-mega's LoRA cannot train (plain "
            "LoRA on every layer of the target modules); remove it or set dropout=0.0",
        ),
        (
            {"use_rslora": True},
            "TrainableModel(lora_config=...) sets use_rslora=True, which art-mega's LoRA cannot train (plain "
            "LoRA on every layer of the target modules); remove it or set use_rslora=False",
        ),
        ({"r": 8}, "TrainableModel(lora_config=...) has the key 'r', which ART's LoRAConfig does not have"),
    ],
)
def test_lora_config_values_art_mega_cannot_train_are_refused(config, message):
    with pytest.raises(HyperParameterError) as caught:
        art.TrainableModel(name="m", project="p", base_model="b", lora_config=config)
    assert str(caught.value).startswith(message)


def test_the_backend_takes_the_models_lora_config_and_refuses_a_disagreeing_one(tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(
        name="m", project="p", base_model="b", lora_config={"rank": 16, "alpha": 32, "target_modules": None}
    )
    backend._apply_lora_config(
        art.TrainableModel(name="m", project="p", base_model="b", lora_config={"rank": 16, "alpha": 32})
    )
    assert backend.lora == {"rank": 16, "alpha": 32.0, "targets": []}
    explicit = art.LocalBackend(path=str(tmp_path), lora_rank=4)
    with pytest.raises(
        HyperParameterError,
        match=r"sets rank=16, but the backend was made with lora_rank=4; set the LoRA once",
    ):
        explicit._apply_lora_config(model)
    with pytest.raises(UserError, match="LoRA targets"):
        backend._apply_lora_config(
            art.TrainableModel(
                name="m", project="p", base_model="b", lora_config={"target_modules": ["q_proj"]}
            )
        )


def test_internal_config_takes_arts_0_5_23_fields_at_what_art_mega_does():
    config = art.dev.InternalModelConfig(
        rollout_weight_update_mode="step_lora",
        rollout_weights_mode="lora",  # 0.5.18's name keeps working
        vllm_runtime={"mode": "managed"},
        megatron_model_initialization="pretrained",
    )
    assert (
        art.TrainableModel(name="m", project="p", base_model="b", _internal_config=config)._internal_config
        == config
    )
    for field, value, fix in [
        (
            "rollout_weight_update_mode",
            "in_flight_lora",
            "art-mega's replicas load one adapter per policy step",
        ),
        ("megatron_model_initialization", "random", "on the pretrained weights"),
    ]:
        with pytest.raises(HyperParameterError) as caught:
            art.TrainableModel(name="m", project="p", base_model="b", _internal_config={field: value})
        assert str(caught.value).startswith(f"TrainableModel(_internal_config=...) sets {field}={value!r}, ")
        assert fix in str(caught.value)
    with pytest.raises(HyperParameterError, match=r"sets vllm_runtime.mode='external'"):
        art.TrainableModel(
            name="m", project="p", base_model="b", _internal_config={"vllm_runtime": {"mode": "external"}}
        )


# ------------------------------------------------------------------ small names


def test_strip_logprobs_drops_logprobs_keys_and_attributes_of_a_copy():
    from art_mega.utils.strip_logprobs import strip_logprobs

    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": {"content": [{"token": "hi", "logprob": -0.5, "bytes": None, "top_logprobs": []}]},
        }
    )
    data = {"a": [{"logprobs": [1.0], "keep": (1, {"logprobs": 2})}], "choice": choice}
    stripped = strip_logprobs(data)
    assert stripped["a"] == [{"keep": (1, {})}]
    assert stripped["choice"].logprobs is None and stripped["choice"].message.content == "hi"
    assert choice.logprobs is not None and data["a"][0]["logprobs"] == [1.0]  # the input is untouched
    assert art.utils.strip_logprobs is strip_logprobs


def test_get_tokenizer_loads_a_base_models_tokenizer(tiny_llama_dir, tiny_tokenizer):
    tokenizer = art.get_tokenizer(str(tiny_llama_dir))
    assert tokenizer("hello world")["input_ids"] == tiny_tokenizer("hello world")["input_ids"]
    assert len(tokenizer) == len(tiny_tokenizer)


def test_local_serving_unavailable_is_what_no_replica_up_is():
    assert issubclass(NoReplicaUpError, art.LocalServingUnavailableError)
    assert issubclass(art.LocalServingUnavailableError, RuntimeError)
    with pytest.raises(art.LocalServingUnavailableError, match="no replica of m@1 is up"):
        raise NoReplicaUpError("m@1", "vllm-0 (http://127.0.0.1:1): exited 1")


def test_model_log_takes_arts_parameter_names(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = art.Model(name="gpt", project="p", base_path=str(tmp_path), report_metrics=[])
    group = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=r)
            for r in (0.0, 1.0)
        ]
    )
    row = asyncio.run(model.log(trajectories=[group], split="val"))
    assert row["val/reward"] == 0.5
    with pytest.raises(HyperParameterError, match=r"^model.log\(trajectories\) got "):
        asyncio.run(model.log(trajectories="groups"))


# ------------------------------------------------------------------ names art-mega does not provide


@pytest.mark.parametrize(
    "module,name", [(module, name) for module, names in NOT_PROVIDED.items() for name in names]
)
def test_a_name_art_mega_does_not_provide_raises_its_sentence(module, name):
    owner = importlib.import_module(module)
    art_name = "art" + module.removeprefix("art_mega")
    sentence = f"{art_name}.{name} is not supported by art-mega: {NOT_PROVIDED[module][name]}"
    with pytest.raises(UnsupportedNameError) as caught:
        getattr(owner, name)
    assert str(caught.value) == sentence
    with pytest.raises(ImportError) as imported:  # `from art_mega.dev import TinkerArgs` keeps it
        exec(f"from {module} import {name}", {})
    assert str(imported.value) == sentence


def test_other_missing_names_are_plain_attribute_errors():
    assert not hasattr(art, "no_such_name") and not hasattr(art.dev, "no_such_name")
    with pytest.raises(AttributeError, match="module 'art_mega.utils' has no attribute 'nope'"):
        art.utils.nope  # noqa: B018


def test_train_sft_log_metrics_false_writes_no_history_row(tmp_path, monkeypatch):
    from art_mega.backend import TrainResult

    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    class Backend:
        async def train_sft(self, model, trajectories, config, _config, verbose, **kwargs):  # noqa: ANN001, ANN202
            return TrainResult(step=1, metrics={"loss/train": 0.5})

        async def get_step(self, model):  # noqa: ANN001, ANN202
            return 1

    def run(log_metrics: bool) -> None:
        model = art.TrainableModel(
            name="m", project="p", base_model="b", base_path=str(tmp_path), report_metrics=[]
        )
        model._backend = Backend()
        asyncio.run(model.train_sft([], log_metrics=log_metrics))

    history = tmp_path / "p" / "models" / "m" / "history.jsonl"
    run(False)
    assert not history.exists()
    run(True)
    assert history.read_text().count("\n") == 1
    with pytest.raises(HyperParameterError, match=r"train_sft\(log_metrics='no'\) must be True or False"):
        run("no")
