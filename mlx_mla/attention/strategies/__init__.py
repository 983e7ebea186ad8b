"""MLA strategies: one signature (``base.Strategy``), chosen once per model by name."""

from .absorb import Absorb
from .auto import Auto
from .base import Strategy, latent_attention
from .materialized import Materialized
from .naive import Naive

STRATEGIES = {
    "naive": Naive,
    "absorb-materialized": Materialized,
    "absorb": Absorb,
    "auto": Auto,
}


def make_strategy(name: str) -> Strategy:
    """A new strategy object for ``name``.

    Raises:
        ValueError: ``name`` is not one of ``STRATEGIES``.
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"unknown MLA strategy {name!r}: choose one of {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name]()


__all__ = ["STRATEGIES", "make_strategy", "Strategy", "latent_attention",
           "Naive", "Absorb", "Materialized", "Auto"]
