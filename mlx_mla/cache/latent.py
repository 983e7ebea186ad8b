"""The latent cache: per layer, only c_kv and the roped k_pe of every past token.

That is (kv_lora_rank + qk_rope_head_dim) values per token per layer — 576 for
DeepSeek-V2-Lite, against 16 heads × (192 + 128) = 5,120 for a decompressed K/V cache
(DeepSeek-V2 paper, section 2.1.2 and table 1).

Four classes, one per kind of cache mlx-lm has, with mlx-lm's semantics and protocol
(``update_and_fetch``, ``make_mask``, ``state`` / ``from_state``, ``trim``, ``size``,
``nbytes``; the batch ones ``merge`` / ``filter`` / ``extend`` / ``extract`` / ``prepare`` /
``finalize``; ``to_quantized``), so mlx-lm's ``generate_step``, ``BatchGenerator``,
prompt-cache files and server drive them unchanged:

==========================  ===========================  ==========================
ours                        mlx-lm's                     what
==========================  ===========================  ==========================
``LatentCache``             ``KVCache``                  one sequence, grows
``BatchLatentCache``        ``BatchKVCache``             left-padded rows, per-row offsets
``RotatingLatentCache``     ``RotatingKVCache``          bounded: keep + a rotating window
``BatchRotatingLatentCache`` ``BatchRotatingKVCache``    bounded, batched
==========================  ===========================  ==========================

Storage: the cache's arrays go, two by two, into instances of that mlx-lm class (its
"stores"), laid out (B, 1, S, ·) as a one-head key/value pair. mlx-lm's classes are generic
in those arrays, so their growth, padding, rotation, trimming, merging and extraction — the
subtle bookkeeping — are mlx-lm's own, not a copy; this module only encodes (``Codec``: float,
or c_kv affine-quantized) and names what is stored. Positions in k_pe are absolute (it is
rotated by its own position when cached), so rotation and padding keep it correct.
"""

from __future__ import annotations

import copy
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from .codec import FLOAT, Codec, Latent, quantized_codec


class _Latent:
    """What the four latent caches share; ``STORE`` is the mlx-lm class of their stores."""

    STORE = KVCache

    def __init__(self, codec: Codec, make_store):
        self.codec = codec
        self.stores = [make_store() for _ in range(codec.n_pairs)]

    @classmethod
    def _wrap(cls, stores, codec: Codec):
        obj = cls.__new__(cls)
        obj.stores, obj.codec = list(stores), codec
        return obj

    # ---- the per-step path
    @property
    def offset(self):
        """Tokens seen (int), or per row for the batch classes (an (B,) array)."""
        return self.stores[0].offset

    def update_and_fetch(self, c_kv: mx.array, k_pe: mx.array) -> Tuple[Latent, mx.array]:
        """Append L new positions and return every stored one.

        Args:
            c_kv: (B, L, kv_lora_rank); k_pe: (B, L, qk_rope_head_dim), roped; same dtype.
        Returns:
            (c_kv, k_pe) of the S stored positions: (B, S, kv_lora_rank) — an array, or a
            ``QuantizedLatent`` once quantized — and (B, S, qk_rope_head_dim).
        """
        fetched = []
        for store, (a, b) in zip(self.stores, self.codec.encode(c_kv, k_pe)):
            ka, kb = store.update_and_fetch(a[:, None], b[:, None])
            fetched.append((ka[:, 0], kb[:, 0]))
        return self.codec.decode(fetched)

    def make_mask(self, N: int, return_array: bool = True, window_size: Optional[int] = None):
        """Bool mask for the next N tokens (True = attend), broadcastable to (B, 1, N, S); or
        None where every stored position is visible (one token, no padding). Always an
        array, never mlx-lm's "causal" shorthand: the absorbed strategies apply it with
        ``mx.where``."""
        return self.stores[0].make_mask(N, return_array=True, window_size=window_size)

    def widths(self) -> Optional[Tuple[int, int]]:
        """(kv_lora_rank, qk_rope_head_dim) of what is stored; None while empty."""
        if self.stores[0].keys is None:
            return None
        c_kv, k_pe = self.codec.decode([(s.keys[:, 0, :0], s.values[:, 0, :0]) for s in self.stores])
        return c_kv.shape[-1], k_pe.shape[-1]

    # ---- mlx-lm's cache protocol
    def size(self) -> int:
        return self.stores[0].size()

    def empty(self) -> bool:
        return self.stores[0].empty()

    def is_trimmable(self) -> bool:
        return self.stores[0].is_trimmable()

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions (mlx-lm prompt-cache reuse); returns how many."""
        return [s.trim(n) for s in self.stores][0]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the stored arrays (used or not)."""
        return sum(s.nbytes for s in self.stores)

    @property
    def state(self):
        """The stores' states and the codec, as mlx-lm's prompt-cache files save them."""
        return [list(s.state) for s in self.stores] + [self.codec.group_size, self.codec.bits]

    @state.setter
    def state(self, v):
        *stores, group_size, bits = v
        self.codec = Codec(int(group_size), int(bits))
        self.stores = [_restored(self.STORE.from_state(list(s))) for s in stores]

    @classmethod
    def from_state(cls, state):
        """A cache holding ``state`` (what mlx-lm's ``load_prompt_cache`` calls)."""
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """This cache with c_kv in MLX's affine format, ``bits`` per value, ``group_size``
        values per scale and bias (what mlx-lm's ``maybe_quantize_kv_cache`` calls once the
        context passes ``quantized_kv_start``; it calls it again every step, and then gets
        the same cache back).

        Raises:
            ValueError: unsupported bits / group size, or a cache already quantized another
                way.
        """
        if self.codec == Codec(group_size, bits):
            return self
        if self.codec.quantized:
            raise ValueError(
                f"the latent cache is already quantized to {self.codec.bits} bits, group "
                f"{self.codec.group_size}: use the same --kv-bits / --kv-group-size"
            )
        (store,) = self.stores
        if store.keys is None:
            codec = Codec(group_size, bits)
            return type(self)._wrap([copy.copy(store) for _ in range(codec.n_pairs)], codec)
        codec = quantized_codec(group_size, bits, store.keys.shape[-1])
        pairs = codec.encode(store.keys[:, 0], store.values[:, 0])
        stores = []
        for a, b in pairs:
            s = copy.copy(store)  # same bookkeeping (offsets, padding, rotation)
            s.keys, s.values = a[:, None], b[:, None]
            stores.append(s)
        return type(self)._wrap(stores, codec)


