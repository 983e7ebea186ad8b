"""The DeepSeek-V2 decoder: embeddings → N × (RMSNorm → MLA → RMSNorm → MLP | MoE) → lm_head.

Pure math, no file I/O (loading is ``mlx_mla.loader``). Module and parameter names follow
mlx-lm's ``deepseek_v2`` (so mlx-lm folders load), except for MLA's split projections
(see ``mlx_mla.attention.mla``).
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.pipeline import PipelineMixin

from .attention import MLAttention, make_strategy
from .cache import LatentCache, RotatingLatentCache
from .config import ModelArgs
from .moe import MLP, MoE
from .sharding import rank_weights, shard_model
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


class DeepseekV2Model(PipelineMixin, nn.Module):
    """Embeddings, decoder layers, final RMSNorm: (B, L) token ids → (B, L, hidden).

    Pipeline parallel (mlx-lm's ``PipelineMixin``): after ``pipeline(group)`` this rank
    runs only ``pipeline_layers`` (``layers[start_idx:end_idx]``; rank 0 holds the last
    layers, rank size-1 the first). It receives the hidden states from rank + 1, runs its
    layers and sends them to rank - 1; rank 0's output is then gathered to every rank, so
    every rank computes the same logits and mlx-lm's generate loop runs unchanged on each.
    The communication is mlx-lm ``deepseek_v2``'s, on the group given to ``pipeline``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pipeline_group = None

    def pipeline(self, group, split=None):
        """Keep only this rank's layers (mlx-lm's ``PipelineMixin.pipeline``: an even split,
        the low ranks taking one more when it is uneven, or ``split`` layers per rank) and
        communicate on ``group``.

        Raises:
            ValueError: ``split`` does not give every rank at least one layer.
        """
        super().pipeline(group, split)
        self.pipeline_group = group

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        L = h.shape[1]
        layers = self.pipeline_layers
        if cache is None:
            cache = [None] * len(layers)
        # The cache knows the positions (and, batched, the padding), so it makes the mask,
        # as in mlx-lm's models; without a cache, plain causal over the L tokens.
        if cache[0] is not None:
            mask = cache[0].make_mask(L)
        else:
            mask = create_causal_mask(L, 0) if L > 1 else None
        rank, size, group = self.pipeline_rank, self.pipeline_size, self.pipeline_group
        if rank < size - 1:
            h = mx.distributed.recv_like(h, rank + 1, group=group)
        for layer, c in zip(layers, cache):
            h = layer(h, mask, c)
        if rank != 0:
            h = mx.distributed.send(h, rank - 1, group=group)
            # mlx-lm's prefill evaluates only the caches: tie the send to this rank's last
            # cache (its first store's keys, as mlx-lm ties it to a KVCache's) so it happens
            # then too, else rank - 1 would wait for it forever.
            if cache[-1] is not None:
                store = cache[-1].stores[0]
                store.keys = mx.depends(store.keys, h)
        if size > 1:
            h = mx.distributed.all_gather(h, group=group)[: h.shape[0]]
        return self.norm(h)


class Model(nn.Module):
    """DeepSeek-V2 causal LM with a latent MLA cache.

    ``model(inputs, cache=None) -> logits``: inputs (B, L) integer token ids, logits
    (B, L, vocab_size) in the activation dtype. ``cache`` is ``make_cache()``'s list, one
    ``LatentCache`` per layer, updated in place; mlx-lm's ``generate_step`` and
    ``stream_generate`` drive it like any mlx-lm model.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = DeepseekV2Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # No strategy until the weights are in: some derive weights from them.
        # ``set_mla_strategy`` chooses one (``mlx_mla.load`` calls it once, after loading).
        self.mla_strategy = None
        # The bound ``make_cache`` uses when none is asked for (the server's and chat's
        # --max-kv-size: mlx-lm's code makes their caches without one).
        self.max_kv_size: Optional[int] = None

    def __call__(self, inputs: mx.array, cache: Optional[List[LatentCache]] = None):
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self):
        """The decoder layers this rank runs (all of them unless pipelined), as mlx-lm's."""
        return self.model.pipeline_layers

    def make_cache(self, max_kv_size: Optional[int] = None, keep: int = 4) -> List:
        """One empty latent cache per layer this rank runs: a ``LatentCache``, or with ``max_kv_size`` a
        ``RotatingLatentCache`` keeping the first ``keep`` tokens (mlx-lm's choice: 4) and
        the last ``max_kv_size - keep``.

        mlx-lm's ``make_prompt_cache(model, max_kv_size)`` — which ``generate_step``,
        ``BatchGenerator`` and mlx-lm's CLIs call — hands a model with its own
        ``make_cache`` no arguments (mlx-lm 0.32), so when it is the caller and no size is
        given here, its ``max_kv_size`` argument is read from its frame
        (``_max_kv_size_of_caller``); tests/test_cache.py fails if mlx-lm changes that.
        Without either, ``self.max_kv_size`` (None: unbounded) applies.

        Raises:
            ValueError: ``max_kv_size`` not above ``keep``.
        """
        if max_kv_size is None:
            max_kv_size = _max_kv_size_of_caller()
        if max_kv_size is None:
            max_kv_size = self.max_kv_size
        if max_kv_size is None:
            return [LatentCache() for _ in self.layers]
        if max_kv_size <= keep:
            raise ValueError(
                f"max_kv_size {max_kv_size} must be larger than the {keep} tokens always kept"
            )
        return [RotatingLatentCache(max_kv_size, keep) for _ in self.layers]

    def set_mla_strategy(self, name: str) -> None:
        """Switch every layer to MLA strategy ``name`` (naive, absorb-materialized, absorb,
        auto): each layer gets its own strategy object, which builds the weights it derives
        from the layer's; the previous strategy's are freed.

        Raises:
            ValueError: unknown name.
        """
        strategies = [make_strategy(name) for _ in self.layers]
        for layer, strategy in zip(self.layers, strategies):
            attn = layer.self_attn
            if attn.strategy is not None:
                attn.strategy.release()
            strategy.prepare(attn)
            attn.strategy = strategy
        self.mla_strategy = name

    @property
    def derived_nbytes(self) -> int:
        """Bytes the current strategy keeps beside the checkpoint's weights, all layers
        (``absorb-materialized``'s precomputed matrices; 0 for the others)."""
        return sum(l.self_attn.strategy.derived_nbytes for l in self.layers
                   if l.self_attn.strategy is not None)

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor parallel over ``group`` (default: the global group): attention split by
        heads, MLPs and experts by their intermediate dimension, as mlx-lm's
        ``deepseek_v2.Model.shard``; see ``mlx_mla.sharding.shard_model``.

        Raises:
            ModelLoadError (a ValueError): the group size cannot split the heads, the MLP
                widths or their quantization groups.
        """
        shard_model(self, group or mx.distributed.init())

    def sanitize(self, weights):
        """Checkpoint tensors (Hugging Face or mlx-lm layout) → this model's names; once
        pipelined, only those of the layers this rank holds (its files also carry some of
        their neighbours')."""
        if self.model.pipeline_size > 1:
            weights = rank_weights(weights, self.model.start_idx, self.model.end_idx)
        return _weights.sanitize(weights, self.args)


def _max_kv_size_of_caller() -> Optional[int]:
    """``max_kv_size`` of mlx-lm's ``make_prompt_cache`` when it is what called
    ``Model.make_cache`` (two frames up), else None."""
    import inspect

    from mlx_lm.models.cache import make_prompt_cache

    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame and frame.f_back else None
        if caller is not None and caller.f_code is make_prompt_cache.__code__:
            return caller.f_locals.get("max_kv_size")
        return None
    finally:
        del frame
