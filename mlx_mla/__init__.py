"""mlx-mla: DeepSeek-V2 Multi-head Latent Attention on MLX, with a latent KV cache.

``model, tokenizer = mlx_mla.load(path, mla_strategy="auto", dtype=None)``.
"""

from pathlib import Path

# Before anything imports MLX: an optimized BLAS, where installed, must be loaded first.
from . import blas

blas.preload()

from .attention import STRATEGIES
from .cache import LatentCache
from .checkpoint import ModelLoadError
from .config import ModelArgs
from .loader import load
from .model import Model

__version__ = "0.1.0"

DEMO_MODEL = Path(__file__).parent / "assets" / "tiny-dsv2-lite-shakespeare"

__all__ = ["load", "Model", "ModelArgs", "LatentCache", "STRATEGIES", "ModelLoadError",
           "DEMO_MODEL", "__version__"]
