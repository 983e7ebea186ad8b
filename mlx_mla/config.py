"""ModelArgs: a DeepSeek-V2 config.json in, the dimensions and RoPE settings MLA needs out.

Accepts both spellings real users meet: the Hub's ``rope_scaling`` (DeepSeek's own repos)
and transformers 5's ``rope_parameters`` (which also carries ``rope_theta``).
Unknown keys are ignored, as ``mlx_lm.models.base.BaseModelArgs.from_dict`` does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

SUPPORTED_MODEL_TYPES = ("deepseek_v2",)
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass
class ModelArgs:
    """Hyper-parameters of a DeepSeek-V2-family model (DeepSeek-V2 paper, section 2; HF config).

    Field names are the Hugging Face config keys. ``rope`` is the normalised RoPE config:
    a dict with ``rope_type`` ("default" or "yarn") and, for YaRN, ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``.
    """

    model_type: str = "deepseek_v2"
    vocab_size: int = 102400
    hidden_size: int = 2048
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    n_shared_experts: Optional[int] = None
    n_routed_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    norm_topk_prob: bool = False
    moe_layer_freq: int = 1
    first_k_dense_replace: int = 0
    kv_lora_rank: int = 512
    q_lora_rank: Optional[int] = None
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope: Dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # mlx-lm's "quantization" entry of an mlx-lm folder: {"group_size", "bits", "mode"} plus
    # one entry per module stored differently ({...} or false); None for float weights.
    quantization: Optional[Dict[str, Any]] = None

    @property
    def q_head_dim(self) -> int:
        """Per-head query/key width: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` uses the MoE block (DeepSeek's modeling_deepseek.py rule)."""
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    def quantization_of(self, module: str) -> Optional[Dict[str, Any]]:
        """How ``module`` is stored (see ``quantization_of``)."""
        return quantization_of(self.quantization, module)

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "ModelArgs":
        """Build from a config.json dict.

        Raises:
            ValueError: ``model_type`` is not in the DeepSeek-V2 family, the RoPE config is
                of an unsupported type, or ``topk_method`` is unknown.
        """
        check_model_type(config.get("model_type"))
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names and k != "rope"}
        rope = _normalise_rope(config)
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope.pop("rope_theta")
        args = cls(**kwargs, rope=rope)
        if args.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"topk_method {args.topk_method!r} is not supported; expected one of {TOPK_METHODS}"
            )
        return args


def quantization_of(quantization: Optional[Dict[str, Any]], module: str) -> Optional[Dict[str, Any]]:
    """How ``module`` (an mlx-lm module path, e.g. "model.layers.0.self_attn.kv_b_proj") is
    stored according to a folder's mlx-lm ``quantization`` config: {"group_size", "bits",
    "mode"} from the module's own entry or the folder's default, or None when it is float
    (no config, or the module listed as ``false``). Bits, group size and mode always come
    from here, never from tensor shapes."""
    if not quantization:
        return None
    entry = quantization.get(module, quantization)
    if not isinstance(entry, dict):  # false: a float module listed explicitly
        return None
    return {"group_size": entry["group_size"], "bits": entry["bits"],
            "mode": entry.get("mode", "affine")}


def check_model_type(model_type: Any) -> None:
    """Raises ValueError unless ``model_type`` is in the DeepSeek-V2 family."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported: mlx-mla runs the DeepSeek-V2 "
            f"family (model_type 'deepseek_v2'); use mlx-lm for other models"
        )


def _normalise_rope(config: Dict[str, Any]) -> Dict[str, Any]:
    """One RoPE dict from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (Hub)."""
    raw = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = dict(raw)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if rope_type not in ("default", "yarn"):
        raise ValueError(
            f"rope type {rope_type!r} is not supported: DeepSeek-V2 uses 'yarn' (or none)"
        )
    rope["rope_type"] = rope_type
    if rope_type == "yarn":
        rope.setdefault("original_max_position_embeddings", 4096)
        rope.setdefault("beta_fast", 32)
        rope.setdefault("beta_slow", 1)
        rope.setdefault("mscale", 1.0)
        rope.setdefault("mscale_all_dim", 0.0)
        if rope.get("factor") is None:
            rope["factor"] = config.get("max_position_embeddings", 2048) / rope[
                "original_max_position_embeddings"
            ]
    return rope


__all__ = ["ModelArgs", "SUPPORTED_MODEL_TYPES", "check_model_type", "quantization_of"]
