"""The one interface every MLA strategy has, and the attention core the absorbed ones share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx

from ...cache import QuantizedLatent

if TYPE_CHECKING:
    from ..mla import MLAttention


class Strategy:
    """Turns one layer's latent cache into attention output; one instance per layer.

    ``__call__(attn, c_q, q_pe, c_kv, k_pe, mask) -> (B, L, hidden)`` with
        attn: the layer's ``MLAttention`` (its weights: w_uq, w_uk, w_uv, o_proj, scale)
        c_q:  (B, L, q_in) the compressed query (x itself when q_lora_rank is null)
        q_pe: (B, H, L, qk_rope_head_dim), roped
        c_kv: (B, S, kv_lora_rank), an array or a ``QuantizedLatent`` (a quantized cache);
        k_pe: (B, S, qk_rope_head_dim), roped; S = the positions the cache holds
        mask: bool, broadcastable to (B, 1, L, S), True = attend; None = attend to all S.
    ``prepare(attn)`` builds the weights the strategy derives from the layer's own (once,
    when the strategy is selected) and keeps them on the strategy object; ``release()``
    drops them; ``derived_nbytes`` is what they occupy. The FLOPs and bytes each strategy
    costs per call are derived in ``mlx_mla.attention.costs``.
    """

    name: str = ""

    def prepare(self, attn: "MLAttention") -> None:
        """Build derived weights from ``attn``'s own (none by default)."""

    def release(self) -> None:
        """Drop derived weights (none by default)."""

    @property
    def derived_nbytes(self) -> int:
        """Bytes of the derived weights this strategy holds (0 by default)."""
        return 0

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask) -> mx.array:
        raise NotImplementedError


# Below this many query rows (H·L) the latent attention uses the decode layout (see
# ``latent_attention``); prefill chunks (thousands of rows) use the plain one.
DECODE_ROWS = 256
# Positions per block of the blocked P·c_kv product in the decode layout.
BLOCK = 128


def query_nope(attn, c_q: mx.array) -> mx.array:
    """q_nope = W_UQ c_q per head: (B, L, q_in) → (B, H, L, qk_nope_head_dim)."""
    B, L, _ = c_q.shape
    q = attn.w_uq(c_q).reshape(B, L, attn.num_heads, attn.qk_nope_head_dim)
    return q.transpose(0, 2, 1, 3)


