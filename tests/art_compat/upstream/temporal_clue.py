# ruff: noqa
# ART's Temporal Clue notebook, run as a program (top-level `await`, as Jupyter runs its cells).
#
# Upstream: https://github.com/OpenPipe/art-notebooks, examples/temporal_clue/temporal-clue.ipynb at
# commit db49d0952cbb6d78f9d9b934739064221a36e911 (the newest; last changed in 7d8cc1e, 2026-05-19).
# Copyright OpenPipe; licensed under the Apache License, Version 2.0
# (https://www.apache.org/licenses/LICENSE-2.0). The repository's THIRD-PARTY-NOTICES lists this
# notebook as containing code adapted from Unsloth Notebooks (https://github.com/unslothai/notebooks,
# GNU LGPL v3.0): that code is its installation cell, which is dropped here.
#
# Each code cell follows verbatim ("# %% [cell N]" marks it) except for these changes:
# - `import art` -> `import art_mega as art` (cell 6), `from art.local import LocalBackend` ->
#   `from art_mega.local import LocalBackend` (cell 8);
# - base_model="Qwen/Qwen2.5-7B-Instruct" -> base_model="./tiny-format-primed" (cell 8): a local HF
#   folder, a tiny Llama with SmolLM2's tokenizer trained to answer in the "A. ...\nB. ...\nC. ..."
#   format with guessed values (tests/art_compat/upstream/primed.py builds it; the test links it into
#   the program's working directory). Untouched, SmolLM2-135M-Instruct's answers all score 0, so no
#   group varies and nothing trains;
# - the dataset is read from the local file data/temporal-clue/puzzles.json beside this program
#   (cell 6): the lines
#       puzzles_url = "https://raw.githubusercontent.com/openpipe/art/main/examples/data/temporal-clue/puzzles.json"
#       puzzles_response = requests.get(puzzles_url)
#       puzzles: list[TemporalCluePuzzle] = json.loads(puzzles_response.text)
#   became the `puzzles_path` line and `json.loads(open(puzzles_path).read())`. ART's puzzles.json
#   (OpenPipe/ART examples/data/temporal-clue/puzzles.json) is absent from the mirror this was ported
#   from, so the local file holds 136 puzzles of the same shape (num_clues, prompt, solution) written
#   for art-mega: three guests, their arrival order and rooms, three questions each. 136 is the fewest
#   the notebook's slices train 2 steps on (val = [:64], test = [64:128], train = [128:], STRIDE 4).
# Cells dropped:
# - cell 2 (installation: `%%capture`, the `!uv pip install openpipe-art[backend]==0.5.9 ...` lines and
#   the Colab numpy/vllm/triton pin logic around them).
# Markdown cells are left out. tests/art_compat/test_upstream_programs.py runs it.

# %% [cell 4]
import os

# Optional
WANDB_API_KEY = ""
if WANDB_API_KEY:
    os.environ["WANDB_API_KEY"] = WANDB_API_KEY

# Optional
OPENPIPE_API_KEY = ""
if OPENPIPE_API_KEY:
    os.environ["OPENPIPE_API_KEY"] = OPENPIPE_API_KEY


# %% [cell 6]
import asyncio
import json
import random
import re
from typing import TypedDict

import requests
from dotenv import load_dotenv

import art_mega as art

load_dotenv()


class TemporalCluePuzzle(TypedDict):
    num_clues: int
    prompt: str
    solution: dict[str, str]


# download the puzzles from the github repo
puzzles_path = os.path.join(os.path.dirname(__file__), "data", "temporal-clue", "puzzles.json")

puzzles: list[TemporalCluePuzzle] = json.loads(open(puzzles_path).read())
val_puzzles = puzzles[:64]
test_puzzles = puzzles[64:128]
train_puzzles = puzzles[128:]
random.seed(42)
random.shuffle(train_puzzles)


# %% [cell 8]
import torch

from art_mega.local import LocalBackend

model = art.TrainableModel(
    name="001",
    project="temporal-clue",
    base_model="./tiny-format-primed",
)

# To run on a T4, we need to override some config defaults.
if torch.cuda.get_device_properties(0).major < 8:
    model._internal_config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(
            max_seq_length=8192,
        ),
        engine_args=art.dev.EngineArgs(
            enforce_eager=True,
            gpu_memory_utilization=0.7,
        ),
    )

backend = LocalBackend(
    in_process=True,
    path="./.art",
)

await model.register(backend)


# %% [cell 10]
from openai import AsyncOpenAI


async def rollout(model: art.Model, puzzle: TemporalCluePuzzle) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": puzzle["prompt"]}]
    client = AsyncOpenAI(
        base_url=model.inference_base_url,
        api_key=model.inference_api_key,
    )
    chat_completion = await client.chat.completions.create(
        messages=messages, model=model.get_inference_name()
    )
    choice = chat_completion.choices[0]
    content = choice.message.content
    assert isinstance(content, str)
    num_correct = 0
    for key, value in puzzle["solution"].items():
        if matches := re.findall(rf"{key}\. ([A-Za-z \.:-]+)", content):
            match = matches[-1]
            if match.strip().lower() == value.lower():
                num_correct += 1
    reward = acc = num_correct / len(puzzle["solution"])
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=reward, metrics={"acc": acc}
    )


# %% [cell 12]
STRIDE = 4
TRAINING_STEPS = 1_000
ROLLOUTS_PER_STEP = 50
LEARNING_RATE = 5e-5

for i in range(await model.get_step(), TRAINING_STEPS):
    val_groups, train_groups = await asyncio.gather(
        art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, puzzle) for _ in range(2))
                for puzzle in val_puzzles
            ),
            pbar_desc="val",
        ),
        art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    rollout(model, puzzle) for _ in range(ROLLOUTS_PER_STEP)
                )
                for puzzle in train_puzzles[i * STRIDE : (i + 1) * STRIDE]
            ),
            pbar_desc="train",
        ),
    )
    await model.log(val_groups)
    train_result = await backend.train(
        model,
        train_groups,
        learning_rate=LEARNING_RATE,
    )

    await model.log(
        train_groups,
        metrics=train_result.metrics,
        step=train_result.step,
        split="train",
    )

    await model.delete_checkpoints()
