"""PipelineTrainer against the synchronous loop, on a layout where the replica and the trainer
rank have their own cores (`taskset` per process kind: the vLLM replica and this controller on
one set of cores, the trainer rank on the other).

Both loops train one task (`--task`) with the same task code for the same number of steps from a
fresh LoRA (rank 8, lr 3e-4, 4 groups of 8 a step), alternating in one invocation; each ends with
the task's validation over fixed prompts with fixed seeds and the task's reward.

- `quickstart` (default): examples/multinode/train.py's questions, one-turn rollout and reward.
  Train-bound on this layout (a step trains ~25 s on one core against a few seconds of rollouts)
  and solved by step 2, after which most groups have equal rewards and train nothing.
- `agent`: an agent-shaped task, a game loop as an ART program writes one: guess the secret
  number (1 to 100) in up to GUESS_TURNS (3) chat turns through the replica. Each reply is a
  guess (its first whole number); the checker tool (`checker_answer`) answers "higher" or
  "lower" as the next user message. That answer comes back after `--tool-latency-s` seconds: an
  `asyncio.sleep` standing for a real environment's wait (a search, a code run, a game engine).
  It costs no CPU, so the pipeline overlaps it with training for free, as it would overlap a
  real environment's wait. The reward (`guess_reward`) is graded: 0.25 x the replies' format
  (only a number) + 0.75 x how close the last guess is to the secret. Closeness varies with
  every sampled guess, so the 8 games of a group differ at every step and every group trains in
  both loops (equal work per step). At step 0 about half the games hold no number at all
  (reward 0: 9 of 16 in a temperature-1 probe of the base model with this module's code), so a
  group whose 8 games all score 0 is ~1%. art_mega's `rollout_with_tools` is not used: it needs
  the policy to write native tool calls, which SmolLM2-135M does not, so the reply itself is the
  tool call. Default latency TOOL_LATENCY_S (14 s), measured to balance the two phases on this
  2-core layout (RESULTS, 2026-12-02 02:42, at fc4ac67: a sync step's rollouts 45.3 s, its
  training 42.3 s; PipelineTrainer 2.03x the sync loop's steps per minute). Overlap gives the
  issue's 1.5x only while rollout and train seconds per step are within 2x of each other
  (pipeline step ~ the larger, sync step ~ their sum); the `rollout_s` and `train_s` rows show
  the balance a run had: on another machine, rerun with `--tool-latency-s` ~ (sync train_s -
  sync rollout_s + 2 x latency) / 2.

Figures per mode: steps per minute (the steps after the first, which both spend waiting for the
first rollouts) and their ratio, trained groups per minute (groups whose rewards differ) and
their ratio, final validation reward, rollout and train seconds per step (`phase_figures`), and
the pipeline's stale group fraction and mean staleness (groups sampled by a policy older than
the one the step trained from, and by how many steps). Rows of the agent task are named
`pipeline agent ...` with the game and the latency in the name.

Run: `.venv/bin/python benchmarks/pipeline.py [--task quickstart|agent] [--tool-latency-s S]
[--steps N] [--runs R] [--base-model NAME] [--max-steps-off-policy K] [--record]`; each run is
`art-mega local --program benchmarks/pipeline.py:art_program` in a fresh directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
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
ENV_TASK = "PIPELINE_BENCH_TASK"
ENV_LATENCY = "PIPELINE_BENCH_TOOL_LATENCY_S"
ENV_CORES = "PIPELINE_BENCH_CORES"
"""The runner's split (`cores`) for its programs: the replica's cores, `|`, the trainer's, each a
comma-separated list (`0|1`, `0,1|2,3`)."""
TASKS = ("quickstart", "agent")

TOOL_LATENCY_S = 14.0
"""The agent task's default seconds before each tool answer (why this value: module docstring)."""
GUESS_TURNS = 3
"""Chat turns (guesses) of one game at most; the checker answers the first GUESS_TURNS - 1."""
GUESS_MAX_TOKENS = 8
"""New tokens a turn may sample (a guess is 1-3 tokens; a chattier reply is cut here)."""
GUESS_RULES = "Guess my secret number: pick a number from 1 to 100. Answer with only the number."
"""The game's first user message; the rules as a system message did no better (first replies of
the base model holding a number at temperature 1: 5 of 16 that way, 6 of 16 this way)."""
GUESS_VAL_SECRETS = (9, 37, 68, 94)
"""The validation's fixed games (8 seeded samples each)."""
GUESS_TRAIN_SEED = 19
"""Seed of the training games' secrets: both loops play the same games in the same order."""


