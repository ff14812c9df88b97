"""ART's `InternalModelConfig.chat_template_kwargs` on the controller: accepted (JSON values),
refused with its sentence otherwise, and rendered into the conversations `backend.train` and
`backend.train_sft` tokenize (the replica half: tests/inference/test_chat_template_kwargs.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

import art_mega as art
from art_mega.backend import MegatronBackend, TrainResult
from art_mega.errors import HyperParameterError

KWARGS = {"enable_thinking": False, "system_note": "be brief"}
TEMPLATE = (
    "{% if system_note is defined %}{{ '<|im_start|>system\\n' + system_note }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ ' no think' }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chat_template_kwargs_are_read_and_kept() -> None:
    model = art.TrainableModel(
        name="m", project="p", base_model="b", _internal_config={"chat_template_kwargs": dict(KWARGS)}
    )
    assert model._internal_config == {"chat_template_kwargs": KWARGS}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"enable_thinking": object},
            "TrainableModel(_internal_config=...) sets chat_template_kwargs.enable_thinking=<class 'object'>, "
            "which is not JSON (the replicas take these as JSON); use a string, number, bool, None, list or dict",
        ),
        ({"budget": float("nan")}, "sets chat_template_kwargs.budget=nan, which is not JSON"),
        (
            ["enable_thinking"],
            "sets chat_template_kwargs=['enable_thinking']: input should be a valid dictionary",
        ),
    ],
)
def test_chat_template_kwargs_that_are_not_json_are_refused(kwargs: Any, message: str) -> None:
    with pytest.raises(HyperParameterError) as info:
        art.TrainableModel(
            name="m", project="p", base_model="b", _internal_config={"chat_template_kwargs": kwargs}
        )
    assert str(info.value).startswith("TrainableModel(_internal_config=...) ") and message in str(info.value)


@pytest.fixture
def backend(tiny_llama_dir: Path, tmp_path: Path) -> MegatronBackend:
    """The tiny llama, with TEMPLATE as its chat template, registered in name only with
    chat_template_kwargs=KWARGS; `_step_with` returns the documents it was given."""
    model_dir = tmp_path / "tiny-llama"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    backend = MegatronBackend()
    backend._model = art.TrainableModel(
        name="m", project="p", base_model="tiny", _internal_config={"chat_template_kwargs": KWARGS}
    )
    backend._model_dir = model_dir

    backend.sent = []  # type: ignore[attr-defined]

    async def step_with(steps, metrics, kind, learning_rates, loss, started, **packing):  # noqa: ANN001
        backend.sent.append(steps)  # type: ignore[attr-defined]
        return TrainResult(step=1, metrics={**metrics, "loss/train": 0.5, "time/train_s": 2.0})

    backend._step_with = step_with  # type: ignore[method-assign]
    return backend


def conversation(reward: float) -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        reward=reward,
    )


def test_train_and_train_sft_tokenize_with_the_models_chat_template_kwargs(backend: MegatronBackend) -> None:
    tokenizer = backend.tokenizer()
    expected = tokenizer.encode(
        "<|im_start|>system\nbe brief no think<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>",
        add_special_tokens=False,
    )
    groups = [art.TrajectoryGroup([conversation(1.0), conversation(0.0)])]
    asyncio.run(backend.train(backend._model, groups, allow_training_without_logprobs=True))
    asyncio.run(backend.train_sft(backend._model, [conversation(0.0)]))
    backend._model._internal_config = {}
    asyncio.run(backend.train(backend._model, groups, allow_training_without_logprobs=True))
    rl, sft, without = [[d.input_ids for d in documents] for (documents, *_) in backend.sent]  # type: ignore[attr-defined]
    assert rl == [expected, expected] and sft == [expected]
    assert without[0] != expected and without[0] == expected[-len(without[0]) :]
