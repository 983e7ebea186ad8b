"""``naive``: decompress K (nope part) and V from the latent for every attended position.

Per decode step and layer, with S attended positions, H heads, r = kv_lora_rank,
dn/dr/dv = qk_nope/qk_rope/v head dims, d = hidden (q_lora_rank null), multiply-adds ×2:
    FLOPs ≈ 2·d·H(dn+dr) [q]  + 2·S·r·H(dn+dv) [decompress K, V]
           + 2·H·S(dn+dr) + 2·H·S·dv [scores, P·V]  + 2·H·dv·d [o_proj]
    DeepSeek-V2-Lite (d 2048, H 16, r 512, dn 128, dr 64, dv 128):
           ≈ 14.7M + 4.21M·S FLOPs
    bytes read ≈ weights (q_proj, W_UK, W_UV, o_proj) + S·(r + dr)·itemsize (cache)
           + the decompressed K and V written and read back: S·H(dn+dr+dv)·itemsize.
The C-engine notes count multiply-adds, not FLOPs, and leave out o_proj: 6.3M + 2.1M·S
is half our q + decompress term; the shape (linear in S with a slope ~2× the absorbed
ones') is the same. Decompression makes this strategy the cheapest per query row for long
prefill chunks, and the slowest for decode at long context.
"""

from __future__ import annotations

import mlx.core as mx


class Naive:
    """Decompress-then-attend MLA (transformers' DeepseekV2Attention, HF reference)."""

    name = "naive"

    def prepare(self, attn) -> None:
        pass

    def release(self, attn) -> None:
        pass

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        B, L, _ = c_q.shape
        H, S = attn.num_heads, c_kv.shape[1]
        q_nope = attn.w_uq(c_q).reshape(B, L, H, attn.qk_nope_head_dim).transpose(0, 2, 1, 3)
        c = c_kv[:, None]  # (B, 1, S, r)
        k_nope = c @ attn.w_uk.swapaxes(-1, -2)  # (B, H, S, dn)
        values = c @ attn.w_uv.swapaxes(-1, -2)  # (B, H, S, dv)
        k_pe = mx.broadcast_to(k_pe[:, None], (B, H, S, attn.qk_rope_head_dim))
        keys = mx.concatenate([k_nope, k_pe], axis=-1)  # (B, H, S, dn + dr)
        queries = mx.concatenate([q_nope, q_pe], axis=-1)  # (B, H, L, dn + dr)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=attn.scale, mask=mask
        )  # (B, H, L, dv)
        return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
