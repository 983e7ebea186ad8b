"""mlx-mla's converter: DeepSeek-V2 checkpoints to mlx-lm folders, streamed shard by shard.

Use `python -m convert --help`, or from Python::

    from convert import ConvertOptions, convert
    report = convert(ConvertOptions(hf_path="deepseek-ai/DeepSeek-V2-Lite", mlx_path="out", quantize=True))
"""

from .errors import ConvertError
from .pipeline import ConvertOptions, ConvertReport, convert

__all__ = ["ConvertError", "ConvertOptions", "ConvertReport", "convert"]
