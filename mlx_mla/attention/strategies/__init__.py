"""MLA strategies: one interface (``base.Strategy``), chosen by name, one instance per layer.

To add a strategy: subclass ``Strategy`` in a module of its own, give it a ``name``, and
register it in ``STRATEGIES`` (and, for ``auto`` to consider it, in ``auto._CANDIDATES``);
its cost model goes in ``mlx_mla.attention.costs``.
"""

from .absorb import Absorb
from .absorb_materialized import AbsorbMaterialized
from .auto import Auto
from .base import Strategy, latent_attention
from .naive import Naive

STRATEGIES = {s.name: s for s in (Naive, AbsorbMaterialized, Absorb, Auto)}


def check_strategy_name(name: str) -> str:
    """``name`` if it names a strategy.

    Raises:
        ValueError: ``name`` is not one of ``STRATEGIES``.
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"unknown MLA strategy {name!r}: choose one of {', '.join(STRATEGIES)}"
        )
    return name


def make_strategy(name: str) -> Strategy:
    """A new, unprepared strategy object for ``name`` (one per layer).

    Raises:
        ValueError: ``name`` is not one of ``STRATEGIES``.
    """
    return STRATEGIES[check_strategy_name(name)]()


__all__ = ["STRATEGIES", "check_strategy_name", "make_strategy", "Strategy",
           "latent_attention", "Naive", "Absorb", "AbsorbMaterialized", "Auto"]
