"""benchmarks/prefill_gemm.py: rows at a tiny shape, and the crossover rule."""

from __future__ import annotations

import benchmarks.prefill_gemm as bench


def test_linear_rows_at_tiny_shape():
    rows = bench.linear_rows(shapes=[(128, 256)], rows=[1, 8], repeats=1, log=lambda *_: None)
    assert [(r["shape"], r["L"]) for r in rows] == [("128x256", 1), ("128x256", 8)]
    for r in rows:
        assert r["quantized_ms"] > 0 and r["dequant_gemm_ms"] > 0 and r["speedup"] > 0


def test_crossover_is_the_first_length_from_which_every_shape_gains():
    def rows(speedups):
        return [{"kind": "linear", "shape": s, "L": L, "speedup": v}
                for s, pts in speedups.items() for L, v in pts]

    assert bench.crossover(rows({"a": [(1, 0.2), (8, 1.5), (16, 2.0)],
                                 "b": [(1, 0.1), (8, 1.05), (16, 3.0)]})) == 16
    # a dip back below the gain after a win moves the crossover past the dip
    assert bench.crossover(rows({"a": [(1, 0.2), (8, 1.5), (16, 0.9), (32, 4.0)]})) == 32
    assert bench.crossover(rows({"a": [(1, 0.2), (8, 1.05)]})) is None
