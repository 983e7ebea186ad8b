"""benchmarks/server_load.py at a tiny size: both servers come up on the word-tokenizer
folder, every phase gives well-formed rows, the cache bytes they report are the latent and
decompressed caches' sizes by hand, and the second request of the pair reuses the prefix."""

from __future__ import annotations

import pytest

import benchmarks.server_load as bench

TINY = {**bench.V2_LITE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "kv_lora_rank": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "bos_token_id": 0, "eos_token_id": 1}


def test_rows_ratios_and_plot(tmp_path):
    config = bench.one_moe_layer(TINY, 1)
    rows = bench.run(config, tmp_path, clients=(1, 3), prompt_tokens=40, max_tokens=6,
                     log=lambda *_: None)
    load = [r for r in rows if r["phase"] == "load"]
    assert [(r["engine"], r["clients"]) for r in load] == [
        (e, c) for e in bench.ENGINES for c in (1, 3)]
    for r in load:
        assert r["prompt_tokens_reported"] == 40 and 0 < r["completion_tokens"] <= 6 * r["clients"]
        assert r["aggregate_tok_s"] > 0 and r["ttft_p95_s"] >= r["ttft_p50_s"] > 0
        assert r["weight_bytes"] > 0 and r["cache_peak_bytes"] >= r["live_cache_peak_bytes"] > 0
    # float32 caches, allocated in mlx-lm's steps of 256 positions, 1 layer: latent
    # (64 + 64) values per position; decompressed 2 heads × ((64 + 64) + 64)
    by = {(r["engine"], r["clients"]): r for r in load}
    assert by["mlx_mla", 1]["live_cache_peak_bytes"] == 256 * (64 + 64) * 4
    assert by["mlx-lm", 1]["live_cache_peak_bytes"] == 256 * 2 * (128 + 64) * 4
    assert len({r["blas"] for r in rows}) == 1  # both servers on this process's BLAS
    reuse = [r for r in rows if r["phase"] == "reuse"]
    assert [r["engine"] for r in reuse] == list(bench.ENGINES)
    assert all(r["cached_tokens_second"] == 40 for r in reuse)
    ratios = bench.ratios(rows)
    assert ratios["cache_bytes_1_clients"] == pytest.approx(
        by["mlx_mla", 1]["cache_peak_bytes"] / by["mlx-lm", 1]["cache_peak_bytes"])
    bench.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
