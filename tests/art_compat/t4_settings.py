"""ART's 2048 example's set-up (OpenPipe/ART examples/2048/2048.py at commit 779559fd: the T4
overrides of `model._internal_config`, `_experimental_pull_from_s3` before `register`), changed
in its import, base model (the tiny test model), the bucket (an empty one: a first run) and its
rollout (one turn whose reward varies with the answer's length, so every group trains), plus
ART's notebooks' `LocalBackend(in_process=True)`, ART 0.5.23's `enable_expert_replay=False` and
`max_num_seqs` (a vLLM engine argument ART passes through)."""

import art_mega as art
from art_mega.local import LocalBackend

model = art.TrainableModel(name="003", project="2048", base_model="tiny-llama")
# To run on a T4, we need to override some config defaults.
model._internal_config = art.dev.InternalModelConfig(
    init_args=art.dev.InitArgs(
        gpu_memory_utilization=0.8,
    ),
    engine_args=art.dev.EngineArgs(
        enforce_eager=True,
        num_scheduler_steps=1,
        max_num_seqs=7,
    ),
)


async def rollout(model: art.Model, move: int) -> art.Trajectory:
    messages = [{"role": "user", "content": f"Move {move}: up, down, left or right?"}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_completion_tokens=6, temperature=1.0
    )
    choice = completion.choices[0]
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=float(len(choice.message.content or ""))
    )


async def main(bucket: str) -> dict:
    """Pull (nothing), register, one step; returns what the test checks."""
    backend = LocalBackend(in_process=True, enable_expert_replay=False)
    try:
        await backend._experimental_pull_from_s3(model, s3_bucket=bucket, verbose=True)
        await model.register(backend)
        served = await model.openai_client().models.list()
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, move) for _ in range(4)) for move in range(2)]
        )
        result = await backend.train(model, groups)
        return {
            "step": result.step,
            "metrics": result.metrics,
            "served": {m.id: m.model_extra.get("max_model_len") for m in served.data},
            "seq_len": backend.seq_len,
            "run_dir": backend._run_dir,
        }
    finally:
        await backend.close()
