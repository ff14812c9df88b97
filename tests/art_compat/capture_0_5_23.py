"""An ART 0.5.23-style program: rollouts written with the capture API (`art.trajectory`,
`art.trajectory_group`, `art.current_trajectory`, `art.no_capture`), the LoRA set by
`TrainableModel(lora_config=art.LoRAConfig(...))`, `art.TrainConfig`'s 0.5.23 fields,
`model.log(trajectories=..., split=...)` and `art.utils.strip_logprobs`, as ART 0.5.23's
documentation writes them; changed only in its import (`import art` -> `import art_mega as art`)
and its base model (the tiny test model)."""

import art_mega as art
from art_mega.local import LocalBackend
from art_mega.utils import strip_logprobs


async def rollout(model: art.TrainableModel, question: int) -> None:
    client = model.openai_client()
    answer = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=[{"role": "user", "content": f"Count to {question}."}],
        max_tokens=8,
    )
    text = answer.choices[0].message.content or ""
    with art.no_capture():  # a side call the trajectory must not hold (e.g. a judge)
        await client.chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "ignored"}], max_tokens=2
        )
    art.current_trajectory(require=True).reward = len(text) / 32


async def main(base_model: str = "tiny-llama", steps: int = 2) -> dict:
    backend = LocalBackend(seq_len=256, max_model_len=256)
    model = art.TrainableModel(
        name="capture-001",
        project="capture",
        base_model=base_model,
        lora_config=art.LoRAConfig(rank=4, alpha=8, dropout=0.0),
    )
    await model.register(backend)
    out: dict = {"steps": [], "trained_tokens": [], "exchanges": []}
    try:
        for _ in range(await model.get_step(), steps):
            groups = [
                await art.trajectory_group(art.trajectory(rollout(model, q)) for _ in range(4))
                for q in (3, 5)
            ]
            out["exchanges"].append(
                sum(len(t.exchanges.chat_completions) for g in groups for t in g.trajectories)
            )
            result = await model.train(
                groups,
                config=art.TrainConfig(
                    learning_rate=1e-4, kl_penalty_source="current_learner", optimizer_save_interval=5
                ),
            )
            await model.log(trajectories=groups, split="train", metrics=result.metrics, step=result.step)
            out["steps"].append(result.step)
            out["trained_tokens"].append(result.metrics.get("data/step_trainer_tokens", 0.0))
        out["stripped"] = strip_logprobs(groups[0].trajectories[0].messages_and_choices)
        out["lora"] = dict(backend.lora)
    finally:
        await backend.close()
    return out
