"""GRPO with RULER rewards only: no reward function is written, an LLM judge ranks each group's
answers against each other (`art_mega.rewards.ruler_score_group` as `after_each`) and its
scores are the rewards. Runs on this machine's CPU with LocalBackend (one trainer rank, one
vLLM replica), in ART's style:

    .venv/bin/python examples/ruler/train.py

The judge, ART_MEGA_RULER_JUDGE:
- "base" (default): the base model on the run's own replica (it serves the base as the model's
  name), asked through LiteLLM as `hosted_vllm/<name>` with `api_base` (the `rewards` extra);
- "policy": the policy as it is now judges its own answers (`judge_model=model`, its replicas);
- any LiteLLM name ("openai/o4-mini" with OPENAI_API_KEY set, ...).

Other knobs: ART_MEGA_STEPS (default 4), ART_MEGA_GROUP_SIZE (4), ART_MEGA_BASE_MODEL
(SmolLM2-135M-Instruct; "tiny-llama" for the random test model). The answers' `yes_no`
metric (first word "yes" or "no") is only watched, never trained on. The run's report plots
`train/reward`, the judge's mean score per step. The last line printed is
`ART_MEGA_RULER_DONE steps=... train/reward first=... last=...`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
from typing import Any

import art_mega as art
from art_mega.local import LocalBackend
from art_mega.rewards import ruler_score_group

QUESTIONS = [
    "Is water wet?",
    "Can fish fly?",
    "Is the sun hot?",
    "Do cats bark?",
    "Is snow cold?",
    "Is ice hot?",
]
SYSTEM = "You answer questions about the world with exactly one word: yes or no."
RUBRIC = """\
- The answer must be the single word "yes" or "no"; any other word, or more words, is wrong.
- A correct yes/no answer to the question scores higher than an incorrect one.
- Among answers of equal correctness, the shorter one scores higher."""


def yes_no(text: str) -> float:
    """1.0 when the first word is "yes" or "no" (watched, not a reward)."""
    words = re.findall(r"[a-zA-Z']+", text.lower())
    return float(bool(words) and words[0] in ("yes", "no"))


async def rollout(model: art.TrainableModel, question: str) -> art.Trajectory:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=12, temperature=1.0
    )
    choice = completion.choices[0]
    return art.Trajectory(
        messages_and_choices=[*messages, choice], metrics={"yes_no": yes_no(choice.message.content or "")}
    )


def judge_for(model: art.TrainableModel, choice: str) -> tuple[Any, dict[str, Any]]:
    """`judge_model` and `extra_litellm_params` for ART_MEGA_RULER_JUDGE `choice`."""
    settings: dict[str, Any] = {"temperature": 0.0}
    if choice == "policy":
        return model, settings
    if choice == "base":
        return f"hosted_vllm/{model.name}", {**settings, "api_base": model.inference_base_url}
    return choice, {}


async def main(
    base_model: str | None = None,
    steps: int | None = None,
    group_size: int | None = None,
    judge: str | None = None,
    explanation_chars: int = 80,
) -> dict[str, Any]:
    """Train `steps` GRPO steps on RULER rewards (a vLLM judge's explanations of at most
    `explanation_chars` characters); returns the steps trained, the judged groups of the last
    step and the run directory."""
    base_model = base_model or os.environ.get("ART_MEGA_BASE_MODEL", "SmolLM2-135M-Instruct")
    steps = steps if steps is not None else int(os.environ.get("ART_MEGA_STEPS", "4"))
    group_size = group_size if group_size is not None else int(os.environ.get("ART_MEGA_GROUP_SIZE", "4"))
    judge = judge or os.environ.get("ART_MEGA_RULER_JUDGE", "base")
    backend = LocalBackend(seq_len=256, max_model_len=2048)
    model = art.TrainableModel(name="ruler-yes-no", project="ruler-example", base_model=base_model)
    await model.register(backend)
    trained: list[int] = []
    groups: list[art.TrajectoryGroup] = []
    try:
        for step in range(await model.get_step(), steps):
            judge_model, params = judge_for(model, judge)
            questions = [QUESTIONS[(2 * step + k) % len(QUESTIONS)] for k in range(2)]
            with model.metrics_builder("train").activate_context():
                groups = await art.gather_trajectory_groups(
                    (art.TrajectoryGroup(rollout(model, q) for _ in range(group_size)) for q in questions),
                    pbar_desc=f"step {step}",
                    after_each=functools.partial(
                        ruler_score_group,
                        judge_model=judge_model,
                        extra_litellm_params=params,
                        rubric=RUBRIC,
                        swallow_exceptions=True,
                        max_explanation_chars=explanation_chars,
                    ),
                )
            if not groups:
                print(f"step {step}: the judge failed on every group; nothing to train")
                continue
            result = await backend.train(model, groups, learning_rate=2e-4)
            await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            trained.append(result.step)
    finally:
        await backend.close()
    from art_mega.metrics import read_history
    from art_mega.report import write_report

    for path in write_report(model.output_dir):
        print(f"report: {path}")
    rewards = [
        row["train/reward"]
        for row in read_history(model.output_dir / "history.jsonl")
        if "train/reward" in row
    ]
    if rewards:
        print(
            f"ART_MEGA_RULER_DONE steps={len(trained)} train/reward first={rewards[0]:.3f} last={rewards[-1]:.3f}"
        )
    return {"steps": trained, "groups": groups, "run_dir": model.output_dir}


if __name__ == "__main__":
    asyncio.run(main())
