"""Issue 13, re-checked with inputs the first tests did not try: numbers the trainer's float32
cannot hold, constructor and keyword arguments of the wrong type or range, rewards and metrics
that pydantic would coerce in silence, and ART's call forms of `model.log` and
`gather_trajectory_groups`. Each is refused in one sentence naming the argument (and group and
trajectory), or accepted with the value checked."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError

import art_mega as art
from art_mega.backend import MegatronBackend
from art_mega.errors import HyperParameterError, NonFiniteValueError, UserError
from art_mega.gather import gather_trajectory_groups
from art_mega.sft import TrainSFTConfig, create_sft_dataset_iterator, iterate_dataset, iterate_file
from art_mega.trainer.prepare.advantages import group_advantages
from art_mega.trajectories import History


def trajectory(reward: Any = 1.0, *items: Any, **fields: Any) -> art.Trajectory:
    messages = items or ({"role": "assistant", "content": "ok"},)
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, *messages], reward=reward, **fields
    )


@pytest.fixture
def backend(tiny_llama_dir) -> MegatronBackend:  # noqa: ANN001
    """A backend with the tiny model registered in name only (its tokenizer loads, nothing
    starts); `_step_with` returns what would be trained instead of training it."""
    backend = MegatronBackend()
    backend._model = art.TrainableModel(name="m", project="p", base_model="tiny")
    backend._model_dir = tiny_llama_dir

    async def step_with(steps, metrics, kind, learning_rates, loss, started, **packing):  # noqa: ANN001
        # an rl step is one document list and one rate (`_step_with` takes SFT's several)
        return {"documents": steps[0], "learning_rate": learning_rates[0], "loss": loss}

    backend._step_with = step_with  # type: ignore[method-assign]
    return backend


def train(backend: MegatronBackend, groups: Any, **options: Any) -> Any:
    return asyncio.run(backend.train(backend._model, groups, **options))


GOOD = [art.TrajectoryGroup([trajectory(1.0), trajectory(0.0)])]


# ------------------------------------------------------------- float32 range of hyper-parameters


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("learning_rate", 1e39, "above 3.403e+38, the largest float32 the trainer computes in"),
        ("learning_rate", np.float64(1e300), "above 3.403e+38"),
        ("learning_rate", 1e-45, "below 1.175e-38, which the trainer's float32 rounds towards 0"),
        ("learning_rate", 5e-324, "below 1.175e-38"),
        ("epsilon", 1e39, "above 3.403e+38"),
        ("epsilon_high", 1e39, "above 3.403e+38"),
        ("kl_beta", 1e39, "above 3.403e+38"),
        ("tis_cap", 1e39, "above 3.403e+38"),
    ],
)
def test_options_float32_cannot_hold_are_refused_at_the_edge(
    backend: MegatronBackend, name: str, value: float, why: str
) -> None:
    """learning_rate=1e39 passed the edge and crashed inside Adam ("value cannot be converted to
    type float without overflow") as a TrainerJobError; 1e-45 trained with a learning rate of 0."""
    with pytest.raises(HyperParameterError, match=rf"backend.train\({name}=") as caught:
        train(backend, GOOD, **{name: value})
    assert why in str(caught.value) and caught.value.name == name


def test_float32_bounds_themselves_and_numpy_rates_train(backend: MegatronBackend) -> None:
    job = train(backend, GOOD, learning_rate=np.float32(3e-5), kl_beta=3.4e38)
    assert job["learning_rate"] == pytest.approx(3e-5) and job["loss"]["kl_beta"] == 3.4e38
    assert type(job["learning_rate"]) is float


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: art.TrainConfig(learning_rate=1e39), "learning_rate"),
        (lambda: art.TrainConfig(beta=1e39), "beta"),
        (lambda: TrainSFTConfig(learning_rate=1e39), "learning_rate"),
    ],
)
def test_configs_refuse_values_above_float32(build: Any, field: str) -> None:
    with pytest.raises(ValidationError, match=rf"{field}[\s\S]*above 3.403e\+38"):
        build()


