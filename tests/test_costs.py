"""mlx_mla.attention.costs against counts derived by hand for DeepSeek-V2-Lite."""

from __future__ import annotations

import pytest

from mlx_mla.attention import costs
from mlx_mla.config import ModelArgs

# d 2048, H 16, r 512, dn 128, dr 64, dv 128, q_lora_rank null
V2_LITE = ModelArgs(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
                    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)

# Shared front end per token: W_DKV|W_KR 2·2048·576 = 2,359,296; W_QR 2·2048·1024 = 4,194,304.
FRONT = 2 * 2048 * 576 + 2 * 2048 * 1024
W_UQ = 2 * 2048 * 2048          # 8,388,608
O_PROJ = 2 * 2048 * 2048        # 8,388,608
UK = UV = 2 * 16 * 128 * 512    # 2,097,152 each (per head (dn, r) products)


def test_decode_flops_by_hand():
    # naive: + W_UQ + decompress K,V 2·512·16·256 per position + attention 2·16·(192+128)
    assert costs.linear_in_s(V2_LITE, "naive") == (FRONT + W_UQ + O_PROJ, 4_194_304 + 10_240)
    assert costs.linear_in_s(V2_LITE, "naive") == (23_330_816, 4_204_544)
    # absorb: + W_UQ + ·W_UK + ·W_UV + o_proj; 2·16·(512 + 64) scores + 2·16·512 P·c_kv
    assert costs.linear_in_s(V2_LITE, "absorb") == (FRONT + W_UQ + UK + UV + O_PROJ, 34_816)
    assert costs.linear_in_s(V2_LITE, "absorb") == (27_525_120, 34_816)
    # materialized: W_UQK 2·2048·8192 and W_OUV 2·8192·2048 replace W_UQ, ·W_UK, ·W_UV, o_proj
    assert costs.linear_in_s(V2_LITE, "absorb-materialized") == (
        FRONT + 2 * 2 * 2048 * 8192, 34_816)
    assert costs.linear_in_s(V2_LITE, "absorb-materialized")[0] == 73_662_464
    # mlx-lm's full K/V cache: kv_b_proj on the new token only, attention 2·16·320 per position
    assert costs.linear_in_s(V2_LITE, "kv-cache") == (FRONT + W_UQ + 2 * 512 * 4096 + O_PROJ, 10_240)


def test_per_position_slopes_by_hand():
    # naive, per cached position: decompress k_nope and v for 16 heads (2·512·16·(128 + 128))
    # plus attention over the decompressed keys and values (2·16·(192 + 128))
    assert costs.linear_in_s(V2_LITE, "naive")[1] == 2 * 512 * 16 * 256 + 2 * 16 * 320
    # absorbed: scores against c_kv and k_pe (2·16·576) and P·c_kv (2·16·512); W_UV is applied
    # once to the 16 latent outputs, so nothing per position is decompressed: 1/120 of naive's
    assert costs.linear_in_s(V2_LITE, "absorb")[1] == 2 * 16 * 576 + 2 * 16 * 512 == 34_816
    assert costs.linear_in_s(V2_LITE, "naive")[1] // costs.linear_in_s(V2_LITE, "absorb")[1] == 120


def test_readme_table_comes_from_the_model():
    table = costs.markdown_table(V2_LITE)
    assert "| `naive` | 23.3M + 4.20M·S |" in table
    assert "| `absorb` | 27.5M + 34.8K·S |" in table


def test_bytes_by_hand():
    q4 = lambda n_in, n_out: n_in * n_out // 2 + 2 * (n_in * n_out // 64) * 4  # 4-bit, fp32 scales
    front = q4(2048, 1024) + q4(2048, 512) + q4(2048, 64) + 512 * 4
    uk_uv = 2 * 16 * 128 * 512 * 4
    S = 4096
    c = costs.step_costs(V2_LITE, "absorb", S=S)
    assert c.weight_bytes == front + q4(2048, 2048) + uk_uv + q4(2048, 2048)
    assert c.cache_bytes == S * 576 * 4
    assert c.temp_bytes == 4 * 16 * S * 4
    n = costs.step_costs(V2_LITE, "naive", S=S)
    assert n.weight_bytes == c.weight_bytes and n.cache_bytes == c.cache_bytes
    # decompressed keys (with k_pe broadcast in) and values, written then read
    assert n.temp_bytes == c.temp_bytes + 2 * 16 * S * (192 + 128) * 4
    m = costs.step_costs(V2_LITE, "absorb-materialized", S=S)
    # W_UQ·W_UK and W_O·W_UV stay float32, whatever the projections' bits
    assert m.weight_bytes == front + 2 * 2048 * 8192 * 4
    kv = costs.step_costs(V2_LITE, "kv-cache", S=S)
    assert kv.cache_bytes == S * 16 * 320 * 4
    assert c.bytes_read == c.weight_bytes + c.cache_bytes + c.temp_bytes
    # 4-bit group 64 with fp32 scales+biases = 0.625 bytes per weight
    assert costs.quantized_bytes(2048, 2048, 4, 64, 4) == 2048 * 2048 * 5 // 8
    assert costs.quantized_bytes(2048, 2048, None, 64, 4) == 2048 * 2048 * 4
    assert costs.quantized_bytes(2048, 2048, 4, 64, 4, scale_itemsize=2) == 2048 * 2048 * 9 // 16


def test_materialized_extra_bytes_and_prefill():
    assert costs.materialized_extra_bytes(V2_LITE) == 2 * 2048 * 8192 * 4  # 134,217,728
    assert costs.materialized_extra_bytes(V2_LITE, itemsize=2) == 2 * 2048 * 8192 * 2
    # prefill: per-token terms ×L, per-position decompression once, attention ×L·S
    L = S = 2048
    n = costs.step_costs(V2_LITE, "naive", S=S, L=L).flops
    assert n == L * 23_330_816 + S * 4_194_304 + L * S * 10_240
    a = costs.step_costs(V2_LITE, "absorb", S=S, L=L).flops
    assert a == L * 27_525_120 + L * S * 34_816


def test_q_lora_and_errors():
    v2 = ModelArgs(hidden_size=5120, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536)
    a0, _ = costs.linear_in_s(v2, "absorb")
    assert a0 == (2 * 5120 * 1536 + 2 * 5120 * 576 + 2 * 1536 * 128 * 64 + 2 * 1536 * 128 * 128
                  + 2 * 2 * 128 * 128 * 512 + 2 * 128 * 128 * 5120)
    with pytest.raises(ValueError, match="no cost model"):
        costs.step_costs(V2_LITE, "flash", S=1)


def test_short_chunk_crossover_is_where_absorb_and_naive_cost_the_same():
    from mlx_mla.attention.costs import short_chunk_tokens

    args = ModelArgs(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512,
                     q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    assert short_chunk_tokens(args) == 512 * 256 / 768  # r(dn + dv) / (2r - dn - dv)
    S = 10**8  # the limit of a long cache
    for L, cheaper in ((170, "absorb"), (171, "naive")):
        flops = {m: costs.step_costs(args, m, S=S, L=L).flops for m in ("absorb", "naive")}
        assert min(flops, key=flops.get) == cheaper, L
