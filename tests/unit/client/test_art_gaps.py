"""ART 0.5.18 names programs use that the ART table (docs/art-compatibility.md) once marked "not supported":
`art.utils.iterate_dataset` as a module, `art.types`' config and result classes, and a prompted
`art.Model`'s `register`, `get_step`, `backend()` and `safe_model_dump` (ART's meanings)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import random
import typing

import pydantic
import pytest

import art_mega as art
from art_mega.errors import UserError


def test_iterate_dataset_is_a_module_path_and_the_utils_attribute_is_the_function():
    from art_mega.utils.iterate_dataset import DatasetBatch, iterate_dataset

    module = importlib.import_module("art_mega.utils.iterate_dataset")
    assert module.iterate_dataset is iterate_dataset is art.utils.iterate_dataset is art.iterate_dataset
    assert DatasetBatch is importlib.import_module("art_mega.sft").DatasetBatch
    assert [f.name for f in dataclasses.fields(DatasetBatch)] == ["items", "step", "epoch", "epoch_step"]
    # ART's order: epoch e shuffled as random.seed(e); random.shuffle(indices)
    expected = []
    for epoch in range(2):
        order = list(range(5))
        random.Random(epoch).shuffle(order)
        expected += [order[i : i + 2] for i in range(0, 5, 2)]
    batches = list(iterate_dataset(list(range(5)), groups_per_step=2, num_epochs=2, use_tqdm=False))
    assert [b.items for b in batches] == expected
    assert [(b.step, b.epoch, b.epoch_step) for b in batches] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 1, 0),
        (4, 1, 1),
        (5, 1, 2),
    ]


def test_art_types_holds_the_same_classes_art_mega_exports():
    from art_mega import types

    assert types.TrainConfig is art.TrainConfig
    assert types.TrainSFTConfig is art.TrainSFTConfig
    assert types.TrainResult is art.TrainResult
    assert types.LocalTrainResult is art.LocalTrainResult
    assert typing.get_args(types.Verbosity) == (0, 1, 2)
    assert types.TrainConfig(learning_rate=1e-5).learning_rate == 1e-5
    with pytest.raises(ImportError, match="^art.types.ServerlessTrainResult is not supported by art-mega"):
        types.ServerlessTrainResult  # noqa: B018


def test_a_prompted_model_is_at_step_0_and_refuses_backend_before_register():
    model = art.Model(name="gpt-4.1", project="p")
    assert asyncio.run(model.get_step()) == 0
    with pytest.raises(
        UserError,
        match=r"model 'gpt-4.1' is not registered with a backend; call `await model.register\(backend\)` first",
    ):
        model.backend()
    trainable = art.TrainableModel(name="agent", project="p", base_model="tiny-llama")
    with pytest.raises(UserError, match="model 'agent' is not registered with a backend"):
        trainable.backend()


def test_a_registered_prompted_model_logs_into_the_backends_folder(tmp_path, monkeypatch):
    from art_mega.local import LocalBackend

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    backend = LocalBackend(path=str(tmp_path / "art"))
    model = art.Model(
        name="gpt-4.1",
        project="p",
        inference_base_url="http://127.0.0.1:9/v1",
        inference_api_key="k",
        report_metrics=[],
    )
    asyncio.run(model.register(backend))
    assert model.backend() is backend
    assert model.output_dir == tmp_path / "art" / "p" / "models" / "gpt-4.1"
    assert asyncio.run(model.get_step()) == 0
    group = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=r)
            for r in (0.0, 1.0)
        ]
    )
    row = asyncio.run(model.log([group], split="val"))
    assert row["val/reward"] == 0.5 and row["step"] == 0
    lines = (model.output_dir / "history.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["val/reward"] == 0.5
    assert model.openai_client().base_url.host == "127.0.0.1"  # still its own endpoint


def test_register_refuses_what_is_not_an_art_mega_backend():
    model = art.Model(name="gpt-4.1", project="p")
    with pytest.raises(UserError, match=r"model.register\(backend=dict\) needs an art-mega backend"):
        asyncio.run(model.register({}))
    with pytest.raises(UserError, match="is not registered"):
        model.backend()


class Cfg(pydantic.BaseModel):
    turns: int


def test_safe_model_dump_drops_the_config_only():
    model = art.TrainableModel[Cfg](name="agent", project="p", base_model="tiny-llama", config=Cfg(turns=3))
    assert model.model_dump()["config"] == {"turns": 3}
    safe = model.safe_model_dump()
    assert safe["config"] is None
    assert {k: v for k, v in safe.items() if k != "config"} == {
        k: v for k, v in model.model_dump().items() if k != "config"
    }
    assert safe["base_model"] == "tiny-llama" and safe["trainable"] is True
    assert art.Model(name="m", project="p").safe_model_dump(include={"name"}) == {"name": "m", "config": None}


@pytest.fixture
def litellm_types(monkeypatch):
    # LiteLLM fetches its price table over the network at import unless told to use its own copy
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return importlib.import_module("litellm.types.utils")


def test_a_litellm_choice_converts_to_the_openai_choice_a_trajectory_holds(litellm_types):
    from openai.types.chat.chat_completion import Choice

    from art_mega.utils.litellm import convert_litellm_choice_to_openai

    u = litellm_types
    call = u.ChatCompletionMessageToolCall(
        id="c1", type="function", function=u.Function(name="search", arguments='{"q": "x"}')
    )
    token = u.ChatCompletionTokenLogprob(
        token="ok", bytes=[111, 107], logprob=-0.25, top_logprobs=[u.TopLogprob(token="ok", logprob=-0.25)]
    )
    choice = convert_litellm_choice_to_openai(
        u.Choices(
            finish_reason="tool_calls",
            index=2,
            message=u.Message(role="assistant", content="ok", tool_calls=[call]),
            logprobs=u.ChoiceLogprobs(content=[token]),
        )
    )
    assert type(choice) is Choice and (choice.finish_reason, choice.index) == ("tool_calls", 2)
    assert choice.message.content == "ok"
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("c1", "search", '{"q": "x"}')
    ]
    assert [(t.token, t.bytes, t.logprob) for t in choice.logprobs.content] == [("ok", [111, 107], -0.25)]
    assert [(t.token, t.logprob) for t in choice.logprobs.content[0].top_logprobs] == [("ok", -0.25)]
    assert "provider_specific_fields" not in choice.message.model_dump()
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "find x"}, choice], reward=1.0
    )
    assert trajectory.messages()[-1]["content"] == "ok"
    plain = convert_litellm_choice_to_openai(
        u.Choices(finish_reason="stop", index=0, message=u.Message(role="assistant", content="hi"))
    )
    assert plain.message.tool_calls is None and plain.logprobs is None


def test_convert_litellm_choice_refuses_a_streamed_choice_in_one_sentence(litellm_types):
    from art_mega.errors import HyperParameterError
    from art_mega.utils.litellm import convert_litellm_choice_to_openai

    with pytest.raises(HyperParameterError, match=r"got a StreamingChoices without a message; pass one of"):
        convert_litellm_choice_to_openai(litellm_types.StreamingChoices(index=0))
    with pytest.raises(HyperParameterError, match=r"got a dict without a message"):
        convert_litellm_choice_to_openai({"message": {"role": "assistant"}})