def latent_attention(
    q_latent: mx.array,
    q_pe: mx.array,
    c_kv: mx.array,
    k_pe: mx.array,
    mask: Optional[mx.array],
    scale: float,
) -> mx.array:
    """Attention of absorbed queries straight over the latent cache.

    scores[h, i, j] = scale · (q_latent[h, i] · c_kv[j] + q_pe[h, i] · k_pe[j]), a softmax
    over j, then o_latent[h, i] = Σ_j p[h, i, j] c_kv[j]: MLA's attention with decoupled RoPE,
    W_UK absorbed into the query and W_UV left for the caller to apply to o_latent
    (DeepSeek-V2 paper, sections 2.1.2 and 2.1.3). The two score terms are separate
    matmuls summed, so no concatenated [c_kv; k_pe] copy is made. All heads share one
    c_kv / k_pe (it is multi-query attention in the latent space), so the H·L query rows
    fold into a single GEMM per batch element instead of H broadcast ones; the scale is
    folded into the (small) queries, not applied to the (H·L, S) scores.

    Layout (measured on MLX's CPU backend, whose GEMM streams the right-hand operand once
    per output row): with few query rows (decode, H·L ≤ ``DECODE_ROWS``) the scores are
    computed as c_kv · q_latentᵀ (each cache row read once while all queries sit in L1,
    the queries transposed into a contiguous copy so the GEMM runs its vectorised form),
    and P·c_kv is blocked over ``BLOCK`` positions (a batched GEMM whose block of c_kv stays
    in cache across the H·L rows, then a sum over blocks). 16K-position decode step:
    ~35% faster than q_latent · c_kvᵀ and P · c_kv done whole. Prefill chunks keep the
    direct layout.

    A quantized c_kv (``QuantizedLatent``) is multiplied as it is stored, with
    ``mx.quantized_matmul`` for both products (its groups run along kv_lora_rank, which is
    the contracted axis of the scores and the output axis of P·c_kv): no dequantized copy of
    the cache is made.

    Args:
        q_latent: (B, H, L, kv_lora_rank); q_pe: (B, H, L, qk_rope_head_dim)
        c_kv: (B, S, kv_lora_rank) array or QuantizedLatent; k_pe: (B, S, qk_rope_head_dim)
        mask: bool broadcastable to (B, 1, L, S) (True = attend), or None
    Returns:
        o_latent: (B, H, L, kv_lora_rank), in q_latent's dtype.
    """
    B, H, L, r = q_latent.shape
    S = c_kv.shape[1]
    HL = H * L
    q_latent = (q_latent * scale).reshape(B, HL, r)
    q_pe = (q_pe * scale).reshape(B, HL, q_pe.shape[-1])
    if isinstance(c_kv, QuantizedLatent):
        return _quantized_latent_attention(q_latent, q_pe, c_kv, k_pe, mask, (B, H, L, r))
    decode = HL <= DECODE_ROWS
    if decode:
        q_lt = mx.contiguous(q_latent.swapaxes(1, 2))  # (B, r, H·L)
        q_pt = mx.contiguous(q_pe.swapaxes(1, 2))  # (B, dr, H·L)
        scores = (c_kv @ q_lt + k_pe @ q_pt).swapaxes(1, 2)  # (B, H·L, S)
    else:
        scores = q_latent @ c_kv.swapaxes(1, 2) + q_pe @ k_pe.swapaxes(1, 2)  # (B, H·L, S)
    probs = _masked_softmax(scores, mask, (B, H, L, S))
    nb = S // BLOCK
    if not decode or nb < 2:
        return (probs @ c_kv).reshape(B, H, L, r)
    S0 = nb * BLOCK
    blocks = probs[..., :S0].reshape(B, HL, nb, BLOCK).swapaxes(1, 2)  # (B, nb, H·L, BLOCK)
    out = (blocks @ c_kv[:, :S0].reshape(B, nb, BLOCK, r)).sum(axis=1)  # (B, H·L, r)
    if S0 < S:
        out = out + probs[..., S0:] @ c_kv[:, S0:]
    return out.reshape(B, H, L, r)


def _masked_softmax(scores: mx.array, mask: Optional[mx.array], shape) -> mx.array:
    """softmax over positions of (B, H·L, S) scores, masked positions getting no mass."""
    B, H, L, S = shape
    if mask is not None:
        scores = scores.reshape(B, H, L, S)
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        scores = scores.reshape(B, H * L, S)
    return mx.softmax(scores, axis=-1, precise=True)


def _quantized_latent_attention(q_latent, q_pe, c_kv: QuantizedLatent, k_pe, mask, shape):
    """``latent_attention``'s two products on the stored quantized c_kv (scaled queries
    already folded into (B, H·L, ·))."""
    B, H, L, r = shape
    q = dict(group_size=c_kv.group_size, bits=c_kv.bits)
    scores = mx.quantized_matmul(q_latent, c_kv.weight, c_kv.scales, c_kv.biases,
                                 transpose=True, **q)  # (B, H·L, S)
    scores = scores + q_pe @ k_pe.swapaxes(1, 2)
    probs = _masked_softmax(scores, mask, (B, H, L, scores.shape[-1]))
    out = mx.quantized_matmul(probs, c_kv.weight, c_kv.scales, c_kv.biases,
                              transpose=False, **q)  # (B, H·L, r)
    return out.reshape(B, H, L, r)