def test_sft_iterator_options_are_refused_when_called_not_at_the_first_batch() -> None:
    """create_sft_dataset_iterator and iterate_dataset were generators: nothing was checked until
    the first next(), after the caller had set up its run."""
    with pytest.raises(HyperParameterError, match=r"peak_lr=1e\+39\) .*above 3.403e\+38"):
        create_sft_dataset_iterator([trajectory()], peak_lr=1e39)
    with pytest.raises(HyperParameterError, match=r"assistant_turns='first'\) must be 'all' or 'last'"):
        create_sft_dataset_iterator([trajectory()], assistant_turns="first")  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"schedule_type='step' must be"):
        create_sft_dataset_iterator([trajectory()], schedule_type="step")  # type: ignore[arg-type]
    with pytest.raises(HyperParameterError, match=r"iterate_dataset\(groups_per_step=1.5\)"):
        iterate_dataset([1, 2, 3], groups_per_step=1.5)  # type: ignore[arg-type]
    with pytest.raises(HyperParameterError, match=r"iterate_file\(epochs=0\)"):
        iterate_file("/nonexistent.jsonl", epochs=0)
    chunks = list(
        create_sft_dataset_iterator([trajectory(), trajectory()], peak_lr=1e-4, schedule_type="constant")
    )
    assert [c.config.learning_rate for c in chunks] == [[1e-4]]  # ART's: one chunk of one batch of 2


def test_unscaled_rewards_whose_advantages_overflow_float32_are_refused(backend: MegatronBackend) -> None:
    """With scale_rewards=False the advantage is r - mean: 3e38 - (-1.5e38) is finite in float64
    but inf in the batch's float32 (the step would only abort inside the ranks)."""
    rewards = (3e38, -3e38, -3e38, -3e38)
    groups = [GOOD[0], art.TrajectoryGroup([trajectory(r) for r in rewards])]
    with pytest.raises(NonFiniteValueError, match=r"group 1: advantage 0 of the group is not finite"):
        train(backend, groups, scale_rewards=False)
    assert group_advantages([3e38, -3e38]).advantages == pytest.approx((1.0, -1.0))  # scaled: fine


def test_a_logprob_float32_turns_into_minus_inf_is_refused(backend: MegatronBackend) -> None:
    sampled = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "ok"},
            "logprobs": {"content": [{"token": "ok", "logprob": -1e39, "bytes": None, "top_logprobs": []}]},
        }
    )
    groups = [GOOD[0], art.TrajectoryGroup([trajectory(1.0), trajectory(0.0, sampled)])]
    with pytest.raises(NonFiniteValueError, match=r"trajectory 1 of group 1: .*logprob -1e\+39 at token 0"):
        train(backend, groups)


