"""MLA's shared front end: projections, decoupled RoPE, latent-cache update; then a strategy.

Notation (DeepSeek-V2 paper, section 2.1; shapes per token, H heads):
    c_q  = x                              (q_lora_rank null: plain q_proj)
         = q_a_layernorm(W_DQ x)          (q_lora_rank set: q_a_proj → q_a_layernorm)
    q_nope = W_UQ c_q   (H, qk_nope_head_dim)     q_pe = RoPE(W_QR c_q)  (H, qk_rope_head_dim)
    c_kv = kv_a_layernorm(W_DKV x)  (kv_lora_rank)  k_pe = RoPE(W_KR x)  (qk_rope_head_dim)
    k_nope = W_UK c_kv per head,  v = W_UV c_kv per head
The checkpoint fuses W_UQ|W_QR in ``q_proj`` (``q_b_proj``), W_DKV|W_KR in
``kv_a_proj_with_mqa`` and W_UK|W_UV in ``kv_b_proj``; ``mlx_mla.weights`` splits them at
load. Only c_kv and k_pe are cached; how a step turns them back into attention is the
strategy's business (``mlx_mla.attention.strategies``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache import LatentCache
from ..config import ModelArgs
from ..rope import RoPE, softmax_scale


class MLAttention(nn.Module):
    """Multi-head Latent Attention over a latent cache.

    Parameters (after ``mlx_mla.weights.sanitize``):
        w_uq: Linear c_q → H·qk_nope_head_dim;  w_qr: Linear c_q → H·qk_rope_head_dim
        q_a_proj, q_a_layernorm: only when q_lora_rank is set
        w_dkv: Linear hidden → kv_lora_rank;  w_kr: Linear hidden → qk_rope_head_dim
        kv_a_layernorm: RMSNorm(kv_lora_rank)
        w_uk: (H, qk_nope_head_dim, kv_lora_rank);  w_uv: (H, v_head_dim, kv_lora_rank),
            kept unquantized: they are ~0.4% of DeepSeek-V2-Lite's weights, and the absorbed
            strategies multiply every query and every output by them, so 4-bit error there
            reaches every attention score.
        o_proj: Linear H·v_head_dim → hidden
    ``strategy`` is this layer's own ``Strategy`` object (not a parameter: whatever it
    derives stays out of the checkpoint's weights), set by ``Model.set_mla_strategy``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.num_attention_heads
        self.num_heads = H
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        bias = args.attention_bias

        q_in = args.hidden_size
        if args.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=1e-6)
            q_in = args.q_lora_rank
        self.w_uq = nn.Linear(q_in, H * args.qk_nope_head_dim, bias=False)
        self.w_qr = nn.Linear(q_in, H * args.qk_rope_head_dim, bias=False)
        self.w_dkv = nn.Linear(args.hidden_size, args.kv_lora_rank, bias=bias)
        self.w_kr = nn.Linear(args.hidden_size, args.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(args.kv_lora_rank, eps=1e-6)
        self.w_uk = mx.zeros((H, args.qk_nope_head_dim, args.kv_lora_rank))
        self.w_uv = mx.zeros((H, args.v_head_dim, args.kv_lora_rank))
        self.o_proj = nn.Linear(H * args.v_head_dim, args.hidden_size, bias=bias)

        self.scale = softmax_scale(args.q_head_dim, args.rope)
        self.rope = RoPE(args.qk_rope_head_dim, args.rope_theta, args.rope)
        self.strategy = None

    def compressed_query(self, x: mx.array) -> mx.array:
        """c_q (DeepSeek-V2 paper, section 2.1.3): q_a_layernorm(q_a_proj(x)) when
        q_lora_rank is set, else x itself. (B, L, hidden) → (B, L, q_in)."""
        if self.q_lora_rank is None:
            return x
        return self.q_a_layernorm(self.q_a_proj(x))

    def __call__(
        self,
        x: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[LatentCache] = None,
    ) -> mx.array:
        """x: (B, L, hidden); mask: bool broadcastable to (B, 1, L, offset + L), True =
        attend, or None (attend to every position) → (B, L, hidden).

        Raises:
            RuntimeError: no strategy is set (``Model.set_mla_strategy`` sets one).
        """
        if self.strategy is None:
            raise RuntimeError(
                "no MLA strategy is set: call model.set_mla_strategy(name) first "
                "(mlx_mla.load does)"
            )
        B, L, _ = x.shape
        H = self.num_heads
        offset = cache.offset if cache is not None else 0

        c_q = self.compressed_query(x)
        q_pe = self.w_qr(c_q).reshape(B, L, H, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        q_pe = self.rope(q_pe, offset)  # (B, H, L, dr)
        c_kv = self.kv_a_layernorm(self.w_dkv(x))  # (B, L, r)
        k_pe = self.rope(self.w_kr(x), offset)  # (B, L, dr)
        if cache is not None:
            c_kv, k_pe = cache.update_and_fetch(c_kv, k_pe)  # (B, S, r), (B, S, dr)
        return self.strategy(self, c_q, q_pe, c_kv, k_pe, mask)
