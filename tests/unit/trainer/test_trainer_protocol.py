"""The trainer's messages (`art_mega.trainer.protocol`): every job and event kind survives the wire,
and a message that is not one is refused with a sentence naming the field, on each receiving side
(the rank's parse in `rank.main`, the agent's check of a rank's event lines)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from art_mega.topology import TrainerSpec, compile_topology
from art_mega.trainer.protocol import (
    RANK_EVENT,
    Accepted,
    AdapterReady,
    Done,
    EngineConfig,
    Exited,
    ExportJob,
    Failed,
    GRPOLossConfig,
    LoraConfig,
    PingJob,
    RankConfig,
    Ready,
    RLJob,
    SFTJob,
    Starting,
    TrainerEvent,
    TrainerEventsResponse,
    TrainerJobRequest,
    TrainerStartRequest,
    describe_invalid,
)
from art_mega.trainer.rank.main import InvalidMessageError, parse_job
from tests.helpers import loopback_cluster

RL = {
    "kind": "rl",
    "step": 3,
    "batch_dir": "/run/batches/0003",
    "checkpoint_dir": "/run/checkpoints/0003",
    "learning_rate": 5e-6,
}

JOBS = [
    PingJob(),
    ExportJob(step=0, checkpoint_dir="/run/checkpoints/0000"),
    SFTJob(
        step=2,
        batch_dir="/run/batches/0002",
        checkpoint_dir="/run/checkpoints/0002",
        learning_rates=[1e-4, 0.0],
    ),
    RLJob(
        step=3,
        batch_dir="/run/batches/0003",
        checkpoint_dir="/run/checkpoints/0003",
        learning_rate=5e-6,
        loss=GRPOLossConfig(
            importance_sampling_level="sequence", epsilon_high=0.28, kl_beta=0.04, tis_cap=2.0
        ),
    ),
]

EVENTS = [
    Starting(pid=4242),
    Ready(seconds=3.5),
    Accepted(job="ab12"),
    AdapterReady(job="ab12", path="/run/checkpoints/0003/adapter", step=3, sha256="f" * 64),
    Done(job="ab12", metrics={"loss/policy": -0.25, "time/checkpoint_s": 0.5}),
    Failed(job="ab12", error="RuntimeError: boom", error_type="RuntimeError", message="boom", dirty=False),
    Exited(code=-9, log_path="/run/logs/trainer-rank1.log"),
]


def rank_config(**engine: object) -> RankConfig:
    topology = compile_topology(
        loopback_cluster(1), trainer=TrainerSpec(cpu_ranks_per_host=2, master_port=29500)
    )
    assert topology.trainer is not None
    return RankConfig(
        world_size=2,
        master_addr="127.0.0.1",
        master_port=29500,
        trainer=topology.trainer,
        rank_table=topology.trainer_ranks,
        engine=EngineConfig(model_dir="/models/tiny", **engine) if engine else None,  # type: ignore[arg-type]
    )


def refusal(model: type, raw: str, what: str = "trainer job") -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(raw)
    return describe_invalid(what, info.value, model)


@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.kind)
def test_every_job_kind_round_trips_through_the_rank_parse(job):
    line = TrainerJobRequest(id="ab12", job=job).model_dump_json().encode()
    parsed = parse_job(line)
    assert isinstance(parsed, TrainerJobRequest)
    assert parsed.id == "ab12" and type(parsed.job) is type(job) and parsed.job == job


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.kind)
def test_every_event_kind_round_trips_as_the_agent_logs_it(event):
    assert RANK_EVENT.validate_json(event.model_dump_json()) == event
    reply = TrainerEventsResponse(events=(TrainerEvent(rank=1, time=1.5e9, event=event),), next=1)
    again = TrainerEventsResponse.model_validate_json(reply.model_dump_json())
    assert again == reply and type(again.events[0].event) is type(event)


def test_a_misspelled_job_field_is_named_by_the_rank_parse():
    job = {k: v for k, v in RL.items() if k != "learning_rate"} | {"learnig_rate": 5e-6}
    line = json.dumps({"id": "ab12", "job": job}).encode()
    refused = parse_job(line)
    assert isinstance(refused, InvalidMessageError)
    assert str(refused) == (
        "trainer job: job.learnig_rate=5e-06 is not a known field; did you mean learning_rate?"
    )


def test_an_unknown_job_kind_and_bad_values_are_named():
    assert str(parse_job(b'{"id": "ab12", "job": {"kind": "dance"}}')) == (
        "trainer job: unknown job kind 'dance'; use one of 'ping', 'export', 'sft', 'rl'."
    )
    for step, shown in (('"3"', "'3'"), ("true", "True"), ("-1", "-1")):
        raw = json.dumps({"id": "a", "job": {**RL, "step": 0}}).replace('"step": 0', f'"step": {step}')
        assert refusal(TrainerJobRequest, raw).startswith(f"trainer job: job.step={shown} is invalid: ")
    for rate in ("0", "-1e-5", '"NaN"'):
        raw = json.dumps({"id": "a", "job": {**RL, "learning_rate": 1}}).replace(
            '"learning_rate": 1', f'"learning_rate": {rate}'
        )
        assert "job.learning_rate=" in refusal(TrainerJobRequest, raw)
    raw = json.dumps({"id": "a", "job": {**RL, "loss": {"kl_beta": -0.1}}})
    assert refusal(TrainerJobRequest, raw) == (
        "trainer job: job.loss.kl_beta=-0.1 is invalid: Input should be greater than or equal to 0."
    )
    assert refusal(TrainerJobRequest, '{"job": {"kind": "ping"}}') == "trainer job: id is required; set it."


def test_an_event_of_an_unknown_kind_or_with_an_unknown_field_is_refused():
    with pytest.raises(ValidationError) as info:
        RANK_EVENT.validate_json('{"kind": "progress", "fraction": 0.5}')
    assert describe_invalid("trainer rank 0's event", info.value) == (
        "trainer rank 0's event: unknown kind 'progress'; use one of 'starting', 'ready', "
        "'accepted', 'adapter_ready', 'done', 'failed', 'exited'."
    )
    with pytest.raises(ValidationError) as info:
        RANK_EVENT.validate_json('{"kind": "done", "job": "ab12", "metrcs": {}}')
    assert (
        describe_invalid("event", info.value)
        == "event: metrcs={} is not a known field; did you mean metrics?"
    )
    with pytest.raises(ValidationError):
        RANK_EVENT.validate_json('{"kind": "done", "job": "ab12", "metrics": {"loss/policy": "low"}}')


def test_the_launch_config_round_trips_and_refuses_what_a_rank_cannot_start_with():
    config = rank_config(lora=LoraConfig(rank=4, alpha=8.0), resume_dir="/run/checkpoints/0001")
    start = TrainerStartRequest(ranks=(), config=config)
    assert TrainerStartRequest.model_validate_json(start.model_dump_json()) == start
    assert rank_config().engine is None  # a ping-only trainer

    raw = json.loads(config.model_dump_json())
    raw["engine"]["micro_batch_row"] = raw["engine"].pop("micro_batch_rows")
    assert refusal(RankConfig, json.dumps(raw), "trainer rank config") == (
        "trainer rank config: engine.micro_batch_row=1 is not a known field; did you mean micro_batch_rows?"
    )
    raw = json.loads(config.model_dump_json())
    raw["engine"]["lora"]["rank"] = 0
    assert refusal(RankConfig, json.dumps(raw), "config") == (
        "config: engine.lora.rank=0 is invalid: Input should be greater than or equal to 1."
    )
    raw = json.loads(config.model_dump_json())
    raw["engine"]["warm_start"] = "/adapters/sft"
    assert refusal(RankConfig, json.dumps(raw), "config") == (
        "config: engine: resume_dir='/run/checkpoints/0001' and warm_start='/adapters/sft' are both set; "
        "a rank resumes a checkpoint or warm-starts an adapter, so set one of them"
    )
    launch = {"rank": 2, "env": {}, "log_path": "/run/logs/trainer-rank2.log"}
    raw = {"ranks": [launch], "config": json.loads(config.model_dump_json())}
    assert refusal(TrainerStartRequest, json.dumps(raw), "trainer start") == (
        "trainer start: ranks [2] must be distinct ranks of the world of 2 (0..1)"
    )
    raw = json.loads(config.model_dump_json())
    raw["rank_table"] = raw["rank_table"][:1]
    assert "rank_table holds ranks [0]; it must list ranks 0..1" in refusal(
        RankConfig, json.dumps(raw), "config"
    )


def test_a_batch_file_a_rank_reads_is_held_to_the_trainbatch_fields_and_dtypes(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    from art_mega.trainer.batch import Document, TrainBatch, pack

    (batch,) = pack([Document([1, 5, 6, 2], [0, 0, 1, 1], [0, 0, -1.5, -2.0], 1.0, 0.5)], 8, 1)
    batch.save(tmp_path / "dp0.safetensors")
    back = TrainBatch.load(tmp_path / "dp0.safetensors")
    assert np.array_equal(back.old_logprobs, batch.old_logprobs) and back.input_ids.dtype == np.int64

    tensors = {name: np.ascontiguousarray(value) for name, value in vars(batch).items()}
    save_file(
        {("loss_msk" if k == "loss_mask" else k): v for k, v in tensors.items()}, str(tmp_path / "renamed")
    )
    with pytest.raises(
        ValueError, match=r"it lacks \['loss_mask'\] and holds unknown tensors \['loss_msk'\]"
    ):
        TrainBatch.load(tmp_path / "renamed")
    save_file({**tensors, "weights": tensors["weights"].astype(np.float64)}, str(tmp_path / "wide"))
    with pytest.raises(ValueError, match="weights is float64, a TrainBatch's is float32"):
        TrainBatch.load(tmp_path / "wide")


def test_the_agent_turns_a_rank_line_that_is_no_rank_event_into_a_failed_naming_it():
    from art_mega.trainer.routes import _rank_event

    done = Done(job="ab12", metrics={"sum": 3.0})
    assert _rank_event(1, done.model_dump_json().encode()) == done
    for line, message in (
        (b"not json\n", "trainer rank 1's event b'not json\\n' is invalid: Invalid JSON: "),
        (
            b'{"kind": "done", "job": "ab12", "rank": 0}',
            "trainer rank 1's event: rank=0 is not a known field; ",
        ),
        (
            Exited(code=0, log_path="x").model_dump_json().encode(),
            "trainer rank 1's event: kind 'exited' is ",
        ),
    ):
        failed = _rank_event(1, line)
        assert isinstance(failed, Failed) and failed.error_type == "InvalidEvent" and failed.dirty
        assert failed.message.startswith(message), failed.message


def test_an_sft_step_may_take_the_zero_rate_a_decaying_schedule_ends_on():
    assert SFTJob(step=4, batch_dir="b", checkpoint_dir="c", learning_rates=[0.0]).learning_rates == [0.0]
    with pytest.raises(ValidationError):
        SFTJob(step=4, batch_dir="b", checkpoint_dir="c", learning_rates=[1e-4, -1e-5])
    with pytest.raises(ValidationError):
        SFTJob(step=4, batch_dir="b", checkpoint_dir="c", learning_rates=[])  # no batch
    with pytest.raises(ValidationError):
        RLJob(step=4, batch_dir="b", checkpoint_dir="c", learning_rate=0.0)  # GRPO rates are > 0
