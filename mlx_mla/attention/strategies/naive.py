"""``naive``: decompress K (nope part) and V from the latent for every attended position.

Per layer, L new tokens attending to S positions (a decode step: L = 1), H heads,
r = kv_lora_rank, dn/dr/dv = qk_nope/qk_rope/v head dims, d = hidden, q_in = d (q_lora_rank
null); FLOPs count a multiply-add as 2 (``mlx_mla.attention.costs`` computes all of this):
    FLOPs = 2·L·d·(r + dr) + 2·L·q_in·H·(dn + dr)   [W_DKV, W_KR; W_UQ, W_QR]
          + 2·S·r·H·(dn + dv)                        [decompress K_nope and V: every position]
          + 2·L·S·H·(dn + dr + dv)                   [scores, P·V]
          + 2·L·H·dv·d                               [o_proj]
    bytes read = weights (4-bit Linears + scales/biases, float W_UK/W_UV)
          + S·(r + dr)·itemsize                      [latent cache]
          + 2·H·S·(dn + dr + dv)·itemsize            [decompressed K, V written, read back]
          + 4·H·L·S·itemsize                         [scores / probabilities]
    DeepSeek-V2-Lite decode step: 23.3M + 4.20M·S FLOPs; 15.7 MB + 43.5 KB·S read (float32
    activations, 4-bit weights with float32 scales).
The C-engine notes' 6.3M + 2.1M·S counts multiply-adds, not FLOPs, and leaves out the
kv_a projection and o_proj: doubled, their slope (2·2,102,272) is exactly ours, and their
intercept (2·6.29M = 12.6M) is our q projection alone. Their 9,760·S memory count is in
elements and leaves out writing the decompressed K/V (ours, in bytes, counts it: it is
~94% of what a long-context decode step moves). Decompression costs ~120x the absorbed
strategies' per-position work, so this is the slowest decode at every context; for a
prefill chunk it is done once for L queries and it is the cheapest.
"""

from __future__ import annotations

import mlx.core as mx

from .base import WithoutDerivedWeights, query_nope


class Naive(WithoutDerivedWeights):
    """Decompress-then-attend MLA (transformers' DeepseekV2Attention, HF reference)."""

    name = "naive"

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        B, L, _ = c_q.shape
        H, S = attn.num_heads, c_kv.shape[1]
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
