"""``absorb``: absorbed attention without materializing W_UQ·W_UKᵀ (factored).

q_latent = (W_UQ c_q) · W_UK per head (DeepSeek-V2 paper, section 2.1.2, "absorb W_UK
into W_UQ", applied as two small products instead of one big matrix); attention runs over
c_kv itself; the latent output goes through W_UV per head, then o_proj.

Per decode step and layer (same symbols as ``naive``):
    FLOPs ≈ 2·d·H(dn+dr) [q] + 2·H·dn·r [q_nope·W_UK] + 2·H·S(r+dr) [scores]
           + 2·H·S·r [P·c_kv] + 2·H·r·dv [·W_UV] + 2·H·dv·d [o_proj]
    DeepSeek-V2-Lite ≈ 14.7M + 2.1M·S FLOPs  (C-engine notes, in multiply-adds and
           without o_proj: 7.3M + 1.06M·S — the same up to the factor 2 and o_proj's 4.2M).
    bytes read ≈ weights + S·(r + dr)·itemsize: the cache is read once, shared by all heads.
Its slope in S is half of naive's (2·H·S·(2r+dr) vs 2·S·r·H(dn+dv) + …), but it is all
matmul over the latent, so it is bound by matmul throughput, not by reading the cache.
"""

from __future__ import annotations

from .base import latent_attention


class Absorb:
    """Factored absorbed MLA over the latent cache."""

    name = "absorb"

    def prepare(self, attn) -> None:
        pass

    def release(self, attn) -> None:
        pass

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        B, L, _ = c_q.shape
        H = attn.num_heads
        q_nope = attn.w_uq(c_q).reshape(B, L, H, attn.qk_nope_head_dim).transpose(0, 2, 1, 3)
        q_latent = q_nope @ attn.w_uk  # (B, H, L, dn) @ (H, dn, r) -> (B, H, L, r)
        o_latent = latent_attention(q_latent, q_pe, c_kv, k_pe, mask, attn.scale)
        out = o_latent @ attn.w_uv.swapaxes(-1, -2)  # (B, H, L, dv)
        return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
