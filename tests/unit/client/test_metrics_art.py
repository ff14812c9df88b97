"""ART 0.5.18's logging: the metrics builder (costs, cumulative totals, throughput), track_api_cost,
the per-step trajectory files and the W&B run, through the real model.log (and wandb offline)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message import ChatCompletionMessage

import art_mega as art
from art_mega.errors import HyperParameterError, UserError
from art_mega.metrics import (
    MetricsBuilder,
    art_train_metrics,
    history_row,
    read_history,
    record_cost,
    record_latency,
    track_api_cost,
)
from art_mega.metrics_files import read_trajectory_groups, trajectory_file


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> art.Model:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return art.Model(name="judge-run", project="p", base_path=str(tmp_path))


def openai_response(prompt: int, completion: int, cached: int = 0) -> SimpleNamespace:
    usage = SimpleNamespace(
        prompt_tokens=prompt,
        completion_tokens=completion,
        prompt_tokens_details=SimpleNamespace(cached_tokens=cached),
    )
    return SimpleNamespace(usage=usage, choices=[])


def group(*rewards: float, scenario: str | None = None) -> art.TrajectoryGroup:
    metadata = {} if scenario is None else {"scenario_id": scenario}
    return art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=r) for r in rewards],
        metadata=metadata,
    )


def test_response_costs_follow_arts_pricing() -> None:
    builder = MetricsBuilder("train")
    # openai/gpt-4.1: $2 prompt, $0.5 cached prompt, $8 completion per million
    usd = builder.add_response_cost(
        "judge", openai_response(1000, 500, cached=200), provider="openai", model_name="openai/gpt-4.1"
    )
    assert usd == pytest.approx((800 * 2 + 200 * 0.5 + 500 * 8) / 1e6)
    anthropic = {"usage": {"input_tokens": 100, "output_tokens": 10, "cache_read_input_tokens": 1000}}
    usd = builder.add_response_cost(
        "judge", anthropic, provider="Anthropic", model_name="anthropic/claude-sonnet-4-6"
    )
    assert usd == pytest.approx((100 * 3 + 1000 * 0.30 + 10 * 15) / 1e6)
    # a response that states its cost (OpenRouter's usage.cost) is taken as is
    assert builder.add_response_cost("other", {"usage": {"cost": 0.25}}, provider="x", model_name="y") == 0.25
    # a price given at the call wins over the known one
    usd = builder.add_response_cost(
        "judge",
        openai_response(1_000_000, 0),
        provider="openai",
        model_name="openai/gpt-4.1",
        prompt_price_per_million=1.0,
    )
    assert usd == pytest.approx(1.0)
    builder.register_model_pricing("openai/my-judge", prompt_per_million=1.2, completion_per_million=4.8)
    usd = builder.add_response_cost(
        "judge", openai_response(10**6, 10**6), provider="openai", model_name="openai/my-judge"
    )
    assert usd == pytest.approx(6.0)
    row = builder.flush_now()
    judge = (800 * 2 + 200 * 0.5 + 500 * 8 + 100 * 3 + 1000 * 0.30 + 10 * 15) / 1e6 + 1.0 + 6.0
    assert row["costs/train/judge"] == pytest.approx(judge)
    assert row["costs/train/other"] == 0.25
    assert row["costs/train"] == pytest.approx(judge + 0.25) == row["costs/all"] == row["costs/cum/all"]
    assert builder.flush_now() == {}  # flushed: the next step starts empty


def test_unpriced_models_and_foreign_usage_are_refused_with_the_fix() -> None:
    builder = MetricsBuilder("train")
    with pytest.raises(
        HyperParameterError,
        match=r"no token pricing is known for model_name='openai/unknown-9'.*register_model_pricing",
    ):
        builder.add_response_cost(
            "judge", openai_response(1, 1), provider="openai", model_name="openai/unknown-9"
        )
    with pytest.raises(HyperParameterError, match=r"has no anthropic token usage to price"):
        builder.add_response_cost(
            "judge", openai_response(1, 1), provider="anthropic", model_name="anthropic/claude-sonnet-4-6"
        )
    with pytest.raises(
        HyperParameterError, match=r"provider='acme' has no token pricing.*register_cost_extractor"
    ):
        builder.add_response_cost(
            "judge", openai_response(1, 1), provider="acme", model_name="openai/gpt-4.1"
        )
    builder.register_cost_extractor("acme", lambda response: 0.5)
    assert builder.add_response_cost("judge", {}, provider="acme", model_name="acme/m") == 0.5


async def test_track_api_cost_lands_in_the_split_of_its_context(model: art.Model) -> None:
    @track_api_cost(source="llm_judge/correctness", provider="openai", model_name="openai/gpt-4.1")
    async def judge(prompt: int) -> SimpleNamespace:
        return openai_response(prompt, 0)

    @track_api_cost(
        source="llm_judge/sync",
        provider="openai",
        model_name="openai/gpt-4.1",
        response_getter=lambda r: r[1],
    )
    def judge_sync() -> tuple[str, SimpleNamespace]:
        return "verdict", openai_response(0, 1_000_000)

    await judge(10**6)  # no active context: nothing recorded, as in ART
    with model.metrics_builder("train").activate_context():
        await judge(10**6)
        assert judge_sync()[0] == "verdict"
    with model.metrics_builder("eval").activate_context():
        await judge(500_000)
    train = await model.log([group(1.0, 0.0)], split="train")
    assert train["costs/train/llm_judge/correctness"] == pytest.approx(2.0)
    assert train["costs/train/llm_judge/sync"] == pytest.approx(8.0)
    assert train["costs/train/llm_judge"] == train["costs/train"] == train["costs/all"] == pytest.approx(10.0)
    assert "costs/eval" not in train  # eval spend waits for the next val row
    val = await model.log([group(1.0)], split="val")
    assert val["costs/eval/llm_judge/correctness"] == pytest.approx(1.0) == val["costs/all"]
    assert val["costs/cum/all"] == pytest.approx(11.0) and val["costs/cum/eval"] == pytest.approx(1.0)


async def test_record_cost_and_latency_join_the_current_step(model: art.Model) -> None:
    assert record_cost("judge/ruler", 0.1) is False and record_latency("judge_ruler", 1.0) is False
    with model.metrics_builder("train").activate_context():
        assert record_cost("judge/ruler", 0.1) and record_cost("judge/ruler", 0.2)
        assert record_latency("judge_ruler", 1.5) and record_latency("judge_ruler", 0.5)
    row = await model.log([group(1.0, 0.0)], split="train", step=1)
    assert row["costs/train/judge/ruler"] == pytest.approx(0.3)
    assert row["time/step_judge_ruler_s"] == 2.0 and row["time/cum/judge_ruler_s"] == 2.0
    with model.metrics_builder("train").activate_context():
        record_latency("judge_ruler", 1.0)
    row = await model.log(None, split="train", metrics={"loss/train": 0.5}, step=2)
    assert row["time/step_judge_ruler_s"] == 1.0 and row["time/cum/judge_ruler_s"] == 3.0
    with (
        model.metrics_builder("train").activate_context(),
        pytest.raises(HyperParameterError, match="without '/'"),
    ):
        record_latency("judge/ruler", 1.0)


async def test_rows_have_arts_names_totals_and_throughput(model: art.Model) -> None:
    groups = [group(1.0, 0.0, scenario="a"), group(0.5, 0.5, scenario="b"), group(1.0, scenario="a")]
    row = await model.log(groups, split="train", metrics={"custom/x": 1.0, "loss/train": 0.25}, step=0)
    assert row["data/step_num_scenarios"] == row["data/step_num_groups_submitted"] == 3.0
    assert row["data/step_num_trajectories"] == 5.0 and row["data/step_num_groups_trainable"] == 1.0
    assert row["data/cum/num_trajectories"] == 5.0 and row["data/cum/num_unique_scenarios"] == 2.0
    assert row["train/reward_std_dev"] == pytest.approx(0.25)  # groups of one trajectory do not count
    assert row["train/custom/x"] == 1.0 and row["loss/train"] == 0.25  # ART prefixes unknown sections
    assert row["training_step"] == 0 and row["time/wall_clock_sec"] >= 0
    train = {"data/step_trainer_tokens": 100.0, "time/step_trainer_s": 4.0}
    first = await model.log(None, split="train", metrics=train, step=1)
    assert first["throughput/avg_trainer_tok_per_s"] == 25.0 and first["time/cum/trainer_s"] == 4.0
    second = await model.log(None, split="train", metrics={**train, "time/step_trainer_s": 1.0}, step=2)
    assert second["data/cum/trainer_tokens"] == 200.0 and second["throughput/avg_trainer_tok_per_s"] == 40.0
    val = await model.log([group(1.0, 0.0)], split="val")
    assert "data/step_num_groups_trainable" not in val and val["data/step_num_trajectories"] == 2.0
    assert (await model.log([group(1.0)], split="probe"))[
        "probe/reward"
    ] == 1.0  # ART: other splits prefix all
    # the totals survive a restart: a new Model object of the same run reads them from state.json
    again = art.Model(name=model.name, project=model.project, base_path=model.base_path)
    third = await again.log(None, split="train", metrics=train, step=3)
    assert third["data/cum/trainer_tokens"] == 300.0 and third["time/cum/trainer_s"] == 9.0
    assert json.loads((model.output_dir / "state.json").read_text())["_metrics_builder_state"]["cum_state"]
    assert [r["step"] for r in read_history(model.output_dir / "history.jsonl")] == [0, 1, 2, 0, 0, 3]
    with model.metrics_builder("train").activate_context():
        record_latency("idle", 1.0)
    assert await model.log() == {}  # nothing to log: no row, and the pending step waits (ART)
    assert (await model.log(None, split="train", metrics={}, step=4))["time/step_idle_s"] == 1.0


def test_history_row_leaves_out_what_it_cannot_compute() -> None:
    row = history_row([group(1.0)], split="val", step=0)
    assert "val/reward_std_dev" not in row  # no group of two: no spread (never a fake 0)
    assert not any(isinstance(v, float) and math.isnan(v) for v in row.values())
    assert "throughput/avg_trainer_tok_per_s" not in history_row(None, metrics={"time/step_trainer_s": 0.0})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: b.add_metric("nosection", 1.0), r"add_metric\(key='nosection'\) must be 'section/name'"),
        (lambda b: b.add_metric("time/cum/x", 1.0), r"is in a cumulative namespace"),
        (lambda b: b.add_metric("time/step_x_s", math.nan), r"time/step_x_s=nan\) must be a finite number"),
        (lambda b: b.add_metric("time/step_x_s", "1"), r"must be a finite number \(a str\)"),
        (
            lambda b: (b.add_cost("train/judge", 1.0), b.add_cost("train/judge/a", 1.0)),
            r"both a total and a part",
        ),
        (lambda b: b.add_cost("", 1.0), r"add_cost\(path=''\) must be a non-empty name"),
        (lambda b: b.for_cost_context(" "), r"cost_context=' '\) must be a non-empty name"),
        (
            lambda b: b.register_model_pricing("m", prompt_per_million=-1, completion_per_million=1),
            r"prompt_per_million=-1\) must be a finite number of at least 0",
        ),
        (lambda b: b.register_cost_extractor("p", 3), r"extractor=3\) must be a function"),
        (lambda b: b.load_state_dict({"cum_state": {"a": "x"}}), r"metrics builder state .* is not"),
    ],
)
def test_the_builder_refuses_in_one_sentence(call, message) -> None:  # noqa: ANN001
    with pytest.raises(HyperParameterError, match=message):
        call(MetricsBuilder("train"))


def test_track_api_cost_checks_its_arguments_when_decorating() -> None:
    with pytest.raises(HyperParameterError, match=r"track_api_cost\(source='/'\) must be a non-empty name"):
        track_api_cost(source="/", provider="openai", model_name="openai/gpt-4.1")
    with pytest.raises(
        HyperParameterError, match=r"completion_price_per_million=inf\) must be a finite number"
    ):
        track_api_cost(source="j", provider="openai", model_name="m", completion_price_per_million=math.inf)


async def test_model_log_refuses_old_cost_keys_and_a_broken_state_file(model: art.Model) -> None:
    with pytest.raises(HyperParameterError, match=r"'costs_prefill' uses the old 'costs_' form"):
        await model.log(metrics={"costs_prefill": 1.0})
    model.output_dir.mkdir(parents=True, exist_ok=True)
    (model.output_dir / "state.json").write_text("[1]")
    fresh = art.Model(name=model.name, project=model.project, base_path=model.base_path)
    with pytest.raises(UserError, match=r"state.json is not a JSON object; fix or delete it"):
        await fresh.log(metrics={"loss/train": 1.0})


def test_train_metrics_get_arts_names() -> None:
    rank = {
        "loss/policy": 0.5,
        "loss/kl": 0.0,
        "loss/grad_norm": 1.0,
        "data/groups": 3.0,
        "data/trained_tokens": 40.0,
        "time/prepare_s": 1.0,
        "time/train_s": 2.0,
        "time/publish_s": 0.5,
    }
    out = art_train_metrics(rank, kl_loss=False)
    assert (
        out["loss/train"] == 0.5
        and "loss/policy" not in out
        and "loss/kl_div" not in out
        and "loss/kl" not in out
    )
    assert out["data/step_num_groups_submitted"] == 3.0 and out["data/step_trainer_tokens"] == 40.0
    assert out["time/step_trainer_s"] == 3.5 and out["loss/grad_norm"] == 1.0
    assert art_train_metrics(out, kl_loss=False) == out
    assert art_train_metrics({**rank, "loss/kl": 0.02}, kl_loss=True)["loss/kl_div"] == 0.02


def choice(content: str) -> Choice:
    return Choice(
        finish_reason="stop", index=0, message=ChatCompletionMessage(role="assistant", content=content)
    )


async def test_each_log_writes_arts_trajectory_file(model: art.Model) -> None:
    import pyarrow.parquet as pq

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    played = art.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"},
            choice("four"),
        ],
        reward=1.0,
        metrics={"correct": 1.0},
        tools=[{"type": "function", "function": {"name": "f"}}],
        logs=["judged"],
    )
    groups = [
        art.TrajectoryGroup([played, ValueError("lost")], metadata={"scenario_id": 7}, logs=["g"]),
        group(0.5),
    ]
    await model.log(groups, split="train", step=3)
    path = trajectory_file(model.output_dir, "train", 3)
    assert path == model.output_dir / "trajectories" / "train" / "0003.parquet"
    table = pq.read_table(path)
    assert table.schema.names == [
        "group_index", "group_metadata", "group_metrics", "group_logs", "reward",
        "metrics", "metadata", "tools", "logs", "messages",
    ]  # fmt: skip
    rows = table.to_pylist()
    assert [r["group_index"] for r in rows] == [0, 1]  # the exception is not a row (ART)
    assert [m["trainable"] for m in rows[0]["messages"]] == [False, False, False, True]
    assert json.loads(rows[0]["messages"][1]["tool_calls"]) == [call]
    back = read_trajectory_groups(path)
    assert back[0].metadata == {"scenario_id": 7} and back[0].logs == ["g"]
    (again,) = back[0].trajectories
    assert again.messages_and_choices[3] == {"role": "assistant", "content": "four"}
    assert (again.reward, again.metrics, again.logs, again.tools) == (
        1.0,
        {"correct": 1.0},
        ["judged"],
        played.tools,
    )
    assert back[1].trajectories[0].reward == 0.5
    await model.log(split="train", metrics={"loss/train": 1.0}, step=4)
    assert not trajectory_file(model.output_dir, "train", 4).exists()  # metrics only: no file


def test_wandb_run_is_arts_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B as ART opens it (run id = model name, resume allowed, project/entity from the model),
    through the real wandb package in offline mode (no network)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline needs no account (issue 34)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    # the checkout is a git repo with a large working tree: wandb's git diff and code capture are not under test
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")

    model = art.Model(
        name="wb-run",
        project="wb-project",
        entity="my-team",
        base_path=str(tmp_path),
        run_name="shown",
        report_metrics=["wandb"],
    )
    model.update_wandb_config({"rollout": {"turns": 3}})

    async def go() -> None:
        await model.log([group(1.0, 0.0)], split="train", step=0)
        await model.log(split="train", metrics={"loss/train": 0.5}, step=1)

    asyncio.run(go())
    run = model._wandb.run
    try:
        model.update_wandb_config({"rollout": {"judge": "small"}})  # merged into the open run
        assert dict(run.config)["rollout"] == {"turns": 3, "judge": "small"}
        with pytest.raises(HyperParameterError, match=r"sets 'rollout.turns' to 4, but it is already 3"):
            model.update_wandb_config({"rollout": {"turns": 4}})
        assert (run.id, run.name, run.project) == ("wb-run", "shown", "wb-project")
        assert run.settings.resume == "allow" and run.settings.entity == "my-team"
        assert run.summary["loss/train"] == 0.5 and run.summary["train/reward"] == 0.5
        assert run.summary["training_step"] == 1
    finally:
        model._wandb.finish()
    assert list(tmp_path.glob("wandb/offline-run-*-wb-run"))


async def test_a_missing_extra_is_named(model: art.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pyarrow the trajectory file cannot be written; without wandb a W&B model cannot
    report: each refused with the extra to install, and no row is written."""
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    with pytest.raises(UserError, match=r"needs pyarrow; pip install 'art-mega\[trajectories\]'"):
        await model.log([group(1.0)], split="val")
    assert not (model.output_dir / "history.jsonl").exists()
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    with pytest.raises(UserError, match=r"wandb is not installed; pip install 'art-mega\[wandb\]'"):
        await model.log(metrics={"loss/train": 1.0})
    assert not (model.output_dir / "history.jsonl").exists()


