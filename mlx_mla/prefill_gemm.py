"""Prefill through dequantized GEMM on MLX's CPU backend.

MLX's CPU quantized kernels (``mx.quantized_matmul``, ``mx.gather_qmm``) do not use BLAS: a
call costs about the same per row of input whatever the number of rows, ~2 GFLOP/s here.
A float matmul goes through BLAS (``cblas_sgemm``), whose GEMM reuses each weight across
rows. So for a call with many rows — a prefill chunk — dequantizing the weight once
(``mx.dequantize``, the same affine values the quantized kernel multiplies by) and
multiplying in float is faster, by as much as the BLAS is fast: 4-25x per Linear at 32-512
rows under OpenBLAS, at best 1.2x under MLX's bundled reference BLAS
(``benchmarks/prefill_gemm.py``, ``results/prefill_gemm.csv``). A single row — a decode step — stays on the quantized
kernel, which reads 4-bit weights instead of float32 ones.

``apply(model, min_rows)`` turns every affine ``nn.QuantizedLinear`` of ``model`` into a
``GemmQuantizedLinear`` and every mlx-lm ``QuantizedSwitchLinear`` (the routed experts)
into a ``GemmQuantizedSwitchLinear``: the same object, parameters and names (weights,
strategies and saving see no difference), with a ``min_rows`` from which a call takes the
dequantized path. For a Linear, rows are the tokens of the call; for the experts, the
tokens routed to one expert (mlx-lm's ``SwitchGLU`` sorts a call's token-expert pairs by
expert when there are ≥ 64; when they average ≥ ``min_rows`` per expert, each expert's
block of rows is then one GEMM, or one quantized matmul when it has fewer than
``min_rows`` rows). The dequantized weight is a transient:
one Linear's (out × in float32, 90 MB for V2-Lite's dense MLP, 838 MB for its lm_head when
logits are computed for every position) or one expert's at a time.

``MIN_ROWS``: per BLAS (``mlx_mla.blas.kind()``), the crossover measured by
``benchmarks/prefill_gemm.py`` (``min_rows`` in ``results/prefill_gemm.csv``); None where
the dequantized GEMM never paid (the reference BLAS), so nothing changes there. The loader
applies it on the CPU backend only: GPU backends have their own quantized GEMMs.
"""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

# BLAS kind -> fewest rows for which dequantize + float GEMM beat the quantized kernel
# (measured, benchmarks/prefill_gemm.py); None = never.
MIN_ROWS: Dict[str, Optional[int]] = {"openblas": 16, "reference": None}


def _dequantized(module, e: Optional[int] = None) -> mx.array:
    """The module's weight (or expert ``e``'s), dequantized: (out, in), scales' dtype."""
    w, s, b = module["weight"], module["scales"], module.get("biases")
    if e is not None:
        w, s, b = w[e], s[e], (b[e] if b is not None else None)
    return mx.dequantize(w, s, b, module.group_size, module.bits, mode=module.mode)


class GemmQuantizedLinear(nn.QuantizedLinear):
    """A ``QuantizedLinear`` that multiplies calls of ≥ ``min_rows`` rows as
    x @ dequantize(W)ᵀ (+ bias) in x's dtype; fewer rows take the quantized kernel.

    x: (..., in) → (..., out). Same result within float rounding (the quantized kernel
    multiplies by the same dequantized values, accumulating in another order).
    """

    min_rows: int = 1

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < self.min_rows:
            return super().__call__(x)
        y = x @ _dequantized(self).astype(x.dtype).T
        if "bias" in self:
            y = y + self["bias"]
        return y


class GemmQuantizedSwitchLinear(QuantizedSwitchLinear):
    """mlx-lm's ``QuantizedSwitchLinear`` (stacked experts (E, out, in), 4-bit) whose
    sorted calls with at least ``min_rows`` rows per expert on average run one GEMM per
    expert: the rows routed to expert e (a contiguous block, since they are sorted) times
    dequantize(W_e)ᵀ when there are ≥ ``min_rows`` of them, else a quantized matmul on
    that block.

    x: (N, 1, in) sorted by ``indices`` (N,) → (N, 1, out). Other calls go to
    ``gather_qmm`` unchanged: unsorted ones (decode, fewer than 64 token-expert pairs) and
    those with fewer rows (64 quantized matmuls on small blocks measured slower than one
    ``gather_qmm``: benchmarks/prefill_gemm.py, experts at 64 tokens). Reads the
    per-expert row counts on the host (one synchronisation per call, as a prefill chunk
    can afford).
    """

    min_rows: int = 1

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if not sorted_indices or indices.size < self.min_rows * self.num_experts:
            return super().__call__(x, indices, sorted_indices)
        counts = np.bincount(np.array(indices).reshape(-1), minlength=self.num_experts)
        rows = x.reshape(-1, x.shape[-1])
        outs, start = [], 0
        for e in np.flatnonzero(counts):
            n = int(counts[e])
            block = rows[start:start + n]
            start += n
            if n >= self.min_rows:
                y = block @ _dequantized(self, int(e)).astype(x.dtype).T
            else:
                b = self.get("biases")
                y = mx.quantized_matmul(
                    block, self["weight"][e], self["scales"][e],
                    b[e] if b is not None else None, transpose=True,
                    group_size=self.group_size, bits=self.bits, mode=self.mode)
            if "bias" in self:
                y = y + self["bias"][e]
            outs.append(y)
        return mx.concatenate(outs).reshape(*x.shape[:-1], self.output_dims)


def apply(model: nn.Module, min_rows: Optional[int]) -> int:
    """Give every affine quantized Linear and routed-expert stack of ``model`` the
    dequantized-GEMM path from ``min_rows`` rows on (in place; None: leave the model as
    it is). Returns how many modules now have it.
    """
    if min_rows is None:
        return 0
    n = 0
    for _, m in model.named_modules():
        if getattr(m, "mode", None) != "affine":
            continue
        if type(m) in (nn.QuantizedLinear, GemmQuantizedLinear):
            m.__class__ = GemmQuantizedLinear
        elif (type(m) in (QuantizedSwitchLinear, GemmQuantizedSwitchLinear)
              and m.get("global_scale") is None):
            m.__class__ = GemmQuantizedSwitchLinear
        else:
            continue
        m.min_rows = int(min_rows)
        n += 1
    return n
