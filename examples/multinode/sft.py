"""Warm-up then RL: SFT on a small JSONL of one-word yes/no answers, then one GRPO step on top.

The task is the one of train.py (answer a yes/no question with exactly one word); the SFT rows in
sft_yes_no.jsonl use other questions than train.py's, so the validation reward before and after
SFT shows what the warm-up taught. Runs unchanged under `art-mega local`, `ssh` and `skypilot`:

    art-mega local --program examples/multinode/sft.py:main

Environment knobs: ART_MEGA_SFT_EPOCHS (default 3), ART_MEGA_SFT_BATCH_SIZE (8), ART_MEGA_SFT_LR
(peak learning rate, 5e-4), ART_MEGA_GROUP_SIZE (8), ART_MEGA_BASE_MODEL.
The last line printed starts with ART_MEGA_SFT_DONE and gives the SFT loss of the first and the
last epoch (mean token cross-entropy, nats), the SFT optimizer steps (one per batch; each epoch is
one train_sft_from_file call, one model step) and the GRPO step's result.
"""

from __future__ import annotations

import os
from pathlib import Path

from train import TRAIN_QUESTIONS, rollout, validate

import art_mega as art
from art_mega import ArtRuntime, InferenceSpec, TrainerSpec, compile_topology
from art_mega.utils.sft import train_sft_from_file

SFT_FILE = Path(__file__).resolve().parent / "sft_yes_no.jsonl"


async def main(launch) -> None:
    epochs = int(os.environ.get("ART_MEGA_SFT_EPOCHS", "3"))
    batch_size = int(os.environ.get("ART_MEGA_SFT_BATCH_SIZE", "8"))
    peak_lr = float(os.environ.get("ART_MEGA_SFT_LR", "5e-4"))
    group_size = int(os.environ.get("ART_MEGA_GROUP_SIZE", "8"))
    base_model = os.environ.get("ART_MEGA_BASE_MODEL", "SmolLM2-135M-Instruct")
    cluster = launch.homogeneous_cluster(cpu_slots=1, allow_shared_kernel=True)
    first_host = cluster.hosts[0].host_id
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(cpu_ranks_per_host=1),
        inference=InferenceSpec(replicas=1, host_ids=(first_host,)),
    )
    runtime = await ArtRuntime.start(launch, topology)
    backend = art.MegatronBackend(runtime=runtime, seq_len=512, max_model_len=512, lora_rank=8)
    model = art.TrainableModel(name="yes-no-sft", project="art-mega-quickstart", base_model=base_model)
    try:
        await model.register(backend)
        val_base = await validate(model)
        print(f"step {await model.get_step()} (base): val/reward {val_base:.3f}", flush=True)

        # one train_sft_from_file call per epoch (ART's initial_step/final_step segments): each is
        # one step whose loss/train is the mean over its batches, so the first and last compare
        rows = sum(1 for line in SFT_FILE.open() if line.strip())
        batches = -(-rows * epochs // batch_size)
        results = []
        for epoch in range(epochs):
            results.append(
                await train_sft_from_file(
                    model,
                    SFT_FILE,
                    epochs=epochs,
                    batch_size=batch_size,
                    peak_lr=peak_lr,
                    schedule_type="cosine",
                    warmup_ratio=0.1,
                    initial_step=epoch * batches // epochs,
                    final_step=(epoch + 1) * batches // epochs,
                    verbose=True,
                )
            )
        loss_first = results[0].metrics["loss/train"]
        loss_last = results[-1].metrics["loss/train"]
        sft_steps = int(sum(r.metrics["data/step_num_gradient_steps"] for r in results))
        val_sft = await validate(model)
        print(f"step {await model.get_step()} (after SFT): val/reward {val_sft:.3f}", flush=True)

        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, q) for _ in range(group_size)) for q in TRAIN_QUESTIONS[:4]),
            pbar_desc="grpo",
        )
        result = await backend.train(model, groups, learning_rate=3e-4)
        await model.log(groups, split="train", metrics=result.metrics, step=result.step - 1)
        val_rl = await validate(model)
        print(
            f"ART_MEGA_SFT_DONE sft_loss first_epoch={loss_first:.4f} last_epoch={loss_last:.4f} "
            f"sft_steps={sft_steps} grpo_step={result.step} grpo_loss={result.metrics.get('loss/train', 0.0):.4f} "
            f"val/reward base={val_base:.3f} sft={val_sft:.3f} grpo={val_rl:.3f}",
            flush=True,
        )
    finally:
        await backend.close()
        await runtime.close()
