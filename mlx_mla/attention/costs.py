"""Analytic cost of one MLA layer call: FLOPs and bytes read, per strategy.

Derived from the computation each strategy performs (``mlx_mla.attention.strategies``),
which follows the DeepSeek-V2 paper (section 2.1: the latent c_kv, decoupled RoPE, and the
absorption of W_UK into the query side and of W_UV into the output side) and DeepSeek's
reference implementations (transformers' ``DeepseekV2Attention`` for the decompressing path;
DeepSeek's ``inference/model.py`` "absorb" path for attention over the latent).
``python -m mlx_mla.attention.costs`` prints the README's table for DeepSeek-V2-Lite.

A pure function of the model dimensions, the call shape (L new tokens attending to S
positions; a decode step is L = 1), the activation itemsize and the weight quantization.
Symbols: d = hidden_size, q_in = d (or q_lora_rank), H heads, r = kv_lora_rank,
dn / dr / dv = qk_nope / qk_rope / v head dims. FLOPs count a multiply-add as 2 and only
the matmuls (norms, RoPE, softmax and the mask are O(H·L·S) or less, under 1%).

FLOPs (L new tokens, S attended positions):
    shared front end   2·L·d·(r + dr) [W_DKV, W_KR] + 2·L·q_in·H·dr [W_QR]
    naive              + 2·L·q_in·H·dn [W_UQ] + 2·S·r·H·(dn + dv) [decompress K, V]
                       + 2·L·S·H·(dn + dr + dv) [scores, P·V] + 2·L·H·dv·d [o_proj]
    absorb             + 2·L·q_in·H·dn [W_UQ] + 2·L·H·dn·r [·W_UK] + 2·L·S·H·(2r + dr)
                       [scores over c_kv and k_pe, P·c_kv] + 2·L·H·r·dv [·W_UV] + 2·L·H·dv·d [o_proj]
    absorb-materialized+ 2·L·q_in·H·r [W_UQ·W_UK] + 2·L·S·H·(2r + dr) + 2·L·H·r·d [W_O·W_UV]
    kv-cache (mlx-lm deepseek_v2, full K/V cache; for comparison)
                       + 2·L·q_in·H·dn + 2·L·r·H·(dn + dv) [kv_b_proj on the new tokens only]
                       + 2·L·S·H·(dn + dr + dv) + 2·L·H·dv·d
DeepSeek-V2-Lite (d 2048, H 16, r 512, dn 128, dr 64, dv 128), per decode step (L = 1):
    naive 23.33M + 4.205M·S;  absorb 27.53M + 34.8K·S;  absorb-materialized 73.66M + 34.8K·S;
    kv-cache 27.52M + 10.2K·S.

Bytes read:
    weights   every weight the call multiplies by: a b-bit quantized Linear costs
              in·out·b/8 + 2·(in·out/group)·scale_itemsize (scales and biases); W_UK / W_UV
              stay float (itemsize); norms at itemsize. absorb-materialized's W_UQ·W_UK and
              W_O·W_UV are float (itemsize) whatever the projections are (see that strategy).
    cache     S·(r + dr)·itemsize (latent), or S·H·(dn + dr + dv)·itemsize (kv-cache).
    temporaries proportional to S, written and read back once each:
              naive: the decompressed keys (H·S·(dn + dr), k_pe broadcast into them) and
              values (H·S·dv); every strategy: the (H·L, S) scores/probabilities, written
              and read twice (score sum, softmax) = 4·H·L·S·itemsize.
Activations of size O(L·(d + H·r)) are left out (under 0.1 MB per decode step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

STRATEGY_MODELS = ("naive", "absorb", "absorb-materialized", "kv-cache")


@dataclass(frozen=True)
class Costs:
    """One call's cost. ``bytes_read`` = weights + cache + temporaries."""

    flops: int
    weight_bytes: int
    cache_bytes: int
    temp_bytes: int

    @property
    def bytes_read(self) -> int:
        """Total bytes one call reads: weights + latent/KV cache + temporaries ∝ S."""
        return self.weight_bytes + self.cache_bytes + self.temp_bytes


