"""``load(path) -> (model, tokenizer)``: a local folder or Hub repo id in, a ready model out.

Mirrors ``mlx_lm.load`` and reuses its machinery: ``mlx_lm.utils.load_model`` (safetensors
reading, ``quantization`` config incl. per-module overrides, strict weight check) with our
``Model`` / ``ModelArgs``, and ``mlx_lm.utils.load_tokenizer`` for the TokenizerWrapper.
What is ours: the checks that turn a bad folder into one clear error, the activation dtype
policy, and selecting the MLA strategy once the weights are in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from .attention import STRATEGIES
from .config import ModelArgs, read_config_file
from .model import Model

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class ModelLoadError(ValueError):
    """A model folder or repo that cannot be loaded; the message says why and what to do."""


def resolve_model_path(path_or_repo: str, revision: Optional[str] = None) -> Path:
    """A local folder as is; anything else that looks like ``owner/name`` is fetched with
    ``huggingface_hub.snapshot_download`` (weights, config, tokenizer files only).

    Raises:
        ModelLoadError: a local-looking path that does not exist, or a failed download.
    """
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path} is a file, not a model folder: pass the folder")
        return path
    looks_local = str(path_or_repo).startswith(("/", ".", "~")) or str(path_or_repo).count("/") != 1
    if looks_local:
        raise ModelLoadError(
            f"model folder {path_or_repo} does not exist: check the path (or pass a Hub "
            f"repo id such as deepseek-ai/DeepSeek-V2-Lite-Chat)"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(path_or_repo, revision=revision, allow_patterns=HUB_PATTERNS)
        )
    except Exception as e:  # network, auth, 404: all end the same way for the user
        raise ModelLoadError(
            f"could not download {path_or_repo} from the Hugging Face Hub "
            f"({type(e).__name__}): check the repo id and your network, or pass a local folder"
        ) from e


def read_config(path: Path) -> dict:
    """config.json of a model folder, checked to be a DeepSeek-V2-family model with weights.

    Raises:
        ModelLoadError: no config.json, unreadable JSON, wrong model_type, no safetensors,
            or a shard named in model.safetensors.index.json that is missing.
    """
    try:
        config = read_config_file(path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    if not list(path.glob("model*.safetensors")):
        raise ModelLoadError(
            f"{path} has no model*.safetensors weights: download the weights too, or "
            f"convert the checkpoint with `python -m convert`"
        )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelLoadError(
                f"{path} is missing weight shard {missing[0]} listed in its index: "
                f"the download is incomplete; fetch it again"
            )
    return config


def activation_dtype(dtype: Union[str, mx.Dtype, None], config: dict) -> mx.Dtype:
    """The activation (and float weight) dtype: ``dtype`` if given; float32 on the CPU
    backend (this CPU build has no bfloat16 gather_mm, and its quantized matmul is ~10x
    slower with bfloat16 activations); else the checkpoint's own dtype.

    Raises:
        ModelLoadError: an unknown dtype name.
    """
    if isinstance(dtype, mx.Dtype):
        return dtype
    if dtype is not None:
        if dtype not in DTYPES:
            raise ModelLoadError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if mx.default_device() == mx.cpu:
        return mx.float32
    return DTYPES.get(config.get("torch_dtype") or config.get("dtype"), mx.bfloat16)


def _check_experts_run(model: Model, dtype: mx.Dtype) -> None:
    """Run one routed-expert product in ``dtype`` so an unsupported backend/dtype pair fails
    here, with advice, rather than mid-generation (this CPU build's gather_mm is float32-only).

    Raises:
        ModelLoadError: the backend cannot run the MoE experts in ``dtype``.
    """
    moe = next((l.mlp for l in model.layers if hasattr(l.mlp, "switch_mlp")), None)
    if moe is None:
        return
    x = mx.zeros((1, 1, model.args.hidden_size), dtype)
    try:
        mx.eval(moe.switch_mlp(x, mx.zeros((1, 1, 1), mx.uint32)))
    except RuntimeError as e:
        raise ModelLoadError(
            f"this MLX backend cannot run the MoE experts with {dtype} activations "
            f"({str(e).strip()}): use dtype float32"
        ) from e


def load(
    path_or_repo: Union[str, Path],
    mla_strategy: str = "auto",
    dtype: Union[str, mx.Dtype, None] = None,
    revision: Optional[str] = None,
) -> Tuple[Model, TokenizerWrapper]:
    """Load a DeepSeek-V2-family model and its tokenizer, like ``mlx_lm.load``.

    Args:
        path_or_repo: a local folder (Hugging Face checkpoint: sharded safetensors + index,
            or an mlx-lm folder, quantized or not) or a Hub repo id.
        mla_strategy: "naive", "absorb-materialized", "absorb" or "auto".
        dtype: activation dtype ("float32", "bfloat16", "float16"); None picks
            ``activation_dtype``'s default.
        revision: Hub revision, for repo ids.
    Returns:
        (model, tokenizer): ``mlx_mla.model.Model`` and mlx-lm's ``TokenizerWrapper``.
    Raises:
        ModelLoadError (a ValueError): every problem with the input, in one line.
    """
    if mla_strategy not in STRATEGIES:
        raise ModelLoadError(
            f"unknown MLA strategy {mla_strategy!r}: choose one of {', '.join(STRATEGIES)}"
        )
    path = resolve_model_path(str(path_or_repo), revision)
    config = read_config(path)
    target = activation_dtype(dtype, config)
    model, config = load_model(
        path, lazy=True, get_model_classes=lambda config: (Model, ModelArgs)
    )

    def cast(p):
        return p.astype(target) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())
    _check_experts_run(model, target)
    model.set_mla_strategy(mla_strategy)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer
