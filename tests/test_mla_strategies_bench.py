"""benchmarks/mla_strategies.py at tiny dims: every row is built, timed and costed."""

from __future__ import annotations

import benchmarks.mla_strategies as bench

TINY = {**bench.V2_LITE, "hidden_size": 128, "num_attention_heads": 4, "kv_lora_rank": 64,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}


def test_rows_at_tiny_size(tmp_path):
    rows = bench.measure(TINY, contexts=[64, 300], prefill=32, repeats=1, log=lambda *_: None)
    impls = bench.STRATEGY_ROWS + bench.PEER_ROWS
    assert [(r["phase"], r["S"], r["impl"]) for r in rows] == [
        (ph, S, i) for ph, S in [("decode", 64), ("decode", 300), ("prefill", 32)] for i in impls]
    for r in rows:
        assert r["ms"] > 0 and r["flops"] > 0 and r["bytes_read"] > r["cache_bytes"] > 0
        assert r["L"] == (1 if r["phase"] == "decode" else 32)
    dec = {(r["S"], r["impl"]): r for r in rows if r["phase"] == "decode"}
    # the full K/V cache is H·(dn+dr+dv) / (r+dr) = 320 / 80 = 4x the latent one here
    assert dec[300, "mlx-lm deepseek_v2"]["cache_bytes"] == 4 * dec[300, "absorb"]["cache_bytes"]
    assert dec[300, "naive"]["flops"] > dec[300, "absorb"]["flops"]
    assert dec[300, "auto"]["cost_model"] in ("naive", "absorb", "absorb-materialized")
    extra = [r["extra_param_bytes"] for r in rows if r["impl"] == "absorb-materialized"]
    assert extra and all(e == extra[0] > 0 for e in extra)
    bench.write_csv(rows, tmp_path / "t.csv", bench.FIELDS)
    bench.plot(rows, tmp_path / "t.png", "tiny")
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0].startswith("phase,S,L,impl,ms") and len(lines) == len(rows) + 1
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_bench_layers_agree_with_naive():
    """The benchmark's layers (random 4-bit weights, a filled cache) compute one function."""
    import mlx.core as mx

    x = mx.random.normal((1, 1, TINY["hidden_size"]), key=mx.random.key(3))
    outs = {}
    for name in bench.STRATEGY_ROWS:
        attn = bench.ours(TINY, name)
        cache = bench.filled_cache("latent", TINY, 300, spare=2)
        outs[name] = attn(x, None, cache)
    for name in ("absorb", "auto"):
        assert mx.allclose(outs[name], outs["naive"], atol=1e-4, rtol=1e-3).item(), name


def test_crossover_table_from_rows():
    rows = [{"phase": "decode", "S": S, "impl": i, "ms": ms} for S, i, ms in [
        (512, "naive", 5), (512, "absorb", 6), (2048, "naive", 20), (2048, "absorb", 9),
        (8192, "absorb", 30), (8192, "absorb-materialized", 31), (8192, "auto", 1)]]
    rows += [{"phase": "prefill", "S": 2048, "impl": "naive", "ms": 1},
             {"phase": "prefill", "S": 2048, "impl": "absorb", "ms": 2}]
    assert bench.crossover_table(rows) == {"prefill": [(0, "naive")],
                                           "decode": [(0, "naive"), (2048, "absorb")]}
