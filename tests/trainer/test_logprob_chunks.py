"""ART's logprob_calculation_chunk_size in `token_logprobs` and `token_entropy`: the cross entropy
and the entropy over chunks of positions give the unchunked values and gradients (one-rank
Megatron world, tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.common import input_ids, require_trainer_deps

require_trainer_deps()


@pytest.mark.parametrize("chunk_size", [3, 5, 1000])
def test_chunked_logprobs_and_gradients_equal_unchunked(
    megatron_world, tiny_dirs: dict[str, Path], chunk_size: int
) -> None:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.logprobs import forward_logits, token_logprobs

    built = build_megatron_model(tiny_dirs["llama"])
    ids = input_ids(built.vocab_size)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    # two packed documents per row, the second starting mid-chunk
    segments = torch.ones_like(ids)
    segments[:, 10:] = 2
    weights = torch.linspace(-1.0, 2.0, ids.numel()).reshape(ids.shape)
    params = [p for p in built.module.parameters() if p.requires_grad]

    def run(size: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        built.module.zero_grad(set_to_none=True)
        logits = forward_logits(built.module, ids, positions, segments)
        logprobs = token_logprobs(
            logits, ids, vocab_size=built.vocab_size, segment_ids=segments, chunk_size=size
        )
        (logprobs * weights).sum().backward()
        return logprobs.detach(), [p.grad.detach().clone() for p in params]

    want, want_grads = run(None)
    got, got_grads = run(chunk_size)
    assert got.shape == ids.shape and got.dtype == torch.float32
    assert torch.count_nonzero(want) == ids.numel() - 2 * ids.shape[0], (
        "all but each row's two document starts"
    )
    assert (got - want).abs().max().item() <= 1e-6
    assert len(got_grads) == len(want_grads) > 0
    assert max((g - w).abs().max().item() for g, w in zip(got_grads, want_grads)) <= 1e-6
    assert any(w.abs().max().item() > 1e-4 for w in want_grads), "the gradients compared are not all zero"


@pytest.mark.parametrize("chunk_size", [4, 1000])
def test_chunked_entropy_equals_unchunked_and_holds_no_graph(
    megatron_world, tiny_dirs: dict[str, Path], chunk_size: int
) -> None:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.logprobs import forward_logits, token_entropy

    built = build_megatron_model(tiny_dirs["llama"])
    ids = input_ids(built.vocab_size)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    segments = torch.ones_like(ids)
    segments[:, 7:] = 2
    needed = torch.ones_like(ids, dtype=torch.bool)
    needed[:, :3] = False
    logits = forward_logits(built.module, ids, positions, segments, needed=needed)
    assert logits.requires_grad
    common = dict(vocab_size=built.vocab_size, segment_ids=segments, needed=needed)
    want = token_entropy(logits, **common)
    got = token_entropy(logits, **common, chunk_size=chunk_size)
    assert not got.requires_grad and got.grad_fn is None, "the reported entropy keeps no graph alive"
    assert torch.equal(got, want)
    # the tiny model's entropy is about log V; a masked / document-start token holds 0.0
    assert 0.5 * torch.log(torch.tensor(float(built.vocab_size))) < want.max() <= torch.log(
        torch.tensor(float(built.vocab_size))
    ) + 1e-4
    assert (want[:, :3] == 0).all() and (want[:, 7] == 0).all() and (want[:, 3] > 0).all()
    # a microbatch with no trained token on this rank: no positions reach the LM head
    nothing = torch.zeros_like(needed)
    empty = forward_logits(built.module, ids, positions, segments, needed=nothing)
    assert empty.shape[1] == 0
    for size in (None, chunk_size):
        none = token_entropy(empty, vocab_size=built.vocab_size, segment_ids=segments, needed=nothing, chunk_size=size)
        assert none.shape == ids.shape and not none.any()


def test_an_engine_step_with_chunks_equals_the_unchunked_step(megatron_world, tiny_llama_dir: Path) -> None:
    """The engine reads GRPOLossConfig.logprob_calculation_chunk_size in the step's forward and in
    the reference / old-policy recomputations: the same loss, KL and gradient norm."""
    from transformers import AutoTokenizer

    from art_mega.trainer.protocol import GRPOLossConfig
    from art_mega.trainer.rank.engine import TrainerEngine
    from tests.trainer.engine_scenarios import LORA, OPTIMIZER
    from tests.trainer.test_lora_engine import ADAM_DRIFT_TOLERANCE
    from tests.trainer.test_plain_assistant_engine import plain_turn_batch

    batch = plain_turn_batch(AutoTokenizer.from_pretrained(tiny_llama_dir))
    options = dict(
        loss_fn="cispo",
        epsilon_low=1.0,
        epsilon_high=4.0,
        kl_penalty_coef=0.5,
        precalculate_logprobs=True,
        truncated_importance_sampling=1.5,
    )
    results = []
    for chunk_size in (None, 3):
        engine = TrainerEngine(tiny_llama_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER)
        config = GRPOLossConfig(**options, logprob_calculation_chunk_size=chunk_size)
        results.append((engine.train_step(batch, "grpo", config), engine.logprobs(batch)))
    (want, want_after), (got, got_after) = results
    for name in ("loss/policy", "loss/kl_policy_ref", "loss/grad_norm", "loss/entropy"):
        assert got[name] == pytest.approx(want[name], abs=1e-6), name
    assert want["loss/grad_norm"] > 0
    # the updated policy agrees only to Adam's drift: it divides each gradient element by its own
    # magnitude, so rounding-level differences of near-zero elements move weights by up to ~lr
    # (measured 2.1e-4 on logprobs of -4 to -9)
    assert abs(got_after - want_after).max() <= ADAM_DRIFT_TOLERANCE
