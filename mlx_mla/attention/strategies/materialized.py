"""``absorb-materialized``: absorbed attention with W_UQ·W_UKᵀ and W_O·W_UV precomputed.

W_UQK[h] = W_UQ[h]ᵀ W_UK[h]: (q_in, kv_lora_rank) per head, stored as one Linear
q_in → H·kv_lora_rank, so the query goes straight to the latent space in one matmul;
W_OUV[:, h] = W_O[:, h] W_UV[h]: one Linear H·kv_lora_rank → hidden replacing W_UV and
o_proj (DeepSeek-V2 paper, section 2.1.2). Both are built from the unquantized W_UK / W_UV
and the dequantized q / o projections, then quantized like those projections were, so a
4-bit model stays a 4-bit model.
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
