"""ART's documentation snippet "Training from a JSONL file" (SFT Training), changed only in its
imports (`art` -> `art_mega`) and base model (the tiny test model); `asyncio.run(main())` runs under
`__main__` and the backend is closed at the end, so the test can import and await `main`."""

import asyncio

import art_mega as art
from art_mega.local import LocalBackend

# from art.serverless.backend import ServerlessBackend
from art_mega.utils.sft import train_sft_from_file


async def main():
    backend = LocalBackend()
    # backend = ServerlessBackend()  # or use serverless for managed GPUs

    model = art.TrainableModel(
        name="my-sft-model",
        project="sft-project",
        base_model="tiny-llama",
    )
    await model.register(backend)
    try:
        await train_sft_from_file(
            model=model,
            file_path="data/train.jsonl",
            epochs=3,
            batch_size=2,
            peak_lr=2e-4,
            schedule_type="cosine",
            warmup_ratio=0.1,
            assistant_turns="last",
            verbose=True,
        )
    finally:
        await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
