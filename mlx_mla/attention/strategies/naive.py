"""``naive``: decompress K (nope part) and V from the latent for every attended position.

k_nope = W_UK c_kv and v = W_UV c_kv per head (DeepSeek-V2 paper, section 2.1.2, eq. 9-13),
k = [k_nope; k_pe] with k_pe broadcast to every head, then ordinary scaled dot-product
attention: what transformers' ``DeepseekV2Attention`` computes.

Cost (``mlx_mla.attention.costs``): decompression is 2·S·r·H·(dn + dv) FLOPs per call, done
for every cached position at every step: ~120x the absorbed strategies' per-position work at
DeepSeek-V2-Lite's shape, so the slowest decode. For a prefill chunk it is done once for L
queries, and attention then costs 2·H·(dn + dr + dv) per query-position pair (the absorbed
strategies' 2·H·(2r + dr) is 3.4x that): the cheapest prefill.
"""

from __future__ import annotations

import mlx.core as mx

from ...cache import QuantizedLatent
from .base import Strategy, query_nope


class Naive(Strategy):
    """Decompress-then-attend MLA (transformers' DeepseekV2Attention, HF reference)."""

    name = "naive"

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        B, L, _ = c_q.shape
        H, S = attn.num_heads, c_kv.shape[1]
        if isinstance(c_kv, QuantizedLatent):  # decompression needs the float latent anyway
            c_kv = c_kv.dequantize()
        q_nope = query_nope(attn, c_q)  # (B, H, L, dn)
        c = c_kv[:, None]  # (B, 1, S, r)
        # Contiguous (H, r, d) copies (4 MB each at V2-Lite shape, made per call, not kept):
        # MLX's CPU GEMM then runs its vectorised form, with one head's (r, d) block in
        # cache; ~1.5x faster than multiplying by the transposed views.
        k_nope = c @ mx.contiguous(attn.w_uk.swapaxes(-1, -2))  # (B, H, S, dn)
        values = c @ mx.contiguous(attn.w_uv.swapaxes(-1, -2))  # (B, H, S, dv)
        k_pe = mx.broadcast_to(k_pe[:, None], (B, H, S, attn.qk_rope_head_dim))
        keys = mx.concatenate([k_nope, k_pe], axis=-1)  # (B, H, S, dn + dr)
        queries = mx.concatenate([q_nope, q_pe], axis=-1)  # (B, H, L, dn + dr)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=attn.scale, mask=mask
        )  # (B, H, L, dv)
        return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
