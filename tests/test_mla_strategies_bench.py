"""benchmarks/mla_strategies.py at tiny dims: every row is built, timed and costed."""

from __future__ import annotations


import mlx.core as mx
import pytest

from mlx_mla.attention.strategies import base

from conftest import load_benchmark

bench = load_benchmark("mla_strategies")

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
    bench.write_csv(rows, tmp_path / "t.csv")
    bench.plot(rows, tmp_path / "t.png", "tiny")
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0].startswith("phase,S,L,impl,ms") and len(lines) == len(rows) + 1
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_each_layer_matches_across_strategies():
    """Same random weights and cache: every strategy's decode output agrees with naive's."""
    x = mx.random.normal((1, 1, TINY["hidden_size"]), key=mx.random.key(3))
    outs = {}
    for name in bench.STRATEGY_ROWS:
        attn = bench.ours(TINY, name)
        cache = bench.filled_cache("latent", TINY, 300, spare=2)
        outs[name] = attn(x, None, cache)
    for name in ("absorb", "auto"):
        assert mx.allclose(outs[name], outs["naive"], atol=1e-4, rtol=1e-3).item(), name
    # materialized products are re-quantized to 4 bits: close, not equal
    err = mx.abs(outs["absorb-materialized"] - outs["naive"]).max().item()
    assert err < 0.25 * mx.abs(outs["naive"]).max().item()


@pytest.mark.parametrize("S,L", [(300, 1), (1000, 1), (257, 3), (40, 40)])
def test_latent_attention_layouts_agree(S, L, monkeypatch):
    """The decode layout (scores as c_kv·qᵀ, blocked P·c_kv) equals the direct one."""
    k = mx.random.split(mx.random.key(0), 4)
    q = mx.random.normal((2, 4, L, 64), key=k[0])
    qp = mx.random.normal((2, 4, L, 16), key=k[1])
    c = mx.random.normal((2, S, 64), key=k[2])
    kp = mx.random.normal((2, S, 16), key=k[3])
    mask = None if L == 1 else (mx.arange(S)[None] <= mx.arange(S - L, S)[:, None])
    fast = base.latent_attention(q, qp, c, kp, mask, 0.1)
    monkeypatch.setattr(base, "DECODE_ROWS", 0)
    direct = base.latent_attention(q, qp, c, kp, mask, 0.1)
    assert mx.allclose(fast, direct, atol=1e-5).item()


def test_crossover_table_from_rows():
    rows = [{"phase": "decode", "S": S, "impl": i, "ms": ms} for S, i, ms in [
        (512, "naive", 5), (512, "absorb", 6), (2048, "naive", 20), (2048, "absorb", 9),
        (8192, "absorb", 30), (8192, "absorb-materialized", 31), (8192, "auto", 1)]]
    rows += [{"phase": "prefill", "S": 2048, "impl": "naive", "ms": 1},
             {"phase": "prefill", "S": 2048, "impl": "absorb", "ms": 2}]
    assert bench.crossover_table(rows) == {"prefill": [(0, "naive")],
                                           "decode": [(0, "naive"), (2048, "absorb")]}
