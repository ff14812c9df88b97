"""A trainer rank's intra-op threads follow the phase: the idle replicas' cores for a train job,
the one it started with otherwise (`TrainerSpec.cpu_train_threads`, `rank.main.train_threads`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from art_mega.errors import UserError
from art_mega.topology import TrainerSpec, compile_topology
from art_mega.trainer.protocol import RankConfig
from art_mega.trainer.rank.main import _busy_cores, _threads, train_threads
from tests.helpers import loopback_cluster


def config(ranks: int, threads: int | None = None, gpu: bool = False) -> RankConfig:
    topology = compile_topology(
        loopback_cluster(1), trainer=TrainerSpec(cpu_ranks_per_host=ranks, cpu_train_threads=threads)
    )
    assert topology.trainer is not None
    table = topology.trainer_ranks
    if gpu:
        table = tuple(r.model_copy(update={"gpu_id": r.rank}) for r in table)
    return RankConfig(
        world_size=ranks,
        master_addr="127.0.0.1",
        master_port=29500,
        trainer=topology.trainer,
        rank_table=table,
    )


@pytest.mark.parametrize(
    ("ranks", "cores", "expected"),
    [(1, 2, 2), (2, 2, 1), (2, 16, 8), (3, 16, 5), (4, 2, 1)],
)
def test_a_cpu_rank_trains_on_its_share_of_the_cores(ranks, cores, expected):
    assert [train_threads(config(ranks), r, cores, running=0) for r in range(ranks)] == [expected] * ranks


@pytest.mark.parametrize(("running", "expected"), [(0, 8), (9, 7), (14, 2), (15, 1), (40, 1)])
def test_cores_others_keep_busy_at_the_jobs_start_are_left_to_them(running, expected):
    assert train_threads(config(2), 0, cores=16, running=running) == expected


def test_the_runnable_tasks_are_read_from_this_host():
    assert train_threads(config(1), 0) in range(1, len(os.sched_getaffinity(0)) + 1)


def test_a_core_another_process_keeps_busy_is_counted():
    """A child spinning on one of this process's cores for the whole window is one busy core
    (at least: the host may run other work too), and it stops counting once it exits."""
    core = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nend = time.time() + 5\nwhile time.time() < end: pass",
        ]
    )
    try:
        time.sleep(0.3)  # the child is past its start-up and spinning
        assert _busy_cores(window_s=0.3) >= 1
    finally:
        spinner.kill()
        spinner.wait()
    assert 0 <= _busy_cores(window_s=0.1) <= len(os.sched_getaffinity(0))


def test_a_set_thread_count_is_used_on_cpu_and_gpu_ranks():
    assert train_threads(config(2, threads=3), 1, cores=4, running=3) == 3
    assert train_threads(config(1, threads=2, gpu=True), 0, cores=8) == 2


def test_a_gpu_rank_without_a_setting_keeps_torchs_default():
    assert train_threads(config(1, gpu=True), 0, cores=8) is None


def test_more_threads_than_the_rank_has_cores_is_refused():
    with pytest.raises(UserError) as info:
        train_threads(config(1, threads=3), 0, cores=2)
    assert str(info.value) == (
        "TrainerSpec.cpu_train_threads=3 is more than the 2 cores trainer rank 0 may run on (host host0); "
        "set at most 2, or None for the share of its host's cores."
    )


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_thread_count_that_is_not_a_positive_integer_is_refused(bad):
    with pytest.raises(ValidationError) as info:
        TrainerSpec(cpu_train_threads=bad)
    assert "cpu_train_threads" in str(info.value)


def test_a_job_runs_with_its_threads_and_gives_them_back():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with _threads(None):
            assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), _threads(2):
            raise RuntimeError("a failed job")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
