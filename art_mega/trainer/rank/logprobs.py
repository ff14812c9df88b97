"""Per-token log-probabilities and entropies from vocab-parallel logits, and packed-row attention masks.

No rank materialises the full vocabulary: each TP rank holds V/tp logit columns and the
softmax normaliser is assembled with all-reduces over the TP group (Megatron's
`tensor_parallel.vocab_parallel_cross_entropy`, which is -log p). Under context parallelism
each CP rank computes the values of its own positions (`cp_attention` split) and they are
all-gathered back into sequence order, so callers always see whole rows.

Needed positions: a loss reads the logprobs (and entropies) of its trained tokens only. Given
`needed` (bool [B, S], whole rows, True at the tokens whose values are read, e.g.
`loss_mask > 0`), `forward_logits` runs the output layer (LM head) only on the positions that
predict those tokens (position t - 1 for token t of the same document; this CP rank's share),
and `token_logprobs` / `token_entropy` with the same `needed` compute the vocabulary terms
there and return whole rows [B, S] holding 0.0 at every other token, as today's masked tokens.

The sampled distribution (`SamplingRows`, the behaviour-policy rule of `trainer.behaviour`): a
token sampled at temperature T with top_k / top_p / min_p has the logprob of the distribution
vLLM 0.32 drew it from (`v1/sample/sampler.py`, `ops/topk_topp_sampler.py`): the logits divided
by T, then min_p (vLLM's `MinPLogitsProcessor`: tokens whose probability is below min_p times the
largest are dropped), then top_k (the k largest kept), then top_p (the smallest set of largest
logits whose probability reaches p, computed after top_k; the largest is always kept), the kept
set renormalised by the softmax. As verl does, the temperature applies in every logprob pass
(old-policy and reference recomputation, and the update). The kept set of every truncated
position is {v : l_v / T >= tau} for one threshold tau per position (`_kept_threshold`; vLLM
masks by sorted position, so only exact ties at the boundary can differ): the cross entropy then
only compares each logit with its position's tau. Finding tau needs each truncated position's
whole vocabulary row: `TRUNCATION_CHUNK` positions at a time are gathered over the TP group and
sorted (no gradient), float32 [C, V] values plus int64 [C, V] sort indices, so the extra working
set is about 16 * C * V bytes (C = 128, V = 152k: ~0.3 GB) and the cost O(K V log V) for K
truncated positions; a temperature alone costs one division of the logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from art_mega.trainer.behaviour import GREEDY_TEMPERATURE

TRUNCATION_CHUNK = 128
"""Positions whose whole vocabulary rows are sorted at once to find their kept sets."""


@dataclass(frozen=True)
class SamplingRows:
    """What each token was sampled with, per token of whole rows (each [B, S]): `temperature`
    float32, `top_k` int (0: off), `top_p` float32 (1: off), `min_p` float32 (0: off); a token
    that was not sampled holds T=1 and no truncation (`batch.SAMPLING_FIELDS`)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> SamplingRows | None:
        """The rows' sampling from a batch's tensors (`TrainBatch.to_torch`), None where every
        token is T=1 without truncation (the raw logits' distribution: nothing to do)."""
        if "temperature" not in tensors:
            return None
        rows = cls(tensors["temperature"], tensors["top_k"], tensors["top_p"], tensors["min_p"])
        if bool((rows.temperature == 1.0).all()) and not rows.truncates():
            return None
        return rows

    def truncates(self) -> bool:
        """Whether any token was sampled with top_k, top_p or min_p."""
        return bool((self.top_k > 0).any() or (self.top_p < 1.0).any() or (self.min_p > 0.0).any())

    def at_positions(self, keep: torch.Tensor | None) -> SamplingRows:
        """Per position instead of per token (position t predicts token t + 1, the last position
        predicts nothing: T=1), for this CP rank's positions (`_for_this_cp_rank`), and with
        `keep` (bool [B, P]) only the kept ones, [1, K] each."""

        def move(values: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full_like(values, fill)
            out[:, :-1] = values[:, 1:]
            out = _for_this_cp_rank(out)
            return out if keep is None else out[keep][None]

        return SamplingRows(
            move(self.temperature, 1.0), move(self.top_k, 0), move(self.top_p, 1.0), move(self.min_p, 0.0)
        )


def _temperature(sampling: SamplingRows) -> torch.Tensor:
    """Per-position temperatures [B, P, 1] (float32), greedy ones (T < `GREEDY_TEMPERATURE`, as
    vLLM's sampler treats them, also CP padding) taken as 1."""
    t = sampling.temperature.float()
    return torch.where(t < GREEDY_TEMPERATURE, torch.ones_like(t), t)[..., None]


@torch.no_grad()
def _kept_threshold(
    logits: torch.Tensor, targets: torch.Tensor, sampling: SamplingRows
) -> torch.Tensor | None:
    """tau float32 [B, P]: position p's kept set is {v : logits[p, v] / T_p >= tau[p]} (-inf where
    nothing is truncated), None when no position is truncated.

    `logits` [B, P, V_padded / tp] this TP rank's columns (padded ones already at the dtype's
    minimum); `targets` int64 [B, P], the sampled token of each position, is always kept (tau is
    lowered to its logit: a token sampled outside the trainer's kept set, by a rounding at the
    boundary, keeps a finite logprob). Collective over the TP group. vLLM 0.32's order: min_p
    on the softmax of l / T, then top_k, then top_p on the softmax of what top_k kept.
    """
    top_p = torch.where(sampling.top_p > 0.0, sampling.top_p, torch.ones_like(sampling.top_p))  # CP padding: 0
    truncated = (sampling.top_k > 0) | (top_p < 1.0) | (sampling.min_p > 0.0)
    if not bool(truncated.any()):
        return None
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    tp = mpu.get_tensor_model_parallel_world_size()
    flat = logits.reshape(-1, logits.shape[-1])
    temperature = _temperature(sampling).reshape(-1, 1)
    tau = torch.full((flat.shape[0],), float("-inf"), dtype=torch.float32, device=logits.device)
    rows = truncated.reshape(-1).nonzero().flatten()
    for first in range(0, rows.numel(), TRUNCATION_CHUNK):
        chunk = rows[first : first + TRUNCATION_CHUNK]
        local = flat[chunk].float()
        if tp > 1:
            pieces = [torch.empty_like(local) for _ in range(tp)]
            torch.distributed.all_gather(pieces, local.contiguous(), group=group)
            local = torch.cat(pieces, dim=-1)
        values = local / temperature[chunk]
        tau[chunk] = _row_threshold(
            values,
            targets.reshape(-1)[chunk],
            sampling.top_k.reshape(-1)[chunk],
            top_p.reshape(-1)[chunk].float(),
            sampling.min_p.reshape(-1)[chunk].float(),
        )
    return tau.reshape(logits.shape[:-1])


def _row_threshold(
    values: torch.Tensor, targets: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """tau [C] of whole rows `values` float32 [C, V] (logits / T), as `_kept_threshold`."""
    x = values.clone()
    if bool((min_p > 0).any()):  # vLLM's MinPLogitsProcessor.apply
        probs = x.softmax(dim=-1)
        x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], float("-inf"))
    ordered = x.sort(dim=-1).values  # ascending, as apply_top_k_top_p_pytorch
    vocab = ordered.shape[1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k.long(), torch.full_like(top_k.long(), vocab))
    kth = ordered.gather(1, (vocab - k)[:, None])
    masked = (ordered < kth) | (ordered == float("-inf"))
    ordered = ordered.masked_fill(masked, float("-inf"))
    if bool((top_p < 1.0).any()):
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        cut = cumulative <= (1.0 - top_p)[:, None]
        cut[:, -1] = False  # at least one
        masked |= cut
    first = masked.sum(dim=-1).clamp(max=vocab - 1)  # the kept set is a suffix of the sorted row
    tau = ordered.gather(1, first[:, None]).squeeze(1)
    own = values.gather(1, targets.long()[:, None]).squeeze(1)
    return torch.minimum(tau, own)


