"""SFT with ART's semantics (openpipe-art 0.5.18, `art/utils/sft.py`, `art/local/backend.py`,
`art/unsloth/train.py`): schedules, chunking, file order, batches per call, token weights, and what
is refused. Expected orders and rates were produced by ART's own functions on the same inputs."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
import torch

import art_mega as art
from art_mega.backend import MegatronBackend, TrainResult
from art_mega.errors import HyperParameterError, SFTFileError
from art_mega.sft import (
    TrainSFTConfig,
    create_lr_schedule,
    create_sft_dataset_iterator,
    get_file_row_count,
    iterate_dataset,
    iterate_file,
    train_sft_from_file,
)
from art_mega.trainer.batch import pack
from art_mega.trainer.prepare.tokenize import Document, sft_documents
from art_mega.trainer.rank.loss import sft_loss


def row(answer: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}


def write(tmp_path, answers: list[str]):  # noqa: ANN001, ANN201
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(row(a)) for a in answers) + "\n")
    return path


def answers(trajectories: Any) -> list[str]:
    return [t.messages_and_choices[-1]["content"] for t in trajectories]


class Recorder:
    """A model whose train_sft records ART's call (trajectories, config, _config, verbose)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[Any], TrainSFTConfig, Any, bool]] = []

    async def train_sft(self, trajectories, config, _config=None, verbose=False, log_metrics=True):  # noqa: ANN001, ANN201
        assert log_metrics is True  # ART 0.5.23's default, passed on
        self.calls.append((list(trajectories), config, _config, verbose))
        return "result"


# ------------------------------------------------------------------------------ schedules


def test_the_cosine_schedule_with_warmup_is_arts() -> None:
    # ART: create_lr_schedule(10, 1.0, "cosine", warmup_steps=2)
    expected = [0.5, 1.0, 1.0, 0.9504844339512095, 0.8117449009293668, 0.6112604669781572]
    expected += [0.38873953302184283, 0.18825509907063326, 0.04951556604879048, 0.0]
    assert create_lr_schedule(10, 1.0, "cosine", warmup_steps=2) == pytest.approx(expected)
    assert create_lr_schedule(0, 1.0) == []
    # warmup starts from min_lr, as ART's
    assert create_lr_schedule(3, 1.0, "constant", warmup_steps=2, min_lr=0.5) == [0.75, 1.0, 1.0]


# ------------------------------------------------------------------------------ chunks


def test_chunks_are_arts_and_resume_starts_at_the_batch() -> None:
    chunks = list(
        create_sft_dataset_iterator(
            list(range(7)),
            chunk_size=2,
            epochs=2,
            batch_size=2,
            peak_lr=1.0,
            warmup_ratio=0.25,
            show_progress=False,
        )
    )
    # ART's output on the same arguments (seed 42 + epoch)
    assert [(c.trajectories, c.step, c.epoch, c.epoch_step) for c in chunks] == [
        ([1, 3, 4, 2], 0, 0, 0),
        ([6, 0, 5], 2, 0, 2),
        ([5, 6, 4, 3], 4, 1, 0),
        ([1, 2, 0], 6, 1, 2),
    ]
    assert [c.config.learning_rate for c in chunks] == [
        pytest.approx(r) for r in ([0.5, 1.0], [1.0, 0.8], [0.6, 0.4], [0.2, 0.0])
    ]
    assert all(c.config.batch_size == 2 for c in chunks)
    # resuming at batch 3 (inside the second chunk) trains batch 3 first, not batch 2 again
    resumed = list(
        create_sft_dataset_iterator(
            list(range(7)),
            chunk_size=2,
            epochs=2,
            batch_size=2,
            peak_lr=1.0,
            warmup_ratio=0.25,
            initial_step=3,
            show_progress=False,
        )
    )
    assert [(c.trajectories, c.step, c.epoch_step) for c in resumed][:2] == [
        ([5], 3, 3),
        ([5, 6, 4, 3], 4, 0),
    ]
    assert resumed[0].config.learning_rate == pytest.approx([0.8])


