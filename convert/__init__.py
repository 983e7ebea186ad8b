"""mlx-mla's converter: DeepSeek-V2 checkpoints to mlx-lm folders, streamed shard by shard.

Use `python -m convert --help`, or from Python::

    from convert import ConvertOptions, convert
    report = convert(ConvertOptions(hf_path="deepseek-ai/DeepSeek-V2-Lite", mlx_path="out", quantize=True))

The names below are imported on first use, so that `python -m convert` starts its own
code (and its Ctrl-C handling) before MLX, mlx-lm and transformers load.
"""

from .errors import ConvertError

_LAZY = {"ConvertOptions", "ConvertReport", "convert"}


def __getattr__(name):
    if name in _LAZY:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ConvertError", "ConvertOptions", "ConvertReport", "convert"]