def quantized_bytes(n_in: int, n_out: int, bits: Optional[int], group_size: int,
                    itemsize: int, scale_itemsize: Optional[int] = None) -> int:
    """Bytes of an (n_out, n_in) Linear weight: float at ``itemsize`` when ``bits`` is None,
    else packed b-bit values plus one scale and one bias per ``group_size`` inputs."""
    if bits is None:
        return n_in * n_out * itemsize
    s = itemsize if scale_itemsize is None else scale_itemsize
    return n_in * n_out * bits // 8 + 2 * (n_in * n_out // group_size) * s


def step_costs(args, strategy: str, S: int, L: int = 1, itemsize: int = 4,
               bits: Optional[int] = 4, group_size: int = 64,
               scale_itemsize: Optional[int] = None) -> Costs:
    """FLOPs and bytes read of one layer's call (see the module docstring for the formulas).

    Args:
        args: anything with DeepSeek-V2's attention fields (``mlx_mla.config.ModelArgs``,
            mlx-lm's ModelArgs): hidden_size, num_attention_heads, kv_lora_rank,
            q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim.
        strategy: 'naive', 'absorb', 'absorb-materialized' or 'kv-cache' (mlx-lm's
            full K/V cache attention, for comparison).
        S: attended positions (cached + new); L: new tokens (1 for a decode step).
        itemsize: bytes per activation / cache / float-weight value.
        bits, group_size: the Linears' quantization (None: float weights).
        scale_itemsize: bytes per quantization scale and bias (default ``itemsize``).
    Raises:
        ValueError: unknown strategy.
    """
    if strategy not in STRATEGY_MODELS:
        raise ValueError(f"no cost model for {strategy!r}: one of {STRATEGY_MODELS}")
    d, H, r = args.hidden_size, args.num_attention_heads, args.kv_lora_rank
    dn, dr, dv = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    q_lora = getattr(args, "q_lora_rank", None)
    q_in = q_lora or d

    def lin(n_in, n_out):
        return quantized_bytes(n_in, n_out, bits, group_size, itemsize, scale_itemsize)

    # shared front end: (q_a_proj + q_a_layernorm), W_QR, W_DKV, W_KR, kv_a_layernorm
    flops = 2 * L * d * (r + dr) + 2 * L * q_in * H * dr
    weights = lin(q_in, H * dr) + lin(d, r) + lin(d, dr) + r * itemsize
    if q_lora:
        flops += 2 * L * d * q_lora
        weights += lin(d, q_lora) + q_lora * itemsize
    scores = 4 * H * L * S * itemsize
    cache = S * (r + dr) * itemsize
    temps = scores

    if strategy == "naive":
        flops += (2 * L * q_in * H * dn + 2 * S * r * H * (dn + dv)
                  + 2 * L * S * H * (dn + dr + dv) + 2 * L * H * dv * d)
        weights += lin(q_in, H * dn) + H * (dn + dv) * r * itemsize + lin(H * dv, d)
        temps += 2 * H * S * (dn + dr + dv) * itemsize
    elif strategy == "absorb":
        flops += (2 * L * q_in * H * dn + 2 * L * H * dn * r + 2 * L * S * H * (2 * r + dr)
                  + 2 * L * H * r * dv + 2 * L * H * dv * d)
        weights += lin(q_in, H * dn) + H * (dn + dv) * r * itemsize + lin(H * dv, d)
    elif strategy == "absorb-materialized":
        flops += 2 * L * q_in * H * r + 2 * L * S * H * (2 * r + dr) + 2 * L * H * r * d
        weights += materialized_extra_bytes(args, itemsize)
    else:  # kv-cache: mlx-lm deepseek_v2 (fused q_proj / kv_a_proj / kv_b_proj)
        flops += (2 * L * q_in * H * dn + 2 * L * r * H * (dn + dv)
                  + 2 * L * S * H * (dn + dr + dv) + 2 * L * H * dv * d)
        weights += lin(q_in, H * dn) + lin(r, H * (dn + dv)) + lin(H * dv, d)
        cache = S * H * (dn + dr + dv) * itemsize
    return Costs(int(flops), int(weights), int(cache), int(temps))