# ------------------------------------------------------------------ MegatronBackend's arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": True}, r"seq_len=True\) must be a whole number of at least 2 \(a bool\)"),
        ({"seq_len": "1024"}, r"seq_len='1024'\) must be a whole number .*\(a str\)"),
        ({"seq_len": 1024.0}, r"seq_len=1024.0\) must be a whole number .*\(a float\)"),
        ({"seq_len": 1}, r"seq_len=1\) must be a whole number of at least 2"),
        ({"max_model_len": -1}, r"max_model_len=-1\) must be a whole number of at least 2"),
        ({"lora_rank": 0}, r"lora_rank=0\) must be a whole number of at least 1"),
        ({"lora_rank": 8.0}, r"lora_rank=8.0\) must be a whole number .*\(a float\)"),
        ({"lora_rank": 1024}, r"lora_rank=1024\) is above 512, the largest LoRA rank vLLM serves"),
        ({"lora_alpha": math.nan}, r"lora_alpha=nan\) must be a finite number greater than 0"),
        ({"lora_alpha": "16"}, r"lora_alpha='16'\) must be a finite number .*\(a str\)"),
        ({"lora_alpha": True}, r"lora_alpha=True\) must be a finite number .*\(a bool\)"),
        ({"lora_alpha": 1e39}, r"lora_alpha=1e\+39\) .*above 3.403e\+38"),
        ({"lora_targets": "q_proj"}, r"lora_targets='q_proj'\) must be a non-empty list or tuple"),
        ({"lora_targets": []}, r"lora_targets=\[\]\) must be a non-empty list or tuple"),
        ({"lora_targets": ["qq_proj"]}, r"LoRA target 'qq_proj' is not known"),
        ({"keep_adapters": 0}, r"keep_adapters=0\) must be a whole number of at least 1"),
        ({"startup_timeout_s": math.inf}, r"startup_timeout_s=inf\) must be a finite number"),
        ({"startup_timeout_s": 0}, r"startup_timeout_s=0\) must be a finite number greater than 0"),
        ({"vllm_python": 5}, r"vllm_python=5\) must be the path of a Python interpreter"),
        ({"vllm_python": ""}, r"vllm_python=''\) must be the path of a Python interpreter"),
        ({"gpu_memory_utilization": True}, r"gpu_memory_utilization=True\) is a fraction"),
        ({"gpu_memory_utilization": "0.5"}, r"gpu_memory_utilization='0.5'\) is a fraction"),
        ({"gpu_memory_utilization": math.nan}, r"gpu_memory_utilization=nan\) is a fraction"),
        ({"runtime": "local"}, r"runtime='local'\) must be a started art_mega ArtRuntime"),
    ],
)
def test_backend_arguments_are_checked_at_construction(kwargs: dict[str, Any], message: str) -> None:
    """Each of these was stored as given: a str seq_len failed at the first pack, lora_rank=1024
    after the trainer ranks started, lora_targets='q_proj' became the targets q, _, p, r, o, j."""
    with pytest.raises(UserError, match=rf"^MegatronBackend\({message}|^{message}"):
        MegatronBackend(**kwargs)


def test_backend_arguments_of_numpy_types_are_kept_as_python_numbers() -> None:
    backend = MegatronBackend(
        lora_rank=np.int32(16),
        lora_alpha=np.float32(32),
        seq_len=np.int64(2048),
        gpu_memory_utilization=np.float32(0.5),
    )
    assert backend.lora["rank"] == 16 and type(backend.lora["rank"]) is int
    assert backend.lora["alpha"] == 32.0 and backend.seq_len == 2048 and type(backend.seq_len) is int
    assert backend.gpu_memory_utilization == 0.5 and type(backend.gpu_memory_utilization) is float
    json.dumps(backend.lora)  # the trainer config travels as JSON


# --------------------------------------------------------------------- Trajectory's fields


@pytest.mark.parametrize("reward", ["1.0", None, [1.0], b"1"])
def test_a_reward_that_is_not_a_number_is_refused(reward: Any) -> None:
    """pydantic turned "1.0" into 1.0 in silence (a judge's "8/10" failed, its "8" passed)."""
    with pytest.raises(ValidationError, match=r"reward .* is a \w+, not a number; score the rollout"):
        trajectory(reward)


def test_a_bool_reward_is_zero_or_one_as_in_art() -> None:
    assert [trajectory(r).reward for r in (True, False, np.bool_(True))] == [1.0, 0.0, 1.0]
    assert type(trajectory(np.bool_(False)).reward) is float


def test_numpy_and_negative_zero_rewards_are_taken_as_floats(backend: MegatronBackend) -> None:
    assert trajectory(np.float32(0.25)).reward == 0.25 and type(trajectory(np.int64(3)).reward) is float
    # -0.0 == 0.0: a group of them carries no signal and trains nothing
    assert train(backend, [art.TrajectoryGroup([trajectory(-0.0), trajectory(0.0)])])["documents"] == []


def test_a_numpy_nan_reward_is_refused_naming_group_and_trajectory(backend: MegatronBackend) -> None:
    groups = [GOOD[0], art.TrajectoryGroup([trajectory(1.0), trajectory(np.float32("nan"))])]
    with pytest.raises(NonFiniteValueError, match=r"trajectory 1 of group 1 has the reward nan"):
        train(backend, groups)