def read_guess(reply: str) -> int | None:
    """The guess in a reply: its first whole number, None without one."""
    found = re.search(r"\d+", reply)
    return int(found.group()) if found else None


def format_score(reply: str) -> float:
    """1.0 for a reply that is only a whole number (a final period allowed), 0.5 for one that
    holds a number among other text, 0.0 for one without a number."""
    if re.fullmatch(r"\s*\d+\s*\.?\s*", reply):
        return 1.0
    return 0.5 if read_guess(reply) is not None else 0.0


def checker_answer(guess: int | None, secret: int, turns_left: int) -> str:
    """The checker tool's answer to a guess that is not `secret` (None: the reply had no
    number), with `turns_left` >= 1 guesses still to come; it repeats the answer format (the
    135M model drifts from it within a turn or two otherwise)."""
    if guess is None:
        answer = "checker: no number in your reply."
    else:
        answer = f"checker: {'higher' if guess < secret else 'lower'} than {guess}."
    return f"{answer} {'Last pick' if turns_left == 1 else 'Pick again'}; answer with only the number."


def guess_reward(replies: list[str], secret: int) -> float:
    """A game's reward in [0, 1]: 0.25 x the mean `format_score` of its replies + 0.75 x the
    closeness of the last guess made, max(0, 1 - |guess - secret| / 100) (0 without a guess)."""
    guesses = [g for g in map(read_guess, replies) if g is not None]
    closeness = max(0.0, 1.0 - abs(guesses[-1] - secret) / 100) if guesses else 0.0
    return 0.25 * statistics.fmean(map(format_score, replies)) + 0.75 * closeness


async def guess_rollout(model, secret: int, latency_s: float, seed: int | None = None):
    """One game against `secret` through `model.openai_client()`: a guess per turn (temperature
    1, GUESS_MAX_TOKENS), the checker's answer appended as the next user message after
    `latency_s` seconds (the environment's wait), until the secret is guessed or GUESS_TURNS
    turns. Returns the Trajectory (its reward `guess_reward`; metrics `turns`, `solved`,
    `format`)."""
    import art_mega as art

    client = model.openai_client()
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": GUESS_RULES}])
    replies: list[str] = []
    for turn in range(GUESS_TURNS):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            max_tokens=GUESS_MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        replies.append(choice.message.content or "")
        guess = read_guess(replies[-1])
        if guess == secret or turn == GUESS_TURNS - 1:
            break
        await asyncio.sleep(latency_s)
        answer = checker_answer(guess, secret, GUESS_TURNS - 1 - turn)
        trajectory.messages_and_choices.append({"role": "user", "content": answer})
    trajectory.reward = guess_reward(replies, secret)
    trajectory.metrics = {
        "turns": float(len(replies)),
        "solved": float(read_guess(replies[-1]) == secret),
        "format": statistics.fmean(map(format_score, replies)),
    }
    return trajectory


def task_parts(task: str, latency_s: float):
    """(training scenarios: an iterator of dicts, `rollout(model, scenario)` -> a Trajectory
    coroutine, `validate(model)` -> a coroutine of the validation reward) of `task` ("quickstart"
    or "agent"; `latency_s`: the agent's tool latency). Both loops run these."""
    import art_mega as art

    if task == "quickstart":
        quickstart = quickstart_module()
        questions = ({"question": q} for _ in range(1000) for q in quickstart.TRAIN_QUESTIONS)
        return questions, lambda model, s: quickstart.rollout(model, s["question"]), quickstart.validate

    async def validate(model) -> float:
        groups = await art.gather_trajectory_groups(
            [
                art.TrajectoryGroup(guess_rollout(model, secret, latency_s, seed=1000 + i) for i in range(8))
                for secret in GUESS_VAL_SECRETS
            ],
            pbar_desc=None,
        )
        return (await model.log(groups, split="val"))["val/reward"]

    rng = random.Random(GUESS_TRAIN_SEED)
    games = ({"secret": rng.randint(1, 100)} for _ in range(100_000))
    return games, lambda model, s: guess_rollout(model, s["secret"], latency_s), validate


