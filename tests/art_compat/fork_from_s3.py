"""ART's documentation snippets "Checkpoint Forking" (Basic Usage, Forking from S3), changed only in
their imports (`art` -> `art_mega`, the rollout from `tests.art_compat.my_project`), base model
(the tiny test model), the bucket name and the loop's length (2 steps, for CI). `train_base`
first trains and backs up the model forked from (`_experimental_push_to_s3`), as the snippets
assume one exists."""

import art_mega as art
from art_mega.local import LocalBackend
from tests.art_compat.my_project import rollout, scenarios


async def _train(backend, model, steps: int) -> list[int]:
    done = []
    for _ in range(steps):
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, scenario) for _ in range(4)) for scenario in scenarios]
        )
        result = await backend.train(model, groups)
        await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        done.append(result.step)
    return done


async def train_base(bucket: str) -> list[int]:
    """Train `my-model-v1` one step and back it up to `bucket`; returns its steps."""
    backend = LocalBackend()
    base = art.TrainableModel(name="my-model-v1", project="my-project", base_model="tiny-llama")
    await base.register(backend)
    try:
        steps = await _train(backend, base, 1)
        await backend._experimental_push_to_s3(base, s3_bucket=bucket)
    finally:
        await backend.close()
    return steps


async def train(bucket: str) -> tuple[int, list[int]]:
    """The snippet: fork `my-model-v2` from the backup at or before step 500, register, train 2
    steps; returns the step it resumed at and the steps trained."""
    async with LocalBackend() as backend:
        # Create a new model that will fork from an existing checkpoint
        model = art.TrainableModel(
            name="my-model-v2",
            project="my-project",
            base_model="tiny-llama",
        )
        # Copy the checkpoint from another model
        await backend._experimental_fork_checkpoint(
            model,
            from_model="my-model-v1",
            from_s3_bucket=bucket,
            not_after_step=500,  # Use checkpoint at or before step 500
            verbose=True,
        )
        # Register and continue training
        await model.register(backend)
        start = await model.get_step()
        return start, await _train(backend, model, 2)
