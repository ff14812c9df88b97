"""ART's documentation example (the rollout/train loop), ported by changing only the imports
(`import art` -> `import art_mega as art`, `art.local` -> `art_mega.local`); the base model is the
tiny test model and the loop is short so it runs on CPU in CI."""

import art_mega as art
from art_mega.local import LocalBackend

SCENARIOS = ["say yes", "say no"]


async def rollout(model: art.Model, scenario: str) -> art.Trajectory:
    openai_client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "system", "content": "You answer with one word."}],
        reward=0,
    )
    trajectory.messages_and_choices.append({"role": "user", "content": scenario})
    chat_completion = await openai_client.chat.completions.create(
        model=model.get_inference_name(),
        messages=trajectory.messages(),
        max_completion_tokens=8,
    )
    choice = chat_completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    content = choice.message.content or ""
    trajectory.reward = 1.0 if content.strip().endswith(scenario.split()[-1]) else len(content) / 100
    trajectory.metrics["length"] = len(content)
    return trajectory


async def main(base_model: str = "tiny-llama", steps: int = 2) -> list[int]:
    backend = LocalBackend(seq_len=256, max_model_len=256)
    model = art.TrainableModel(name="agent-001", project="my-agentic-task", base_model=base_model)
    await model.register(backend)
    seen = []
    try:
        for _ in range(await model.get_step(), steps):
            train_groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, scenario) for _ in range(4)) for scenario in SCENARIOS),
                pbar_desc="gather",
            )
            await model.log(train_groups, split="train")
            await model.delete_checkpoints()
            await model.train(train_groups, config=art.TrainConfig(learning_rate=1e-4))
            seen.append(await model.get_step())
    finally:
        await backend.close()
    return seen
