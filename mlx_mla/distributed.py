"""DeepSeek-V2 over several processes or Macs (``mx.distributed``, started by ``mlx.launch``).

Two ways to split the model, as mlx-lm's ``deepseek_v2`` does, behind the same seams
(``model.model.pipeline(group)``, ``model.shard(group)``), so mlx-lm's generate loop drives
either unchanged on every rank:

- **Pipeline parallel**: each rank holds a contiguous block of decoder layers (mlx-lm's
  ``PipelineMixin`` split: rank 0 the last layers, rank size-1 the first) and the latent
  cache of those layers only; hidden states go rank to rank (``DeepseekV2Model``). Each
  rank reads only the safetensors files holding its layers (plus the embeddings, final norm
  and head, which every rank keeps, as in mlx-lm).
- **Tensor parallel** (``mlx_mla.sharding.shard_model``): MLA split by heads — W_UQ / W_QR rows and W_UK /
  W_UV per head, ``o_proj``'s input with one all-sum — and the MLPs and experts by their
  intermediate dimension (one all-sum per MoE). c_kv and k_pe are shared by all heads, so
  the down-projections W_DKV / W_KR stay whole and **every rank holds the whole latent
  cache**: tensor parallelism splits weights, not the cache.

``load_sharded`` is ``mlx_lm.utils.sharded_load`` for our classes: it checks the group
size against the model (one-line error), lets every rank agree that all ranks can read
their files before any weight is loaded (so a failing rank makes all ranks stop with one
line each instead of leaving the others waiting), and loads through mlx-lm's
``load_model`` on a view of the folder that holds only the rank's files.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model

from . import checkpoint
from .attention import check_strategy_name
from .checkpoint import INDEX_NAME, ModelLoadError
from .config import ModelArgs
from .loader import activation_dtype, check_experts_dtype, load_tokenizer, prepare
from .model import Model
from .sharding import (check_group_size, layer_of, pipeline_problem, pipeline_range, rank_weights,
                       shard_model, tensor_parallel_problem)
from .weights import split_quantization

# What a Hub download fetches before the rank knows which weight files it needs.
WEIGHTLESS_PATTERNS = [p for p in checkpoint.HUB_ALLOW_PATTERNS if ".safetensors" not in p]


def rank_weight_files(folder: Path, layers: Optional[range]) -> List[str]:
    """The weight files (names, in index order) a rank needs: with ``layers`` (pipeline),
    those holding a tensor of those layers or of no layer; else every file.

    The folder's ``model.safetensors.index.json`` says where each tensor is; without one,
    every ``model*.safetensors`` file is needed (only their headers would tell).

    Raises:
        ModelLoadError: an unreadable index, no weights, or no tensor for one of ``layers``.
    """
    folder = Path(folder)
    index = folder / INDEX_NAME
    if not index.is_file():
        files = sorted(p.name for p in folder.glob("model*.safetensors"))
        if not files:
            raise ModelLoadError(
                f"{folder} has no model*.safetensors weights: download the weights too, or "
                f"convert the checkpoint with `python -m convert`")
        return files
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(
            f"{index} is not a valid safetensors index ({e}): fetch the model again") from e
    if layers is None:
        return list(dict.fromkeys(weight_map.values()))
    needed, seen = [], set()
    for name, file in weight_map.items():
        i = layer_of(name)
        seen.add(i)
        if (i is None or i in layers) and file not in needed:
            needed.append(file)
    missing = [i for i in layers if i not in seen]
    if missing:
        raise ModelLoadError(
            f"{INDEX_NAME} lists no tensors for layers {missing}: the checkpoint is incomplete; "
            f"fetch it again")
    return needed


def agree(group, error: Optional[ModelLoadError]) -> None:
    """Every rank learns whether any rank failed (one all-sum), and then all raise or none.

    A rank that failed re-raises its own error; the others raise one naming the failed
    ranks, so each prints one line and exits, rather than waiting for a rank that is gone.

    Raises:
        ModelLoadError: this rank's ``error``, or one naming the ranks that failed.
    """
    rank, size = group.rank(), group.size()
    flags = mx.zeros((size,), mx.int32)
    if error is not None:
        flags[rank] = 1
    flags = mx.distributed.all_sum(flags, group=group, stream=mx.cpu).tolist()
    if error is not None:
        raise error
    failed = [r for r, f in enumerate(flags) if f]
    if failed:
        who = (f"rank {failed[0]}" if len(failed) == 1
               else "ranks " + ", ".join(map(str, failed)))
        raise ModelLoadError(f"{who} of {size} could not load the model (see its error line); "
                             f"this rank stops too")


def barrier(group) -> None:
    """Wait for this rank's pending work (mlx-lm's generation stream, which can hold a step in
    flight, and the default stream), then for every rank of ``group`` to get here: a rank
    that exited earlier would close the sockets its peers are still exchanging data on."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))