class LatentCache(_Latent):
    """One sequence's latent cache, grown in blocks of 256 positions (mlx-lm ``KVCache``)."""

    STORE = KVCache

    def __init__(self, codec: Codec = FLOAT):
        super().__init__(codec, KVCache)

    @property
    def c_kv(self) -> Optional[Latent]:
        """The stored c_kv, (B, offset, kv_lora_rank) (None when empty)."""
        return self._stored()[0]

    @property
    def k_pe(self) -> Optional[mx.array]:
        """The stored k_pe, (B, offset, qk_rope_head_dim) (None when empty)."""
        return self._stored()[1]

    def _stored(self):
        if self.empty():
            return None, None
        n = self.offset
        return self.codec.decode([(s.keys[:, 0, :n], s.values[:, 0, :n]) for s in self.stores])

    @classmethod
    def merge(cls, caches: List["LatentCache"]) -> "BatchLatentCache":
        """Left-pad single caches into one batch (what ``BatchGenerator`` does)."""
        return BatchLatentCache._merge(caches)


class BatchLatentCache(_Latent):
    """A batch of left-padded sequences (mlx-lm ``BatchKVCache``).

    ``left_padding[b]`` positions at the start of row b are padding: the mask hides them and
    ``offset[b]`` counts only row b's own tokens, so RoPE positions start at 0 for every row.
    """

    STORE = BatchKVCache

    def __init__(self, left_padding: List[int], codec: Codec = FLOAT):
        super().__init__(codec, lambda: BatchKVCache(left_padding))

    @property
    def left_padding(self) -> mx.array:
        return self.stores[0].left_padding

    @classmethod
    def _merge(cls, caches):
        codec = _one_codec(caches)
        n = codec.n_pairs
        merged = [cls.STORE.merge([c.stores[i] for c in caches]) for i in range(n)]
        return cls._wrap(merged, codec)

    @classmethod
    def merge(cls, caches):
        return cls._merge(caches)

    def prepare(self, **kwargs) -> None:
        """Right padding of the next prompt chunk, or more left padding (mlx-lm's)."""
        for s in self.stores:
            s.prepare(**kwargs)

    def finalize(self) -> None:
        """Move right padding to the left once the chunk is in (mlx-lm's)."""
        for s in self.stores:
            s.finalize()

    def filter(self, batch_indices) -> None:
        """Keep only these rows."""
        for s in self.stores:
            s.filter(batch_indices)

    def extend(self, other: "BatchLatentCache") -> None:
        """Append ``other``'s rows (sequences joining mid-generation)."""
        _one_codec([self, other])
        for s, o in zip(self.stores, other.stores):
            s.extend(o)

    def extract(self, idx: int) -> LatentCache:
        """Row ``idx`` as a single-sequence cache, padding dropped."""
        return LatentCache._wrap([s.extract(idx) for s in self.stores], self.codec)


class RotatingLatentCache(_Latent):
    """A bounded cache (mlx-lm ``RotatingKVCache``): the first ``keep`` tokens stay, the rest
    rotate through ``max_size - keep`` slots; a prefill chunk longer than the window is kept
    whole for its own attention, as mlx-lm does."""

    STORE = RotatingKVCache

    def __init__(self, max_size: int, keep: int = 0, codec: Codec = FLOAT):
        super().__init__(codec, lambda: RotatingKVCache(max_size, keep))

    @property
    def max_size(self) -> int:
        return self.stores[0].max_size

    @classmethod
    def merge(cls, caches):
        return BatchRotatingLatentCache._merge(caches)


class BatchRotatingLatentCache(BatchLatentCache):
    """A bounded batch cache (mlx-lm ``BatchRotatingKVCache``)."""

    STORE = BatchRotatingKVCache

    def __init__(self, max_size: int, left_padding: List[int], codec: Codec = FLOAT):
        _Latent.__init__(self, codec, lambda: BatchRotatingKVCache(max_size, left_padding))

    @property
    def max_size(self) -> int:
        return self.stores[0].max_size

    def extract(self, idx: int) -> RotatingLatentCache:
        return RotatingLatentCache._wrap([s.extract(idx) for s in self.stores], self.codec)


def _restored(store):
    """mlx-lm's ``from_state`` skips ``__init__``, so the batch stores come back without the
    padding bookkeeping that lives outside their state (``_right_padding``, ``_lengths``:
    None between prompt chunks); give them their resting values (mlx-lm 0.32)."""
    for name in ("_right_padding", "_lengths"):
        if isinstance(store, (BatchKVCache, BatchRotatingKVCache)) and not hasattr(store, name):
            setattr(store, name, None)
    return store


def _one_codec(caches) -> Codec:
    codecs = {c.codec for c in caches}
    if len(codecs) > 1:
        raise ValueError(
            "cannot batch latent caches stored differently (float and quantized, or other "
            "bits): quantize them alike first"
        )
    return codecs.pop()


CACHE_CLASSES = (LatentCache, BatchLatentCache, RotatingLatentCache, BatchRotatingLatentCache)
