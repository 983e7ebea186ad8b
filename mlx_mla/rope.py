"""Decoupled RoPE for MLA's q_pe / k_pe, with YaRN context extension.

The math follows transformers' ``_compute_yarn_parameters`` and DeepSeek's
``DeepseekV2YarnRotaryEmbedding`` (modeling_deepseek.py); YaRN is Peng et al. 2023,
"YaRN: Efficient Context Window Extension of Large Language Models", section 3.
DeepSeek-V2 rotates *interleaved* pairs (x[2i], x[2i+1]) — MLX's ``traditional=True`` —
not the half-split layout of Llama.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import mlx.core as mx
import numpy as np


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor 0.1·mscale·ln(scale) + 1 (1 when scale ≤ 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(dim: int, base: float, rope: Dict[str, Any]) -> np.ndarray:
    """Per-pair inverse frequencies θ_i (radians per position), shape (dim // 2,), float32.

    With YaRN, pairs rotating fast enough (more than ``beta_fast`` turns over the original
    context) keep their frequency, slow ones (fewer than ``beta_slow`` turns) are divided by
    ``factor``, and a linear ramp blends the ones between. The correction range is
    floor/ceil-truncated and computed over ``dim`` (not ``dim // 2``), as the reference does.
    """
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(base) ** exponents
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    if rope["rope_type"] == "default":
        return extrapolation
    factor = float(rope["factor"])
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        original = rope["original_max_position_embeddings"]
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(rope["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1.0 - ramp).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def attention_factor(rope: Dict[str, Any]) -> float:
    """Scale YaRN applies to cos/sin (so to both q_pe and k_pe): mscale(factor, mscale) /
    mscale(factor, mscale_all_dim); 1.0 without YaRN."""
    if rope["rope_type"] == "default":
        return 1.0
    factor = rope["factor"]
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return yarn_get_mscale(factor, rope["mscale"]) / yarn_get_mscale(
            factor, rope["mscale_all_dim"]
        )
    return yarn_get_mscale(factor)


def softmax_scale(q_head_dim: int, rope: Dict[str, Any]) -> float:
    """Softmax scale: q_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN.

    DeepSeek corrects the temperature of *all* score dimensions (nope and rope alike) here,
    which is why it cannot be folded into the RoPE attention factor.
    """
    scale = q_head_dim**-0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        m = yarn_get_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    return scale


class RoPE:
    """Applies interleaved (YaRN) RoPE to the last axis of q_pe or k_pe.

    Not an ``nn.Module`` on purpose: its frequencies are derived from the config, not
    weights, so they must not appear among the parameters a checkpoint is checked against.
    """

    # DeepSeek-V2's pairs are interleaved; a flag rather than a constant so a test can make
    # one engine wrong on purpose and check that ``compare`` catches it.
    traditional = True

    def __init__(self, dim: int, base: float, rope: Dict[str, Any]):
        self.dim = dim
        # mx.fast.rope takes wavelengths (positions per radian), the inverse of θ_i.
        self._wavelengths = mx.array(1.0 / inverse_frequencies(dim, base, rope))
        self.scale = attention_factor(rope)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        """x: (..., L, dim) at positions offset..offset+L-1 → same shape and dtype."""
        if self.scale != 1.0:
            x = x * self.scale
        return mx.fast.rope(
            x, self.dim, traditional=self.traditional, base=None, scale=1.0, offset=offset,
            freqs=self._wavelengths,
        )