def _sampled_logits(logits: torch.Tensor, sampling: SamplingRows, tau: torch.Tensor | None) -> torch.Tensor:
    """float32 logits of the distribution the tokens were sampled from: `logits` [B, P, V/tp] /
    T, those below their position's `tau` [B, P] (`_kept_threshold`) at float32's minimum (out
    of the softmax); differentiable in the kept logits. A new tensor: `logits` is not modified."""
    # padded vocabulary columns (the dtype's minimum) may overflow to -inf at T < 1: out of the
    # softmax all the same (exp gives 0, and so does their gradient)
    x = logits.float() / _temperature(sampling)
    if tau is None:
        return x
    return x.masked_fill(x < tau[..., None], torch.finfo(torch.float32).min)


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed rows: bool [B, 1, S, S], True = masked (Megatron's convention).

    `segment_ids` int [B, S]: document index within the row, from 1; 0 marks padding. Query t
    may attend to key u when u <= t and both belong to the same document (block-diagonal causal).
    A padding token attends to itself only, so no softmax row is empty. Megatron's local
    `DotProductAttention` applies an explicit mask whatever its `attn_mask_type`
    (`fusions/fused_softmax.py` forward_torch_softmax builds the causal mask only when none is
    given). The fused CUDA softmax (`masked_softmax_fusion`, off by default in 0.16) and
    TransformerEngine's attention ignore it for a causal layer: packed rows there need
    Megatron's `PackedSeqParams` (THD) instead.
    """
    from art_mega.trainer.rank.cp_attention import attention_mask_for_queries

    positions = torch.arange(segment_ids.shape[1], device=segment_ids.device)
    return attention_mask_for_queries(segment_ids, positions)


def _mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """`logits` with the columns of padded vocabulary ids (>= vocab_size) set to the dtype's minimum.

    Megatron pads the vocabulary to a multiple of TP with zero rows; their logit (0) must not
    enter the softmax. Returns `logits` itself when this rank has no padded column.
    """
    local = logits.shape[-1]
    valid = vocab_size - tp_rank * local
    if valid >= local:
        return logits
    keep = torch.arange(local, device=logits.device) < valid
    return logits.masked_fill(~keep, torch.finfo(logits.dtype).min)


def _next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """targets[:, t] = input_ids[:, t + 1]; the last column (no next token) is 0."""
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


def _shift_to_token(values: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """Move per-position predictions onto the predicted token: out[:, t] = values[:, t - 1].

    out[:, 0] = 0, and so is every first token of a document or padding token (its "previous"
    position belongs to another document).
    """
    out = torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)
    if segment_ids is None:
        return out
    continues = torch.zeros_like(segment_ids, dtype=torch.bool)
    continues[:, 1:] = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    return torch.where(continues, out, torch.zeros_like(out))


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_size: int,
    segment_ids: torch.Tensor | None = None,
    chunk_size: int | None = None,
    needed: torch.Tensor | None = None,
    sampling: SamplingRows | None = None,
) -> torch.Tensor:
    """log p(input_ids[t] | tokens < t of its document), float32 [B, S], differentiable.

    Args:
        logits: this TP rank's vocabulary shard of the model output, [B, S, V_padded / tp]
            (contiguous, any float dtype). Megatron's kernel works in place on float32 logits:
            the tensor is consumed, do not use it afterwards.
        input_ids: int64 [B, S], the same on every TP rank.
        vocab_size: the real vocabulary size; padded columns (ids >= vocab_size) are excluded.
        segment_ids: int [B, S] of packed rows (see `packed_attention_mask`), or None for one
            document per row.
        chunk_size: None (the whole rows at once) or ART's `logprob_calculation_chunk_size`:
            the cross entropy runs over `chunk_size` positions of this rank's logits at a time,
            so its float32 working set is [B, chunk_size, V_padded / tp]; with a gradient each
            chunk is recomputed in the backward (activation checkpointing) rather than kept.
            The values are the same. A last chunk shorter than `chunk_size` is allowed (ART
            asserts that the length is a multiple; packed rows here have any length). Chunked,
            `logits` is read, not consumed. With `needed` the chunks are of needed positions.
        needed: None (every position) or bool [B, S], the tokens whose logprob is read, as given
            to `forward_logits`: `logits` are then its [1, K, V_padded / tp] (K positions of this
            rank) and every other token holds 0.0.
        sampling: None (the raw logits' distribution, T=1) or what each token was sampled with:
            its logprob is then that of the distribution it was drawn from (temperature and
            truncation, see the module docstring), per token of the rows.

    Position 0, the first token of every document and padding tokens hold 0.0: mask them out.
    Call on every rank of the TP group (it all-reduces over it). With CP > 1, `logits` are
    this CP rank's positions as `forward_logits` returns them ([B, S'/cp, ...], S' = S padded
    to a multiple of 2*cp) while `input_ids`, `segment_ids` and the result are whole rows
    [B, S]: the values are all-gathered over the CP group (call on every CP rank); the
    backward gives each rank the gradient of its own positions.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = _mask_padded_vocab(logits, vocab_size, mpu.get_tensor_model_parallel_rank())
    targets = _for_this_cp_rank(_next_token_targets(input_ids))
    keep = None
    if needed is None:
        _check_positions(logits, targets.shape[1], "positions of this rank's rows")
    else:
        keep = _kept_positions(needed, segment_ids)
        targets = targets[keep][None]
        _check_positions(logits, targets.shape[1], "needed positions of this rank")
    positions = None if sampling is None else sampling.at_positions(keep)
    tau = None if positions is None else _kept_threshold(logits.detach(), targets, positions)
    if chunk_size is None or logits.shape[1] == 0:
        if positions is not None:
            logits = _sampled_logits(logits, positions, tau)
        nll = vocab_parallel_cross_entropy(logits, targets)
    else:
        nll = torch.cat(
            [
                _chunk_nll(
                    logits[:, start : start + chunk_size],
                    targets[:, start : start + chunk_size],
                    None if positions is None else _slice(positions, start, chunk_size),
                    None if tau is None else tau[:, start : start + chunk_size],
                )
                for start in range(0, logits.shape[1], chunk_size)
            ],
            dim=1,
        )
    return _shift_to_token(_whole_rows(_scatter(-nll.float(), keep), input_ids.shape[1]), segment_ids)