@pytest.mark.parametrize("value", ["yes", None, [1.0], {"a": 1}])
def test_a_metric_that_is_not_a_number_is_refused_in_one_sentence(value: Any) -> None:
    with pytest.raises(ValidationError, match=r"metric 'correct' is .* metrics are numbers") as caught:
        trajectory(1.0, metrics={"correct": value})
    assert caught.value.error_count() == 1  # was one error per member of the union
    with pytest.raises(ValidationError, match=r"metric 'size' is"):
        art.TrajectoryGroup([trajectory()], metrics={"size": "3"})


# ------------------------------------------------------------------------------ model.log


def test_model_log_takes_arts_call_forms(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """ART's order is log(trajectories, split, *, metrics, step); a list of trajectories is one group."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = art.TrainableModel(name="m", project="p", base_model="tiny")
    row = asyncio.run(model.log([trajectory(1.0), trajectory(0.0), ValueError("x")], "val"))
    assert row["val/reward"] == 0.5 and row["data/step_num_groups_submitted"] == 1.0
    assert row["val/exception_rate"] == pytest.approx(1 / 3)
    row = asyncio.run(
        model.log(split="train", metrics={"loss/policy": np.float32(0.5), "flag": True}, step=2)
    )
    assert (row["step"], row["loss/policy"], row["train/flag"]) == (2, 0.5, 1.0)
    # an overflowed ratio from backend.train is logged as is (model.log(metrics=result.metrics))
    assert asyncio.run(model.log(metrics={"loss/ratio_mean": math.inf}))["loss/ratio_mean"] == math.inf


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            {"metrics": {"loss": math.nan}},
            r"model.log\(metrics=...\) has 'loss': nan, which the history row cannot hold",
        ),
        ({"metrics": {"loss": "0.5"}}, r"has 'loss': '0.5', a str, not a number"),
        ({"metrics": [("loss", 1.0)]}, r"model.log\(metrics=\[\('loss', 1.0\)\]\) must be a dict"),
        ({"metrics": {1: 1.0}}, r"has the key 1; metric names are non-empty strings"),
        ({"step": -1}, r"model.log\(step=-1\) must be a whole number of at least 0"),
        ({"step": 1.5}, r"model.log\(step=1.5\) must be a whole number"),
        ({"split": ""}, r"model.log\(split=''\) must be a name"),
        ({"split": {"loss": 1.0}}, r"model.log\(split=\{'loss': 1.0\}\) must be a name"),
        ({"trajectories": "groups"}, r"model.log\(trajectories\) got a str"),
        ({"trajectories": [1, 2]}, r"model.log\(trajectories\) got a list of int"),
    ],
)
def test_model_log_refuses_what_the_row_cannot_hold(tmp_path, monkeypatch, call, message) -> None:  # noqa: ANN001
    """A NaN metric was left out of the row in silence, "0.5" logged as 0.5, a str split crashed
    inside history_row; nothing is written when refused."""
    monkeypatch.chdir(tmp_path)
    model = art.TrainableModel(name="m", project="p", base_model="tiny")
    with pytest.raises(HyperParameterError, match=message):
        asyncio.run(model.log(**call))
    assert not (model.output_dir / "history.jsonl").exists()


# ------------------------------------------------------------------- gather_trajectory_groups


async def ok() -> art.Trajectory:
    return trajectory(1.0)


async def fails() -> art.Trajectory:
    raise ValueError("no")


@pytest.mark.parametrize(
    ("value", "why"),
    [(-1, "negative"), (-0.5, "negative"), (math.nan, "NaN"), (True, "a bool"), ("2", "a str")],
)
def test_gather_refuses_max_exceptions_that_mean_something_else(value: Any, why: str) -> None:
    """-1 raised 'rollouts raised' when none did; True counted as 1; NaN always raised."""
    with pytest.raises(HyperParameterError, match=rf"gather_trajectory_groups\(max_exceptions=.*\({why}\)"):
        asyncio.run(gather_trajectory_groups([], max_exceptions=value))


def test_gather_takes_numpy_fractions_counts_and_no_limit() -> None:
    def groups() -> list[Any]:
        return [art.TrajectoryGroup([ok(), ok(), ok(), fails()])]

    # np.float32(0.3) is a fraction (was a count of 0.3: one failure raised)
    assert (
        len(asyncio.run(gather_trajectory_groups(groups(), pbar_desc=None, max_exceptions=np.float32(0.3))))
        == 1
    )
    assert len(asyncio.run(gather_trajectory_groups(groups(), pbar_desc=None, max_exceptions=math.inf))) == 1
    with pytest.raises(ValueError, match="^no$"):  # the rollout's own exception (ART)
        asyncio.run(gather_trajectory_groups(groups(), pbar_desc=None, max_exceptions=np.float32(0.2)))
    with pytest.raises(HyperParameterError, match=r"after_each=3\) must be a function"):
        asyncio.run(gather_trajectory_groups([], after_each=3))  # type: ignore[arg-type]


def test_a_chat_completion_message_object_is_refused_naming_its_index() -> None:
    """`messages.append(choice.message)` gave a pydantic error per member of the union; it also
    drops the sampled tokens the Choice carries."""
    sampled = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}
    )
    with pytest.raises(
        ValidationError, match=r"messages_and_choices\[1\] is a ChatCompletionMessage object"
    ) as caught:
        art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, sampled.message])
    assert caught.value.error_count() == 1
    assert isinstance(art.Trajectory(messages_and_choices=[sampled]).messages_and_choices[0], Choice)


# ---------------------------------------------------------------------------- SFT files


def sft_file(tmp_path, data: bytes) -> str:  # noqa: ANN001
    path = tmp_path / "data.jsonl"
    path.write_bytes(data)
    return str(path)


ROW = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # an int literal past Python's 4300-digit limit: AttributeError ('ValueError' has no msg)
        (
            ROW + b', "n": ' + b"9" * 5000 + b"}\n",
            r"data.jsonl:1: not a JSON row this loader reads \(Exceeds the limit",
        ),
        # RecursionError traceback
        (
            ROW + b', "n": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",
            r"data.jsonl:1: nests JSON arrays or objects too deeply",
        ),
        (b"[" + ROW + b"}]\n", r"data.jsonl:1: a row must be a JSON object with 'messages', got a list"),
        (b"", r"SFT file .*data.jsonl has no rows"),
        (
            ROW + b', "functions": [{"name": "f"}]}\n',
            r"data.jsonl:1: 'functions' \(OpenAI's legacy format\) is not read",
        ),
        (
            ROW + b"}\n" + b"\xef\xbb\xbf" + ROW + b"}\n",
            r"data.jsonl:2: not valid JSON \(Unexpected UTF-8 BOM",
        ),
    ],
)
def test_sft_files_that_do_not_load_are_named_with_file_and_line(tmp_path, data: bytes, message: str) -> None:  # noqa: ANN001
    from art_mega.errors import SFTFileError
    from art_mega.sft import read_sft_jsonl

    with pytest.raises(SFTFileError, match=message):
        read_sft_jsonl(sft_file(tmp_path, data))


def test_sft_rows_with_crlf_extra_keys_and_rl_roles_load_as_written(tmp_path) -> None:  # noqa: ANN001
    """CRLF lines and keys other than messages/tools load (ART reads only those); 'ipython', a role
    RL training takes, was refused in SFT files only."""
    from art_mega.sft import read_sft_jsonl

    ipython = (
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "ipython", "content": "42"}, '
        b'{"role": "assistant", "content": "yo"}]}'
    )
    rows = read_sft_jsonl(sft_file(tmp_path, ROW + b', "id": 7}\r\n' + ipython + b"\r\n"))
    assert [m["content"] for m in rows[0].messages_and_choices] == ["hi", "yo"]
    assert [m["role"] for m in rows[1].messages_and_choices] == ["user", "ipython", "assistant"]


# ---------------------------------------------------------------------------------- wire


def test_wire_refuses_dicts_shaped_like_its_tags_and_lossy_long_doubles() -> None:
    """{"__float__": "nan"} in metadata arrived as the float nan, {"__model__": ..., "data": ...}
    as an import error; an np.longdouble recursed until RecursionError."""
    from art_mega.rollouts import wire

    with pytest.raises(
        wire.WireError, match=r"trajectory.metadata\['x'\] is a dict with only the keys \['__float__'\]"
    ):
        changed = art.Trajectory()  # Trajectory(metadata=...) refuses the value itself
        changed.metadata["x"] = {"__float__": "nan"}
        wire.encode(changed)
    with pytest.raises(
        wire.WireError, match=r"result\[0\] is a dict with only the keys \['__model__', 'data'\]"
    ):
        wire.encode([{"__model__": "x:Y", "data": {}}])
    with pytest.raises(
        wire.WireError, match=r"result\['a'\] is the longdouble .*JSON float \(float64\) cannot hold"
    ):
        wire.encode({"a": np.longdouble(1) / 3})
    back = wire.decode(
        json.loads(json.dumps(wire.encode({"a": np.longdouble(2.5), "b": {"__float__": 1, "c": 2}})))
    )
    assert back == {"a": 2.5, "b": {"__float__": 1, "c": 2}} and type(back["a"]) is float
    nested = wire.decode(
        json.loads(json.dumps(wire.encode(art.Trajectory(metadata={"a": [{"b": math.nan}]}))))
    )
    assert math.isnan(nested.metadata["a"][0]["b"])


def test_numbers_beyond_float_range_and_history_typos_are_refused_in_one_sentence() -> None:
    """reward=10**400 raised a bare OverflowError; {"messages": [...]} as a history trained
    nothing, in silence (ART's History model requires messages_and_choices)."""
    with pytest.raises(ValidationError, match=r"reward ~10\*\*400 is too large for a float"):
        trajectory(10**400)
    with pytest.raises(ValidationError, match=r"metric 'n' is -~10\*\*400, too large for a float"):
        trajectory(1.0, metrics={"n": -(10**400)})
    with pytest.raises(
        ValidationError, match=r"additional_histories\[0\] has the keys \['messages'\]; a history is"
    ):
        trajectory(1.0, additional_histories=[{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValidationError, match=r"additional_histories\[0\] is a list; a history is"):
        trajectory(1.0, additional_histories=[[{"role": "user", "content": "x"}]])
    history = {"messages_and_choices": [{"role": "user", "content": "x"}], "tools": None}
    assert trajectory(1.0, additional_histories=[history]).additional_histories == [History(**history)]


def test_model_log_refuses_a_metric_beyond_float_range(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    model = art.TrainableModel(name="m", project="p", base_model="tiny")
    with pytest.raises(HyperParameterError, match=r"has 'n': 1000.*, an int too large for a float"):
        asyncio.run(model.log(metrics={"n": 10**400}))


# ------------------------------------------------------------------ warm-start adapters


@pytest.mark.parametrize(
    ("extra", "listed"),
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"layers_to_transform": [0]}, "layers_to_transform=[0]"),
        ({"lora_bias": True}, "lora_bias=True"),
        ({"trainable_token_indices": [5]}, "trainable_token_indices=[5]"),
        ({"layer_replication": [[0, 2]]}, "layer_replication=[[0, 2]]"),
    ],
)
def test_adapters_with_weights_or_layers_plain_lora_lacks_are_refused(
    extra: dict[str, Any], listed: str
) -> None:
    """These passed the register check: a full lm_head copy or LoRA biases would be dropped at
    load, an adapter on layer 0 only would train every layer."""
    from art_mega.errors import AdapterMismatchError
    from art_mega.trainer.peft_config import check_adapter_config

    targets = ["k_proj", "o_proj", "q_proj", "v_proj"]
    plain = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": targets, "bias": "none"}
    lora = {"rank": 8, "alpha": 16.0, "target_modules": targets}
    check_adapter_config(
        {**plain, "modules_to_save": None, "lora_bias": False}, "/a", **lora
    )  # PEFT's defaults
    with pytest.raises(
        AdapterMismatchError,
        match="^" + re.escape(f"the warm-start adapter /a has {listed}, but art-mega trains plain LoRA"),
    ):
        check_adapter_config({**plain, **extra}, "/a", **lora)


# --------------------------------------------------------------------- model config.json


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_attention_heads": "4"}, r"num_attention_heads is '4', not a whole number of at least 1"),
        ({"num_attention_heads": 0}, r"num_attention_heads is 0, not a whole number"),
        ({"num_attention_heads": 4.0}, r"num_attention_heads is 4.0, not a whole number"),
        (
            {"num_attention_heads": None},
            r"num_attention_heads is None, not a whole number",
        ),  # was a TypeError
        ({"num_hidden_layers": 0}, r"num_hidden_layers is 0, not a whole number"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3 does not divide num_attention_heads=4"),
        ({"num_key_value_heads": 8}, r"num_key_value_heads=8 does not divide num_attention_heads=4"),
        (
            {"model_type": ["llama"]},
            r"is not a model config \(an object with a model_type string\)",
        ),  # TypeError
    ],
)
def test_a_broken_config_json_is_one_sentence_at_register(tmp_path, tiny_llama_dir, changes, message) -> None:  # noqa: ANN001
    """check_model_fits (register, before any start) accepted these or raised KeyError/TypeError."""
    from art_mega.trainer.model_builder import check_model_fits

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(UserError, match=rf"config.json:? .*{message}.*; use the model's own config.json"):
        check_model_fits(tmp_path, 1, spec="TrainerSpec")
    del config["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"num_attention_heads is missing"):  # was KeyError
        check_model_fits(tmp_path, 1)
    check_model_fits(tiny_llama_dir, 2)


# --------------------------------------------------------------------- sampled choices


def sampled_choice(token_ids: list[int], logprobs: list[float], **extra: Any) -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "x"},
            "token_ids": token_ids,
            "logprobs": {
                "content": [
                    {"token": "t", "logprob": lp, "bytes": None, "top_logprobs": []} for lp in logprobs
                ]
            },
            **extra,
        }
    )


