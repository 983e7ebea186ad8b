"""The reference side of ``compare``: stock ``mlx_lm.load``, adjusted only where it must be.

Where mlx-lm cannot take the folder or dtype as it is, only its side is adjusted, and each
adjustment is returned as a line to print:

- a config with ``rope_parameters`` (transformers 5) but no ``rope_scaling``: mlx-lm's
  ``deepseek_v2`` reads ``rope_scaling["factor"]``, so it gets ``rope_scaling`` copied from
  ``rope_parameters`` (``factor`` 1.0, i.e. plain RoPE, when there is no scaling);
- float parameters in another dtype than mlx_mla's activation dtype (e.g. a bfloat16
  checkpoint, which this CPU build cannot run through a bfloat16 MoE ``gather_mm``): cast to
  that dtype, as ``mlx_mla.load`` casts its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..dtypes import cast_floating, dtype_name


def peer_config_adjustments(config: dict) -> Tuple[dict, List[str]]:
    """``model_config`` overrides mlx-lm's ``deepseek_v2`` needs to take ``config``, and one
    line per override saying what was adjusted and why."""
    if config.get("rope_scaling"):
        return {}, []
    params = dict(config.get("rope_parameters") or {})
    overrides: dict = {}
    if "rope_theta" in params:
        overrides["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        scaling = {"type": "yarn", "factor": 1.0}  # factor 1 = plain RoPE in mlx-lm's YaRN
        why = "no rope scaling; mlx-lm's deepseek_v2 needs rope_scaling['factor'], given 1.0 (plain RoPE)"
    else:
        scaling = {"type": rope_type, **params}
        why = "mlx-lm's deepseek_v2 reads rope_scaling only; copied from rope_parameters"
    overrides["rope_scaling"] = scaling
    source = "rope_parameters" if config.get("rope_parameters") else "no rope config"
    return overrides, [f"config: {source} -> rope_scaling={json.dumps(scaling)} ({why})"]


def load_peer(path: Path, dtype: mx.Dtype, config: dict):
    """Stock ``mlx_lm.load`` of ``path`` with only the adjustments it needs.

    Returns (model, tokenizer, adjustments: list of printed lines).
    """
    import mlx_lm

    overrides, notes = peer_config_adjustments(config)
    model, tokenizer = mlx_lm.load(str(path), model_config=overrides or None)
    cast_from = sorted({
        dtype_name(v.dtype) for _, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype
    })
    if cast_from:
        cast_floating(model, dtype)
        notes.append(
            f"dtype: mlx-lm's float parameters cast {', '.join(cast_from)} -> "
            f"{dtype_name(dtype)}, mlx_mla's activation dtype (mlx-lm would run the "
            f"checkpoint dtype; this CPU build has no bfloat16 gather_mm for the MoE)"
        )
    return model, tokenizer, notes
