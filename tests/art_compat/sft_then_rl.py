"""ART's documentation snippet "SFT as warmup before RL", changed only in its imports (`art` ->
`art_mega`, `my_project` -> `tests.art_compat.my_project`), base model (the tiny test model) and
the loop's end (3, not 50: 2 RL steps after the SFT step, for CI); the backend is closed at the end."""

import art_mega as art
from art_mega.local import LocalBackend

# from art.serverless.backend import ServerlessBackend
from art_mega.utils.sft import train_sft_from_file


async def main():
    backend = LocalBackend()
    # backend = ServerlessBackend()  # or use serverless for managed GPUs

    model = art.TrainableModel(
        name="warmup-then-rl",
        project="my-project",
        base_model="tiny-llama",
    )
    await model.register(backend)
    try:
        # Phase 1: SFT warmup from a dataset
        await train_sft_from_file(
            model=model,
            file_path="data/train.jsonl",
            epochs=3,
        )

        # Phase 2: RL training picks up from the SFT checkpoint
        from tests.art_compat.my_project import rollout, scenarios

        for step in range(await model.get_step(), 3):  # noqa: B007 (ART's loop as written)
            train_groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model, scenario) for _ in range(8)) for scenario in scenarios]
            )
            result = await backend.train(model, train_groups)
            await model.log(train_groups, metrics=result.metrics, step=result.step, split="train")
    finally:
        await backend.close()