def test_a_positive_sampling_logprob_is_refused_naming_the_token(backend: MegatronBackend) -> None:
    """log_softmax is <= 0 in floating point: 5.0 came from no server, and trained a ratio of e^-5."""
    from art_mega.errors import TrainInputError

    bad = sampled_choice([5, 6], [-0.5, 5.0])
    groups = [GOOD[0], art.TrajectoryGroup([trajectory(1.0), trajectory(0.0, bad)])]
    with pytest.raises(TrainInputError, match=r"trajectory 1 of group 1: .*logprob 5.0 at token 1, above 0"):
        train(backend, groups)
    zero = sampled_choice([5, 6], [-0.0, 0.0])  # a certain token: kept, trained with its logprob
    job = train(backend, [art.TrajectoryGroup([trajectory(1.0, zero), trajectory(0.0)])])
    assert job["documents"]


def test_an_empty_prompt_token_ids_is_refused(tiny_tokenizer) -> None:  # noqa: ANN001
    """The turn trained its tokens with no context at all."""
    from art_mega.errors import TokenizationError
    from art_mega.trainer.prepare.tokenize import tokenize_history

    items = [{"role": "user", "content": "hi"}, sampled_choice([5, 6], [-0.5, -0.5], prompt_token_ids=[])]
    with pytest.raises(TokenizationError, match=r"t: messages_and_choices\[1\].prompt_token_ids is empty"):
        tokenize_history(tiny_tokenizer, items, where="t")


