"""Which tensors get how many bits.

A recipe maps a module path to a `QuantSpec` (or None: keep float). Tensors are grouped
into classes by role (`tensor_class`), because sensitivity to quantization follows the
role far more than the layer index; `benchmarks/quant_recipe.py` measures it per class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
RECIPES = ("mla", "uniform")
DEFAULT_RECIPE = "mla"


@dataclass(frozen=True)
class QuantSpec:
    """Affine quantization parameters for one module, as `mx.quantize` takes them."""

    bits: int
    group_size: int

    def as_config(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}


# Ordered: the first pattern that matches a module path names its class.
_CLASSES = [
    ("embed", r"model\.embed_tokens$"),
    ("lm_head", r"lm_head$"),
    ("attn_q", r"self_attn\.(q_proj|q_a_proj|q_b_proj)$"),
    ("attn_kv_a", r"self_attn\.kv_a_proj_with_mqa$"),
    ("attn_kv_b", r"self_attn\.kv_b_proj$"),
    ("attn_o", r"self_attn\.o_proj$"),
    ("dense_gate_up", r"layers\.\d+\.mlp\.(gate_proj|up_proj)$"),
    ("dense_down", r"layers\.\d+\.mlp\.down_proj$"),
    ("shared_gate_up", r"mlp\.shared_experts\.(gate_proj|up_proj)$"),
    ("shared_down", r"mlp\.shared_experts\.down_proj$"),
    ("experts_gate_up", r"mlp\.switch_mlp\.(gate_proj|up_proj)$"),
    ("experts_down", r"mlp\.switch_mlp\.down_proj$"),
]
TENSOR_CLASSES = tuple(name for name, _ in _CLASSES)


def tensor_class(module: str) -> str:
    """The role of a quantizable module, e.g. 'attn_kv_b' for '...self_attn.kv_b_proj'.

    Raises:
        ValueError: a path none of the DeepSeek-V2 roles matches.
    """
    for name, pattern in _CLASSES:
        if re.search(pattern, module):
            return name
    raise ValueError(f"no tensor class for module {module!r}")


# The `mla` recipe, as measured for a 4-bit, group-64 base: {class: (bits, group)}.
# benchmarks/quant_recipe.py measured KL per class and option on the fixture and picked
# the lowest summed KL within 4.6 bits per weight, never below the base bits, kv_b_proj at
# >= 8 bits (mlx_mla splits it into the absorbed W_UK / W_UV; see the strategies
# section). Classes not listed use the base. In short: the routed and shared experts,
# which hold most weights and tolerate it, move to group 128, and the bits saved go to
# the embeddings, the MLA down-projection kv_a_proj_with_mqa (the per-parameter most
# sensitive class: its error reaches every head's keys and values through c_kv and
# k_pe), q_proj and the dense first layer.
MLA_TABLE = {
    "embed": (5, 64),
    "lm_head": (4, 128),
    "attn_q": (5, 128),
    "attn_kv_a": (6, 128),
    "attn_kv_b": (8, 64),
    "dense_gate_up": (5, 128),
    "dense_down": (6, 64),
    "shared_gate_up": (4, 128),
    "shared_down": (4, 128),
    "experts_gate_up": (4, 128),
    "experts_down": (4, 128),
}
MLA_MEASURED_BASE = QuantSpec(4, 64)


def _mla_overrides(base: QuantSpec) -> dict:
    """MLA_TABLE moved to another base: the same extra bits over the base (to the next
    bits mx.quantize supports, at most 8; kv_b_proj stays >= 8) and the same group-size
    ratio to the base group (clamped to 32..128)."""
    table = {}
    for cls, (bits, group) in MLA_TABLE.items():
        want = max(base.bits, min(8, base.bits + bits - MLA_MEASURED_BASE.bits))
        if cls == "attn_kv_b":
            want = max(want, 8)
        bits_ = next(b for b in SUPPORTED_BITS if b >= want)
        group_ = min(128, max(32, group * base.group_size // MLA_MEASURED_BASE.group_size))
        spec = QuantSpec(bits_, group_)
        if spec != base:
            table[cls] = spec
    return table


@dataclass(frozen=True)
class Recipe:
    """A base spec plus per-class overrides (None in an override: keep that class float)."""

    name: str
    base: QuantSpec
    overrides: dict  # class -> QuantSpec | None

    def spec_for(self, module: str, in_dim: int):
        """The QuantSpec for a module, or None to keep it float.

        A module whose input dim is not a multiple of its group size stays float, as in
        mlx-lm, since `mx.quantize` cannot group it.
        """
        spec = self.overrides.get(tensor_class(module), self.base)
        if spec is None or in_dim % spec.group_size:
            return None
        return spec


def make_recipe(name: str, bits: int, group_size: int, overrides: dict | None = None) -> Recipe:
    """Build a recipe by name for a base of `bits` and `group_size`.

    `mla` applies MLA_TABLE (measured at 4-bit, group 64) relative to the base.

    Raises:
        ValueError: unknown recipe, bits or group size (message lists the valid ones).
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(
            f"--q-bits {bits} is not supported; choose one of {', '.join(map(str, SUPPORTED_BITS))}"
        )
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"--q-group-size {group_size} is not supported; choose one of "
            f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}"
        )
    base = QuantSpec(bits, group_size)
    if overrides is not None:
        return Recipe(name, base, dict(overrides))
    if name == "uniform":
        return Recipe(name, base, {})
    if name == "mla":
        return Recipe(name, base, _mla_overrides(base))
    raise ValueError(f"--quant-recipe {name} is not known; choose one of {', '.join(RECIPES)}")
