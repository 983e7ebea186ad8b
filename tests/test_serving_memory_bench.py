"""benchmarks/serving_memory.py at a tiny size: rows well-formed, cache sizes by hand."""

from __future__ import annotations

import mlx.core as mx
import pytest

import benchmarks.serving_memory as bench

TINY = {**bench.V2_LITE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "kv_lora_rank": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64}
# mlx-lm v3 re-quantizes W_UK along dn, and v2's 8-bit cache groups dn + dr: multiples of 64


def test_concurrency_and_decode_rows(tmp_path):
    config = bench.one_layer_config(TINY)
    conc = bench.concurrency_rows(config, seq_tokens=256, budget=2**30)  # one 256-block
    by = {r["label"]: r for r in conc}
    # float16: latent 64 + 64 values; decompressed 2 heads × (64 + 64 + 64) values
    assert by["mlx_mla float16 latent"]["cache_bytes_per_token_layer"] == (64 + 64) * 2
    assert by["mlx-lm deepseek_v2 float16"]["cache_bytes_per_token_layer"] == 2 * 192 * 2
    assert by["mlx-lm deepseek_v3 float16 latent"]["cache_bytes_per_token_layer"] == (64 + 64) * 2
    # 8-bit c_kv (64 B) + one float16 scale and bias (4 B) + float16 k_pe (128 B)
    assert by["mlx_mla 8-bit latent"]["cache_bytes_per_token_layer"] == 64 + 4 + 128
    for r in conc:
        assert r["sequences"] == int((r["budget_bytes"] - r["weight_bytes"]) // r["bytes_per_sequence"])
    checks = bench.verify_concurrency(config, conc, cache_budget=2**22, seq_tokens=256)
    assert len(checks) == 2 and all(abs(c["relative_error"]) < 0.25 for c in checks)
    folders = bench.write_folders(config, tmp_path)
    dec = bench.decode_rows(config, folders, batches=(1, 3), context=32, steps=1, log=lambda *_: None)
    assert [(r["engine"], r["batch"]) for r in dec] == [
        (e, b) for e in bench.DECODE_ENGINES for b in (1, 3)]
    assert all(r["tokens_per_second"] > 0 for r in dec)
    ratios = bench.ratios(conc, dec)
    assert ratios["sequences_f16_latent_vs_v2_f16"] == pytest.approx(
        by["mlx_mla float16 latent"]["sequences"] / by["mlx-lm deepseek_v2 float16"]["sequences"])
    bench.plot(conc, dec, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
