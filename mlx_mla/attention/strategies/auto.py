"""``auto``: per forward call, pick a strategy by phase and context length.

The choice is a pure function of (L, S) — L new tokens, S attended positions — and of the
MLX backend, so every layer of one forward call makes the same choice. Phase: a call with
L = 1 is a decode step, any other a prefill chunk. Each phase has rules
[(minimum S, strategy)]; the last rule whose minimum is ≤ S wins.

``CROSSOVER_TABLES["cpu"]`` is what ``benchmarks/mla_strategies.py`` measured (its
``crossover_table``; results in ``benchmarks/results/mla_strategies.csv``) at
DeepSeek-V2-Lite's shape on a 2-core x86 CPU, MLX CPU build, float32: ``absorb`` is the
fastest decode step at every measured context (512 to 16K: it does 1/120 of naive's
per-position work and 1/2.7 of ``absorb-materialized``'s fixed work), ``naive`` the fastest
2K-token prefill chunk (it decompresses K/V once for 2K queries, then attends with
2·H·(dn + dr + dv) = 10.2K FLOPs per query-position pair against the absorbed 34.8K).
Analytically (``mlx_mla.attention.costs``) naive stays the cheaper prefill while
L ≳ 170 new tokens per chunk at V2-Lite's shape; shorter chunks over a long cache (e.g.
speculative verification) would favour absorb, which this two-phase table does not model.

Metal and CUDA cannot be measured on the machine this project is benchmarked on; they,
and any backend without a table, use ``DEFAULT_TABLE``, an analytic default: naive for
prefill chunks, absorb for decode (a decode step there is bound by memory bandwidth, and
absorb reads the 576-value latent per position where naive writes and reads back
H·(dn + dr + dv) = 5,120 decompressed values).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import mlx.core as mx

from .absorb import Absorb
from .materialized import Materialized
from .naive import Naive

# phase -> [(minimum S, strategy name)], ascending; the last rule whose minimum S ≤ S wins.
Table = Dict[str, List[Tuple[int, str]]]

DEFAULT_TABLE: Table = {"prefill": [(0, "naive")], "decode": [(0, "absorb")]}

# Measured by benchmarks/mla_strategies.py at DeepSeek-V2-Lite's attention shape
# (2-core x86 CPU, MLX CPU build, float32; contexts 512-16K decode, a 2K prefill chunk).
CROSSOVER_TABLES: Dict[str, Table] = {
    "cpu": {"prefill": [(0, "naive")], "decode": [(0, "absorb")]},
}


def backend_name() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


class Auto:
    """Dispatches each call to the strategy its crossover table names for (phase, S)."""

    name = "auto"

    def __init__(self, table: Table | None = None):
        self.table = table or CROSSOVER_TABLES.get(backend_name(), DEFAULT_TABLE)
        self.strategies = {s.name: s for s in (Naive(), Absorb(), Materialized())}
        self.used = {n for rules in self.table.values() for _, n in rules}

    def choose(self, L: int, S: int) -> str:
        """Strategy name for a call with L new tokens and S attended positions."""
        rules = self.table["decode" if L == 1 else "prefill"]
        name = rules[0][1]
        for min_s, candidate in rules:
            if S >= min_s:
                name = candidate
        return name

    def prepare(self, attn) -> None:
        for n in self.used:
            self.strategies[n].prepare(attn)

    def release(self, attn) -> None:
        for n in self.used:
            self.strategies[n].release(attn)

    def __call__(self, attn, c_q, q_pe, c_kv, k_pe, mask):
        name = self.choose(c_q.shape[1], c_kv.shape[1])
        return self.strategies[name](attn, c_q, q_pe, c_kv, k_pe, mask)
