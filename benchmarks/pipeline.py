"""PipelineTrainer against the synchronous loop, on a layout where the replica and the trainer
rank have their own cores (`taskset` per process kind: the vLLM replica and this controller on
one set of cores, the trainer rank on the other).

Both runs train the quickstart's task (examples/multinode/train.py: its questions, rollout and
reward; 4 groups of 8 a step) for the same number of steps from a fresh LoRA, alternating in
one invocation; each ends with the quickstart's validation. Figures: steps per minute (the
steps after the first, which both spend waiting for the first rollouts), the ratio, final
validation reward, and the pipeline's stale group fraction and mean staleness (groups sampled
by a policy older than the one the step trained from, and by how many steps).

Run: `.venv/bin/python benchmarks/pipeline.py [--steps N] [--runs R] [--base-model NAME]
[--max-steps-off-policy K] [--record]`; each run is `art-mega local --program
benchmarks/pipeline.py:art_program` in a fresh directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _programs import art_program_command, emit, quickstart_module  # noqa: E402
from _results import print_table, record, rows_for  # noqa: E402

GROUPS_PER_STEP = 4
GROUP_SIZE = 8
LEARNING_RATE = 3e-4
ENV = {"mode": "PIPELINE_BENCH_MODE", "steps": "PIPELINE_BENCH_STEPS", "events": "PIPELINE_BENCH_EVENTS"}
ENV_MODEL = "PIPELINE_BENCH_MODEL"
ENV_OFF = "PIPELINE_BENCH_OFF_POLICY"


def cores() -> tuple[set[int], set[int]]:
    """(replica and controller cores, trainer cores): this process's cores split in two halves
    (on a 1-core machine both get the one core)."""
    mine = sorted(os.sched_getaffinity(0))
    half = max(1, len(mine) // 2)
    return set(mine[:half]), set(mine[half:] or mine)


def _pin(pid: int, where: set[int]) -> None:
    # sched_setaffinity(pid) moves one thread; every thread the process already started moves too
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), where)


def pin_processes() -> dict[str, list[int]]:
    """Pin this run's processes (this controller and its descendants only) by kind: vLLM and
    this controller (its agent too) to the first half of the cores, the trainer rank
    (`art_mega.trainer.rank_main`) and its children to the second. Returns kind -> pids."""
    import psutil

    inference, trainer = cores()
    pinned: dict[str, list[int]] = {"replica": [], "trainer": [], "controller": [os.getpid()]}
    _pin(os.getpid(), inference)
    ranks = {p.pid for p in psutil.Process().children(recursive=True) if "rank_main" in " ".join(p.cmdline())}
    for proc in psutil.Process().children(recursive=True):
        line = " ".join(proc.cmdline())
        under_rank = proc.pid in ranks or any(a.pid in ranks for a in proc.parents())
        kind = "trainer" if under_rank else "replica" if "vllm" in line else "controller"
        try:
            _pin(proc.pid, trainer if kind == "trainer" else inference)
        except (ProcessLookupError, FileNotFoundError):
            continue
        pinned[kind].append(proc.pid)
    return pinned


async def art_program(launch) -> None:
    """One run: the quickstart's model, `mode` "sync" (gather then train, as the quickstart) or
    "pipeline" (PipelineTrainer, `max_steps_off_policy` from the environment); appends
    `pinned`, one `step` event a step, and `done` (validation reward) to the events file."""
    import art_mega as art
    from art_mega import ArtRuntime, InferenceSpec, TrainerSpec, compile_topology
    from art_mega.pipeline_trainer import PipelineTrainer

    quickstart = quickstart_module()
    mode, steps, events = (os.environ[ENV[k]] for k in ("mode", "steps", "events"))
    steps = int(steps)
    cluster = launch.homogeneous_cluster(cpu_slots=1, allow_shared_kernel=True)
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(cpu_ranks_per_host=1, cpu_train_threads=len(cores()[1])),
        inference=InferenceSpec(replicas=1, host_ids=(cluster.hosts[0].host_id,)),
    )
    runtime = await ArtRuntime.start(launch, topology)
    backend = art.MegatronBackend(
        runtime=runtime, seq_len=512, max_model_len=512, lora_rank=8, lora_alpha=16.0
    )
    model = art.TrainableModel(
        name=f"pipeline-{mode}-{os.getpid()}", project="pipeline-bench", base_model=os.environ[ENV_MODEL]
    )
    try:
        await model.register(backend)
        emit(events, event="pinned", **pin_processes())
        start = await model.get_step()
        questions = (q for _ in range(1000) for q in quickstart.TRAIN_QUESTIONS)
        if mode == "sync":
            for step in range(steps):
                started = time.perf_counter()
                batch = [next(questions) for _ in range(GROUPS_PER_STEP)]
                groups = await art.gather_trajectory_groups(
                    (
                        art.TrajectoryGroup(quickstart.rollout(model, q) for _ in range(GROUP_SIZE))
                        for q in batch
                    ),
                    pbar_desc=None,
                )
                result = await backend.train(model, groups, learning_rate=LEARNING_RATE)
                await model.log(groups, split="train", metrics=result.metrics, step=result.step)
                emit(
                    events,
                    event="step",
                    step=step,
                    t=time.time(),
                    step_s=time.perf_counter() - started,
                    groups=result.metrics.get("data/step_num_groups_trainable", 0.0),
                )
        else:

            async def group_rollout(model, scenario, config):
                return await art.TrajectoryGroup(
                    quickstart.rollout(model, scenario["q"]) for _ in range(GROUP_SIZE)
                )

            trainer = PipelineTrainer(
                model,
                backend,
                group_rollout,
                ({"q": q} for q in questions),
                None,
                num_rollout_workers=GROUPS_PER_STEP,
                min_batch_size=GROUPS_PER_STEP,
                max_batch_size=GROUPS_PER_STEP,
                max_steps_off_policy=int(os.environ[ENV_OFF]),
                learning_rate=LEARNING_RATE,
                max_steps=steps,
                resume=False,
            )
            await trainer.train(handle_signals=False)
            rows = [
                json.loads(line) for line in (model.output_dir / "history.jsonl").read_text().splitlines()
            ]
            for row in rows:
                if "offpolicy/mean_staleness" in row and row["step"] > start:
                    emit(
                        events,
                        event="step",
                        step=row["step"] - start - 1,
                        step_s=row["time/step_wall_s"],
                        stale_fraction=row["offpolicy/stale_group_fraction"],
                        staleness=row["offpolicy/mean_staleness"],
                        groups=row.get("data/step_num_groups_trainable", 0.0),
                    )
        emit(events, event="done", val_reward=await quickstart.validate(model))
    finally:
        await backend.close()
        await runtime.close()


def run(mode: str, steps: int, base_model: str, off_policy: int, work: Path) -> list[dict]:
    """One `art-mega local` run of `art_program` in `work`; its events."""
    events = work / "events.jsonl"
    env = {
        **os.environ,
        ENV["mode"]: mode,
        ENV["steps"]: str(steps),
        ENV["events"]: str(events),
        ENV_MODEL: base_model,
        ENV_OFF: str(off_policy),
        # vLLM's CPU engine binds one OpenMP thread per core it is given (default: every core
        # of the NUMA node); pinned onto fewer cores afterwards its threads would share one
        # core and spin in each other's barriers (a 131 s rollout against ~5 s when measured)
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(cores()[0])),
    }
    with open(work / "art.log", "w") as log:
        subprocess.run(
            [
                # born on the replica's cores, so vLLM sizes its OpenMP team for them; the trainer
                # rank moves to its own cores once started (`pin_processes`)
                "taskset",
                "-c",
                ",".join(str(c) for c in sorted(cores()[0])),
                *art_program_command(__file__),
            ],
            cwd=work,
            env=env,
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return [json.loads(line) for line in events.read_text().splitlines()]


def summarize(runs: dict[str, list[list[dict]]]) -> dict[str, float]:
    """Figures of the runs by mode: steps per minute (median over runs of 60 / the mean step
    seconds after the first step), trained groups per minute over the same steps (groups whose
    rewards differ: the work a step does), validation reward (mean), stale fraction and
    staleness."""

    def later(events: list[dict]) -> list[dict]:
        return [e for e in events if e["event"] == "step" and e["step"] > 0]

    def per_minute(events: list[dict]) -> float:
        return 60.0 / statistics.fmean(e["step_s"] for e in later(events))

    def groups_per_minute(events: list[dict]) -> float:
        # equal work: the sync loop's step trains only its groups with unequal rewards, while
        # PipelineTrainer samples until its batch holds min_batch_size of them
        steps = later(events)
        return 60.0 * sum(e["groups"] for e in steps) / sum(e["step_s"] for e in steps)

    out: dict[str, float] = {}
    for mode, mode_runs in runs.items():
        out[f"{mode}_steps_per_min"] = statistics.median(per_minute(r) for r in mode_runs)
        out[f"{mode}_trained_groups_per_min"] = statistics.median(groups_per_minute(r) for r in mode_runs)
        out[f"{mode}_val_reward"] = statistics.fmean(
            next(e["val_reward"] for e in r if e["event"] == "done") for r in mode_runs
        )
    steps = [e for r in runs["pipeline"] for e in r if e["event"] == "step"]
    out["pipeline_stale_fraction"] = statistics.fmean(e["stale_fraction"] for e in steps)
    out["pipeline_mean_staleness"] = statistics.fmean(e["staleness"] for e in steps)
    out["ratio"] = out["pipeline_steps_per_min"] / out["sync_steps_per_min"]
    out["trained_groups_ratio"] = out["pipeline_trained_groups_per_min"] / out["sync_trained_groups_per_min"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--base-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-steps-off-policy", type=int, default=1)
    parser.add_argument("--record", action="store_true", help="write the rows into RESULTS.md")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.runs < 1 or args.max_steps_off_policy < 0:
        parser.error("--steps must be at least 2, --runs at least 1, --max-steps-off-policy at least 0")
    runs: dict[str, list[list[dict]]] = {"sync": [], "pipeline": []}
    for _ in range(args.runs):
        for mode in runs:
            with tempfile.TemporaryDirectory(prefix=f"pipeline-bench-{mode}-") as work:
                runs[mode].append(
                    run(mode, args.steps, args.base_model, args.max_steps_off_policy, Path(work))
                )
    figures = summarize(runs)
    command = (
        f"python benchmarks/pipeline.py --steps {args.steps} --runs {args.runs} --base-model {args.base_model} "
        f"--max-steps-off-policy {args.max_steps_off_policy}"
    )
    units = {
        "sync_steps_per_min": "steps/min",
        "pipeline_steps_per_min": "steps/min",
        "sync_val_reward": "reward",
        "pipeline_val_reward": "reward",
        "pipeline_stale_fraction": "fraction",
        "pipeline_mean_staleness": "steps",
        "ratio": "x",
        "sync_trained_groups_per_min": "groups/min",
        "pipeline_trained_groups_per_min": "groups/min",
        "trained_groups_ratio": "x",
    }
    rows = rows_for(
        [
            (f"pipeline {name} ({args.base_model}, taskset replica|trainer)", value, units[name])
            for name, value in figures.items()
        ],
        command,
    )
    print_table(rows)
    if args.record:
        record(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