def _check_positions(logits: torch.Tensor, expected: int, what: str) -> None:
    """Refuse logits [B, P, V] whose P is not the `expected` count of `what`."""
    if logits.shape[1] != expected:
        raise ValueError(
            f"logits hold {logits.shape[1]} positions where {expected} {what} are expected: pass "
            "token_logprobs / token_entropy the rows and `needed` given to forward_logits"
        )


def _slice(sampling: SamplingRows, start: int, size: int) -> SamplingRows:
    """Positions [start, start + size) of per-position `sampling` ([B, P] each)."""
    return SamplingRows(
        *(
            values[:, start : start + size]
            for values in (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        )
    )


def _chunk_nll(
    logits: torch.Tensor,
    targets: torch.Tensor,
    sampling: SamplingRows | None = None,
    tau: torch.Tensor | None = None,
) -> torch.Tensor:
    """-log p of `targets` [B, C] under a slice of logits [B, C, V_padded / tp], float32 [B, C]
    (with `sampling`, per position [B, C], and its `tau`: of the sampled distribution).

    Megatron's kernel upcasts and works in place, so it gets its own float32 copy of the slice
    (the caller's logits stay intact for the other chunks and for a recomputation). With a
    gradient the chunk is checkpointed: only the slice is kept, and the softmax is recomputed
    in the backward, so at most one chunk's float32 softmax is alive at a time.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def nll(chunk: torch.Tensor) -> torch.Tensor:
        if sampling is not None:
            return vocab_parallel_cross_entropy(_sampled_logits(chunk, sampling, tau), targets)
        return vocab_parallel_cross_entropy(chunk.to(torch.float32, copy=True), targets)

    if not (torch.is_grad_enabled() and logits.requires_grad):
        return nll(logits)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(nll, logits, use_reentrant=False)


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor,
    *,
    vocab_size: int,
    segment_ids: torch.Tensor | None = None,
    needed: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy (nats) of the distribution each token was drawn from, float32 [B, S], no gradient.

    H = log Z - sum_v p_v l_v with l the logits shifted by their max and Z = sum_v exp(l_v); two
    all-reduces over the TP group of [B, S] numbers each (a chunk's [B, chunk] with
    `chunk_size`). Aligned and zeroed like `token_logprobs`. `logits` is read, not modified:
    call this before `token_logprobs`. With CP > 1 `logits` are this CP rank's positions and
    `segment_ids` (required then) the whole rows; the result is whole rows [B, S], gathered over
    the CP group. With `needed` (bool [B, S], as given to `forward_logits`) `logits` are
    [1, K, V_padded / tp] at the needed positions and every other token holds 0.0.
    `chunk_size` (ART's `logprob_calculation_chunk_size`, as in `token_logprobs`): the working
    set (`_entropy`, about 25 bytes an element) is held for that many positions at a time
    instead of all of them; every position's entropy is computed alone, so the values are the
    same.
    """
    with torch.no_grad():
        positions = logits.shape[1]
        step = chunk_size or positions
        # one call on no positions too: every TP rank makes the same all-reduces
        starts = range(0, positions, step) if positions else [0]
        entropy = torch.cat([_entropy(logits[:, start : start + step], vocab_size) for start in starts], dim=1)
    length = segment_ids.shape[1] if segment_ids is not None else None
    if needed is None:
        return _shift_to_token(_whole_rows(entropy, length), segment_ids)
    keep = _kept_positions(needed, segment_ids)
    _check_positions(logits, int(keep.sum()), "needed positions of this rank")
    return _shift_to_token(_whole_rows(_scatter(entropy, keep), needed.shape[1]), segment_ids)


def _entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Entropy (nats) float32 [B, C] of this TP rank's vocabulary shard [B, C, V_padded / tp] of
    the logits, all-reduced over the TP group (`token_entropy`). Its working set, float32 [B, C,
    V/tp] each: the shifted logits, their exp, `exp > 0` (bool), `exp * shifted`, the zeros and
    the `torch.where` result (plus a float32 copy of 16-bit logits)."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    local = _mask_padded_vocab(logits.float(), vocab_size, mpu.get_tensor_model_parallel_rank())
    peak = local.max(dim=-1).values
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = local - peak[..., None]
    exp = shifted.exp()
    # Padded columns sit at -inf after the shift: their exp is 0 and so is their term.
    weighted = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp))
    sums = torch.stack([exp.sum(dim=-1), weighted.sum(dim=-1)])
    torch.distributed.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]


