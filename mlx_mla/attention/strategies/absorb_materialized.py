"""``absorb-materialized``: absorbed attention with W_UQ·W_UKᵀ and W_O·W_UV precomputed.

W_UQK[h] = W_UQ[h]ᵀ W_UK[h]: (q_in, kv_lora_rank) per head, held as one Linear
q_in → H·kv_lora_rank, so the query goes straight to the latent space in one matmul;
W_OUV[:, h] = W_O[:, h] W_UV[h]: one Linear H·kv_lora_rank → hidden replacing W_UV and
o_proj (DeepSeek-V2 paper, section 2.1.2). Both are built in float32 from the unquantized
W_UK / W_UV and the dequantized q / o projections, and kept in float (the activation dtype),
also in a quantized model: then the strategy computes what the others compute, and agrees
with mlx-lm as closely (max |Δlogit| ~2e-5 in float32 on every folder converted from the
demo checkpoint). Re-quantizing them was measured (``python -m benchmarks.compare_quantized``):
like the projections they replace, up to 4.3 max |Δlogit| on 2-bit folders (greedy tokens
differing), 0.7-1.2 at 4-bit; at 8-bit affine still 0.03-0.54, varying with the group size
and folder, with greedy tokens differing on some. The price is memory: float32 W_UQK + W_OUV are 134 MB per DeepSeek-V2-Lite
layer (``costs.materialized_extra_bytes``). They are this strategy's own (``prepare`` builds
them, ``release`` drops them); the layer's weights are untouched.

Cost (``mlx_mla.attention.costs``): the same per-position work as ``absorb``; the fixed
part multiplies by (H·r)×q_in and d×(H·r) matrices, 4x the W_UQ and o_proj they stand in
for at DeepSeek-V2-Lite's shape (r = 512 vs dn = dv = 128), and they are extra memory
(``costs.materialized_extra_bytes``). Materializing only pays where H·r is small next to
q_in.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...weights import dequantize_float32
from .base import Strategy, latent_attention


def dense_weight(linear: nn.Module) -> mx.array:
    """The float weight (out, in) of a Linear, or of a QuantizedLinear dequantized in
    float32 (any mode; its bits, group size and mode are the layer's, which the loader set
    from the folder's ``quantization`` config); of their tensor-parallel forms, this rank's
    part."""
    if "scales" in linear:
        spec = {"group_size": linear.group_size, "bits": linear.bits, "mode": linear.mode}
        return dequantize_float32(linear.weight, linear.scales, linear.get("biases"), spec)
    return linear.weight


# How the derived matrices are stored: None = float, in the activation dtype (see the
# module docstring); an mx.quantize spec ({"group_size", "bits", "mode"}) quantizes them
# when the projections are quantized. Read when a layer is prepared;
# benchmarks.compare_quantized sets specs to measure them.
DERIVED_QUANTIZATION: Optional[dict] = None


def _derived_linear(source: nn.Module, weight: mx.array) -> nn.Module:
    """A bias-free Linear holding ``weight`` (out, in): float, or quantized to
    ``DERIVED_QUANTIZATION`` when that is set, the projection it stands in for (``source``)
    is quantized, and ``in`` is a multiple of the group size.

    When ``source`` is a tensor-parallel ``o_proj`` (``nn.ShardedToAllLinear`` or its
    quantized form), ``weight`` is this rank's (hidden, heads_here·r) part and the layer is
    of that kind too: its products are all-summed over the group, then the bias added.
    """
    out_dims, in_dims = weight.shape
    layer = nn.Linear(in_dims, out_dims, bias=False)
    layer.weight = weight
    spec = DERIVED_QUANTIZATION
    quantized = bool(spec) and "scales" in source and in_dims % spec["group_size"] == 0
    if quantized:
        layer = nn.QuantizedLinear.from_linear(layer, **spec)
    if not isinstance(source, (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)):
        return layer
    group = source.group
    if quantized:
        sharded = nn.QuantizedShardedToAllLinear(in_dims * group.size(), out_dims, bias=False,
                                                 group=group, **spec)
    else:
        sharded = nn.ShardedToAllLinear(in_dims * group.size(), out_dims, bias=False, group=group)
    sharded.update(layer.parameters())
    return sharded


class AbsorbMaterialized(Strategy):
    """Absorbed MLA with materialized W_UQ·W_UKᵀ and W_O·W_UV (see module docstring)."""

    name = "absorb-materialized"

    def __init__(self):
        self.w_uqk = None  # Linear q_in → H·kv_lora_rank
        self.w_ouv = None  # Linear H·kv_lora_rank → hidden

    def prepare(self, attn) -> None:
        H, dn, dv, r = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
        dtype = attn.w_uk.dtype
        w_uq = dense_weight(attn.w_uq).astype(mx.float32).reshape(H, dn, -1)  # (H, dn, q_in)
        w_uk = attn.w_uk.astype(mx.float32)  # (H, dn, r)
        # row h·r + j of W_UQK: Σ_d W_UK[h, d, j] · W_UQ[h, d, :]
        w_uqk = (w_uk.swapaxes(1, 2) @ w_uq).reshape(H * r, -1)  # (H·r, q_in)
        w_o = dense_weight(attn.o_proj).astype(mx.float32)  # (hidden, H·dv)
        w_o = w_o.reshape(-1, H, dv).transpose(1, 0, 2)  # (H, hidden, dv)
        w_ouv = w_o @ attn.w_uv.astype(mx.float32)  # (H, hidden, r)
        w_ouv = w_ouv.transpose(1, 0, 2).reshape(-1, H * r)  # (hidden, H·r)
        self.w_uqk = _derived_linear(attn.w_uq, w_uqk.astype(dtype))
        self.w_ouv = _derived_linear(attn.o_proj, w_ouv.astype(dtype))
        if attn.o_proj.get("bias") is not None:
            self.w_ouv.bias = attn.o_proj.bias
        mx.eval(self.w_uqk.parameters(), self.w_ouv.parameters())

    def release(self) -> None:
        self.w_uqk = self.w_ouv = None

    @property
    def derived_nbytes(self) -> int:
        """Bytes of W_UQK and W_OUV (0 until prepared)."""
        return sum(v.nbytes for lin in (self.w_uqk, self.w_ouv) if lin is not None
                   for _, v in tree_flatten(lin.parameters()))

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        B, L, _ = c_q.shape
        H, r = attn.num_heads, attn.kv_lora_rank
        q_latent = self.w_uqk(c_q).reshape(B, L, H, r).transpose(0, 2, 1, 3)  # (B, H, L, r)
        o_latent = latent_attention(q_latent, q_pe, c_kv, k_pe, mask, attn.scale)
        return self.w_ouv(o_latent.transpose(0, 2, 1, 3).reshape(B, L, H * r))
