"""Whether MLX's compiled core imports, and if not, which install fixes it.

On Linux, ``pip install mlx`` brings only MLX's Python side: the compiled backend comes from
an extra (``mlx[cpu]`` or ``mlx[cuda]``, which mlx-mla's own ``[cpu]`` / ``[cuda]`` extras
pull in). Without it ``import mlx.core`` fails with ``ImportError: libmlx.so: cannot open
shared object file``. ``mlx_mla`` (and so every command: generate, compare, convert) calls
``require_mlx`` before anything imports ``mlx.core``, so that failure becomes one line saying
which extra to install.

This module imports nothing from MLX at module level.
"""

from __future__ import annotations

import sys


class MissingBackendError(ImportError):
    """``mlx.core`` cannot be imported; the message says what to install."""


def install_advice(platform: str = sys.platform) -> str:
    """What to install for ``platform`` (a ``sys.platform`` value) to get a working MLX."""
    if platform == "darwin":
        return ('reinstall MLX: pip install --force-reinstall mlx (MLX runs on Apple silicon, '
                'macOS 14 or later)')
    return ('install mlx-mla with a backend extra: pip install "mlx-mla[cpu]" (CPU) or '
            '"mlx-mla[cuda]" (NVIDIA GPU); from a checkout, pip install -e ".[cpu]"')


def _print_one_line(previous):
    """An excepthook that prints a ``MissingBackendError`` as one ``error:`` line (no
    traceback) and hands every other exception to ``previous``."""

    def hook(exc_type, exc, tb):
        if isinstance(exc, MissingBackendError):
            print(f"error: {exc}", file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    return hook


def require_mlx() -> None:
    """Import ``mlx.core``, or raise ``MissingBackendError`` saying which extra to install.

    On failure it also installs an excepthook that prints that error as one ``error:``
    line, because the commands (``python -m mlx_mla.generate``, the installed scripts)
    import the package before any of their own code can catch it.

    Raises:
        MissingBackendError (an ImportError): ``mlx.core`` (or ``mlx``) does not import.
    """
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.excepthook = _print_one_line(sys.excepthook)
        raise MissingBackendError(
            f"MLX's backend is not installed ({reason}): {install_advice()}"
        ) from e


__all__ = ["MissingBackendError", "install_advice", "require_mlx"]
