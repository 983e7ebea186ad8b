"""Quantized kernel vs dequantize + float GEMM on MLX's CPU backend, per BLAS: the crossover.

For a 4-bit (group 64) Linear at two of DeepSeek-V2-Lite's shapes (2048 → 2048, as W_UQ and
o_proj; 2048 → 10944, the dense MLP's gate/up) and a call of L rows (tokens), times
``mx.quantized_matmul`` (what ``nn.QuantizedLinear`` runs) against ``mx.dequantize`` then
``x @ Wᵀ`` (what ``mlx_mla.prefill_gemm.GemmQuantizedLinear`` runs from ``min_rows`` on);
then V2-Lite's routed experts (64 × 1408 × 2048, top-6, mlx-lm's ``SwitchGLU``) on N
tokens, stock (``gather_qmm``) against ``GemmQuantizedSwitchLinear`` with the measured
``min_rows``. Float32 activations, random weights; per point the median of ``repeats``
calls, the two paths alternated. Each BLAS runs in its own process
(``benchmarks.common.run_per_blas``).

``min_rows`` per BLAS (what ``mlx_mla.prefill_gemm.MIN_ROWS`` holds): the smallest measured
L from which the dequantized GEMM is ≥ 1.1x faster at every larger measured L and both
shapes; none if there is no such L.

    python -m benchmarks.prefill_gemm            # ~3 minutes per BLAS on a 2-core CPU
Writes benchmarks/results/prefill_gemm.csv (a ``blas`` column) and .json (meta per BLAS).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_mla import prefill_gemm

from .common import RESULTS, default_blas, run_per_blas, worker_result, write_csv, summary

SHAPES = [(2048, 2048), (2048, 10944)]  # (in, out)
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]
EXPERT_TOKENS = [16, 64, 256]
GAIN = 1.1  # the dequantized GEMM must be this much faster to count


def _time(fns: Dict[str, callable], repeats: int) -> Dict[str, float]:
    """Median ms of each fn: a first call taking > 2 s is the measurement (warm-up effects
    are noise at that length); the others are warmed up, then timed ``repeats`` times,
    calls alternated."""
    times = {}
    for k, f in fns.items():
        t0 = time.perf_counter()
        mx.eval(f())
        first = time.perf_counter() - t0
        times[k] = [first] if first > 2.0 else []
    for _ in range(repeats):
        for k, f in fns.items():
            if len(times[k]) == 1 and times[k][0] > 2.0:
                continue
            t0 = time.perf_counter()
            mx.eval(f())
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def linear_rows(shapes=SHAPES, rows=ROWS, repeats: int = 3, log=print) -> List[Dict]:
    """Rows {'kind': 'linear', 'shape', 'L', 'quantized_ms', 'dequant_gemm_ms', 'speedup'}."""
    out = []
    for i, (d_in, d_out) in enumerate(shapes):
        lin = nn.Linear(d_in, d_out, bias=False)
        ql = nn.QuantizedLinear.from_linear(lin, 64, 4)
        mx.eval(ql.parameters())
        for L in rows:
            x = mx.random.normal((1, L, d_in), key=mx.random.key(i + L))
            t = _time({
                "q": lambda: mx.quantized_matmul(x, ql.weight, ql.scales, ql.biases, True, 64, 4),
                "d": lambda: x @ mx.dequantize(ql.weight, ql.scales, ql.biases, 64, 4).T,
            }, repeats)
            out.append({"kind": "linear", "shape": f"{d_in}x{d_out}", "L": L,
                        "quantized_ms": round(t["q"], 3), "dequant_gemm_ms": round(t["d"], 3),
                        "speedup": round(t["q"] / t["d"], 3)})
            log(f"linear {d_in}->{d_out} L={L:5d}: quantized {t['q']:9.2f} ms, "
                f"dequant+GEMM {t['d']:9.2f} ms ({t['q'] / t['d']:.2f}x)")
    return out


def crossover(rows: List[Dict], gain: float = GAIN) -> Optional[int]:
    """Smallest L with speedup ≥ ``gain`` at every measured L' ≥ L, for every shape."""
    lin = [r for r in rows if r["kind"] == "linear"]
    Ls = sorted({r["L"] for r in lin})
    for L in Ls:
        if all(r["speedup"] >= gain for r in lin if r["L"] >= L):
            return L
    return None


def expert_rows(min_rows: Optional[int], tokens=EXPERT_TOKENS, repeats: int = 3,
                log=print) -> List[Dict]:
    """V2-Lite's routed experts on N tokens: stock SwitchGLU vs the per-expert GEMM path."""
    from mlx_lm.models.switch_layers import SwitchGLU

    if min_rows is None:
        return []
    mx.random.seed(0)
    stock = SwitchGLU(2048, 1408, 64)
    nn.quantize(stock, 64, 4)
    mx.eval(stock.parameters())
    gemm = SwitchGLU(2048, 1408, 64)
    nn.quantize(gemm, 64, 4)
    gemm.update(stock.parameters())
    prefill_gemm.apply(gemm, min_rows)
    out = []
    for N in tokens:
        x = mx.random.normal((1, N, 2048), key=mx.random.key(N))
        inds = mx.argsort(mx.random.uniform(shape=(1, N, 64), key=mx.random.key(N + 1)),
                          axis=-1)[..., :6].astype(mx.uint32)
        t = _time({"q": lambda: stock(x, inds), "d": lambda: gemm(x, inds)}, repeats)
        out.append({"kind": "experts", "shape": "64x(2048x1408)x3 top-6", "L": N,
                    "quantized_ms": round(t["q"], 3), "dequant_gemm_ms": round(t["d"], 3),
                    "speedup": round(t["q"] / t["d"], 3), "min_rows": min_rows})
        log(f"experts N={N:5d} tokens: gather_qmm {t['q']:9.2f} ms, per-expert GEMM "
            f"{t['d']:9.2f} ms ({t['q'] / t['d']:.2f}x)")
    return out


def measure(repeats: int = 3, log=print) -> List[Dict]:
    rows = linear_rows(repeats=repeats, log=log)
    m = crossover(rows)
    log(f"min_rows (crossover): {m}")
    for r in rows:
        r["min_rows"] = m
    return rows + expert_rows(m, repeats=repeats, log=log)


FIELDS = ["blas", "kind", "shape", "L", "quantized_ms", "dequant_gemm_ms", "speedup", "min_rows"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--blas", nargs="+", default=None,
                   help="reference, openblas (CPU; default: both where OpenBLAS is installed) or current (this backend as it is: a GPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker_out:
        worker_result(a.worker_out, measure(a.repeats))
        return
    t = time.perf_counter()
    results = run_per_blas("benchmarks.prefill_gemm", ["--repeats", str(a.repeats)],
                           a.blas or default_blas())
    rows = [r for res in results for r in res["rows"]]
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, a.out / "prefill_gemm.csv", FIELDS)
    (a.out / "prefill_gemm.json").write_text(json.dumps(
        {"meta": {res["meta"]["blas"]: res["meta"] for res in results}}, indent=2))
    for res in results:
        print(f"{res['meta']['blas_label']}: min_rows {res['rows'][0]['min_rows']}")
    print(f"wrote {a.out / 'prefill_gemm.csv'} in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