def forward_logits(
    module: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    *,
    needed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run a GPTModel (or its DDP wrapper) on packed rows: this rank's logits [B, S, V_padded / tp].

    `input_ids`, `position_ids` int64 [B, S]; `segment_ids` int [B, S] or None (plain causal
    attention, one document per row). With context parallelism (CP > 1) the arguments are
    still whole rows: they are padded to S' (a multiple of 2*cp; padding is its own segment 0,
    seen by no real token) and this CP rank runs its positions (`cp_attention.slice_for_cp_rank`)
    with the mask of its queries against the whole row (`cp_attention.cp_attention_mask`);
    the result is [B, S'/cp, V_padded / tp], for `token_logprobs` / `token_entropy`.

    `needed` (bool [B, S], whole rows): only the positions predicting a needed token of their
    own document (t - 1 for token t; under CP this rank's share of them) go through the output
    layer; the result is [1, K, V_padded / tp], those K positions in row-major order of this
    rank's [B, S'/cp] layout, for `token_logprobs` / `token_entropy` with the same `needed`.
    The transformer layers still run every position (attention needs them). A sequence-parallel
    output layer (MoE at TP > 1) gets its sequence shard, not whole rows: there the LM head runs
    every position and the K rows are taken from its output (same values, the cross entropy
    still runs on K positions only).
    """
    from megatron.core import parallel_state as mpu

    cp_size = mpu.get_context_parallel_world_size()
    keep = None if needed is None else _kept_positions(needed, segment_ids)
    if cp_size == 1:
        mask = None if segment_ids is None else packed_attention_mask(segment_ids)
        return _run(module, keep, input_ids, position_ids, mask)
    from art_mega.trainer.rank.cp_attention import cp_attention_mask, padded_length, slice_for_cp_rank

    cp_rank = mpu.get_context_parallel_rank()
    length = padded_length(input_ids.shape[1], cp_size)
    input_ids, position_ids = _pad_columns(input_ids, length), _pad_columns(position_ids, length)
    mask = None
    if segment_ids is not None:
        mask = cp_attention_mask(_pad_columns(segment_ids, length), cp_size, cp_rank)
    return _run(
        module,
        keep,
        slice_for_cp_rank(input_ids, cp_size, cp_rank),
        slice_for_cp_rank(position_ids, cp_size, cp_rank),
        mask,
    )


def _run(module: torch.nn.Module, keep: torch.Tensor | None, *inputs: torch.Tensor | None) -> torch.Tensor:
    """`module(*inputs)`; with `keep` (bool [B, P], this rank's positions) the output layer sees
    the hidden states [K, 1, h] of the kept positions only and the result is [1, K, V_padded / tp].
    A pipeline stage other than the last (no output layer) returns its hidden states [P, B, h]
    for the next stage, whatever `keep`."""
    if keep is None:
        return module(*inputs)
    gpt = module
    while not hasattr(gpt, "post_process"):  # DDP / Float16Module wrappers hold the GPTModel
        gpt = gpt.module
    if not gpt.post_process:  # a pipeline stage before the last: hidden states, no output layer
        return module(*inputs)
    output_layer = gpt.output_layer
    rows, cols = keep.nonzero(as_tuple=True)
    if output_layer.sequence_parallel:
        return module(*inputs)[rows, cols][None]

    def kept_hidden(layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Megatron's hidden states are [s, b, h]: index (position, row), row-major over [b, s]
        return (args[0][cols, rows][:, None], *args[1:]), kwargs

    hook = output_layer.register_forward_pre_hook(kept_hidden, with_kwargs=True)
    try:
        return module(*inputs)
    finally:
        hook.remove()


def _kept_positions(needed: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """The positions whose logits predict a needed token: bool [B, S'/cp] of this CP rank.

    Position p is kept when token p + 1 is `needed` and belongs to the same document as p (the
    first token of a document and padding hold 0.0 whatever the logits, `_shift_to_token`).
    """
    keep = torch.zeros_like(needed, dtype=torch.bool)
    keep[:, :-1] = needed[:, 1:].bool()
    if segment_ids is not None:
        keep[:, :-1] &= (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    return _for_this_cp_rank(keep)


def _scatter(values: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """[1, K] values of the kept positions -> [B, P] with 0.0 elsewhere (identity without `keep`);
    differentiable, the gradient of the zeros is dropped."""
    if keep is None:
        return values
    rows, cols = keep.nonzero(as_tuple=True)
    return values.new_zeros(keep.shape).index_put((rows, cols), values[0])


def _pad_columns(values: torch.Tensor, length: int) -> torch.Tensor:
    """[B, S] -> [B, length] with zero columns appended (length >= S)."""
    extra = length - values.shape[1]
    return values if extra == 0 else torch.cat([values, values.new_zeros(values.shape[0], extra)], dim=1)


def _for_this_cp_rank(values: torch.Tensor) -> torch.Tensor:
    """Whole rows [B, S] -> this CP rank's positions [B, S'/cp], as `forward_logits` runs them
    (identity at CP=1)."""
    from megatron.core import parallel_state as mpu

    from art_mega.trainer.rank.cp_attention import padded_length, slice_for_cp_rank

    cp_size = mpu.get_context_parallel_world_size()
    if cp_size == 1:
        return values
    length = padded_length(values.shape[1], cp_size)
    return slice_for_cp_rank(_pad_columns(values, length), cp_size, mpu.get_context_parallel_rank())


def _whole_rows(local: torch.Tensor, length: int | None) -> torch.Tensor:
    """This CP rank's per-position values [B, S'/cp] -> whole rows [B, length], gathered over the
    CP group in sequence order (identity at CP=1); the backward keeps this rank's own positions."""
    from megatron.core import parallel_state as mpu

    from art_mega.trainer.rank.cp_attention import gather_from_cp_ranks

    if mpu.get_context_parallel_world_size() == 1:
        return local
    if length is None:
        raise ValueError("segment_ids (whole rows) are required under context parallelism")
    return gather_from_cp_ranks(local, mpu.get_context_parallel_group(), dim=1)[:, :length]
