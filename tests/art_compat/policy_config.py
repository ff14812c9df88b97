"""An ART-style program whose rollout reads a typed policy (`TrainableModel[Policy]` with
`config=Policy(...)`), then evaluates a prompted `art.Model` (any OpenAI-compatible endpoint;
here the trained model's own vLLM replica) with the same rollout and logs it as "val", as ART's
docs compare prompted and trained models. Changed only in its imports and base model."""

from pydantic import BaseModel

import art_mega as art
from art_mega.local import LocalBackend

SCENARIOS = ["say yes", "say no"]


class Policy(BaseModel):
    system_prompt: str = "You answer with one word."
    max_completion_tokens: int = 6
    bonus_word: str = "yes"


async def rollout(model: art.Model[Policy], scenario: str) -> art.Trajectory:
    policy = model.config
    client = model.openai_client()
    messages: art.Messages = [
        {"role": "system", "content": policy.system_prompt},
        {"role": "user", "content": scenario},
    ]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_completion_tokens=policy.max_completion_tokens,
    )
    choice = completion.choices[0]
    content = choice.message.content or ""
    reward = 1.0 if policy.bonus_word in content.lower() else len(content) / 100
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)


async def main(base_model: str = "tiny-llama", steps: int = 2) -> dict:
    backend = LocalBackend(seq_len=256, max_model_len=256)
    policy = Policy()
    model = art.TrainableModel[Policy](
        name="policy-001", project="policy-demo", base_model=base_model, config=policy
    )
    await model.register(backend)
    seen = []
    try:
        for _ in range(await model.get_step(), steps):
            train_groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, s) for _ in range(4)) for s in SCENARIOS),
                pbar_desc="gather",
            )
            await model.train(train_groups, config=art.TrainConfig(learning_rate=1e-4))
            seen.append(await model.get_step())
        prompted = art.Model(
            name="prompted-baseline",
            project="policy-demo",
            config=policy,
            inference_base_url=model.inference_base_url,
            inference_api_key=model.inference_api_key,
            inference_model_name=model.get_inference_name(),
        )
        val_groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(prompted, s) for _ in range(2)) for s in SCENARIOS),
            pbar_desc="val",
        )
        row = await prompted.log(val_groups, split="val")
        litellm = model.litellm_completion_params()
    finally:
        await backend.close()
    return {"steps": seen, "val_groups": val_groups, "val_row": row, "litellm": litellm, "prompted": prompted}
