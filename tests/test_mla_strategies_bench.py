"""benchmarks/mla_strategies.py at tiny dims: every row is built, timed and costed."""

from __future__ import annotations

import benchmarks.mla_strategies as bench

TINY = {**bench.V2_LITE, "hidden_size": 128, "num_attention_heads": 4, "kv_lora_rank": 64,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}


def test_rows_at_tiny_size(tmp_path):
    rows = bench.measure(TINY, contexts=[64, 300], prefill=32, repeats=1, chunks=[4],
                         chunk_cache=100, log=lambda *_: None)
    impls = bench.STRATEGY_ROWS + bench.PEER_ROWS
    assert [(r["phase"], r["S"], r["impl"]) for r in rows] == [
        (ph, S, i) for ph, S in [("decode", 64), ("decode", 300), ("prefill", 32),
                                 ("short_prefill", 104)] for i in impls]
    for r in rows:
        assert r["ms"] > 0 and r["flops"] > 0 and r["bytes_read"] > r["cache_bytes"] > 0
        assert r["L"] == {"decode": 1, "prefill": 32, "short_prefill": 4}[r["phase"]]
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
    assert lines[0].startswith("blas,phase,S,L,impl,ms") and len(lines) == len(rows) + 1
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
    rows += [{"phase": "prefill", "S": 2048, "L": 2048, "impl": "naive", "ms": 1},
             {"phase": "prefill", "S": 2048, "L": 2048, "impl": "absorb", "ms": 2}]
    table = bench.crossover_table(rows)
    assert table == bench.Table(decode=((0, "naive"), (2048, "absorb")), prefill=((0, "naive"),))
    chunks = [{"phase": "short_prefill", "S": 4096 + L, "L": L, "impl": i, "ms": ms} for L, i, ms in [
        (16, "naive", 9), (16, "absorb", 2), (64, "naive", 9), (64, "absorb", 5),
        (128, "naive", 9), (128, "absorb", 10), (256, "naive", 9), (256, "absorb", 8)]]
    table = bench.crossover_table(rows + chunks)
    # 256 is absorb's again, but 128 is naive's: the phase ends at the last unbroken win
    assert (table.short_chunk, table.short_prefill) == (64, ((0, "absorb"),))
    # an auto row is another sample of the strategy it ran: naive's best time at 64 is 4
    auto64 = {"phase": "short_prefill", "S": 4160, "L": 64, "impl": "auto", "ms": 4,
              "cost_model": "naive"}
    assert bench.crossover_table(rows + chunks + [auto64]).short_chunk == 16


def test_main_worker_then_parent_merges_per_blas(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(bench, "V2_LITE", TINY)
    worker = tmp_path / "w.json"
    bench.main(["--worker-out", str(worker), "--contexts", "64", "--prefill", "16",
                "--chunks", "4", "--chunk-cache", "32", "--repeats", "1"])
    result = json.loads(worker.read_text())
    assert result["meta"]["measured_table"].startswith("Table(")

    def fake(module, argv, names, log=print):
        assert module == "benchmarks.mla_strategies" and "--worker-out" not in argv
        return [{"meta": {**result["meta"], "blas": n},
                 "rows": [{**r, "blas": n} for r in result["rows"]]} for n in names]

    monkeypatch.setattr(bench, "run_per_blas", fake)
    bench.main(["--blas", "reference", "openblas", "--out", str(tmp_path)])
    lines = (tmp_path / "mla_strategies.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * len(result["rows"])
    assert json.loads((tmp_path / "mla_strategies.json").read_text())["meta"].keys() == {
        "reference", "openblas"}