def test_arts_defaults_make_one_chunk_of_batches_of_two() -> None:
    (chunk,) = create_sft_dataset_iterator(list(range(5)), show_progress=False)
    # 3 batches of 2, warmup int(3 * 0.1) = 0, linear from 2e-4
    assert len(chunk.trajectories) == 5 and chunk.config.batch_size == 2
    assert chunk.config.learning_rate == pytest.approx([2e-4, 1e-4, 0.0])


# ------------------------------------------------------------------------------ file order


def test_iterate_file_yields_arts_buffer_shuffled_order(tmp_path) -> None:  # noqa: ANN001
    path = write(tmp_path, [f"a{i}" for i in range(6)])
    order = [int(a[1:]) for a in answers(iterate_file(path, epochs=2, shuffle_buffer_size=3))]
    assert order == [2, 0, 1, 5, 3, 4, 0, 2, 4, 1, 3, 5]  # ART's iterate_file
    assert [int(a[1:]) for a in answers(iterate_file(path))] == [3, 1, 2, 4, 0, 5]
    skipped = answers(iterate_file(path, epochs=2, shuffle_buffer_size=3, initial_skip=4))
    assert [int(a[1:]) for a in skipped] == [3, 4, 0, 2, 4, 1, 3, 5]
    assert answers(iterate_file(path, shuffle_buffer_size=1)) == [f"a{i}" for i in range(6)]
    path.write_text(path.read_text() + "\n  \n")  # blank lines are not rows
    assert get_file_row_count(path) == 6
    with pytest.raises(SFTFileError, match="cannot be read"):
        get_file_row_count(tmp_path / "missing.jsonl")


def test_iterate_dataset_shuffles_as_art_and_takes_use_tqdm() -> None:
    batches = list(iterate_dataset(list(range(5)), 2, 2, 0, False))
    assert [b.items for b in batches] == [[2, 1], [0, 4], [3], [2, 3], [4, 0], [1]]  # ART's order
    assert [(b.step, b.epoch, b.epoch_step) for b in batches][2:4] == [(2, 0, 2), (3, 1, 0)]
    assert len(list(iterate_dataset(list(range(5)), 2, use_tqdm=True))) == 3
    with pytest.raises(HyperParameterError, match=r"iterate_dataset\(use_tqdm='no'\) must be True or False"):
        iterate_dataset([1], use_tqdm="no")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ train_sft_from_file


