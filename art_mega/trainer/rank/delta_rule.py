"""The gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", 2024), the linear
attention of Qwen3-Next / Qwen3.5's gated delta-net layers, in plain torch (any device).

Per head, with a state S [d_k, d_v] starting at zero, keys and queries L2-normalised (eps 1e-6
inside the root, as fla's `l2norm`) and queries scaled by d_k^-0.5, token t does

    S <- S * exp(g_t)                              (decay, g_t <= 0)
    S <- S + beta_t * k_t (v_t - S^T k_t)^T        (delta-rule write, 0 < beta_t < 1)
    o_t = S^T q_t

(transformers 5.19 `models/qwen3_5/modeling_qwen3_5.py` torch_recurrent_gated_delta_rule;
`recurrent_gated_delta_rule` below is that loop). `chunk_gated_delta_rule` computes the same in
chunks of C tokens (the WY form of the same paper, as transformers' torch_chunk_gated_delta_rule
and fla's kernels): inside a chunk the writes are solved at once with a unit lower-triangular
system, the state is carried between chunks. Both compute in fp32 and return the input dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's and transformers' `l2norm`)."""
    import torch

    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """[b, s, h, d] / [b, s, h] inputs -> fp32 [b, h, s, d] / [b, h, s], q and k normalised, q scaled."""
    import torch

    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    return tuple(x.transpose(1, 2).contiguous().to(torch.float32) for x in (q, k, v, g, beta))


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The gated delta rule token by token (the module docstring's loop): the reference.

    q, k [b, s, h, d_k]; v [b, s, h, d_v]; g (log decay, <= 0), beta (write strength in (0, 1))
    [b, s, h]. Returns o [b, s, h, d_v] in v's dtype.
    """
    import torch

    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, s, dk = k.shape
    state = k.new_zeros(b, h, dk, v.shape[-1])
    out = torch.empty_like(v)
    for t in range(s):
        state = state * g[:, :, t, None, None].exp()
        stored = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        delta = (v[:, :, t] - stored) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out.transpose(1, 2).to(dtype)


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64
) -> Tensor:
    """The gated delta rule in chunks of `chunk_size` tokens; same arguments and result as
    `recurrent_gated_delta_rule` (equal up to fp32 rounding).

    Within a chunk, with G the cumulative sum of g (so the decay from token j to token i >= j is
    D[i, j] = exp(G_i - G_j)) and the state S entering the chunk:

    - the delta-rule writes u_i = beta_i (v_i - (decayed S and earlier writes)^T k_i) solve the
      unit lower-triangular system (I + A) [u | w] = [beta v | beta k exp(G)], with
      A[i, j] = beta_i k_i . k_j D[i, j] for j < i; w maps the entering state to what it
      already stores for each key, so the new values are u - w S;
    - outputs: o_i = exp(G_i) q_i^T S + sum_{j <= i} (q_i . k_j) D[i, j] (u - w S)_j;
    - the state leaving the chunk: S exp(G_last) + sum_j exp(G_last - G_j) k_j (u - w S)_j^T.

    The sequence is zero-padded to whole chunks (padding follows every real token, so it changes
    no output). Compute is O(s C (d_k + d_v)) per head plus a C x C solve per chunk.
    """
    import torch
    import torch.nn.functional as F

    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = (-s) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (s + pad) // chunk_size

    def chunks(x: Tensor) -> Tensor:  # [b, h, n*C, ...] -> [b, h, n, C, ...]
        return x.reshape(b, h, n, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(dim=-1)  # G, [b, h, n, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # D
    k_beta = k * beta[..., None]
    a = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)  # A, strictly lower
    eye = torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    uw = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u, w = uw.split([dv, dk], dim=-1)
    intra = (q @ k.transpose(-1, -2) * decay).masked_fill(~lower, 0.0)  # j <= i
    state = q.new_zeros(b, h, dk, dv)
    out = torch.empty_like(u)
    for c in range(n):
        new = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = (q[:, :, c] * cum[:, :, c, :, None].exp()) @ state + intra[:, :, c] @ new
        last = cum[:, :, c, -1]
        tail = (last[..., None] - cum[:, :, c]).exp()[..., None]  # exp(G_last - G_j)
        state = state * last[..., None, None].exp() + (k[:, :, c] * tail).transpose(-1, -2) @ new
    out = out.reshape(b, h, n * chunk_size, dv)[:, :, :s]
    return out.transpose(1, 2).to(dtype)
