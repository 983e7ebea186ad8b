"""MLA: the shared front end (``mla``) and the swappable strategies (``strategies``)."""

from .mla import MLAttention
from .strategies import STRATEGIES, make_strategy

__all__ = ["MLAttention", "STRATEGIES", "make_strategy"]
