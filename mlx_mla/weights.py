"""Checkpoint tensors → mlx_mla's parameter names: stack experts, split MLA's fused projections.

Reads both layouts: a Hugging Face DeepSeek-V2 checkpoint (per-expert tensors) and an
mlx-lm folder (experts already stacked in ``switch_mlp``, quantized tensors as
weight/scales/biases). Row splits are exact on quantized tensors too, because MLX's affine
groups run along the input dimension, so a block of output rows keeps its own scales.

Fused layouts (transformers' DeepseekV2Attention, DeepSeek's modeling_deepseek.py):
    q_proj / q_b_proj:   rows per head h = [q_nope(h) (qk_nope_head_dim); q_pe(h) (qk_rope_head_dim)]
    kv_a_proj_with_mqa:  rows = [c_kv (kv_lora_rank); k_pe (qk_rope_head_dim)]
    kv_b_proj:           rows per head h = [k_nope(h) (qk_nope_head_dim); v(h) (v_head_dim)]
"""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

from .config import ModelArgs

QUANT_PARTS = ("weight", "scales", "biases", "bias")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def sanitize(weights: Dict[str, mx.array], args: ModelArgs) -> Dict[str, mx.array]:
    """Rename/split/stack ``weights`` in place of the checkpoint layout; returns the dict.

    Raises:
        ValueError: a layer's routed experts are incomplete in the checkpoint.
    """
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    for layer in range(args.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        _stack_experts(weights, f"{prefix}.mlp", args)
        _split_attention(weights, f"{prefix}.self_attn", args)
    if args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def _stack_experts(weights, prefix: str, args: ModelArgs) -> None:
    for proj in EXPERT_PROJS:
        for part in ("weight", "scales", "biases"):
            first = f"{prefix}.experts.0.{proj}.{part}"
            if first not in weights:
                continue
            names = [f"{prefix}.experts.{e}.{proj}.{part}" for e in range(args.n_routed_experts)]
            missing = [n for n in names if n not in weights]
            if missing:
                raise ValueError(
                    f"checkpoint is missing {len(missing)} routed-expert tensors, e.g. "
                    f"{missing[0]}: the download is incomplete; fetch the model again"
                )
            weights[f"{prefix}.switch_mlp.{proj}.{part}"] = mx.stack([weights.pop(n) for n in names])


def _split_rows(weights, src: str, dst_a: str, dst_b: str, groups: int, rows_a: int) -> None:
    """Split each row group of ``src`` into its first ``rows_a`` rows and the rest."""
    for part in QUANT_PARTS:
        name = f"{src}.{part}"
        if name not in weights:
            continue
        t = weights.pop(name)
        grouped = t.reshape(groups, -1, *t.shape[1:])
        a, b = grouped[:, :rows_a], grouped[:, rows_a:]
        weights[f"{dst_a}.{part}"] = a.reshape(-1, *t.shape[1:])
        weights[f"{dst_b}.{part}"] = b.reshape(-1, *t.shape[1:])


def dense_kv_b(weights, name: str, args: ModelArgs) -> mx.array:
    """kv_b_proj's weight (out, kv_lora_rank) in float32, dequantized with the bits, group
    size and mode the folder's ``quantization`` config gives for it, if it is quantized.

    Raises:
        ValueError: the tensors are quantized but the config says the module is float.
    """
    w = weights.pop(f"{name}.weight")
    scales = weights.pop(f"{name}.scales", None)
    if scales is None:
        return w.astype(mx.float32)
    spec = args.quantization_of(name)
    if spec is None:
        raise ValueError(
            f"{name} is stored quantized but config.json's quantization says it is float: "
            f"the folder is inconsistent; convert it again"
        )
    return dequantize_float32(w, scales, weights.pop(f"{name}.biases", None), spec)


def dequantize_float32(w: mx.array, scales: mx.array, biases: Optional[mx.array],
                       spec: dict) -> mx.array:
    """``mx.dequantize`` of one quantized matrix, in float32.

    Args:
        w: packed uint32 weight (out, in·bits/32); scales: (out, in/group_size), float for
            "affine" or uint8 shared exponents for the fp modes; biases: same shape as
            scales for "affine", else None.
        spec: {"group_size", "bits", "mode"}, as ``quantization_of`` gives it.
    Returns:
        (out, in) float32. Float scales are widened first: with bfloat16 ones MLX would
        compute (and round) in bfloat16. (The fp modes' values, a few-bit significand
        times a power-of-two or fp8 scale, are exact in MLX's default bfloat16 result.)
    """
    if mx.issubdtype(scales.dtype, mx.floating):
        scales = scales.astype(mx.float32)
    if biases is not None:
        biases = biases.astype(mx.float32)
    return mx.dequantize(w, scales, biases, **spec).astype(mx.float32)


def split_quantization(quantization: Optional[dict], args: ModelArgs) -> Optional[dict]:
    """The folder's ``quantization`` config with an entry for each split module (w_uq, w_qr,
    w_dkv, w_kr: the spec of the fused module it is cut from, or false), so that loading
    reads their bits, group size and mode from the config rather than from tensor shapes.
    None for a float folder."""
    if not quantization:
        return quantization
    out = dict(quantization)
    q_src = "q_proj" if args.q_lora_rank is None else "q_b_proj"
    splits = {q_src: ("w_uq", "w_qr"), "kv_a_proj_with_mqa": ("w_dkv", "w_kr")}
    for layer in range(args.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn"
        for fused, parts in splits.items():
            spec = args.quantization_of(f"{prefix}.{fused}")
            for part in parts:
                out[f"{prefix}.{part}"] = spec if spec is not None else False
    return out


def _split_attention(weights, prefix: str, args: ModelArgs) -> None:
    H = args.num_attention_heads
    q_src = f"{prefix}.q_proj" if args.q_lora_rank is None else f"{prefix}.q_b_proj"
    _split_rows(weights, q_src, f"{prefix}.w_uq", f"{prefix}.w_qr", H, args.qk_nope_head_dim)
    _split_rows(
        weights, f"{prefix}.kv_a_proj_with_mqa", f"{prefix}.w_dkv", f"{prefix}.w_kr",
        1, args.kv_lora_rank,
    )
    if f"{prefix}.kv_b_proj.weight" in weights:
        kv_b = dense_kv_b(weights, f"{prefix}.kv_b_proj", args)
        kv_b = kv_b.reshape(H, args.qk_nope_head_dim + args.v_head_dim, args.kv_lora_rank)
        weights[f"{prefix}.w_uk"] = kv_b[:, : args.qk_nope_head_dim]  # (H, dn, r)
        weights[f"{prefix}.w_uv"] = kv_b[:, args.qk_nope_head_dim :]  # (H, dv, r)