def test_train_sft_from_file_is_one_train_sft_call_as_art(tmp_path) -> None:  # noqa: ANN001
    path = write(tmp_path, [f"a{i}" for i in range(5)])
    model = Recorder()
    assert asyncio.run(train_sft_from_file(model, path, epochs=2)) == "result"
    ((trajectories, config, dev, verbose),) = model.calls
    # ART: 10 trajectories in 5 batches of 2 (one spans the epochs), linear from 2e-4, no warmup
    assert answers(trajectories) == ["a3", "a1", "a2", "a4", "a0", "a1", "a4", "a3", "a2", "a0"]
    assert config.learning_rate == pytest.approx([2e-4, 1.5e-4, 1e-4, 5e-5, 0.0])
    assert (config.batch_size, config.assistant_turns, dev, verbose) == (2, "all", None, False)

    model = Recorder()
    asyncio.run(train_sft_from_file(model, path, epochs=2, initial_step=1, final_step=3))
    ((trajectories, config, _, _),) = model.calls
    assert answers(trajectories) == ["a2", "a4", "a0", "a1"]
    assert config.learning_rate == pytest.approx([1.5e-4, 1e-4])

    model = Recorder()
    asyncio.run(
        train_sft_from_file(
            model,
            path,
            epochs=2,
            batch_size=3,
            shuffle_buffer_size=2,
            schedule_type="cosine",
            warmup_ratio=0.5,
            assistant_turns="last",
        )
    )
    ((trajectories, config, _, _),) = model.calls
    assert answers(trajectories) == ["a0", "a1", "a3", "a2", "a4", "a0", "a2", "a1", "a4", "a3"]
    assert config.learning_rate == pytest.approx([1e-4, 2e-4, 2e-4, 0.0])
    assert config.assistant_turns == "last"

    model = Recorder()  # past the last batch: nothing left to train, as ART
    assert asyncio.run(train_sft_from_file(model, path, initial_step=3)) is None and not model.calls
    model = Recorder()  # final_step past the end is the end
    asyncio.run(train_sft_from_file(model, path, final_step=99))
    assert len(model.calls[0][1].learning_rate) == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"epochs": 0}, r"train_sft_from_file\(epochs=0\) must be a whole number of at least 1"),
        ({"batch_size": 2.0}, r"train_sft_from_file\(batch_size=2.0\) must be a whole number"),
        ({"peak_lr": 0}, r"train_sft_from_file\(peak_lr=0\) must be a finite number greater than 0"),
        ({"warmup_ratio": 1.5}, r"train_sft_from_file\(warmup_ratio=1.5\) must be a number from 0 to 1"),
        (
            {"initial_step": -1},
            r"train_sft_from_file\(initial_step=-1\) must be a whole number of at least 0",
        ),
        ({"initial_step": 2, "final_step": 2}, r"\(final_step=2\) must be a whole number of at least 3"),
        ({"shuffle_buffer_size": 0}, r"\(shuffle_buffer_size=0\) must be a whole number of at least 1"),
        ({"verbose": "yes"}, r"train_sft_from_file\(verbose='yes'\) must be True or False"),
        ({"assistant_turns": "first"}, r"\(assistant_turns='first'\) must be 'all' or 'last'"),
    ],
)
def test_train_sft_from_file_refuses_bad_options_before_reading(tmp_path, options, message) -> None:  # noqa: ANN001
    model = Recorder()
    with pytest.raises(HyperParameterError, match=message):
        asyncio.run(train_sft_from_file(model, tmp_path / "missing.jsonl", **options))
    assert not model.calls
    with pytest.raises(SFTFileError, match="does not exist"):
        asyncio.run(train_sft_from_file(model, tmp_path / "missing.jsonl"))


def test_iterator_options_are_refused_when_called() -> None:
    with pytest.raises(HyperParameterError, match=r"create_sft_dataset_iterator\(chunk_size=0\)"):
        create_sft_dataset_iterator([1], chunk_size=0)
    with pytest.raises(HyperParameterError, match=r"create_sft_dataset_iterator\(show_progress=1\)"):
        create_sft_dataset_iterator([1], show_progress=1)  # type: ignore[arg-type]
    with pytest.raises(
        HyperParameterError, match=r"create_sft_dataset_iterator\(trajectories\) got an empty"
    ):
        create_sft_dataset_iterator([])
    with pytest.raises(HyperParameterError, match=r"iterate_file\(shuffle_buffer_size=0\)"):
        iterate_file("/nonexistent.jsonl", shuffle_buffer_size=0)


# ------------------------------------------------------------------------------ TrainSFTConfig


def test_train_sft_config_is_arts() -> None:
    config = TrainSFTConfig()
    assert (config.learning_rate, config.batch_size) == (5e-5, "auto")
    assert config.resolved_batch_size() == 2 and config.batch_count(5) == 3  # ART's "auto" = 2
    assert config.learning_rates(3) == [5e-5] * 3
    listed = TrainSFTConfig(learning_rate=(2e-4, 0), batch_size=4)
    assert listed.learning_rate == [2e-4, 0.0] and listed.learning_rates(2) == [2e-4, 0.0]
    with pytest.raises(HyperParameterError, match=r"has 2 learning rates for 3 batches of batch_size=4"):
        listed.learning_rates(3)
    assert art.TrainSFTConfig is TrainSFTConfig  # ART's top-level name


# ------------------------------------------------------------------------------ token weights


