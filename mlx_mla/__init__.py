"""mlx-mla: DeepSeek-V2 Multi-head Latent Attention on MLX, with a latent KV cache.

``model, tokenizer = mlx_mla.load(path, mla_strategy="auto", dtype=None)``.
"""

from pathlib import Path

# Before anything imports MLX: an optimized BLAS, where installed, must be loaded first
# (blas imports nothing of MLX's), then mlx.core itself, or one line naming the extra.
from . import blas

blas.preload()

from .backend import require_mlx  # noqa: E402

require_mlx()

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
