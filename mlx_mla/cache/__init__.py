"""The latent cache (``latent``) and how it is stored (``codec``).

mlx-lm's ``load_prompt_cache`` finds a cache class by its name among the names of its own
module ``mlx_lm.models.cache``; our classes are added there (under their own names, nothing
of mlx-lm's is replaced) so prompt-cache files of mlx_mla models load with mlx-lm's
function unchanged.
"""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx
import mlx_lm.models.cache as _mlx_lm_cache
from mlx.utils import tree_flatten

from .codec import FLOAT, Codec, Latent, QuantizedLatent, quantized_codec
from .latent import (
    CACHE_CLASSES, BatchLatentCache, BatchRotatingLatentCache, LatentCache, RotatingLatentCache,
)

for _cls in CACHE_CLASSES:
    setattr(_mlx_lm_cache, _cls.__name__, _cls)


def cache_bytes_per_token(cache: Iterable) -> float:
    """Physical bytes per cached token over all layers of a prompt cache, ours or mlx-lm's
    (the sequence axis is -2 of every stored array: mlx-lm's (B, H, S, D), ours (B, 1, S, ·))."""
    total = 0.0
    for c in cache:
        for _, a in tree_flatten(c.state):
            if isinstance(a, mx.array) and a.ndim >= 3 and a.shape[-2] > 0:
                total += a.nbytes / a.shape[-2]
    return total


__all__ = ["LatentCache", "BatchLatentCache", "RotatingLatentCache", "BatchRotatingLatentCache",
           "Codec", "FLOAT", "QuantizedLatent", "Latent", "quantized_codec",
           "cache_bytes_per_token"]