def test_a_batch_weighs_every_trained_token_the_same_as_art(tiny_tokenizer) -> None:  # noqa: ANN001
    """ART (unsloth/train.py): the batch loss is sum of token cross-entropies / the batch's
    trained tokens. Two answers of 1 and 3 trained tokens with logprobs -1 and -3 per token:
    (1 * 1 + 3 * 3) / 4 = 2.5 (per-document weights 1/tokens would give (1 + 3) / 2 = 2)."""
    short = art.Trajectory(
        messages_and_choices=[row("y")["messages"][0], {"role": "assistant", "content": "y"}]
    )
    documents, stats = sft_documents(tiny_tokenizer, [short, short], "all")
    assert [d.weight for d in documents] == [1.0, 1.0] and stats.trained_tokens > 0

    a = Document([11, 12, 13], [0.0, 0.0, 1.0], [0.0] * 3, 0.0, 1.0)
    b = Document([21, 22, 23, 24, 25], [0.0, 0.0, 1.0, 1.0, 1.0], [0.0] * 5, 0.0, 1.0)
    (batch,) = pack([a, b], seq_len=16)
    ids = torch.as_tensor(batch.input_ids)
    logprobs = torch.where(ids >= 21, -3.0, -1.0).double()
    loss = sft_loss(logprobs, torch.as_tensor(batch.loss_mask), torch.as_tensor(batch.weights))
    assert float(loss) == pytest.approx((1 * 1 + 3 * 3) / 4)


# ------------------------------------------------------------------------------ train_sft's batches


@pytest.fixture
def backend(tiny_llama_dir) -> MegatronBackend:  # noqa: ANN001
    """The tiny model registered in name only; `_step_with` records the job instead of running it."""
    backend = MegatronBackend()
    backend._model = art.TrainableModel(name="m", project="p", base_model="tiny")
    backend._model_dir = tiny_llama_dir
    backend.jobs = []  # type: ignore[attr-defined]

    async def step_with(steps, metrics, kind, learning_rates, loss, started):  # noqa: ANN001
        backend.jobs.append((kind, steps, learning_rates, metrics))  # type: ignore[attr-defined]
        return TrainResult(step=1, metrics={**metrics, "loss/sft": 0.5, "time/train_s": 2.0})

    backend._step_with = step_with  # type: ignore[method-assign]
    return backend


def sft(backend: MegatronBackend, trajectories: Any, *args: Any, **kwargs: Any) -> TrainResult:
    return asyncio.run(backend.train_sft(backend._model, trajectories, *args, **kwargs))


def trajectories(n: int) -> list[art.Trajectory]:
    return [art.Trajectory(messages_and_choices=row(f"answer {i}")["messages"]) for i in range(n)]


def test_train_sft_is_one_job_with_an_optimizer_step_per_batch(backend: MegatronBackend) -> None:
    result = sft(backend, trajectories(5), TrainSFTConfig(learning_rate=[3e-4, 2e-4, 1e-4]))
    ((kind, steps, rates, _),) = backend.jobs  # type: ignore[attr-defined]
    assert kind == "sft" and [len(s) for s in steps] == [2, 2, 1] and rates == [3e-4, 2e-4, 1e-4]
    assert all(d.weight == 1.0 for s in steps for d in s)
    metrics = result.metrics
    assert metrics["loss/train"] == 0.5 and "loss/sft" not in metrics
    assert metrics["data/step_num_trajectories"] == 5.0 and metrics["data/step_num_gradient_steps"] == 3.0
    assert metrics["data/step_trainer_tokens"] == metrics["data/trained_tokens"] > 0
    assert metrics["time/step_trainer_s"] == 2.0 and metrics["data/step_num_dropped_trajectories"] == 0.0
    sft(backend, trajectories(3), batch_size=3, learning_rate=1e-4)  # kwargs are TrainSFTConfig fields
    assert backend.jobs[-1][2] == [1e-4]  # type: ignore[attr-defined]


