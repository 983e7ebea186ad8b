"""``load(path) -> (model, tokenizer)``: a local folder or Hub repo id in, a ready model out.

Mirrors ``mlx_lm.load`` and reuses its machinery: ``mlx_lm.utils.load_model`` (safetensors
reading, ``quantization`` config incl. per-module overrides, strict weight check) with our
``Model`` / ``ModelArgs``, and ``mlx_lm.utils.load_tokenizer`` for the TokenizerWrapper.
What is ours: the folder checks (``mlx_mla.checkpoint``) that turn a bad folder into one
clear error, the activation dtype policy, on the CPU backend the dequantized-GEMM prefill
path for quantized Linears and experts where the BLAS makes it pay
(``mlx_mla.prefill_gemm``), and selecting the MLA strategy once the weights are in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from . import blas, checkpoint, prefill_gemm
from .attention import check_strategy_name
from .checkpoint import ModelLoadError
from .config import ModelArgs
from .dtypes import DTYPES, cast_floating, parse_dtype
from .model import Model
from .weights import split_quantization


def activation_dtype(dtype: Union[str, mx.Dtype, None], config: dict) -> mx.Dtype:
    """The activation (and float weight) dtype: ``dtype`` if given; float32 on the CPU
    backend (this CPU build has no bfloat16 gather_mm, and its quantized matmul is ~10x
    slower with bfloat16 activations); else the checkpoint's own dtype.

    Raises:
        ModelLoadError: an unknown dtype name.
    """
    if dtype is not None:
        try:
            return parse_dtype(dtype)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
    if mx.default_device() == mx.cpu:
        return mx.float32
    return DTYPES.get(config.get("torch_dtype") or config.get("dtype"), mx.bfloat16)


def check_experts_run(model: Model, dtype: mx.Dtype) -> None:
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
    try:
        check_strategy_name(mla_strategy)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    path, _ = checkpoint.resolve(str(path_or_repo), revision)
    config = checkpoint.read_config(path)
    checkpoint.check_weights(path)
    target = activation_dtype(dtype, config)
    try:
        args = ModelArgs.from_dict(config)
        overrides = {"quantization": split_quantization(config.get("quantization"), args)}
        model, config = load_model(
            path, lazy=True, model_config=overrides,
            get_model_classes=lambda config: (Model, ModelArgs),
        )
    except ValueError as e:  # an unsupported config value, weights that do not fit it
        reason = str(e).strip().splitlines()[0]
        raise ModelLoadError(f"cannot load {path}: {reason}") from e
    prepare(model, target, mla_strategy)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer


def prepare(model: Model, dtype: mx.Dtype, mla_strategy: str) -> None:
    """What a load does once the weights are in (``load``, and ``load_sharded`` per rank):
    cast the float parameters to ``dtype`` (reading the weights), give prefill chunks the
    BLAS GEMM path where it pays (CPU backend), check the experts run, set the strategy.

    Raises:
        ModelLoadError: the backend cannot run the MoE experts in ``dtype``.
    """
    cast_floating(model, dtype)
    if mx.default_device() == mx.cpu:  # prefill chunks through BLAS GEMM where it pays
        prefill_gemm.apply(model, prefill_gemm.MIN_ROWS.get(blas.kind()))
    check_experts_run(model, dtype)
    model.set_mla_strategy(mla_strategy)
