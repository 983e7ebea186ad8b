"""Prompt-cache files for a loaded model: mlx-lm's own files and functions, checked to fit.

The files are what ``mlx_lm.models.cache.save_prompt_cache`` writes (the caches' ``state``
plus string metadata; ``mlx_mla.cache`` makes our classes known to its loader), so
``python -m mlx_mla.cache_prompt`` and ``mlx_lm.cache_prompt`` make the same kind of file and
``load_prompt_cache`` reads both. What is ours: refusing, in one line, a file that was made
for another model.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .latent import CACHE_CLASSES


class PromptCacheError(ValueError):
    """A prompt-cache file that cannot be used with this model; the message says why."""


def load(path, model) -> Tuple[List, Dict[str, str]]:
    """Read a prompt-cache file and check it was made for ``model``'s shape.

    Returns:
        (one cache per layer, the file's metadata: "model", "tokenizer_config", ...).
    Raises:
        PromptCacheError: no such file, not a prompt-cache file, caches that are not latent
            caches, or another layer count / latent width than ``model``'s.
    """
    from mlx_lm.models.cache import load_prompt_cache

    path = Path(path)
    if not path.is_file():
        raise PromptCacheError(f"prompt cache file {path} does not exist: make one with "
                               f"python -m mlx_mla.cache_prompt")
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:  # a foreign or damaged file fails in many ways inside mlx
        raise PromptCacheError(f"{path} is not a prompt cache file ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e
    check_fits(cache, model, path)
    return cache, metadata


def check_fits(cache: List, model, path="the prompt cache") -> None:
    """Raises PromptCacheError unless ``cache`` has one latent cache per layer of ``model``
    holding (kv_lora_rank, qk_rope_head_dim)-wide entries."""
    args = model.args
    kinds = {type(c).__name__ for c in cache}
    if not all(isinstance(c, CACHE_CLASSES) for c in cache):
        raise PromptCacheError(
            f"{path} holds {', '.join(sorted(kinds))} caches, made for another kind of model: "
            f"make it for this one with python -m mlx_mla.cache_prompt"
        )
    if len(cache) != args.num_hidden_layers:
        raise PromptCacheError(
            f"{path} was made for a model with {len(cache)} layers, this one has "
            f"{args.num_hidden_layers}: make it again with this model"
        )
    want = (args.kv_lora_rank, args.qk_rope_head_dim)
    widths = cache[0].widths()
    if widths is not None and tuple(widths) != want:
        raise PromptCacheError(
            f"{path} holds a latent of width {widths[0]} + {widths[1]} (c_kv + k_pe), this model's "
            f"is {want[0]} + {want[1]}: it was made for another model; make it again"
        )


def named_model(path) -> Optional[str]:
    """The "model" a prompt-cache file's metadata names (None if none or unreadable), read
    from the safetensors header alone (save_prompt_cache stores its metadata dict under
    keys "0.<name>")."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        return header.get("__metadata__", {}).get("0.model")
    except (OSError, ValueError, struct.error):
        return None


def metadata_for(model_path: str, tokenizer_config: dict) -> Dict[str, str]:
    """The metadata mlx-lm's cache_prompt writes (its generate reads "model" and
    "tokenizer_config" back)."""
    return {"model": str(model_path), "tokenizer_config": json.dumps(tokenizer_config)}
