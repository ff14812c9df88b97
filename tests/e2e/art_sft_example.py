"""ART's SFT-from-file example, ported by changing only the imports."""

import art_mega as art
from art_mega.local import LocalBackend
from art_mega.utils.sft import train_sft_from_file


async def main(file_path: str, base_model: str = "tiny-llama") -> int:
    backend = LocalBackend(seq_len=256, max_model_len=256)
    model = art.TrainableModel(name="sft-agent", project="sft-demo", base_model=base_model)
    await model.register(backend)
    try:
        await train_sft_from_file(
            model=model,
            file_path=file_path,
            epochs=1,
            batch_size=2,
            peak_lr=2e-4,
            schedule_type="cosine",
        )
        return await model.get_step()
    finally:
        await backend.close()
