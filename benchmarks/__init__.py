"""Benchmarks: ``python -m benchmarks.NAME`` from the repository root.

``mlx_mla`` is imported first so that, where ``mlx-mla[openblas]`` is installed, OpenBLAS is
loaded before MLX (``mlx_mla.blas``); every benchmark records which BLAS it ran on.
"""

import mlx_mla  # noqa: F401  (before any MLX import: see mlx_mla.blas)