def test_another_packages_trajectory_group_is_named_by_its_module(backend: MegatronBackend) -> None:
    """openpipe-art's own TrajectoryGroup was 'a TrajectoryGroup, not an art.TrajectoryGroup'."""
    from art_mega.errors import TrainInputError

    foreign = type("TrajectoryGroup", (), {"__module__": "art.trajectories"})()
    with pytest.raises(
        TrainInputError, match=r"group 1 is a art.trajectories.TrajectoryGroup, not art_mega's"
    ):
        train(backend, [GOOD[0], foreign])


def test_a_learning_rate_that_disagrees_with_the_config_is_refused(backend: MegatronBackend) -> None:
    """config's learning rate replaced an explicit learning_rate=1e-5 in silence."""
    with pytest.raises(
        HyperParameterError, match=r"learning_rate=1e-05\) disagrees with config.learning_rate=2e-06"
    ):
        train(backend, GOOD, learning_rate=1e-5, config=art.TrainConfig(learning_rate=2e-6))
    assert train(backend, GOOD, config=art.TrainConfig(learning_rate=2e-6))["learning_rate"] == 2e-6
    assert (
        train(backend, GOOD, learning_rate=2e-6, config=art.TrainConfig(learning_rate=2e-6))["learning_rate"]
        == 2e-6
    )