def test_train_sft_refuses_what_art_would_misread(backend: MegatronBackend) -> None:
    with pytest.raises(HyperParameterError, match=r"has 2 learning rates for 3 batches of batch_size=auto"):
        sft(backend, trajectories(5), TrainSFTConfig(learning_rate=[1e-4, 1e-4]))
    with pytest.raises(HyperParameterError, match=r"train_sft got the unknown keyword lr=0.1; use config="):
        sft(backend, trajectories(1), lr=0.1)
    with pytest.raises(HyperParameterError, match=r"train_sft\(_config=\{'beta': 1\}\) must be ART's dev"):
        sft(backend, trajectories(1), None, {"beta": 1})
    with pytest.raises(HyperParameterError, match=r"train_sft\(verbose='loud'\) must be True or False"):
        sft(backend, trajectories(1), None, None, "loud")
    assert not backend.jobs  # type: ignore[attr-defined]
    sft(backend, trajectories(1), None, {}, True)  # ART's empty dev.TrainSFTConfig() and verbose
    assert math.isclose(backend.jobs[0][2][0], 5e-5)  # type: ignore[attr-defined]


def test_a_host_local_root_gets_each_sft_batch_of_its_dp_rank(tmp_path) -> None:  # noqa: ANN001
    """With a host-local artifact_root the controller writes every batch's `dp<r>` file on the
    host whose ranks read DP rank r, through the agent's artifact write (run here as the agent
    runs it, `transfer.files.write_file`, into that host's own root)."""
    from types import SimpleNamespace

    from art_mega.topology import TrainerSpec, compile_topology
    from art_mega.trainer.protocol import sft_batch_file
    from art_mega.transfer.files import write_file
    from tests.helpers import loopback_cluster

    class HostAgent:
        def __init__(self, host: str) -> None:
            self.host = host

        async def call(self, route, body, timeout_s=None):  # noqa: ANN001, ANN201
            return write_file(body.model_copy(update={"root": str(tmp_path / self.host)}))

    cluster = loopback_cluster(2, tmp=str(tmp_path / "controller"), shared_artifact_root=False)
    topology = compile_topology(cluster, trainer=TrainerSpec(host_ids=("host0", "host1")))
    backend = MegatronBackend()
    backend._runtime = SimpleNamespace(topology=topology, clients={h: HostAgent(h) for h in cluster.host_ids})
    batch_dir = tmp_path / "controller" / "artifacts" / "run" / "batches" / "0003"
    for k in range(2):
        for dp in range(2):
            file = sft_batch_file(batch_dir, k, dp)
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(f"batch {k} dp {dp}".encode())
    asyncio.run(backend._send_batches(batch_dir))
    received = sorted(p.relative_to(tmp_path / "host1") for p in (tmp_path / "host1").rglob("*.safetensors"))
    assert [str(p) for p in received] == [
        "run/batches/0003/0000/dp1.safetensors",
        "run/batches/0003/0001/dp1.safetensors",
    ]
    assert (tmp_path / "host1" / received[1]).read_bytes() == b"batch 1 dp 1"
    assert not (tmp_path / "host0").exists()  # the controller's own host reads its files in place


def test_train_sft_takes_arts_0_5_23_metric_logging_with_a_logged_line(
    backend: MegatronBackend, caplog
) -> None:  # noqa: ANN001
    import logging

    with caplog.at_level(logging.INFO, logger="art_mega.backend"):
        sft(backend, trajectories(1), None, {"metric_logging": {"enabled": False}})
    assert len(backend.jobs) == 1  # type: ignore[attr-defined]
    assert [r.getMessage() for r in caplog.records] == [
        "train_sft(_config={'metric_logging': {'enabled': False}}): art-mega logs every train_sft call's "
        "metrics (model.train_sft(log_metrics=False) turns that off)"
    ]
    with pytest.raises(HyperParameterError, match=r"whose one key is metric_logging; leave the others out"):
        sft(backend, trajectories(1), None, {"metric_logging": None, "beta": 1})