def cores() -> tuple[set[int], set[int]]:
    """(replica and controller cores, trainer cores): the runner's cores split in two halves (on
    a 1-core machine both get the one core). The runner starts each run's program pinned to the
    first half (`run`), so the program reads the split from ENV_CORES, which the runner sets;
    without it (the runner itself) it is this process's affinity halved."""
    given = os.environ.get(ENV_CORES)
    if given:
        inference, trainer = given.split("|")
        return {int(c) for c in inference.split(",")}, {int(c) for c in trainer.split(",")}
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
    (`art_mega.trainer.rank.main`) and its children to the second. Returns kind -> pids."""
    import psutil

    inference, trainer = cores()
    pinned: dict[str, list[int]] = {"replica": [], "trainer": [], "controller": [os.getpid()]}
    _pin(os.getpid(), inference)
    ranks = {p.pid for p in psutil.Process().children(recursive=True) if "trainer.rank.main" in " ".join(p.cmdline())}
    for proc in psutil.Process().children(recursive=True):
        line = " ".join(proc.cmdline())
        under_rank = proc.pid in ranks or any(a.pid in ranks for a in proc.parents())
        kind = "trainer" if under_rank else "replica" if "vllm" in line.lower() else "controller"
        try:
            _pin(proc.pid, trainer if kind == "trainer" else inference)
        except (ProcessLookupError, FileNotFoundError):
            continue
        pinned[kind].append(proc.pid)
    return pinned


async def art_program(launch) -> None:
    """One run: the task from the environment (`task_parts`), `mode` "sync" (gather then
    train, as the quickstart) or "pipeline" (PipelineTrainer, `max_steps_off_policy` from the
    environment); appends `pinned`, one `step` event a step (seconds `step_s`, `rollout_s`,
    `train_s`, trained `groups`; the pipeline's also `stale_fraction`, `staleness` and the
    trainer's wait `idle_s`), and `done` (validation reward) to the events file."""
    import art_mega as art
    from art_mega import ArtRuntime, InferenceSpec, TrainerSpec, compile_topology
    from art_mega.pipeline_trainer import PipelineTrainer

    mode, steps, events = (os.environ[ENV[k]] for k in ("mode", "steps", "events"))
    steps = int(steps)
    task = os.environ[ENV_TASK]
    scenarios, rollout, validate = task_parts(task, float(os.environ[ENV_LATENCY]))
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
        name=f"pipeline-{task}-{mode}-{os.getpid()}",
        project="pipeline-bench",
        base_model=os.environ[ENV_MODEL],
    )
    try:
        await model.register(backend)
        emit(events, event="pinned", **pin_processes())
        start = await model.get_step()
        if mode == "sync":
            for step in range(steps):
                started = time.perf_counter()
                batch = [next(scenarios) for _ in range(GROUPS_PER_STEP)]
                groups = await art.gather_trajectory_groups(
                    (art.TrajectoryGroup(rollout(model, s) for _ in range(GROUP_SIZE)) for s in batch),
                    pbar_desc=None,
                )
                rollout_s = time.perf_counter() - started
                result = await backend.train(model, groups, learning_rate=LEARNING_RATE)
                await model.log(groups, split="train", metrics=result.metrics, step=result.step)
                emit(
                    events,
                    event="step",
                    step=step,
                    t=time.time(),
                    step_s=time.perf_counter() - started,
                    rollout_s=rollout_s,
                    train_s=result.metrics["time/step_trainer_s"],
                    groups=result.metrics.get("data/step_num_groups_trainable", 0.0),
                )
        else:

            async def group_rollout(model, scenario, config):
                return await art.TrajectoryGroup(rollout(model, scenario) for _ in range(GROUP_SIZE))

            trainer = PipelineTrainer(
                model,
                backend,
                group_rollout,
                scenarios,
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
                        # the step's groups rolled out concurrently (with each other and with
                        # training); time/step_actor_s sums their seconds
                        rollout_s=row["time/step_actor_s"] / row["data/step_num_groups_submitted"],
                        train_s=row["time/step_trainer_s"],
                        idle_s=row["throughput/step_trainer_idle_s"],
                        stale_fraction=row["offpolicy/stale_group_fraction"],
                        staleness=row["offpolicy/mean_staleness"],
                        groups=row.get("data/step_num_groups_trainable", 0.0),
                    )
        emit(events, event="done", val_reward=await validate(model))
    finally:
        await backend.close()
        await runtime.close()


def run(
    mode: str, task: str, latency_s: float, steps: int, base_model: str, off_policy: int, work: Path
) -> list[dict]:
    """One `art-mega local` run of `art_program` in `work` (`task` with tool latency
    `latency_s` seconds, `steps` steps of `mode`); its events."""
    events = work / "events.jsonl"
    env = {
        **os.environ,
        ENV["mode"]: mode,
        ENV["steps"]: str(steps),
        ENV["events"]: str(events),
        ENV_MODEL: base_model,
        ENV_OFF: str(off_policy),
        ENV_TASK: task,
        ENV_LATENCY: repr(latency_s),
        # vLLM's CPU engine binds one OpenMP thread per core it is given (default: every core
        # of the NUMA node); pinned onto fewer cores afterwards its threads would share one
        # core and spin in each other's barriers (a 131 s rollout against ~5 s when measured)
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(cores()[0])),
        # the program runs on the replica's cores (below), so its own affinity no longer shows
        # the trainer's: before this, the rank was pinned onto the replica's core as well
        ENV_CORES: "|".join(",".join(str(c) for c in sorted(half)) for half in cores()),
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


