"""The `my_project` of ART's "SFT as warmup before RL" snippet: a one-word yes/no rollout on the
served policy (the reward is 1 for the word asked for) and its scenarios."""

import art_mega as art

scenarios = ["say yes", "say no"]


async def rollout(model: art.Model, scenario: str) -> art.Trajectory:
    messages = [
        {"role": "system", "content": "You answer with one word."},
        {"role": "user", "content": scenario},
    ]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_completion_tokens=4
    )
    choice = completion.choices[0]
    content = (choice.message.content or "").strip().lower()
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=1.0 if content == scenario.split()[-1] else 0.0
    )