def materialized_extra_bytes(args, itemsize: int = 4) -> int:
    """Extra parameter bytes per layer of ``absorb-materialized``: W_UQ·W_UKᵀ (q_in → H·r)
    and W_O·W_UV (H·r → d), float at ``itemsize`` (the strategy keeps them float, quantized
    model or not). (They replace nothing in memory: W_UQ, W_UK, W_UV and o_proj stay, for
    the other strategies.)"""
    d, H, r = args.hidden_size, args.num_attention_heads, args.kv_lora_rank
    q_in = getattr(args, "q_lora_rank", None) or d
    return (q_in * H * r + H * r * d) * itemsize


def linear_in_s(args, strategy: str, **kw) -> tuple:
    """(a, b) with decode-step FLOPs = a + b·S (exact: the count is affine in S)."""
    c0 = step_costs(args, strategy, S=0, L=1, **kw).flops
    c1 = step_costs(args, strategy, S=1, L=1, **kw).flops
    return c0, c1 - c0


def short_chunk_tokens(args) -> float:
    """Chunk length L below which a prefill chunk over a long cache costs ``absorb`` fewer
    FLOPs than ``naive`` (the limit S → ∞ of the formulas above): naive decompresses all S
    cached positions once per call (2·S·r·H·(dn + dv), whatever L), then pays
    2·L·S·H·(dn + dr + dv) per query-position pair; absorb pays 2·L·S·H·(2r + dr) and no
    decompression (its 2·L·H·r·(dn + dv) absorption does not grow with S). So
    L* = r·(dn + dv) / (2r − dn − dv): DeepSeek-V2-Lite (and V2, whose per-head dims are
    the same) 512·256 / 768 = 170.7. Infinite when 2r ≤ dn + dv."""
    r, dn, dv = args.kv_lora_rank, args.qk_nope_head_dim, args.v_head_dim
    denom = 2 * r - dn - dv
    return float("inf") if denom <= 0 else r * (dn + dv) / denom


def _si(x: float) -> str:
    for unit, div in (("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            v = x / div
            return (f"{v:#.3g}".rstrip(".") if v < 100 else f"{v:.0f}") + unit
    return f"{x:g}"


def _bytes(x: float) -> str:
    return f"{x / 1e6:.1f} MB" if x >= 1e6 else f"{x / 1e3:.3g} KB"


def markdown_table(args, itemsize: int = 4, bits: Optional[int] = 4, group_size: int = 64) -> str:
    """The README's table: per-layer decode-step FLOPs and bytes read as a + b·S for each
    strategy and for mlx-lm's full K/V cache (``kv-cache``)."""
    names = {"naive": "`naive`", "absorb-materialized": "`absorb-materialized`",
             "absorb": "`absorb`", "kv-cache": "mlx-lm `deepseek_v2` (full K/V cache)"}
    kw = dict(itemsize=itemsize, bits=bits, group_size=group_size)
    lines = ["| strategy | FLOPs | bytes read |", "|---|---|---|"]
    for model in ("naive", "absorb-materialized", "absorb", "kv-cache"):
        f0, f1 = linear_in_s(args, model, **kw)
        b0 = step_costs(args, model, S=0, **kw).bytes_read
        b1 = step_costs(args, model, S=1, **kw).bytes_read - b0
        lines.append(f"| {names[model]} | {_si(f0)} + {_si(f1)}·S | {_bytes(b0)} + {_bytes(b1)}·S |")
    return "\n".join(lines)


__all__ = ["Costs", "STRATEGY_MODELS", "step_costs", "quantized_bytes",
           "materialized_extra_bytes", "linear_in_s", "short_chunk_tokens", "markdown_table"]


if __name__ == "__main__":
    from mlx_mla.config import ModelArgs

    # DeepSeek-V2-Lite's attention (deepseek-ai/DeepSeek-V2-Lite config.json), float32
    # activations, 4-bit group-64 Linears with float32 scales
    print(markdown_table(ModelArgs(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512,
                                   q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                   v_head_dim=128)))
