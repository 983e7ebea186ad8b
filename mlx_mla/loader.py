"""``load(path) -> (model, tokenizer)``: a local folder or Hub repo id in, a ready model out.

Mirrors ``mlx_lm.load`` and reuses its machinery: ``mlx_lm.utils.load_model`` (safetensors
reading, ``quantization`` config incl. per-module overrides, strict weight check) with our
``Model`` / ``ModelArgs``, and ``mlx_lm.utils.load_tokenizer`` for the TokenizerWrapper.
What is ours: the checks made before any tensor is read (``open_folder``: the folder, via
``mlx_mla.checkpoint``, and whether the backend runs the MoE in the dtype) that turn bad
input into one clear error, the activation dtype policy, on the CPU backend the
dequantized-GEMM prefill path for quantized Linears and experts where the BLAS makes it pay
(``mlx_mla.prefill_gemm``), and selecting the MLA strategy once the weights are in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model
from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

from . import blas, checkpoint, prefill_gemm
from .attention import check_strategy_name
from .checkpoint import ModelLoadError
from .config import ModelArgs
from .dtypes import DTYPES, cast_floating, dtype_name, parse_dtype
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


def check_experts_dtype(args: ModelArgs, dtype: mx.Dtype) -> None:
    """Run one tiny routed-expert product in ``dtype`` for each way the folder stores its
    experts (float, or each quantization spec its config gives ``switch_mlp``), before any
    weights are read, so that a backend/dtype pair that cannot run the MoE fails here, with
    advice, rather than mid-generation. (This CPU build's float ``gather_mm`` is
    float32-only; its quantized ``gather_qmm`` runs bfloat16 too.) The probe is mlx-lm's
    ``SwitchLinear``, the layer the model's experts are made of.

    Raises:
        ModelLoadError: the backend cannot run the MoE experts with ``dtype`` activations,
            or the config gives them a quantization MLX refuses.
    """
    from mlx_lm.models.switch_layers import SwitchLinear

    moe_layers = [i for i in range(args.num_hidden_layers) if args.is_moe_layer(i)]
    specs = {
        tuple(sorted((args.quantization_of(f"model.layers.{i}.mlp.switch_mlp.{p}") or {}).items()))
        for i in moe_layers for p in ("gate_proj", "up_proj", "down_proj")
    }
    for spec in map(dict, sorted(specs)):
        dims = spec.get("group_size", 32)
        layer = SwitchLinear(dims, 2, 2, bias=False)
        if spec:
            try:
                layer = layer.to_quantized(**spec)
            except ValueError as e:  # bits / group size the mode does not take
                raise ModelLoadError(
                    f"config.json's quantization {spec} for the MoE experts is not one MLX "
                    f"can use ({str(e).strip()}): the folder's config is inconsistent"
                ) from e
        layer.set_dtype(dtype)
        try:
            mx.eval(layer(mx.zeros((1, 1, 1, 1, dims), dtype), mx.zeros((1, 1, 1), mx.uint32)))
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(
                f"this MLX backend cannot run the MoE experts with {dtype_name(dtype)} "
                f"activations ({str(e).strip()}): use float32 activations (--dtype float32)"
            ) from e


def open_folder(
    path_or_repo: Union[str, Path],
    dtype: Union[str, mx.Dtype, None] = None,
    revision: Optional[str] = None,
) -> Tuple[Path, dict, ModelArgs, mx.Dtype]:
    """Every check ``load`` makes before reading a tensor, for the commands to make first
    too: the folder (``mlx_mla.checkpoint``: config, weight files whole, tokenizer files),
    the config (``ModelArgs``), the activation dtype and whether this backend can run the
    MoE in it (``check_experts_dtype``).

    Returns:
        (local folder, config.json dict, ModelArgs, activation dtype).
    Raises:
        ModelLoadError: the first problem found, in one line.
    """
    path, _ = checkpoint.resolve(str(path_or_repo), revision)
    config = checkpoint.read_config(path)
    checkpoint.check_weights(path)
    checkpoint.check_tokenizer(path)
    target = activation_dtype(dtype, config)
    try:
        args = ModelArgs.from_dict(config)
    except (ValueError, TypeError) as e:  # an unsupported or malformed config value
        reason = str(e).strip().splitlines()[0]
        raise ModelLoadError(f"cannot load {path}: {reason}") from e
    check_experts_dtype(args, target)
    return path, config, args, target


def load_tokenizer(path: Path, config: dict) -> TokenizerWrapper:
    """mlx-lm's ``load_tokenizer`` for the folder (eos ids from ``config``, as mlx_lm.load).

    Raises:
        ModelLoadError: the tokenizer files are there but cannot be loaded.
    """
    try:
        return mlx_lm_load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # noqa: BLE001 - transformers raises many types, each one line here
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"cannot load the tokenizer in {path} ({reason}): restore its tokenizer files"
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
    path, config, args, target = open_folder(path_or_repo, dtype, revision)
    try:
        overrides = {"quantization": split_quantization(config.get("quantization"), args)}
        model, config = load_model(
            path, lazy=True, model_config=overrides,
            get_model_classes=lambda config: (Model, ModelArgs),
        )
    except ValueError as e:  # an unsupported config value, weights that do not fit it
        reason = str(e).strip().splitlines()[0]
        raise ModelLoadError(f"cannot load {path}: {reason}") from e
    prepare(model, target, mla_strategy)
    return model, load_tokenizer(path, config)


def prepare(model: Model, dtype: mx.Dtype, mla_strategy: str) -> None:
    """What a load does once the weights are in (``load``, and ``load_sharded`` on each
    rank): cast the float parameters to ``dtype`` (which reads the weights), give prefill
    chunks the dequantized-GEMM path where the BLAS makes it pay (CPU backend), select the
    MLA strategy."""
    cast_floating(model, dtype)
    if mx.default_device() == mx.cpu:  # prefill chunks through BLAS GEMM where it pays
        prefill_gemm.apply(model, prefill_gemm.MIN_ROWS.get(blas.kind()))
    model.set_mla_strategy(mla_strategy)
