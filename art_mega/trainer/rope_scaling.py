"""RoPE scaling read from an HF config (linear and YaRN) and installed into a megatron-core GPTModel.

The formulas are transformers 5.19's, `modeling_rope_utils.py`: `_compute_linear_scaling_rope_parameters`
(linear: the default inverse frequencies divided by `factor`) and `_compute_yarn_parameters` (YaRN, Peng
et al. 2023, arXiv:2309.00071: a per-dimension blend of the interpolated frequencies inv_freq / factor and
the original ones, ramping linearly between the correction dimensions of `beta_fast` and `beta_slow`
rotations over `original_max_position_embeddings` positions, with cos and sin multiplied by the
attention factor 0.1 * ln(factor) + 1). They are written here op for op as transformers computes them,
so the inverse frequencies are bit-identical in fp32 (tests/unit/trainer/test_rope_scaling.py).

Why not megatron-core's own `YarnRotaryEmbedding` (`models/common/embeddings/yarn_rotary_pos_embedding.py`)?
Its blend is the same formula, but `GPTModel` with position_embedding_type "yarn" reads `yarn_*` fields
that `TransformerConfig` does not have, its embedding returns (angles, mscale) where
`model_builder.RopeFromPositionIds` (angles from each row's position ids) expects the plain rotary
interface with an `inv_freq`, and it has no `attention_factor` override. Here the model keeps Megatron's
plain `RotaryEmbedding` (so position ids, context parallelism and the fused/unfused paths are unchanged)
with transformers' inverse frequencies put in its `inv_freq`, and the attention factor is given to
Megatron's attention through the config fields it already reads for YaRN
(`transformer/attention.py` passes `mscale=_yarn_get_concentration_factor_from_config(config)` to
`apply_rotary_pos_emb`, which multiplies cos and sin by it, `rope_utils._apply_rotary_pos_emb_bshd`):
`yarn_rotary_scaling_factor` = factor with `yarn_mscale` / `yarn_mscale_all_dim` None gives
0.1 * ln(factor) + 1, both set gives mscale(factor, m) / mscale(factor, m_all): transformers' two cases.

Torch-free at import (the controller reads a config through it); `inv_freq` and `install` import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_mega.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

SCALED_TYPES = ("linear", "yarn")
"""The rope_type values this module implements (besides "default" and Llama 3's, which megatron-core's
`RotaryEmbedding` computes itself)."""

_REFUSED = {
    "dynamic": "its frequencies change with each batch's sequence length (dynamic NTK)",
    "longrope": "it switches between short and long frequency factors by sequence length",
}
"""rope_type -> why it is refused (the Megatron trainer computes one fixed frequency table)."""


@dataclass(frozen=True)
class RopeScaling:
    """Linear or YaRN RoPE scaling of one model, read from its HF config (`read`).

    `rope_type` "linear" or "yarn"; `factor` > 0 (the context extension). YaRN only:
    `original_max_position_embeddings` (the pre-training length), `beta_fast` / `beta_slow` (the
    rotation counts bounding the ramp; transformers' defaults 32 / 1), `truncate` (round the ramp's
    bounds to integers, transformers' default True; GPT-OSS sets False), `mscale` / `mscale_all_dim`
    (DeepSeek's attention-factor terms; None unless both are given and non-zero, as transformers
    uses them).
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @property
    def attention_factor(self) -> float:
        """The factor transformers multiplies cos and sin by: 1 for linear; for YaRN
        mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
        mscale(factor) = 0.1 * ln(factor) + 1 (1 when factor <= 1)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return float(_mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim))
        return _mscale(self.factor)

    def inv_freq(self, dim: int, theta: float, device: Any = None) -> Tensor:
        """The inverse frequencies [dim // 2] float32 of a rotary dimension `dim` with base `theta`.

        Linear: 1 / theta^(2i/dim) / factor. YaRN: inv_interp * (1 - e) + inv_extrap * e with
        inv_extrap = 1 / theta^(2i/dim), inv_interp = 1 / (factor * theta^(2i/dim)) and
        e = 1 - clamp((i - low) / (high - low), 0, 1), where low / high are the correction
        dimensions of beta_fast / beta_slow rotations (floored / ceiled when `truncate`),
        clamped to [0, dim - 1] (transformers' `_compute_yarn_parameters`).
        """
        import torch

        if self.rope_type == "linear":
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
            inv_freq = 1.0 / (theta**exponents)
            inv_freq /= self.factor
            return inv_freq
        pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (self.factor * pos_freqs)
        low, high = self.correction_range(dim, theta)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp.to(device=device, dtype=torch.float)
        return inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation

    def correction_range(self, dim: int, theta: float) -> tuple[float, float]:
        """YaRN's ramp bounds (low, high) in rotary-pair indices: the dimension whose wavelength
        makes `beta_fast` (low) and `beta_slow` (high) turns over the original length,
        d(r) = dim * ln(L / (2 pi r)) / (2 ln theta)."""

        def dim_of(rotations: float) -> float:
            length = self.original_max_position_embeddings
            return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)


def _mscale(scale: float, mscale: float = 1) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from transformers 5's `rope_parameters` or the older `rope_scaling` (a copy)."""
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def rope_type(config: dict[str, Any]) -> str:
    """The config's rope_type ("default" when none is set; the old key "type" is read too)."""
    params = rope_parameters(config)
    return str(params.get("rope_type", params.get("type", "default")))


def read(config: dict[str, Any]) -> RopeScaling | None:
    """The linear or YaRN scaling of an HF config dict; None for another rope_type (the caller
    handles "default" and "llama3").

    YaRN reads as transformers does: `original_max_position_embeddings` from the top level of the
    config when there (Phi-3 style), else from the RoPE parameters, else max_position_embeddings;
    `factor` None means max_position_embeddings / original; beta_fast / beta_slow 0 or absent mean
    32 / 1.

    Raises:
        UserError: rope_type "dynamic" or "longrope" (one sentence naming it and why), a YaRN
            `attention_factor` (megatron-core's attention computes the factor from factor/mscale
            and cannot take a given one), a linear factor that is missing or not positive.
    """
    params = rope_parameters(config)
    kind = rope_type(config)
    if kind in _REFUSED:
        raise UserError(
            f"rope_type={kind!r} is not supported because {_REFUSED[kind]}; "
            "use a checkpoint with rope_type 'default', 'linear', 'llama3' or 'yarn'."
        )
    if kind == "linear":
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise UserError(f"linear RoPE factor={factor!r} is not supported; it must be a number above 0.")
        return RopeScaling("linear", float(factor))
    if kind != "yarn":
        return None
    if params.get("attention_factor") is not None:
        raise UserError(
            f"YaRN attention_factor={params['attention_factor']} is not supported; megatron-core derives the "
            "factor from factor, mscale and mscale_all_dim, so remove attention_factor from the config."
        )
    max_positions = int(config.get("max_position_embeddings", 4096))
    original = config.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    original = int(original or max_positions)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and mscale_all_dim)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        mscale=float(mscale) if both else None,
        mscale_all_dim=float(mscale_all_dim) if both else None,
    )


def install(module: Any, scaling: RopeScaling | None, theta: float) -> None:
    """Give a megatron-core GPTModel `module` (plain `RotaryEmbedding`) transformers' scaled RoPE.

    Replaces `module.rotary_pos_emb.inv_freq` with `scaling.inv_freq(dim, theta)` (dim = the rotary
    width, twice the existing table's length; same device) and, for YaRN, sets the config fields
    Megatron's attention reads for the cos/sin factor (module docstring). A no-op for None. Call
    right after construction, before any forward (the rotary module caches its output per length).
    """
    if scaling is None:
        return
    rotary = module.rotary_pos_emb
    old = rotary.inv_freq
    rotary.inv_freq = scaling.inv_freq(2 * old.shape[0], theta, device=old.device)
    rotary.forward.cache_clear()
    if scaling.rope_type == "yarn":
        config = module.config
        config.yarn_rotary_scaling_factor = scaling.factor
        config.yarn_mscale = scaling.mscale
        config.yarn_mscale_all_dim = scaling.mscale_all_dim
