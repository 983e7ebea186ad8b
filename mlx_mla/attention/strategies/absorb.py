"""``absorb``: absorbed attention without materializing W_UQ·W_UKᵀ (factored).

q_latent = (W_UQ c_q) · W_UK per head (DeepSeek-V2 paper, section 2.1.2: W_UK is absorbed
into the query side, applied here as two small products instead of one big matrix);
scores = q_latent·c_kvᵀ + q_pe·k_peᵀ (two matmuls summed, no concatenation); attention runs
over c_kv itself (``base.latent_attention``); the latent output goes through W_UV per head,
then o_proj. Nothing is decompressed and nothing is precomputed.

Cost (``mlx_mla.attention.costs``): per attended position 2·H·(2r + dr) FLOPs and
(r + dr) cached values read once for all heads; W_UV is applied once to the H latent
outputs, not to every position. The cheapest decode step at every context length.
"""

from __future__ import annotations

from .base import Strategy, latent_attention, query_nope


class Absorb(Strategy):
    """Factored absorbed MLA over the latent cache."""

    name = "absorb"

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        B, L, _ = c_q.shape
        q_nope = query_nope(attn, c_q)  # (B, H, L, dn)
        q_latent = q_nope @ attn.w_uk  # (B, H, L, dn) @ (H, dn, r) -> (B, H, L, r)
        o_latent = latent_attention(q_latent, q_pe, c_kv, k_pe, mask, attn.scale)
        out = o_latent @ attn.w_uv.swapaxes(-1, -2)  # (B, H, L, dv)
        return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
