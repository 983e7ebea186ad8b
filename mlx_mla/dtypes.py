"""Float dtype names, and casting a model's floating parameters to one.

Shared by the loader, the converter, ``compare`` and the benchmarks, so a dtype is spelled,
checked and applied one way everywhere.
"""

from __future__ import annotations

from typing import Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def parse_dtype(dtype: Union[str, mx.Dtype]) -> mx.Dtype:
    """``mx.float32`` for "float32" (an ``mx.Dtype`` passes through).

    Raises:
        ValueError: a name outside ``DTYPES``.
    """
    if isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: mx.Dtype) -> str:
    """'float32' for ``mx.float32``."""
    return str(dtype).rpartition(".")[2]


def cast_floating(module: nn.Module, dtype: mx.Dtype, evaluate: bool = True) -> nn.Module:
    """Cast every floating-point parameter of ``module`` to ``dtype`` in place (quantized
    weights, integer tensors, stay as they are); returns the module.

    ``evaluate=False`` keeps the cast lazy (for sizing a model from its shapes alone).
    """
    module.update(tree_map(
        lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
        module.parameters(),
    ))
    if evaluate:
        mx.eval(module.parameters())
    return module


__all__ = ["DTYPES", "parse_dtype", "dtype_name", "cast_floating"]
