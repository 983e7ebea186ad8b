"""benchmarks/kv_quant.py on a few tokens: rows well-formed; the emulated rounding is right."""

from __future__ import annotations

import mlx.core as mx

import benchmarks.kv_quant as bench


def test_fake_quantize_by_hand():
    x = mx.array([[0.0, 1.0, 2.0, 3.0] * 4])
    # 2 bits over [0, 3] in one group of 16: steps of 1, exact
    assert mx.array_equal(bench.fake_quantize(x, 2), x).item()
    y = mx.array([[0.0, 0.4, 1.0, 0.6] * 4])  # 1 bit over [0, 1]: rounds to 0 or 1
    assert bench.fake_quantize(y, 1).tolist() == [[0.0, 0.0, 1.0, 1.0] * 4]


def test_rows(corpus_text, tmp_path):
    rows = bench.run(corpus_text, 96)
    assert [(r["c_kv_bits"], r["k_pe"].split(" ")[0]) for r in rows] == [
        (8, "float"), (8, "8-bit"), (4, "float"), (4, "8-bit"), (4, "4-bit")]
    assert all(r["kl"] >= 0 and 0 <= r["top1"] <= 1 and r["tokens"] == 96 for r in rows)
    assert rows[0]["kl"] < rows[2]["kl"]  # 8 bits lose less than 4
    bench.plot(rows, tmp_path / "k.png")