def _view(folder: Path, weight_files: List[str], into: Path) -> Path:
    """``into`` with links to ``folder``'s files, of its weights only ``weight_files``: what
    mlx-lm's ``load_model`` (which reads every ``model*.safetensors`` of a folder) then reads."""
    for p in folder.iterdir():
        if p.name.endswith(".safetensors") and p.name not in weight_files:
            continue
        (into / p.name).symlink_to(p.resolve())
    return into


def load_sharded(
    path_or_repo: Union[str, Path],
    pipeline_group=None,
    tensor_group=None,
    mla_strategy: str = "auto",
    dtype: Union[str, mx.Dtype, None] = None,
    revision: Optional[str] = None,
) -> Tuple[Model, TokenizerWrapper]:
    """``mlx_mla.load`` for one rank of a distributed run (``mlx_lm.utils.sharded_load``'s
    seams: pipeline over ``pipeline_group``, tensor parallel over ``tensor_group``; neither:
    tensor parallel over the global group, as mlx-lm).

    Reads only the weight files the rank needs (pipeline: its layers'; a Hub id fetches
    only those). Every rank checks its own files, then all agree (``agree``) before loading;
    then loads (mlx-lm's ``load_model`` on a view of the folder holding only those files,
    strict: every tensor of the rank's layers must be there), shards, and finishes as
    ``mlx_mla.load`` does (``loader.prepare``: activation dtype, ``mla_strategy`` prepared
    from the rank's weights); a last all-sum keeps the ranks in step.

    Returns:
        (model, tokenizer), as ``mlx_mla.load``; ``model.layers`` are the rank's layers.
    Raises:
        ModelLoadError: one line, on every rank: a bad group size, a file the rank cannot
            read (on the others: which rank failed), or any ``mlx_mla.load`` error.
    """
    world = mx.distributed.init()
    if pipeline_group is None and tensor_group is None:
        tensor_group = world
    error = None
    try:
        check_strategy_name(mla_strategy)
        # mlx_mla.load's checks (loader.open_folder), on this rank's weight files only
        path, repo = checkpoint.resolve(str(path_or_repo), revision, WEIGHTLESS_PATTERNS)
        config = checkpoint.read_config(path)
        checkpoint.check_tokenizer(path)
        target = activation_dtype(dtype, config)
        args = ModelArgs.from_dict(config)
        check_experts_dtype(args, target)
        layers = None
        if tensor_group is not None:
            check_group_size(args, tensor_group.size(), "tensor")
        if pipeline_group is not None:
            check_group_size(args, pipeline_group.size(), "pipeline")
            layers = range(*pipeline_range(args.num_hidden_layers, pipeline_group))
        files = rank_weight_files(path, layers)
        if repo is not None:
            path, _ = checkpoint.resolve(repo, revision, files)
        for name in files:
            if not (path / name).is_file():
                raise ModelLoadError(
                    f"{path} is missing weight shard {name}, which this rank needs: "
                    f"the download is incomplete; fetch it again")
            checkpoint.read_header(path / name)
    except ModelLoadError as e:
        error = e
    except (ValueError, TypeError) as e:  # an unsupported or malformed config value
        error = ModelLoadError(f"cannot load {path_or_repo}: {str(e).strip().splitlines()[0]}")
    agree(world, error)

    def rank_model(model_args: ModelArgs) -> Model:
        model = Model(model_args)
        if pipeline_group is not None:
            model.model.pipeline(pipeline_group)  # before loading: only its layers remain
        return model

    try:
        with tempfile.TemporaryDirectory(prefix="mlx-mla-rank-") as tmp:
            overrides = {"quantization": split_quantization(config.get("quantization"), args)}
            model, config = load_model(
                _view(path, files, Path(tmp)), lazy=True, model_config=overrides,
                get_model_classes=lambda config: (rank_model, ModelArgs),
            )
            if tensor_group is not None:
                model.shard(tensor_group)
            prepare(model, target, mla_strategy)  # reads the weights while the view exists
        tokenizer = load_tokenizer(path, config)
    except ModelLoadError as e:
        error = e
    except ValueError as e:  # weights that do not fit the config
        error = ModelLoadError(f"cannot load {path}: {str(e).strip().splitlines()[0]}")
    agree(world, error)
    return model, tokenizer


__all__ = ["load_sharded", "shard_model", "check_group_size", "pipeline_range", "pipeline_problem",
           "tensor_parallel_problem", "rank_weight_files", "rank_weights", "layer_of", "agree",
           "barrier"]
