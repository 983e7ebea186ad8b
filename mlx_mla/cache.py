"""The latent cache: per layer, only c_kv and the roped k_pe of every past token.

That is (kv_lora_rank + qk_rope_head_dim) values per token per layer — 576 for
DeepSeek-V2-Lite, against 16 heads × (192 + 128) = 5,120 for a decompressed K/V cache
(DeepSeek-V2 paper, section 2.1.2 and table 1).
"""

from __future__ import annotations

from typing import Iterable, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask


class LatentCache:
    """Per-layer latent cache, preallocated in blocks of ``step`` tokens.

    Fields, once filled (B = batch, S = allocated positions ≥ ``offset``):
        c_kv: (B, S, kv_lora_rank), the normalised KV latent (after kv_a_layernorm).
        k_pe: (B, S, qk_rope_head_dim), the shared RoPE key, already rotated.
    ``offset`` is the number of valid positions. It implements mlx-lm's cache protocol
    (``state`` / ``from_state``, ``size``, ``empty``, ``is_trimmable`` / ``trim``,
    ``nbytes``) itself: mlx-lm calls those methods and checks no base class, so it does not
    subclass mlx-lm's private ``_BaseCache``.
    """

    step = 256

    def __init__(self):
        self.c_kv = None
        self.k_pe = None
        self.offset = 0

    def update_and_fetch(self, c_kv: mx.array, k_pe: mx.array) -> Tuple[mx.array, mx.array]:
        """Append L new positions and return every valid one.

        Args:
            c_kv: (B, L, kv_lora_rank); k_pe: (B, L, qk_rope_head_dim), same dtype.
        Returns:
            (c_kv, k_pe) of shapes (B, offset + L, ·), views into the preallocated buffers.
        """
        prev = self.offset
        L = c_kv.shape[1]
        if self.c_kv is None or prev + L > self.c_kv.shape[1]:
            self._grow(c_kv, k_pe, prev + L)
        self.offset = prev + L
        self.c_kv[:, prev : self.offset, :] = c_kv
        self.k_pe[:, prev : self.offset, :] = k_pe
        return self.c_kv[:, : self.offset, :], self.k_pe[:, : self.offset, :]

    def _grow(self, c_kv: mx.array, k_pe: mx.array, needed: int) -> None:
        B = c_kv.shape[0]
        capacity = ((needed + self.step - 1) // self.step) * self.step
        new_c = mx.zeros((B, capacity, c_kv.shape[2]), c_kv.dtype)
        new_k = mx.zeros((B, capacity, k_pe.shape[2]), k_pe.dtype)
        if self.c_kv is not None and self.offset > 0:
            new_c[:, : self.offset, :] = self.c_kv[:, : self.offset, :]
            new_k[:, : self.offset, :] = self.k_pe[:, : self.offset, :]
        self.c_kv, self.k_pe = new_c, new_k

    def size(self) -> int:
        return self.offset

    def make_mask(self, N: int, return_array: bool = True, **kwargs):
        """Bool (N, offset + N) causal mask for the next N tokens (True = attend), or None
        when N = 1 (a single token sees every cached position). Always an array, never
        mlx-lm's "causal" shorthand: the absorbed strategies apply it with ``mx.where``."""
        if N == 1:
            return None
        return create_causal_mask(N, self.offset)

    def empty(self) -> bool:
        return self.c_kv is None

    @property
    def state(self):
        """(c_kv, k_pe) of the valid positions, as mlx-lm evaluates and saves caches."""
        if self.c_kv is None:
            return []
        return self.c_kv[:, : self.offset, :], self.k_pe[:, : self.offset, :]

    @state.setter
    def state(self, v):
        if not v:
            self.c_kv, self.k_pe, self.offset = None, None, 0
            return
        self.c_kv, self.k_pe = v
        self.offset = self.c_kv.shape[1]

    @classmethod
    def from_state(cls, state) -> "LatentCache":
        """A cache holding ``state`` (what mlx-lm's ``load_prompt_cache`` calls)."""
        cache = cls()
        cache.state = state
        return cache

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions (mlx-lm prompt-cache reuse); returns how many."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def used_nbytes(self) -> int:
        """Bytes of the ``offset`` valid positions: offset × (kv_lora_rank + qk_rope_head_dim) × itemsize."""
        if self.c_kv is None:
            return 0
        per_token = self.c_kv.shape[2] * self.c_kv.itemsize + self.k_pe.shape[2] * self.k_pe.itemsize
        return self.offset * self.c_kv.shape[0] * per_token

    @property
    def nbytes(self) -> int:
        """Bytes allocated for c_kv and k_pe (the preallocated blocks, used or not)."""
        if self.c_kv is None:
            return 0
        return self.c_kv.nbytes + self.k_pe.nbytes


def cache_bytes_per_token(cache: Iterable) -> float:
    """Physical bytes per cached token over all layers of a prompt cache, ours or mlx-lm's
    (the sequence axis is -2 both in mlx-lm's KVCache (B, H, S, D) and in LatentCache's
    (B, S, r))."""
    total = 0.0
    for c in cache:
        for a in c.state:
            if isinstance(a, mx.array) and a.ndim >= 2 and a.shape[-2] > 0:
                total += a.nbytes / a.shape[-2]
    return total
