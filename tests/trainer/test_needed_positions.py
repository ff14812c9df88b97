"""The train step computes only what the loss reads (issue 19): the LM head and the vocabulary
cross entropy / entropy run on the positions predicting a needed token (`needed`), and a
microbatch's padding columns are cut. Both give today's full-row values and gradients
(one-rank Megatron world, tiny llama with a non-zero LoRA adapter, float32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.trainer.common import require_trainer_deps

require_trainer_deps()

TOLERANCE = 1e-6
"""Absolute, and relative for the engine's losses (an SFT loss of ~8 in float32 has ulps of ~1e-6)."""
PAD_COLUMNS = 16
"""Padding columns appended to the engine test's batch: the trim must cut them all."""


def _packed_rows(vocab_size: int):
    """Two packed rows [2, 24]: row 0 documents of 10 + 10 tokens then padding, row 1 one of
    16; `needed` marks tokens of both documents, padding and two document starts."""
    import torch

    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(3, vocab_size, (2, 24), generator=generator)
    segments = torch.zeros(2, 24, dtype=torch.int32)
    segments[0, :10], segments[0, 10:20], segments[1, :16] = 1, 2, 1
    ids[segments == 0] = 0
    positions = torch.zeros_like(ids)
    positions[0, :10], positions[0, 10:20], positions[1, :16] = (
        torch.arange(10),
        torch.arange(10),
        torch.arange(16),
    )
    needed = torch.zeros(2, 24, dtype=torch.bool)
    needed[0, 4:10] = True  # the end of document 1
    needed[0, 10:13] = True  # document 2's first token (no prediction: 0.0) and two more
    needed[0, 21] = True  # padding (0.0)
    needed[1, [0, 7, 8, 15]] = True  # the row's first token (0.0) and three
    return ids, positions, segments, needed


@pytest.fixture(scope="module")
def lora_model(megatron_world, tiny_dirs: dict[str, Path]):
    """The tiny llama GPTModel with LoRA whose A and B are both non-zero (so every LoRA weight has
    a gradient), and its LoRA parameters."""
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.lora import apply_lora, lora_parameters
    from tests.trainer.engine_scenarios import LORA

    built = build_megatron_model(tiny_dirs["llama"])
    apply_lora(built.module, LORA)
    params = lora_parameters(built.module)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in params.values():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return built, params


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_needed_positions_equal_the_full_rows(lora_model, chunk_size: int | None) -> None:
    import torch

    from art_mega.trainer.rank.logprobs import forward_logits, token_entropy, token_logprobs

    built, params = lora_model
    module = built.module
    ids, positions, segments, needed = _packed_rows(built.vocab_size)
    # a weighted mean over the needed tokens, as the step's loss is
    weights = torch.linspace(-1.0, 2.0, ids.numel()).reshape(ids.shape) / needed.sum()
    seen: list[tuple[int, ...]] = []
    hook = module.output_layer.register_forward_hook(
        lambda layer, args, out: seen.append(tuple(args[0].shape))
    )

    def run(select: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        logits = forward_logits(module, ids, positions, segments, needed=select)
        entropy = token_entropy(logits, vocab_size=built.vocab_size, segment_ids=segments, needed=select)
        logprobs = token_logprobs(
            logits,
            ids,
            vocab_size=built.vocab_size,
            segment_ids=segments,
            chunk_size=chunk_size,
            needed=select,
        )
        (logprobs * weights * needed).sum().backward()
        return logprobs.detach(), entropy, [p.grad.detach().clone() for p in params.values()]

    try:
        full, full_entropy, want_grads = run(None)
        got, got_entropy, got_grads = run(needed)
    finally:
        hook.remove()
    # 14 needed tokens, of which 3 have no prediction (two document starts, one padding token)
    hidden = module.config.hidden_size
    assert seen == [(24, 2, hidden), (11, 1, hidden)], "the LM head saw only the 11 predicting positions"
    assert got.shape == ids.shape and got.dtype == torch.float32
    want = torch.where(needed, full, torch.zeros_like(full))
    assert torch.count_nonzero(want) == 11
    assert (got - want).abs().max().item() <= TOLERANCE
    assert torch.equal(got[~needed], torch.zeros_like(got[~needed])), "not needed: exactly 0.0"
    want_entropy = torch.where(needed, full_entropy, torch.zeros_like(full_entropy))
    assert torch.count_nonzero(want_entropy) == 11
    assert (got_entropy - want_entropy).abs().max().item() <= TOLERANCE
    assert len(got_grads) == len(want_grads) == len(params) > 0
    assert max((g - w).abs().max().item() for g, w in zip(got_grads, want_grads)) <= TOLERANCE
    assert all(w.abs().max().item() > 1e-4 for w in want_grads), "every LoRA weight has a gradient"


def test_nothing_needed_gives_zeros_and_no_gradient(lora_model) -> None:
    import torch

    from art_mega.trainer.rank.logprobs import forward_logits, token_logprobs

    built, params = lora_model
    ids, positions, segments, _ = _packed_rows(built.vocab_size)
    none = torch.zeros_like(ids, dtype=torch.bool)
    built.module.zero_grad(set_to_none=True)
    logits = forward_logits(built.module, ids, positions, segments, needed=none)
    assert logits.shape == (1, 0, built.padded_vocab_size)
    logprobs = token_logprobs(logits, ids, vocab_size=built.vocab_size, segment_ids=segments, needed=none)
    assert torch.equal(logprobs, torch.zeros(ids.shape))
    logprobs.sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in params.values())


