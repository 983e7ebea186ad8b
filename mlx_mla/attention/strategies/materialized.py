"""``absorb-materialized``: absorbed attention with W_UQ·W_UKᵀ and W_O·W_UV precomputed.

W_UQK[h] = W_UQ[h]ᵀ W_UK[h]: (q_in, kv_lora_rank) per head, stored as one Linear
q_in → H·kv_lora_rank, so the query goes straight to the latent space in one matmul;
W_OUV[:, h] = W_O[:, h] W_UV[h]: one Linear H·kv_lora_rank → hidden replacing W_UV and
o_proj (DeepSeek-V2 paper, section 2.1.2). Both are built from the unquantized W_UK / W_UV
and the dequantized q / o projections, then quantized like those projections were, so a
4-bit model stays a 4-bit model.

Per layer, L new tokens attending to S positions (symbols as in ``naive``; exact counts
in ``mlx_mla.attention.costs``):
    FLOPs = 2·L·d·(r + dr) + 2·L·q_in·H·dr           [W_DKV, W_KR, W_QR]
          + 2·L·q_in·H·r                              [W_UQK]
          + 2·L·S·H·(2r + dr)                         [scores over c_kv and k_pe, P·c_kv]
          + 2·L·H·r·d                                 [W_OUV]
    bytes read = weights (W_UQK and W_OUV instead of W_UQ, W_UK, W_UV, o_proj)
          + S·(r + dr)·itemsize + 4·H·L·S·itemsize
    DeepSeek-V2-Lite decode step: 73.7M + 34.8K·S FLOPs; 23.0 MB + 2.56 KB·S read.
Extra parameters: W_UQK and W_OUV are (H·r)·q_in and d·(H·r), 4x the W_UQ and o_proj
they stand in for (r = 512 vs dn = dv = 128): 2 × 16.8M weights = 20.97 MB per layer at
4-bit with float32 scales (``extra_nbytes``, ``costs.materialized_extra_bytes``); 566 MB
over V2-Lite's 27 layers, on top of the originals, which stay for the other strategies.
So materializing only pays where H·r is small next to q_in; for V2-Lite it is never the
cheapest: same per-position cost as ``absorb``, 2.7x its fixed cost. The C-engine notes'
18.9M + 1.06M·S (multiply-adds) counts W_UQK (16.8M) plus a q_rope product of 2048·1024,
leaves W_OUV out and decompresses V per position (1.05M of the 1.06M slope): the real
slope is the factored one's, 17.4K multiply-adds.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .base import latent_attention


def _dense_weight(linear: nn.Module) -> mx.array:
    """The float weight (out, in) of a Linear or QuantizedLinear."""
    if isinstance(linear, nn.QuantizedLinear):
        biases = linear.get("biases")
        # float32 scales, or MLX dequantizes to their (possibly bfloat16) dtype
        return mx.dequantize(
            linear.weight, linear.scales.astype(mx.float32),
            None if biases is None else biases.astype(mx.float32),
            group_size=linear.group_size, bits=linear.bits, mode=linear.mode,
        )
    return linear.weight


def _like(linear: nn.Module, weight: mx.array) -> nn.Module:
    """A bias-free Linear holding ``weight``, quantized the way ``linear`` is (if it is)."""
    out_dims, in_dims = weight.shape
    dense = nn.Linear(in_dims, out_dims, bias=False)
    dense.weight = weight
    if isinstance(linear, nn.QuantizedLinear) and in_dims % linear.group_size == 0:
        return nn.QuantizedLinear.from_linear(dense, linear.group_size, linear.bits, linear.mode)
    return dense


class Materialized:
    """Absorbed MLA with materialized W_UQ·W_UKᵀ and W_O·W_UV (see module docstring)."""

    name = "absorb-materialized"

    def prepare(self, attn) -> None:
        if getattr(attn, "_absorbed_q", None) is not None:
            return
        H, dn, dv, r = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
        dtype = attn.w_uk.dtype
        w_uq = _dense_weight(attn.w_uq).astype(mx.float32)  # (H·dn, q_in)
        w_uq = w_uq.reshape(H, dn, -1)
        w_uk = attn.w_uk.astype(mx.float32)  # (H, dn, r)
        # row h·r + j of W_UQK: Σ_d W_UK[h, d, j] · W_UQ[h, d, :]
        w_uqk = (w_uk.swapaxes(1, 2) @ w_uq).reshape(H * r, -1)  # (H·r, q_in)
        w_o = _dense_weight(attn.o_proj).astype(mx.float32)  # (hidden, H·dv)
        w_o = w_o.reshape(-1, H, dv).transpose(1, 0, 2)  # (H, hidden, dv)
        w_ouv = (w_o @ attn.w_uv.astype(mx.float32))  # (H, hidden, r)
        w_ouv = w_ouv.transpose(1, 0, 2).reshape(-1, H * r)  # (hidden, H·r)
        q_lin = _like(attn.w_uq, w_uqk.astype(dtype))
        o_lin = _like(attn.o_proj, w_ouv.astype(dtype))
        if attn.o_proj.get("bias") is not None:
            o_lin.bias = attn.o_proj.bias
        mx.eval(q_lin.parameters(), o_lin.parameters())
        # Underscored: kept out of the model's parameters (not checkpoint weights).
        attn._absorbed_q, attn._absorbed_o = q_lin, o_lin

    def release(self, attn) -> None:
        attn._absorbed_q = attn._absorbed_o = None

    @staticmethod
    def extra_nbytes(attn) -> int:
        """Bytes the materialized matrices of one layer occupy (0 if not prepared)."""
        from mlx.utils import tree_flatten

        total = 0
        for lin in (getattr(attn, "_absorbed_q", None), getattr(attn, "_absorbed_o", None)):
            if lin is not None:
                total += sum(v.nbytes for _, v in tree_flatten(lin.parameters()))
        return total

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        B, L, _ = c_q.shape
        H, r = attn.num_heads, attn.kv_lora_rank
        q_latent = attn._absorbed_q(c_q).reshape(B, L, H, r).transpose(0, 2, 1, 3)
        o_latent = latent_attention(q_latent, q_pe, c_kv, k_pe, mask, attn.scale)
        return attn._absorbed_o(o_latent.transpose(0, 2, 1, 3).reshape(B, L, H * r))
