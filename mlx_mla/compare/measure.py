"""What ``compare`` measures of one engine: a greedy run through mlx-lm's generate loop, and
teacher-forced logits over a fixed token sequence."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import List

import mlx.core as mx
import numpy as np

from ..cache import cache_bytes_per_token


@dataclass
class Run:
    """One engine's greedy run: the tokens it generated and what mlx-lm's responses report.

    prompt_tps / generation_tps: tokens per second; peak_memory_bytes: MLX's peak;
    cache_bytes_per_token: physical cache bytes per cached token, all layers.
    """

    engine: str
    tokens: List[int]
    prompt_tps: float
    generation_tps: float
    peak_memory_bytes: int
    cache_bytes_per_token: float
    cache_layers: int


def greedy_run(engine: str, model, tokenizer, prompt: List[int], max_tokens: int) -> Run:
    """Greedy generation through mlx-lm's ``stream_generate`` (after a 2-token warm-up, so
    first-call kernel builds are not timed)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=0.0)
    for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=2, sampler=sampler):
        pass
    cache = make_prompt_cache(model)
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    tokens, last = [], None
    for last in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                                sampler=sampler, prompt_cache=cache):
        tokens.append(int(last.token))
    peak = mx.get_peak_memory()
    return Run(engine, tokens, last.prompt_tps, last.generation_tps, peak,
               cache_bytes_per_token(cache), len(cache))


def teacher_forced_logits(model, prompt: List[int], continuation: List[int]) -> np.ndarray:
    """float32 logits (positions, vocab) for ``prompt + continuation``: one prefill call for
    the prompt, then one cached decode call per continuation token (its logits at position
    i predict token i + 1). The last continuation token is fed too, so positions =
    len(prompt) + len(continuation)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [np.array(model(mx.array(prompt)[None], cache=cache)[0].astype(mx.float32))]
    for t in continuation:
        out.append(np.array(model(mx.array([[t]]), cache=cache)[0].astype(mx.float32)))
    return np.concatenate(out, axis=0)
