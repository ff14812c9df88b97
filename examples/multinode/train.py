"""GRPO on SmolLM2-135M-Instruct: learn to answer a yes/no question with exactly one word.

Runs unchanged under `art-mega local`, `art-mega ssh` and `art-mega skypilot`: the trainer takes
one rank per host (data parallel over the hosts it is given), one vLLM replica serves on the
first host. The reward is verifiable and dense, so a 135M model improves on it in minutes on CPU:
half for a first word that is "yes" or "no", half for brevity (1 / number of words).

    art-mega local --program examples/multinode/train.py:main

Environment knobs: ART_MEGA_STEPS (default 6), ART_MEGA_GROUP_SIZE (8), ART_MEGA_BASE_MODEL.
"""

from __future__ import annotations

import math
import os
import re

import art_mega as art
from art_mega import ArtRuntime, InferenceSpec, TrainerSpec, compile_topology

TRAIN_QUESTIONS = [
    "Is water wet?",
    "Can fish fly?",
    "Is the sun hot?",
    "Do cats bark?",
    "Is snow cold?",
    "Can birds swim?",
    "Is ice hot?",
    "Do trees grow?",
    "Is the moon made of cheese?",
    "Can a dog read?",
    "Is fire cold?",
    "Do people sleep?",
]
VAL_QUESTIONS = ["Is grass green?", "Can rocks talk?", "Is the sky blue?", "Do fish breathe water?"]
ANSWER_RULE = "Answer with one word: yes or no."


def reward_for(text: str) -> float:
    """1.0 for exactly "yes" or "no"; 0.5 for a yes/no first word; plus 0.5 / number of words."""
    words = re.findall(r"[a-zA-Z']+", text.lower())
    if not words:
        return 0.0
    first = 0.5 if words[0] in ("yes", "no") else 0.0
    return first + 0.5 / len(words)


async def rollout(model: art.TrainableModel, question: str, seed: int | None = None) -> art.Trajectory:
    messages = [{"role": "user", "content": f"{question} {ANSWER_RULE}"}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=16, temperature=1.0, seed=seed
    )
    choice = completion.choices[0]
    reward = reward_for(choice.message.content or "")
    return art.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=reward,
        metrics={"exact": float(reward == 1.0), "words": float(len((choice.message.content or "").split()))},
    )


async def validate(model: art.TrainableModel) -> float:
    """Expected reward of the policy on held-out questions: 8 samples each at temperature 1 with
    fixed seeds, so two steps' figures differ only by the policy (greedy answers are already
    "Yes"/"No" for this model; what RL changes is the distribution)."""
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, q, seed=1000 + i) for i in range(8)) for q in VAL_QUESTIONS],
        pbar_desc=None,
    )
    row = await model.log(groups, split="val")
    return row["val/reward"]


async def main(launch) -> None:
    steps = int(os.environ.get("ART_MEGA_STEPS", "6"))
    group_size = int(os.environ.get("ART_MEGA_GROUP_SIZE", "8"))
    base_model = os.environ.get("ART_MEGA_BASE_MODEL", "SmolLM2-135M-Instruct")
    cluster = launch.homogeneous_cluster(cpu_slots=1, allow_shared_kernel=True)
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(cpu_ranks_per_host=1),
        inference=InferenceSpec(replicas=1, host_ids=(cluster.hosts[0].host_id,)),
    )
    runtime = await ArtRuntime.start(launch, topology)
    backend = art.MegatronBackend(runtime=runtime, seq_len=512, max_model_len=512, lora_rank=8)
    model = art.TrainableModel(name="yes-no", project="art-mega-quickstart", base_model=base_model)
    try:
        await model.register(backend)
        first_val = await validate(model)
        print(f"step {await model.get_step()}: val/reward {first_val:.3f}", flush=True)
        val = first_val
        epochs = math.ceil(steps * 4 / len(TRAIN_QUESTIONS))  # the epochs that hold `steps` steps
        for batch in art.iterate_dataset(
            TRAIN_QUESTIONS, groups_per_step=4, num_epochs=epochs, initial_step=await model.get_step()
        ):
            if batch.step >= steps:
                break
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, q) for _ in range(group_size)) for q in batch.items),
                pbar_desc=f"step {batch.step}",
            )
            result = await backend.train(model, groups, learning_rate=3e-4)
            # logged at the step of the policy that sampled these groups, like the validation
            await model.log(
                groups,
                split="train",
                metrics=result.metrics,
                step=batch.step,
            )
            if result.step % 2 == 0 or result.step >= steps:
                val = await validate(model)
                print(f"step {result.step}: val/reward {val:.3f}", flush=True)
        from art_mega.report import write_report

        for path in write_report(model.output_dir):
            print(f"report: {path}")
        print(f"ART_MEGA_TRAIN_DONE val/reward step0={first_val:.3f} final={val:.3f}", flush=True)
    finally:
        await backend.close()
        await runtime.close()