def test_model_train_checks_keywords_against_its_config(backend: MegatronBackend) -> None:
    """model.train(config=TrainConfig(learning_rate=2e-6), learning_rate=1e-5) trained at 1e-5."""
    model = backend._model
    model._backend = backend
    config = art.TrainConfig(learning_rate=2e-6, beta=0.1)
    with pytest.raises(
        HyperParameterError, match=r"learning_rate=1e-05\) disagrees with config.learning_rate"
    ):
        asyncio.run(model.train(GOOD, config=config, learning_rate=1e-5))
    with pytest.raises(HyperParameterError, match=r"kl_beta=0.2\) disagrees with config.beta=0.1"):
        asyncio.run(model.train(GOOD, config=config, kl_beta=0.2))
    job = asyncio.run(model.train(GOOD, config=config))
    assert (job["learning_rate"], job["loss"]["kl_beta"]) == (2e-6, 0.1)


def test_an_sft_message_weight_other_than_one_is_refused(tmp_path) -> None:  # noqa: ANN001
    """OpenAI's fine-tuning format skips a message with weight 0; it was trained here in silence."""
    from art_mega.errors import SFTFileError
    from art_mega.sft import read_sft_jsonl

    row = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "weight": 0}]
    }
    with pytest.raises(
        SFTFileError, match=r"data.jsonl:1: messages\[1\] has weight=0; every assistant message"
    ):
        read_sft_jsonl(sft_file(tmp_path, (json.dumps(row) + "\n").encode()))
    row["messages"][1]["weight"] = 1
    assert (
        read_sft_jsonl(sft_file(tmp_path, (json.dumps(row) + "\n").encode()))[0].messages_and_choices[1][
            "weight"
        ]
        == 1
    )


def test_iterate_dataset_reads_a_generator_and_refuses_a_string() -> None:
    """A generator failed with "object of type 'generator' has no len()" at the first next()."""
    batches = list(iterate_dataset((i for i in range(5)), groups_per_step=2, shuffle=False))
    assert [b.items for b in batches] == [[0, 1], [2, 3], [4]]
    with pytest.raises(HyperParameterError, match=r"iterate_dataset\(dataset\) got a str; pass a list"):
        iterate_dataset("prompts.jsonl")


def test_a_lone_surrogate_in_a_content_is_refused_naming_the_message(backend: MegatronBackend) -> None:
    """The tokenizer raised 'TextEncodeInput must be Union[...]' (a TypeError traceback)."""
    from art_mega.errors import TrainInputError

    odd = trajectory(0.0, {"role": "assistant", "content": [{"type": "text", "text": "ok \udcff"}]})
    with pytest.raises(
        TrainInputError,
        match=r"trajectory 1 of group 1: messages_and_choices\[1\] has a lone UTF-16 surrogate '\\udcff' at character 3",
    ):
        train(backend, [GOOD[0], art.TrajectoryGroup([trajectory(1.0), odd])])