def later(events: list[dict]) -> list[dict]:
    """The step events after the first step (which both modes spend waiting for the first
    rollouts)."""
    return [e for e in events if e["event"] == "step" and e["step"] > 0]


def summarize(runs: dict[str, list[list[dict]]]) -> dict[str, float]:
    """Figures of the runs by mode: steps per minute (median over runs of 60 / the mean step
    seconds after the first step), trained groups per minute over the same steps (groups whose
    rewards differ: the work a step does), validation reward (mean), stale fraction and
    staleness."""

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


def phase_figures(runs: dict[str, list[list[dict]]]) -> dict[str, float]:
    """Seconds per step by mode, each the median over runs of the mean over the steps after the
    first: `{mode}_rollout_s` (sync: the gather's wall time, all of a step's groups at once;
    pipeline: the mean of one group's rollout time, the groups overlapping each other and
    training), `{mode}_train_s` (`time/step_trainer_s`: prepare, train and publish), and
    `pipeline_trainer_idle_s` (how long a pipeline step waited for its batch)."""

    def mean_of(key: str, events: list[dict]) -> float:
        return statistics.fmean(e[key] for e in later(events))

    out: dict[str, float] = {}
    for mode, mode_runs in runs.items():
        for key in ("rollout_s", "train_s"):
            out[f"{mode}_{key}"] = statistics.median(mean_of(key, r) for r in mode_runs)
    out["pipeline_trainer_idle_s"] = statistics.median(mean_of("idle_s", r) for r in runs["pipeline"])
    return out


def figure_name(task: str, name: str, base_model: str, latency_s: float) -> str:
    """The RESULTS.md row name of figure `name` (a key of `summarize` or `phase_figures`): the
    quickstart's rows keep their names, the agent task's say the game and the tool latency."""
    if task == "quickstart":
        return f"pipeline {name} ({base_model}, taskset replica|trainer)"
    return (
        f"pipeline agent {name} ({base_model}, {GUESS_TURNS}-turn guessing game, "
        f"tool latency {latency_s:g} s, taskset replica|trainer)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="quickstart")
    parser.add_argument(
        "--tool-latency-s",
        type=float,
        default=None,
        help=f"seconds before each tool answer of --task agent (default {TOOL_LATENCY_S:g})",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--base-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-steps-off-policy", type=int, default=1)
    parser.add_argument("--record", action="store_true", help="write the rows into RESULTS.md")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.runs < 1 or args.max_steps_off_policy < 0:
        parser.error("--steps must be at least 2, --runs at least 1, --max-steps-off-policy at least 0")
    latency = args.tool_latency_s
    if args.task == "quickstart" and latency is not None:
        parser.error(
            f"--tool-latency-s {latency:g} is the agent task's tool latency; leave it out with "
            "--task quickstart or pass --task agent"
        )
    if latency is not None and not (math.isfinite(latency) and latency >= 0):
        parser.error(f"--tool-latency-s {latency:g} must be a finite number of seconds, at least 0")
    latency = (TOOL_LATENCY_S if latency is None else latency) if args.task == "agent" else 0.0
    runs: dict[str, list[list[dict]]] = {"sync": [], "pipeline": []}
    for _ in range(args.runs):
        for mode in runs:
            with tempfile.TemporaryDirectory(prefix=f"pipeline-bench-{mode}-") as work:
                runs[mode].append(
                    run(
                        mode,
                        args.task,
                        latency,
                        args.steps,
                        args.base_model,
                        args.max_steps_off_policy,
                        Path(work),
                    )
                )
    figures = {**summarize(runs), **phase_figures(runs)}
    command = (
        f"python benchmarks/pipeline.py --steps {args.steps} --runs {args.runs} --base-model {args.base_model} "
        f"--max-steps-off-policy {args.max_steps_off_policy}"
    )
    if args.task == "agent":
        command += f" --task agent --tool-latency-s {latency:g}"
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
        "sync_rollout_s": "s",
        "pipeline_rollout_s": "s",
        "sync_train_s": "s",
        "pipeline_train_s": "s",
        "pipeline_trainer_idle_s": "s",
    }
    rows = rows_for(
        [
            (figure_name(args.task, name, args.base_model, latency), value, units[name])
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
