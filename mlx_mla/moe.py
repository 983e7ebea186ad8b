"""DeepSeekMoE: a softmax router over routed experts, plus always-on shared experts.

Math from DeepSeek-V2's modeling_deepseek.py (``MoEGate``, ``DeepseekV2MoE``) and the
paper, section 2.2. Routed experts are stacked (E, out, in) and run with mlx-lm's
``SwitchGLU`` (gather matmuls), so mlx-lm's ``switch_mlp`` weight layout loads as is.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from .config import ModelArgs


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) · up(x)). x: (..., hidden) → (..., hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    """Router: softmax over n_routed_experts in float32, then top-k.

    ``group_limited_greedy`` first keeps the ``topk_group`` groups (of ``n_group``) whose
    best expert scores highest and zeroes the rest. Weights of the chosen experts are
    renormalised to sum to 1 when ``norm_topk_prob`` (and top_k > 1), otherwise multiplied
    by ``routed_scaling_factor`` — DeepSeek-V2's rule (V3 does both; transformers 5.24
    ignores ``norm_topk_prob``, which every released V2 checkpoint sets to false).
    Returns (indices (..., top_k) uint32, weights (..., top_k) float32).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.n_routed_experts = args.n_routed_experts
        self.topk_method = args.topk_method
        self.n_group = args.n_group
        self.topk_group = args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = args.routed_scaling_factor
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        if self.topk_method == "group_limited_greedy":
            if not self.n_group or not self.topk_group or args.n_routed_experts % self.n_group:
                raise ValueError(
                    "topk_method 'group_limited_greedy' needs n_group dividing "
                    f"n_routed_experts and topk_group set (got n_group={self.n_group}, "
                    f"topk_group={self.topk_group}, n_routed_experts={args.n_routed_experts})"
                )

    def __call__(self, x: mx.array):
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        scores = mx.softmax(logits, axis=-1, precise=True)  # (..., E)
        if self.topk_method == "group_limited_greedy":
            grouped = scores.reshape(*scores.shape[:-1], self.n_group, -1)
            group_best = grouped.max(axis=-1, keepdims=True)  # (..., n_group, 1)
            drop = self.n_group - self.topk_group
            if drop > 0:
                dropped = mx.argpartition(group_best, kth=drop - 1, axis=-2)[..., :drop, :]
                grouped = mx.put_along_axis(grouped, dropped, mx.array(0.0), axis=-2)
                scores = grouped.reshape(scores.shape)
        k = self.top_k
        inds = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        else:
            weights = weights * self.routed_scaling_factor
        return mx.stop_gradient(inds), weights


class MoE(nn.Module):
    """Routed experts (weighted by the gate) plus shared experts. (B, L, hidden) → same.

    Tensor parallel (``mlx_mla.sharding.shard_model``, as mlx-lm's ``deepseek_v2``):
    every expert's intermediate dimension is split over ``sharding_group``, each rank adds
    up its part of every expert's output, and one all-sum completes them.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = MoEGate(args)
        self.switch_mlp = SwitchGLU(
            args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
        )
        if args.n_shared_experts:
            self.shared_experts = MLP(
                args.hidden_size, args.moe_intermediate_size * args.n_shared_experts
            )
        self.sharding_group = None

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.gate(x)
        y = self.switch_mlp(x, inds)  # (B, L, top_k, hidden)
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        if self.sharding_group is not None:
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y
