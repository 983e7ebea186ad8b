"""How a latent cache stores c_kv and k_pe: as they come, or c_kv in MLX's affine format.

A quantized latent cache keeps c_kv as ``mx.quantize`` output (packed weights plus one
scale and one bias per ``group_size`` values, along kv_lora_rank) and k_pe in the activation
dtype. k_pe stays in float because it is small (qk_rope_head_dim = 64 of DeepSeek-V2-Lite's
576 cached values per token), it carries the positional (RoPE) signal every score depends
on, and MLX cannot group fewer than 32 values at all (the demo model's k_pe has 16); see the
README's cache section for the measurements.

The absorbed strategies multiply by a ``QuantizedLatent`` directly with
``mx.quantized_matmul`` (scores = q_latent · c_kvᵀ, then P · c_kv), so the cache is never
dequantized as a whole; ``naive`` dequantizes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Tuple, Union

import mlx.core as mx


class QuantizedLatent(NamedTuple):
    """c_kv of S positions in MLX's affine format (``mx.quantize`` along kv_lora_rank).

    weight: (B, S, r·bits/32) uint32; scales, biases: (B, S, r/group_size) in the
    activation dtype.
    """

    weight: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int

    @property
    def shape(self) -> Tuple[int, int, int]:
        """The logical (B, S, kv_lora_rank)."""
        B, S, packed = self.weight.shape
        return B, S, packed * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    def dequantize(self) -> mx.array:
        """c_kv as a float (B, S, kv_lora_rank) array in the scales' dtype."""
        return mx.dequantize(self.weight, self.scales, self.biases,
                             group_size=self.group_size, bits=self.bits)


Latent = Union[mx.array, QuantizedLatent]


@dataclass(frozen=True)
class Codec:
    """The encoding of one latent cache: float (``bits`` 0) or c_kv affine-quantized to
    ``bits`` with ``group_size`` values per scale/bias.

    ``encode`` turns (c_kv (B, L, r), k_pe (B, L, dr)) into the arrays stored, in pairs of
    one dtype each (the storage holds arrays two by two, see ``mlx_mla.cache.latent``): float
    [(c_kv, k_pe)]; quantized [(weight, ∅), (scales, biases), (k_pe, ∅)], ∅ a zero-width
    array of its partner's dtype, since a pair shares one dtype when storage pads or merges.
    ``decode`` reverses it for the stored positions.
    """

    group_size: int = 0
    bits: int = 0

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def encode(self, c_kv: mx.array, k_pe: mx.array) -> List[Tuple[mx.array, mx.array]]:
        if not self.quantized:
            return [(c_kv, k_pe)]
        w, scales, biases = mx.quantize(c_kv, group_size=self.group_size, bits=self.bits)
        return [(w, w[..., :0]), (scales, biases), (k_pe, k_pe[..., :0])]

    def decode(self, pairs: List[Tuple[mx.array, mx.array]]) -> Tuple[Latent, mx.array]:
        if not self.quantized:
            (c_kv, k_pe), = pairs
            return c_kv, k_pe
        (w, _), (scales, biases), (k_pe, _) = pairs
        return QuantizedLatent(w, scales, biases, self.group_size, self.bits), k_pe

    @property
    def n_pairs(self) -> int:
        """How many array pairs ``encode`` makes."""
        return 3 if self.quantized else 1


FLOAT = Codec()


def quantized_codec(group_size: int, bits: int, kv_lora_rank: int) -> Codec:
    """The codec for ``--kv-bits bits --kv-group-size group_size``.

    Raises:
        ValueError: bits or group size MLX cannot quantize with, or a group size that does
            not divide kv_lora_rank.
    """
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"kv bits {bits} is not supported: use 4 or 8 (MLX also takes 2, 3, 5, 6)")
    if group_size not in (32, 64, 128) or kv_lora_rank % group_size:
        raise ValueError(
            f"kv group size {group_size} must be 32, 64 or 128 and divide kv_lora_rank "
            f"({kv_lora_rank})"
        )
    return Codec(group_size, bits)
