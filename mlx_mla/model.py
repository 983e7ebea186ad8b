"""The DeepSeek-V2 decoder: embeddings → N × (RMSNorm → MLA → RMSNorm → MLP | MoE) → lm_head.

Pure math, no file I/O (loading is ``mlx_mla.loader``). Module and parameter names follow
mlx-lm's ``deepseek_v2`` (so mlx-lm folders load), except for MLA's split projections
(see ``mlx_mla.attention.mla``).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from .attention import MLAttention, make_strategy
from .cache import LatentCache
from .config import ModelArgs
from .moe import MLP, MoE
from . import weights as _weights


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h = x + MLA(norm(x)); out = h + FFN(norm(h))."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = MLAttention(args)
        self.mlp = MoE(args) if args.is_moe_layer(layer_idx) else MLP(
            args.hidden_size, args.intermediate_size
        )
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV2Model(nn.Module):
    """Embeddings, decoder layers, final RMSNorm: (B, L) token ids → (B, L, hidden)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = causal_mask(h.shape[1], cache[0].offset if cache[0] is not None else 0)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


def causal_mask(L: int, offset: int) -> Optional[mx.array]:
    """Bool (L, offset + L): query i (at position offset + i) sees keys 0..offset + i.

    None for a single token, which sees every cached position.
    """
    if L == 1:
        return None
    rows = mx.arange(offset, offset + L)[:, None]
    cols = mx.arange(offset + L)[None, :]
    return cols <= rows


class Model(nn.Module):
    """DeepSeek-V2 causal LM with a latent MLA cache.

    ``model(inputs, cache=None) -> logits``: inputs (B, L) integer token ids, logits
    (B, L, vocab_size) in the activation dtype. ``cache`` is ``make_cache()``'s list, one
    ``LatentCache`` per layer, updated in place; mlx-lm's ``generate_step`` and
    ``stream_generate`` drive it like any mlx-lm model.
    """

    def __init__(self, args: ModelArgs, mla_strategy: str = "auto"):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = DeepseekV2Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # Not prepared here: derived weights need the real ones; ``set_mla_strategy``
        # (called by the loader after loading) prepares.
        self.mla_strategy = mla_strategy
        strategy = make_strategy(mla_strategy)
        for layer in self.layers:
            layer.self_attn.strategy = strategy

    def __call__(self, inputs: mx.array, cache: Optional[List[LatentCache]] = None):
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self) -> List[LatentCache]:
        """One empty ``LatentCache`` per layer."""
        return [LatentCache() for _ in self.layers]

    def set_mla_strategy(self, name: str) -> None:
        """Switch every layer to MLA strategy ``name`` (naive, absorb-materialized, absorb,
        auto), building the derived weights it needs and freeing the previous one's.

        Raises:
            ValueError: unknown name.
        """
        strategy = make_strategy(name)
        for layer in self.layers:
            attn = layer.self_attn
            attn.strategy.release(attn)
            strategy.prepare(attn)
            attn.strategy = strategy
        self.mla_strategy = name

    def sanitize(self, weights):
        """Checkpoint tensors (Hugging Face or mlx-lm layout) → this model's names."""
        return _weights.sanitize(weights, self.args)
