"""What the LoRA / engine tests run in every trainer world: in-process TP=1 and the 2-rank worker.

Each scenario takes this rank's `ParallelState` and returns plain tensors, numbers and paths, so
the tests can compare worlds with each other, with Hugging Face + PEFT and across ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from art_mega.trainer.batch import Document, TrainBatch, pack
from art_mega.trainer.prepare.advantages import group_advantages, token_weight
from art_mega.trainer.protocol import GRPOLossConfig, LoraConfig, OptimizerConfig
from art_mega.trainer.rank.engine import TrainerEngine
from art_mega.trainer.rank.lora import lora_parameters
from art_mega.trainer.rank.parallel import ParallelState
from tests.trainer.common import input_ids, megatron_logits

LORA = LoraConfig(rank=4, alpha=8.0, seed=3)
OPTIMIZER = OptimizerConfig(lr=2e-2, clip_grad=1.0, weight_decay=0.01)
SEQ_LEN = 32
EXPORT_MODELS = ("llama", "qwen2_1kv")
"""Untied GQA with 2 KV heads; tied embeddings, q/k/v biases and fewer KV heads than TP=2."""
COMPARED_METRICS = (
    "loss/policy",
    "loss/grad_norm",
    "loss/kl",
    "loss/entropy",
    "loss/ratio_mean",
    "loss/clipped_fraction",
    "loss/tokens",
)
"""The step metrics that every parallel layout must reproduce against one process."""


def assert_steps_match(label: str, metrics: list[dict], reference: list[dict], tolerance: float) -> None:
    """Each step's `COMPARED_METRICS` within `tolerance` of the reference run's (printed per step)."""
    for step, (got, expected) in enumerate(zip(metrics, reference, strict=True)):
        diffs = {key: abs(got[key] - expected[key]) for key in COMPARED_METRICS}
        print(f"{label} step {step + 1}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
        assert max(diffs.values()) <= tolerance, diffs


STEP_LOSSES = (
    GRPOLossConfig(),
    GRPOLossConfig(importance_sampling_level="sequence", kl_beta=0.05, epsilon_high=0.3),
    GRPOLossConfig(tis_cap=2.0),
)
"""The loss of each equivalence step: token level; GSPO with KL to the base model; TIS."""


def grpo_batch(engine: TrainerEngine, seed: int = 0, documents: int = 9) -> TrainBatch:
    """A packed GRPO batch of random documents with an even number of rows (for DP=2 splits).

    old_logprobs are the engine's own logprobs plus N(0, 0.1^2) noise on trained tokens, so the
    ratios spread around 1 and some are clipped.
    """
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(documents):
        length = int(rng.integers(6, 15))
        prompt = int(rng.integers(2, length - 2))
        docs.append(
            Document(
                input_ids=rng.integers(3, engine.vocab_size, length).tolist(),
                loss_mask=[0.0] * prompt + [1.0] * (length - prompt),
                old_logprobs=[0.0] * length,
                advantage=float(rng.normal()),
                weight=token_weight(length - prompt),
            )
        )
    batch = pack(docs, SEQ_LEN)[0]
    if batch.shape[0] % 2:  # one more row of padding
        batch = TrainBatch(
            **{name: np.concatenate([value, np.zeros_like(value[:1])]) for name, value in vars(batch).items()}
        )
    noise = rng.normal(0.0, 0.1, batch.shape).astype(np.float32)
    batch.old_logprobs = ((engine.logprobs(batch) + noise) * batch.loss_mask).astype(np.float32)
    return batch


def rows(batch: TrainBatch, start: int, step: int) -> TrainBatch:
    """The rows start, start + step, ... of `batch` (a DP rank's share)."""
    return TrainBatch(**{name: value[start::step].copy() for name, value in vars(batch).items()})


def split_documents(batch: TrainBatch) -> TrainBatch:
    """The same documents as `batch`, one per row, each starting at column 0 (unpacked)."""
    docs = []
    for r in range(batch.shape[0]):
        for segment in range(1, int(batch.segment_ids[r].max()) + 1):
            cols = np.nonzero(batch.segment_ids[r] == segment)[0]
            docs.append({name: value[r, cols] for name, value in vars(batch).items()})
    out = {name: np.zeros((len(docs), SEQ_LEN), dtype=value.dtype) for name, value in vars(batch).items()}
    for i, doc in enumerate(docs):
        for name, value in doc.items():
            out[name][i, : len(value)] = value
    return TrainBatch(**out)


def packed_logprobs(state: ParallelState, model_dir: str) -> dict[str, Any]:
    """Logprobs of a packed batch and of the same documents unpacked, under a trained adapter."""
    engine = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    batch = grpo_batch(engine, seed=5)
    engine.train_step(batch, learning_rate=0.05)  # a non-identity adapter
    unpacked = split_documents(batch)
    return {
        "packed": engine.logprobs(batch),
        "unpacked": engine.logprobs(unpacked),
        "packed_rows_to_unpacked": [
            (r, s) for r in range(batch.shape[0]) for s in range(1, int(batch.segment_ids[r].max()) + 1)
        ],
        "segments": batch.segment_ids,
        "unpacked_segments": unpacked.segment_ids,
    }


def training(state: ParallelState, model_dir: str, out: Path, *, dp_split: bool) -> dict[str, Any]:
    """3 GRPO steps (`STEP_LOSSES`) on `grpo_batch`, a save/resume of step 3, export and round trip.

    With `dp_split` each DP rank trains on its share of the rows (rank r: rows r, r + dp, ...).
    """
    engine = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    full = grpo_batch(engine)
    batch = rows(full, state.dp_rank, state.dp) if dp_split else full
    metrics = []
    for step, loss_config in enumerate(STEP_LOSSES):
        if step == 2:
            engine.save_state(out / "state")
        metrics.append(engine.train_step(batch, "grpo", loss_config))
    resumed = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    resumed.load_state(out / "state")
    resumed_metrics = resumed.train_step(batch, "grpo", STEP_LOSSES[2])
    adapter = out / "adapter"
    engine.export_adapter(adapter)
    fresh = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    fresh.load_adapter(adapter)
    fresh.export_adapter(out / "roundtrip")
    return {
        "metrics": metrics,
        "resumed_metrics": resumed_metrics,
        "logits": megatron_logits(engine.model, input_ids(engine.vocab_size)),
        "resumed_logits": megatron_logits(resumed.model, input_ids(engine.vocab_size)),
        "imported_logits": megatron_logits(fresh.model, input_ids(engine.vocab_size)),
        "adapter": str(adapter),
        "roundtrip": str(out / "roundtrip"),
    }


def nothing_trainable(state: ParallelState, model_dir: str) -> dict[str, Any]:
    """A step on a batch without trained tokens: its metrics and whether any LoRA weight moved."""
    engine = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    batch = grpo_batch(engine)
    batch.loss_mask[:] = 0.0
    before = {name: p.detach().clone() for name, p in lora_parameters(engine.ddp.module).items()}
    metrics = engine.train_step(batch)
    after = lora_parameters(engine.ddp.module)
    return {"metrics": metrics, "moved": any(not torch.equal(before[n], after[n]) for n in before)}


def sft_steps(state: ParallelState, model_dir: str, steps: int = 4) -> list[float]:
    """SFT loss over `steps` steps on one batch (assistant tokens = the batch's loss_mask)."""
    engine = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    batch = grpo_batch(engine)
    return [engine.train_step(batch, "sft", learning_rate=5e-2)["loss/sft"] for _ in range(steps)]


PROMPT = [1, 101, 202, 303, 2, 1, 404, 505]
CANDIDATES = ([518, 393, 2], [670, 354, 2], [369, 65, 2], [377, 310, 2])
"""A prompt and four candidate completions (tiny-vocabulary ids) that the seed-0 tiny llama finds
about equally likely (sequence logprobs within 0.1 of each other)."""


def _candidate_batch() -> TrainBatch:
    length = len(PROMPT) + len(CANDIDATES[0])
    ids = np.array([PROMPT + c for c in CANDIDATES], dtype=np.int64)
    shape = ids.shape
    mask = np.zeros(shape, dtype=np.float32)
    mask[:, len(PROMPT) :] = 1.0
    return TrainBatch(
        input_ids=ids,
        segment_ids=np.ones(shape, dtype=np.int32),
        position_ids=np.tile(np.arange(length), (len(CANDIDATES), 1)),
        loss_mask=mask,
        old_logprobs=np.zeros(shape, dtype=np.float32),
        advantages=np.zeros(shape, dtype=np.float32),
        weights=np.zeros(shape, dtype=np.float32),
    )


LEARNING_LR = 3e-4
"""Small enough that the preferred share climbs over several steps rather than in one Adam step."""


def grpo_learning(
    state: ParallelState, model_dir: str, *, steps: int = 20, groups: int = 4, group_size: int = 8
) -> dict[str, Any]:
    """GRPO on a reward that prefers the initially least likely of four candidate completions.

    Every step: the exact probability of each candidate given the prompt (product of its token
    probabilities) from the engine, normalised over the four; `groups` groups of `group_size`
    completions sampled from that distribution (numpy, seeded alike on every rank); reward 1 for
    the preferred candidate; advantages from `group_advantages`; old logprobs = the policy's own
    (on-policy); `pack`; one `train_step`. Returns per step the preferred candidate's
    probability (absolute and normalised), the sampled candidates and the step metrics.
    """
    engine = TrainerEngine(
        model_dir,
        state,
        lora=LoraConfig(rank=8, alpha=16.0),
        optimizer=OptimizerConfig(lr=LEARNING_LR),
        micro_batch_rows=16,
    )
    candidates = _candidate_batch()
    rng = np.random.default_rng(0)
    preferred = None
    absolute, normalised, picks_log, metrics = [], [], [], []
    for step in range(steps + 1):
        logprobs = engine.logprobs(candidates)
        sequence = (logprobs.astype(np.float64) * candidates.loss_mask).sum(axis=1)
        probs = np.exp(sequence)
        dist = probs / probs.sum()
        if preferred is None:
            preferred = int(np.argmin(dist))
        absolute.append(float(probs[preferred]))
        normalised.append(float(dist[preferred]))
        if step == steps:
            break
        docs = []
        for _ in range(groups):
            picks = rng.choice(len(CANDIDATES), size=group_size, p=dist)
            picks_log.append(picks.tolist())
            advantages = group_advantages([1.0 if k == preferred else 0.0 for k in picks])
            for i in advantages.kept():
                k = int(picks[i])
                docs.append(
                    Document(
                        input_ids=candidates.input_ids[k].tolist(),
                        loss_mask=candidates.loss_mask[k].tolist(),
                        old_logprobs=(logprobs[k] * candidates.loss_mask[k]).tolist(),
                        advantage=advantages.advantages[i],
                        weight=token_weight(int(candidates.loss_mask[k].sum())),
                    )
                )
        batch = pack(docs, 64)[0] if docs else _empty_batch()
        metrics.append(engine.train_step(batch, "grpo"))
    return {
        "preferred": preferred,
        "absolute": absolute,
        "normalised": normalised,
        "picks": picks_log,
        "metrics": metrics,
    }


def _empty_batch() -> TrainBatch:
    shape = (1, 64)
    ints = {name: np.zeros(shape, dtype=np.int64) for name in ("input_ids", "position_ids")}
    floats = {
        name: np.zeros(shape, dtype=np.float32)
        for name in ("loss_mask", "old_logprobs", "advantages", "weights")
    }
    return TrainBatch(segment_ids=np.zeros(shape, dtype=np.int32), **ints, **floats)


def run_all(
    state: ParallelState, models: dict[str, str], out: Path, *, learning: bool = True
) -> dict[str, Any]:
    """Every scenario of a TP world (DP=1): results by name."""
    results: dict[str, Any] = {"state": (state.tp, state.dp, state.tp_rank, state.dp_rank)}
    results["packed"] = packed_logprobs(state, models["llama"])
    for name in EXPORT_MODELS:
        results[f"training/{name}"] = training(state, models[name], out / name, dp_split=False)
    if learning:
        results["learning"] = grpo_learning(state, models["llama"])
    return results
