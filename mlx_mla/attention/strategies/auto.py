"""``auto``: per forward call, pick a strategy by phase and context length.

The choice is a pure function of (L, S) — L new tokens, S attended positions — and of the
MLX backend, so every layer of one forward call makes the same choice. The crossover table
comes from ``benchmarks/mla_strategies.py`` (results in ``benchmarks/results/``); a backend
with no measured table uses ``DEFAULT_TABLE``: naive for prefill chunks (decompressing once
per chunk is cheapest per query row), absorb for decode (it reads only the latent cache).
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

# Measured by benchmarks/mla_strategies.py at DeepSeek-V2-Lite's attention shape.
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
