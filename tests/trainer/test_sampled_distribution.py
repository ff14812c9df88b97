"""The behaviour-policy rule on a one-rank Megatron world (tiny Llama): `token_logprobs` with
`SamplingRows` gives vLLM 0.32's processed logprobs (its own sampler functions, run in the vLLM
interpreter, on the same logits), chunked or not, at needed positions; the engine's step reports
the sampler gap and treats constrained tokens' sampler logprobs as unknown (ratio 1)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.common import input_ids, require_trainer_deps

require_trainer_deps()

HERE = Path(__file__).parent
SETTINGS = [
    # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.3, 5, 1.0, 0.0),
    (0.5, 0, 1.0, 0.1),
    (0.7, 20, 0.8, 0.05),
    (2.0, 0, 0.5, 0.0),
    (0.0, 0, 1.0, 0.0),  # greedy: vLLM reports T=1 logprobs
]


def vllm_processed_logprobs(tmp_path: Path, logits, params: list[tuple], targets: list[int]) -> list[float]:
    """vLLM's processed logprob of each target under its row of `logits` [N, V] with `params`."""
    from tests.inference.common import VLLM_PYTHON, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    spec = {
        "logits": logits.tolist(),
        "temperature": [t if t >= 1e-5 else 1.0 for t, _, _, _ in params],
        "top_k": [k for _, k, _, _ in params],
        "top_p": [p for _, _, p, _ in params],
        "min_p": [m for _, _, _, m in params],
        "targets": targets,
    }
    (tmp_path / "in.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [
            VLLM_PYTHON,
            str(HERE / "vllm_sampler_reference.py"),
            str(tmp_path / "in.json"),
            str(tmp_path / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())["logprobs"]


def test_token_logprobs_are_vllms_processed_logprobs(
    megatron_world, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    import torch

    from art_mega.trainer.model_builder import build_megatron_model
    from art_mega.trainer.rank.logprobs import SamplingRows, forward_logits, token_logprobs

    built = build_megatron_model(tiny_dirs["llama"])
    ids = input_ids(built.vocab_size)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    segments = torch.ones_like(ids)
    segments[:, 10:] = 2
    generator = torch.Generator().manual_seed(7)
    choice = torch.randint(0, len(SETTINGS), ids.shape, generator=generator)
    table = torch.tensor([[t, k, p, m] for t, k, p, m in SETTINGS], dtype=torch.float32)
    per_token = table[choice]
    sampling = SamplingRows(
        per_token[..., 0], per_token[..., 1].to(torch.int32), per_token[..., 2], per_token[..., 3]
    )
    needed = torch.rand(ids.shape, generator=generator) < 0.7
    rank = torch.randint(0, 3, ids.shape, generator=generator)
    with torch.no_grad():  # each token one of the 3 likeliest after the tokens before it
        for t in range(1, ids.shape[1]):
            if t != 10:
                logits = forward_logits(built.module, ids, positions, segments)[:, t - 1]
                ids[:, t] = logits.topk(3, dim=-1).indices.gather(1, rank[:, t, None])[:, 0]
        full = forward_logits(built.module, ids, positions, segments)
    params = [p for p in built.module.parameters() if p.requires_grad]

    def run(chunk_size: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        built.module.zero_grad(set_to_none=True)
        logits = forward_logits(built.module, ids, positions, segments, needed=needed)
        out = token_logprobs(
            logits,
            ids,
            vocab_size=built.vocab_size,
            segment_ids=segments,
            chunk_size=chunk_size,
            needed=needed,
            sampling=sampling,
        )
        out.sum().backward()
        return out.detach(), [p.grad.detach().clone() for p in params]

    whole, whole_grads = run(None)
    chunked, chunked_grads = run(4)
    # the tokens with a logprob: needed, not the first of their document
    read = needed.clone()
    read[:, 0] = False
    read[:, 10] = False
    rows, cols = read.nonzero(as_tuple=True)
    settings = [SETTINGS[int(choice[r, c])] for r, c in zip(rows, cols)]
    expected = vllm_processed_logprobs(tmp_path, full[rows, cols - 1], settings, ids[rows, cols].tolist())
    expected = torch.tensor(expected)
    # random ids: some targets lie outside vLLM's kept set (-inf there: it would never sample
    # them); the trainer keeps a trained token in its set (finite), and matches vLLM elsewhere
    kept = torch.isfinite(expected)
    worst = (whole[rows, cols][kept] - expected[kept]).abs().max().item()
    print(
        f"\n{int(kept.sum())} of {len(expected)} tokens in vLLM's kept set, 7 settings: "
        f"max |trainer - vLLM processed logprob| = {worst:.2e}"
    )
    assert worst <= 1e-5 and int(kept.sum()) >= 0.8 * len(expected)
    assert bool(torch.isfinite(whole).all()) and bool((whole[~read] == 0).all())
    assert (chunked - whole).abs().max().item() <= 1e-6
    assert max((g - w).abs().max().item() for g, w in zip(chunked_grads, whole_grads)) <= 1e-6
    assert all(bool(torch.isfinite(g).all()) for g in whole_grads)
    # the raw distribution differs: the rule changes the values it should
    raw = token_logprobs(
        forward_logits(built.module, ids, positions, segments, needed=needed),
        ids,
        vocab_size=built.vocab_size,
        segment_ids=segments,
        needed=needed,
    ).detach()
    changed = torch.tensor([t not in (0.0, 1.0) or k > 0 or p < 1 or m > 0 for t, k, p, m in settings])
    gap = (raw[rows, cols] - expected).abs()
    changed &= kept
    print(f"raw (T=1) logprobs differ from vLLM's by {gap[changed].mean():.3f} nats on average")
    assert gap[changed].mean().item() > 0.1 and gap[~changed & kept].max().item() <= 1e-5


def test_the_step_reports_the_gap_and_constrained_tokens_train_at_ratio_one(
    megatron_world, tiny_llama_dir: Path
) -> None:
    from art_mega.trainer.batch import TrainBatch
    from art_mega.trainer.behaviour import CONSTRAINED, EXACT
    from art_mega.trainer.protocol import GRPOLossConfig
    from art_mega.trainer.rank.engine import TrainerEngine
    from tests.trainer.engine_scenarios import LORA, OPTIMIZER

    engine = TrainerEngine(tiny_llama_dir, megatron_world, lora=LORA, optimizer=OPTIMIZER)
    ids = input_ids(engine.vocab_size)[:1].numpy()
    shape = ids.shape
    trained = np.zeros(shape, dtype=np.float32)
    trained[:, 12:] = 1.0

    def batch(old: np.ndarray, code: np.ndarray) -> TrainBatch:
        return TrainBatch(
            input_ids=ids,
            segment_ids=np.ones(shape, dtype=np.int32),
            position_ids=np.arange(shape[1], dtype=np.int64)[None],
            loss_mask=trained,
            old_logprobs=old,
            advantages=trained.copy(),
            weights=trained / trained.sum(),
            temperature=np.where(trained > 0, 0.7, 1.0).astype(np.float32),
            top_p=np.where(trained > 0, 0.9, 1.0).astype(np.float32),
            sampling=code,
        )

    exact = np.where(trained > 0, EXACT, 0).astype(np.int8)
    sampler = engine.logprobs(batch(np.zeros(shape, np.float32), exact))  # what a processed sampler reports
    config = GRPOLossConfig()
    on_policy = engine.train_step(batch(sampler, exact), "grpo", config, learning_rate=1e-9)
    print(f"\nexact tokens: {on_policy}")
    assert on_policy["offpolicy/sampler_logprob_gap_mean"] <= 1e-6
    assert abs(on_policy["loss/ratio_mean"] - 1.0) <= 1e-6
    assert on_policy["offpolicy/constrained_token_fraction"] == 0.0

    # half of the tokens sampled under a grammar mask: vLLM reports ~0 for them
    masked = trained.copy()
    masked[:, :18] = 0.0
    after_mask = np.where(masked > 0, 0.0, sampler).astype(np.float32)
    code = np.where(masked > 0, CONSTRAINED, exact).astype(np.int8)
    constrained = engine.train_step(batch(after_mask, code), "grpo", config, learning_rate=1e-9)
    gap = float(np.abs(sampler[masked > 0]).sum() / (trained > 0).sum())
    print(f"constrained tokens: {constrained}")
    assert constrained["offpolicy/constrained_token_fraction"] == 0.5
    assert abs(constrained["offpolicy/sampler_logprob_gap_mean"] - gap) <= 1e-4 and gap > 1.0
    assert abs(constrained["loss/ratio_mean"] - 1.0) <= 1e-5
    # the same sampler logprobs taken at their word (as before the rule): the ratio collapses
    taken = engine.train_step(batch(after_mask, exact), "grpo", config, learning_rate=1e-9)
    print(f"taken at their word: loss/ratio_mean {taken['loss/ratio_mean']:.4f}")
    assert taken["loss/ratio_mean"] < 0.6
