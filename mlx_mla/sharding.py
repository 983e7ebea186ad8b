"""How a DeepSeek-V2 model splits over ranks: which layers a pipeline rank runs, whether a
rank count can split the model, and tensor parallelism applied in place (``shard_model``).

Pure model surgery and arithmetic, no I/O: ``mlx_mla.model`` uses it for ``Model.shard`` and
for a pipeline rank's weights, ``mlx_mla.distributed`` for loading over ``mlx.launch``
(see that module for the two ways to split, after mlx-lm's ``deepseek_v2``).
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx_lm.models.pipeline import PipelineMixin

from .checkpoint import ModelLoadError
from .config import ModelArgs
from .moe import MoE

# The decoder layer a tensor belongs to, in both layouts (mlx-lm's sharded_load rule).
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> Optional[int]:
    """The decoder layer index in a tensor name ("model.layers.3.mlp..." → 3), None for the
    embeddings, final norm and head."""
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


def rank_weights(weights: Dict[str, mx.array], start: int, end: int) -> Dict[str, mx.array]:
    """The tensors a pipeline rank holding layers [start, end) keeps: its layers' and those of
    no layer. A file is shared by neighbouring layers, so it carries others' tensors too."""
    return {k: v for k, v in weights.items()
            if (i := layer_of(k)) is None or start <= i < end}


def pipeline_range(num_layers: int, group) -> Tuple[int, int]:
    """The layers [start, end) this rank of ``group`` runs, by mlx-lm's ``PipelineMixin``
    rule (even split, low ranks one more; rank 0 the last layers)."""
    stage = PipelineMixin()
    stage.layers = [None] * num_layers
    stage.pipeline(group)
    return stage.start_idx, stage.end_idx


def pipeline_problem(args: ModelArgs, size: int) -> Optional[str]:
    """Why ``size`` pipeline ranks cannot split the model (every rank needs a layer), or None."""
    if size > args.num_hidden_layers:
        return (f"a pipeline over {size} ranks needs at least {size} decoder layers, and the "
                f"model has {args.num_hidden_layers}")
    return None


def tensor_parallel_problem(args: ModelArgs, size: int) -> Optional[str]:
    """Why ``size`` tensor-parallel ranks cannot split the model, or None.

    Split dimensions: the heads; the dense MLP's ``intermediate_size`` and the experts'
    ``moe_intermediate_size`` (shared experts: that times ``n_shared_experts``). A quantized
    module whose input is split (``o_proj``, every ``down_proj``) needs its per-rank input
    to be a whole number of quantization groups.
    """
    H = args.num_attention_heads
    if H % size:
        return f"num_attention_heads ({H}) is not divisible by {size}"
    layers = range(args.num_hidden_layers)
    moe = [i for i in layers if args.is_moe_layer(i)]
    dense = [i for i in layers if not args.is_moe_layer(i)]
    inputs = {"self_attn.o_proj": (layers, H * args.v_head_dim)}
    if dense:
        if args.intermediate_size % size:
            return f"intermediate_size ({args.intermediate_size}) is not divisible by {size}"
        inputs["mlp.down_proj"] = (dense, args.intermediate_size)
    if moe:
        if args.moe_intermediate_size % size:
            return (f"moe_intermediate_size ({args.moe_intermediate_size}) is not divisible "
                    f"by {size}")
        inputs["mlp.switch_mlp.down_proj"] = (moe, args.moe_intermediate_size)
        if args.n_shared_experts:
            width = args.moe_intermediate_size * args.n_shared_experts
            inputs["mlp.shared_experts.down_proj"] = (moe, width)
    for module, (where, width) in inputs.items():
        for i in where:
            spec = args.quantization_of(f"model.layers.{i}.{module}")
            if spec is not None and (width // size) % spec["group_size"]:
                return (f"model.layers.{i}.{module} is quantized in groups of "
                        f"{spec['group_size']}, and its input ({width}) split {size} ways "
                        f"is not a whole number of groups")
    return None


def check_group_size(args: ModelArgs, size: int, mode: str) -> None:
    """Raise unless ``size`` ranks can split the model in ``mode`` ("pipeline" or "tensor").

    Raises:
        ModelLoadError: one line, with the rank counts that would work.
    """
    problem = pipeline_problem if mode == "pipeline" else tensor_parallel_problem
    why = problem(args, size)
    if why is None:
        return
    limit = args.num_hidden_layers if mode == "pipeline" else args.num_attention_heads
    fits = [n for n in range(2, limit + 1) if problem(args, n) is None]
    kind = "pipeline" if mode == "pipeline" else "tensor-parallel"
    if fits:
        counts = ", ".join(map(str, fits[:-1])) + (" or " if len(fits) > 1 else "") + str(fits[-1])
        advice = f"use {counts} ranks"
    else:
        advice = "run it on one rank" + ("" if mode == "pipeline" else ", or with --pipeline")
    raise ModelLoadError(f"cannot split the model over {size} {kind} ranks: {why}; {advice}")


def shard_model(model: nn.Module, group) -> None:
    """Tensor parallel in place over ``group`` for an ``mlx_mla.Model`` (which imports this
    module, hence no type here), as mlx-lm's ``deepseek_v2.Model.shard``.

    Per layer (this rank keeps heads [rank·H/N, (rank+1)·H/N) of H, N = group size):
        w_uq, w_qr      rows of its heads (``AllToShardedLinear``; no communication)
        w_uk, w_uv      (H/N, ·, kv_lora_rank): its heads
        o_proj          columns of its heads, then one all-sum (``ShardedToAllLinear``)
        q_a_proj, w_dkv, w_kr, the norms: whole, so c_q, c_kv and k_pe (the latent cache)
                        are computed, and held, in full on every rank
        dense MLP       gate/up rows, down columns + all-sum (``shard_linear``)
        MoE             every expert's and the shared experts' gate/up rows and down
                        columns (``shard_inplace``), one all-sum of the MoE output; the
                        router stays whole
    A strategy already set is prepared again from the rank's heads
    (absorb-materialized's W_UQ·W_UKᵀ and W_O·W_UV are then per rank).

    Raises:
        ModelLoadError: the group size cannot split the model (``check_group_size``).
    """
    N = group.size()
    check_group_size(model.args, N, "tensor")
    head_rows = lambda path, w: 0 if path in ("w_uk", "w_uv") else None  # noqa: E731 (a predicate, as shard_inplace takes it)
    for layer in model.layers:
        attn = layer.self_attn
        attn.w_uq = shard_linear(attn.w_uq, "all-to-sharded", group=group)
        attn.w_qr = shard_linear(attn.w_qr, "all-to-sharded", group=group)
        shard_inplace(attn, head_rows, group=group)
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.num_heads //= N
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            mlp.sharding_group = group
            experts = [mlp.switch_mlp] + ([mlp.shared_experts] if "shared_experts" in mlp else [])
            for e in experts:
                shard_inplace(e.gate_proj, "all-to-sharded", group=group)
                shard_inplace(e.up_proj, "all-to-sharded", group=group)
                shard_inplace(e.down_proj, "sharded-to-all", group=group)
        else:
            mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
            mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
            mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    if model.mla_strategy is not None:
        model.set_mla_strategy(model.mla_strategy)