async def test_train_rows_of_a_registered_model_get_the_step_wall_time(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """ART's LocalBackend rows: `time/step_wall_s` once per train step (the seconds since the
    previous train row), none for val rows or an unregistered model."""
    from art_mega.backend import MegatronBackend

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    model = art.TrainableModel(name="m", project="p", base_model="tiny", base_path=str(tmp_path))
    assert "time/step_wall_s" not in await model.log([group(1.0, 0.0)], split="train", step=0)
    model._backend = MegatronBackend()  # in name only: the rows need no runtime
    first = await model.log([group(1.0, 0.0)], split="train", step=0)
    assert first["time/step_wall_s"] >= 0 and first["time/cum/wall_s"] == first["time/step_wall_s"]
    again = await model.log(None, split="train", metrics={"loss/train": 1.0}, step=0)
    assert "time/step_wall_s" not in again  # the same step: timed once
    assert "time/step_wall_s" not in await model.log([group(1.0)], split="val", step=0)
    given = await model.log(None, split="train", metrics={"time/step_wall_s": 7.0}, step=1)
    assert given["time/step_wall_s"] == 7.0  # the caller's value replaces the automatic one


def test_run_state_is_arts_state_json(model: art.Model) -> None:
    assert model.read_state() is None
    model.overwrite_state({"step": 5, "data": {"offset": 100}})
    assert model.merge_state({"data": {"seen": 3}, "note": "x"}) == {
        "step": 5,
        "data": {"offset": 100, "seen": 3},
        "note": "x",
    }
    assert json.loads((model.output_dir / "state.json").read_text()) == model.read_state()
    with pytest.warns(DeprecationWarning, match="write_state"):
        model.write_state({"step": 6})
    assert model.read_state() == {"step": 6}
    with pytest.raises(
        HyperParameterError, match=r"model.merge_state\(state=...\) must be a dict of JSON values"
    ):
        model.merge_state({"when": object()})
    with pytest.raises(HyperParameterError, match=r"must be a dict of JSON values .* not a list"):
        model.overwrite_state([1])
    with pytest.raises(HyperParameterError, match=r"update_wandb_config\(config=3\) must be a dict"):
        model.update_wandb_config(3)
