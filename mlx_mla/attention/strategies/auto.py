"""``auto``: per forward call, pick a strategy by phase and context length.

The choice is a pure function of (L, S) — L new tokens, S attended positions — and of a
table, so every layer of one forward call makes the same choice. Phases, by L: a decode
step (L = 1); a short prefill chunk (1 < L ≤ the table's ``short_chunk``: a few new tokens
over what is cached, as in chunked or multi-turn prefill); a prefill chunk (longer). Each
phase has rules [(minimum S, strategy)]; the last rule whose minimum is ≤ S wins.

Why tables and not an ``if``: which strategy is fastest depends on the backend and, on the
CPU, on the BLAS under MLX (``mlx_mla.blas``), and the measured crossovers differ between
them, so each (backend, BLAS) gets the table ``benchmarks/mla_strategies.py`` measured for
it (its ``crossover_table``; results in ``benchmarks/results/mla_strategies.csv``).
Backends without one (Metal and CUDA, not measured yet; a CPU under another BLAS) use
``DEFAULT_TABLE``, the analytic one (``mlx_mla.attention.costs``): naive for prefill chunks
(it decompresses K/V once for the whole chunk, then attends with 2·H·(dn + dr + dv) FLOPs
per query-position pair against the absorbed strategies' 2·H·(2r + dr)), absorb for decode
(it reads the 576-value latent per position where naive writes and reads back
H·(dn + dr + dv) = 5,120 decompressed values) and for chunks shorter than
``costs.short_chunk_tokens`` (170 at DeepSeek-V2's head dims: below it, decompressing every
cached position costs more than the absorbed per-pair work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import mlx.core as mx

from ... import blas
from .absorb import Absorb
from .absorb_materialized import AbsorbMaterialized
from .base import Strategy
from .naive import Naive

# [(minimum S, strategy name)], ascending; the last rule whose minimum S ≤ S wins.
Rules = Tuple[Tuple[int, str], ...]


@dataclass(frozen=True)
class Table:
    """``auto``'s rules per phase. ``short_chunk``: the longest L that is a short prefill
    chunk (1: there is no such phase; chunks with L > 1 all use ``prefill``)."""

    decode: Rules
    prefill: Rules
    short_prefill: Rules = ()
    short_chunk: int = 1

    def phase(self, L: int) -> str:
        """'decode', 'short_prefill' or 'prefill' for a call with L new tokens."""
        if L == 1:
            return "decode"
        return "short_prefill" if L <= self.short_chunk else "prefill"

    def names(self) -> set:
        """Every strategy name the table can choose."""
        return {n for rules in (self.decode, self.prefill, self.short_prefill) for _, n in rules}


# Analytic (mlx_mla.attention.costs; short_chunk = floor(short_chunk_tokens) at V2's dims).
DEFAULT_TABLE = Table(decode=((0, "absorb"),), prefill=((0, "naive"),),
                      short_prefill=((0, "absorb"),), short_chunk=170)

# Measured by benchmarks/mla_strategies.py at DeepSeek-V2-Lite's attention shape (2-core
# x86 CPU, MLX CPU build, float32; decode at 512-16K, a 2K prefill chunk, short chunks of
# 16-256 tokens over 4K cached; its crossover_table), keyed "backend/BLAS" (``backend_key``).
CROSSOVER_TABLES: Dict[str, Table] = {
    "cpu/reference": Table(decode=((0, "absorb"),), prefill=((0, "naive"),),
                           short_prefill=((0, "absorb"),), short_chunk=64),
    "cpu/openblas": Table(decode=((0, "absorb"),), prefill=((0, "naive"),),
                          short_prefill=((0, "absorb"),), short_chunk=256),
}

_CANDIDATES = {s.name: s for s in (Naive, Absorb, AbsorbMaterialized)}


def backend_name() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


def backend_key() -> str:
    """The ``CROSSOVER_TABLES`` key of this process: 'cpu/<BLAS kind>' on the CPU backend
    (``mlx_mla.blas.kind()``: the BLAS MLX multiplies with), else the GPU backend's name."""
    backend = backend_name()
    return f"cpu/{blas.kind()}" if backend == "cpu" else backend


def table_for(key: str) -> Table:
    """The measured table for ``key`` (``backend_key()``), else ``DEFAULT_TABLE``."""
    return CROSSOVER_TABLES.get(key, DEFAULT_TABLE)


def choose(table: Table, L: int, S: int) -> str:
    """The strategy ``table`` names for a call with L new tokens and S attended positions."""
    rules = getattr(table, table.phase(L))
    name = rules[0][1]
    for min_s, candidate in rules:
        if S >= min_s:
            name = candidate
    return name


class Auto(Strategy):
    """Dispatches each call to the strategy its crossover table names for (phase, S)."""

    name = "auto"

    def __init__(self, table: Table | None = None):
        self.table = table or table_for(backend_key())
        self.strategies = {n: _CANDIDATES[n]() for n in sorted(self.table.names())}

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
