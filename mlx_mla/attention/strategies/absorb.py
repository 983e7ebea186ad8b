"""``absorb``: absorbed attention without materializing W_UQ·W_UKᵀ (factored).

q_latent = (W_UQ c_q) · W_UK per head (DeepSeek-V2 paper, section 2.1.2, "absorb W_UK
into W_UQ", applied as two small products instead of one big matrix); scores =
q_latent·c_kvᵀ + q_pe·k_peᵀ (two matmuls summed, no concatenation); attention runs over
c_kv itself (``base.latent_attention``); the latent output goes through W_UV per head,
then o_proj. Nothing is decompressed and nothing is precomputed.

Per layer, L new tokens attending to S positions (symbols as in ``naive``; exact counts
in ``mlx_mla.attention.costs``):
    FLOPs = 2·L·d·(r + dr) + 2·L·q_in·H·(dn + dr)   [W_DKV, W_KR; W_UQ, W_QR]
          + 2·L·H·dn·r + 2·L·H·r·dv                  [·W_UK, ·W_UV per head]
          + 2·L·S·H·(2r + dr)                        [scores over c_kv and k_pe, P·c_kv]
          + 2·L·H·dv·d                               [o_proj]
    bytes read = weights + S·(r + dr)·itemsize [latent cache, read once for all heads]
          + 4·H·L·S·itemsize [scores / probabilities]
    DeepSeek-V2-Lite decode step: 27.5M + 34.8K·S FLOPs; 15.7 MB + 2.56 KB·S read.
The C-engine notes give 7.3M + 1.06M·S (multiply-adds) for this variant, and their author
doubts it, rightly: their slope still decompresses V for every position
(512·2048 = 1.05M of the 1.06M multiply-adds per position) instead of applying W_UV once
to the H latent outputs; without it the slope is 17.4K multiply-adds = 34.8K FLOPs, 1/120
of naive's. Their intercept also drops the 2048·512 term they list (and o_proj).
On MLX's CPU backend (reference BLAS) this strategy is bound by matmul throughput: per
position it does 3.4x the FLOPs of attention over a decompressed cache (2·H·(2r + dr) vs
2·H·(dn + dr + dv)), while reading 8.9x fewer cache bytes; on bandwidth-bound hardware the
latter is what counts.
"""

from __future__ import annotations

from .base import WithoutDerivedWeights, latent_attention, query_nope


class Absorb(WithoutDerivedWeights):
    """Factored absorbed MLA over the latent cache."""

    name = "absorb"

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        B, L, _ = c_q.shape
        q_nope = query_nope(attn, c_q)  # (B, H, L, dn)
        q_latent = q_nope @ attn.w_uk  # (B, H, L, dn) @ (H, dn, r) -> (B, H, L, r)
        o_latent = latent_attention(q_latent, q_pe, c_kv, k_pe, mask, attn.scale)
        out = o_latent @ attn.w_uv.swapaxes(-1, -2)  # (B, H, L, dv)
        return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
