"""``auto``: per forward call, pick a strategy by phase and context length.

The choice is a pure function of (L, S) — L new tokens, S attended positions — and of the
MLX backend, so every layer of one forward call makes the same choice. Phase: a call with
L = 1 is a decode step, any other a prefill chunk. Each phase has rules
[(minimum S, strategy)]; the last rule whose minimum is ≤ S wins.

Why a table and not an ``if``: which strategy is fastest depends on the backend (and, on the
CPU, on the BLAS under MLX), and measured crossovers differ between them, so each backend
gets the table ``benchmarks/mla_strategies.py`` measured for it (its ``crossover_table``;
results in ``benchmarks/results/``). Backends without a table (Metal and CUDA, not measured
yet) use ``DEFAULT_TABLE``: naive for prefill chunks (it decompresses K/V once for the whole
chunk, then attends with 2·H·(dn + dr + dv) FLOPs per query-position pair against the
absorbed strategies' 2·H·(2r + dr)), absorb for decode (it reads the 576-value latent per
position where naive writes and reads back H·(dn + dr + dv) = 5,120 decompressed values).
``mlx_mla.attention.costs`` has the formulas.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import mlx.core as mx

from .absorb import Absorb
from .absorb_materialized import AbsorbMaterialized
from .base import Strategy
from .naive import Naive

# phase -> [(minimum S, strategy name)], ascending; the last rule whose minimum S ≤ S wins.
Table = Dict[str, List[Tuple[int, str]]]

DEFAULT_TABLE: Table = {"prefill": [(0, "naive")], "decode": [(0, "absorb")]}

# Measured by benchmarks/mla_strategies.py at DeepSeek-V2-Lite's attention shape
# (2-core x86 CPU, MLX CPU build, float32; contexts 512-16K decode, a 2K prefill chunk).
CROSSOVER_TABLES: Dict[str, Table] = {
    "cpu": {"prefill": [(0, "naive")], "decode": [(0, "absorb")]},
}

_CANDIDATES = {s.name: s for s in (Naive, Absorb, AbsorbMaterialized)}


def backend_name() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


def choose(table: Table, L: int, S: int) -> str:
    """The strategy ``table`` names for a call with L new tokens and S attended positions."""
    rules = table["decode" if L == 1 else "prefill"]
    name = rules[0][1]
    for min_s, candidate in rules:
        if S >= min_s:
            name = candidate
    return name


class Auto(Strategy):
    """Dispatches each call to the strategy its crossover table names for (phase, S)."""

    name = "auto"

    def __init__(self, table: Table | None = None):
        self.table = table or CROSSOVER_TABLES.get(backend_name(), DEFAULT_TABLE)
        used = {n for rules in self.table.values() for _, n in rules}
        self.strategies = {n: _CANDIDATES[n]() for n in sorted(used)}

    def choose(self, L: int, S: int) -> str:
        """Strategy name for a call with L new tokens and S attended positions."""
        return choose(self.table, L, S)

    def prepare(self, attn) -> None:
        for s in self.strategies.values():
            s.prepare(attn)

    def release(self) -> None:
        for s in self.strategies.values():
            s.release()

    @property
    def derived_nbytes(self) -> int:
        return sum(s.derived_nbytes for s in self.strategies.values())

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        name = self.choose(c_q.shape[1], c_kv.shape[1])
        return self.strategies[name](attn, c_q, q_pe, c_kv, k_pe, mask)
