"""MLA: the shared front end (``mla``) and the swappable strategies (``strategies``)."""

from .mla import MLAttention
from .strategies import STRATEGIES, check_strategy_name, make_strategy

__all__ = ["MLAttention", "STRATEGIES", "check_strategy_name", "make_strategy"]