def test_logits_of_other_positions_are_refused(lora_model) -> None:
    import torch

    from art_mega.trainer.rank.logprobs import forward_logits, token_logprobs

    built, _ = lora_model
    ids, positions, segments, needed = _packed_rows(built.vocab_size)
    with torch.no_grad():
        logits = forward_logits(built.module, ids, positions, segments)
        with pytest.raises(ValueError, match="logits hold 24 positions where 11 needed positions"):
            token_logprobs(logits, ids, vocab_size=built.vocab_size, segment_ids=segments, needed=needed)


def _widened(batch, columns: int):
    """`batch` with `columns` padding columns appended (zeros, segment 0)."""
    from art_mega.trainer.batch import TrainBatch

    return TrainBatch(
        **{
            name: np.concatenate([value, np.zeros((value.shape[0], columns), dtype=value.dtype)], axis=1)
            for name, value in vars(batch).items()
        }
    )


def test_engine_step_equals_the_full_row_loss(megatron_world, tiny_llama_dir: Path) -> None:
    """A GRPO step (KL to the base model, TIS: both recomputations) and an SFT step on packed rows
    with padding columns and two rows per microbatch: loss, grad norm and logprobs equal those
    computed from full-row logits; every forward runs only up to each microbatch's last token."""
    import torch

    from art_mega.trainer.protocol import GRPOLossConfig
    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.logprobs import forward_logits, token_logprobs
    from art_mega.trainer.rank.lora import lora_disabled, lora_parameters
    from art_mega.trainer.rank.loss import grpo_loss, sft_loss
    from tests.trainer.engine_scenarios import LORA, OPTIMIZER, grpo_batch

    config = GRPOLossConfig(kl_beta=0.05, tis_cap=2.0)
    engine = TrainerEngine(tiny_llama_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER, micro_batch_rows=2)
    with torch.no_grad():  # a non-zero adapter: A and B both have gradients
        generator = torch.Generator().manual_seed(2)
        for p in lora_parameters(engine.ddp.module).values():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    batch = _widened(grpo_batch(engine, seed=3), PAD_COLUMNS)
    module = engine.model.module
    t = {name: torch.from_numpy(value) for name, value in vars(batch).items()}

    def full_logprobs() -> torch.Tensor:
        logits = forward_logits(module, t["input_ids"], t["position_ids"], t["segment_ids"])
        return token_logprobs(
            logits, t["input_ids"], vocab_size=engine.vocab_size, segment_ids=t["segment_ids"]
        )

    lora = list(lora_parameters(module).values())

    def loss_and_norm(loss: torch.Tensor) -> tuple[float, float]:
        grads = torch.autograd.grad(loss, lora)
        return float(loss), float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))

    with torch.no_grad():
        with lora_disabled(module):
            ref = full_logprobs()
        old = full_logprobs()
    new = full_logprobs()
    mask, weights = t["loss_mask"], t["weights"]
    grpo = grpo_loss(
        new,
        old,
        t["advantages"],
        mask,
        weights,
        config=config,
        ref_logprobs=ref,
        inference_logprobs=t["old_logprobs"],
    )
    want_grpo = loss_and_norm(grpo.loss)
    want_sft = loss_and_norm(sft_loss(full_logprobs(), mask, weights))
    want_logprobs = old.numpy()

    widths: list[int] = []
    hook = module.register_forward_pre_hook(lambda layer, args: widths.append(args[0].shape[1]))
    try:
        trained_only = engine.logprobs(batch, trained_only=True)
        every = engine.logprobs(batch)
        grpo_metrics = engine.train_step(batch, "grpo", config, learning_rate=0.0, weight_decay=0.0)
        sft_metrics = engine.train_step(batch, "sft", learning_rate=0.0, weight_decay=0.0)
    finally:
        hook.remove()

    rows = batch.shape[0]
    assert rows >= 4 and batch.shape[1] == 32 + PAD_COLUMNS
    real = [int(np.nonzero(batch.segment_ids[r : r + 2].any(axis=0))[0][-1]) + 1 for r in range(0, rows, 2)]
    assert max(real) <= 32 and min(real) > 1
    # logprobs twice; the GRPO step: the reference pass over the microbatches, then the old policy's
    # (each a forward-only sweep, as a pipeline schedule runs them), then the step's forwards; SFT's
    assert widths == real * 6, (widths, real)
    assert every.shape == batch.shape
    # float32 logprobs of magnitude up to ~10 have ulps of ~1e-6: the trimmed microbatches' other
    # matmul shapes may round a last bit differently (2 ulps, 1.9e-6, with torch 2.13.0+cpu)
    ulps = 4 * float(np.spacing(np.float32(np.abs(want_logprobs).max())))
    assert np.abs(every - want_logprobs).max() <= max(TOLERANCE, ulps)
    trained = batch.loss_mask > 0
    assert np.abs(trained_only - np.where(trained, want_logprobs, 0.0)).max() <= max(TOLERANCE, ulps)
    assert np.count_nonzero(trained_only) == np.count_nonzero(trained_only[trained]) > 0
    assert grpo_metrics["loss/policy"] == pytest.approx(want_grpo[0], abs=TOLERANCE)
    assert grpo_metrics["loss/grad_norm"] == pytest.approx(want_grpo[1], abs=TOLERANCE)
    assert grpo_metrics["loss/kl"] == pytest.approx(grpo.kl, abs=TOLERANCE)
    assert sft_metrics["loss/sft"] == pytest.approx(want_sft[0], rel=TOLERANCE)
    assert sft_metrics["loss/grad_norm"] == pytest.approx(want_sft[1], abs=TOLERANCE)
    assert want_grpo[1] > 1e-3 and want_sft[1] > 1e-3
