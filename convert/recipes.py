"""Which tensors get how many bits.

A recipe maps a module path to a `QuantSpec` (or None: keep float). Tensors are grouped
into classes by role (`tensor_class`), because sensitivity to quantization follows the
role first (at 4-bit, per parameter, 60-80x between kv_a_proj and the routed experts);
within a class it varies by layer up to ~5x (o_proj), so a recipe may also name a class
in one layer ("attn_o@0").
`benchmarks/quant_recipe.py` measures both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
RECIPES = ("mla", "uniform")
DEFAULT_RECIPE = "mla"
# MLX's floating-point quantization modes fix bits and group size ({mode: (bits, group)},
# `mx.quantize`'s table); only "affine" has a choice, so only it has recipes other than
# `uniform` (the `mla` recipe's extra bits and group sizes were measured for affine).
FIXED_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
Q_MODES = ("affine", *FIXED_MODES)


@dataclass(frozen=True)
class QuantSpec:
    """Quantization parameters for one module, as `mx.quantize` takes them."""

    bits: int
    group_size: int
    mode: str = "affine"

    def as_config(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


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


def layer_of(module: str):
    """The decoder layer index of a module path, or None (embed_tokens, lm_head)."""
    m = re.search(r"layers\.(\d+)\.", module)
    return int(m.group(1)) if m else None


def tensor_class(module: str) -> str:
    """The role of a quantizable module, e.g. 'attn_kv_b' for '...self_attn.kv_b_proj'.

    Raises:
        ValueError: a path none of the DeepSeek-V2 roles matches.
    """
    for name, pattern in _CLASSES:
        if re.search(pattern, module):
            return name
    raise ValueError(f"no tensor class for module {module!r}")


# The `mla` recipe, as measured for a 4-bit, group-64 base: {unit: (bits, group)}, where a
# unit is a class ("attn_o") or a class in one decoder layer ("attn_o@0"; it wins over the
# class entry for that layer). benchmarks/quant_recipe.py measured KL per class and option
# on the fixture, split each class's KL over its layers by quantizing one layer at a time,
# and picked the lowest summed KL within 4.6 bits per weight, never below the base bits,
# kv_b_proj at >= 8 bits (mlx_mla splits it into the absorbed W_UK / W_UV; see the
# strategies section). Units not listed use the base. In short: the routed experts, which
# hold most weights and tolerate it, and most shared experts move to group 128, and the
# bits saved go to the embeddings, the MLA down-projection kv_a_proj_with_mqa (the
# per-parameter most sensitive class: its error reaches every head's keys and values
# through c_kv and k_pe), q_proj, the dense first layer, and the layers where o_proj and
# the shared experts measured most sensitive. Per-class choices alone measured KL 0.5006 -
# 0.507 x mlx-lm's uniform 4-bit over the whole corpus; the per-layer units 0.488 x.
# Layer indices are the fixture's (4 layers: 0 dense, 1-3 MoE); on a deeper model they
# name the same first layers and the rest follow the class entries.
MLA_TABLE = {
    "embed": (5, 128),
    "lm_head": (4, 128),
    "attn_q": (5, 128),
    "attn_q@0": (4, 128),
    "attn_kv_a": (6, 128),
    "attn_kv_a@0": (6, 64),
    "attn_kv_b": (8, 64),
    "attn_o": (4, 128),
    "attn_o@0": (5, 128),
    "attn_o@1": (5, 128),
    "dense_gate_up": (5, 128),
    "dense_down": (6, 128),
    "shared_gate_up": (4, 128),
    "shared_gate_up@3": (5, 128),
    "shared_down": (4, 128),
    "shared_down@1": (5, 128),
    "experts_gate_up": (4, 128),
    "experts_down": (4, 128),
}
MLA_MEASURED_BASE = QuantSpec(4, 64)


def _mla_overrides(base: QuantSpec) -> dict:
    """MLA_TABLE moved to another base: the same extra bits over the base (to the next
    bits mx.quantize supports, at most 8; kv_b_proj stays >= 8) and the same group-size
    ratio to the base group (clamped to 32..128)."""
    table = {}
    for unit, (bits, group) in MLA_TABLE.items():
        want = max(base.bits, min(8, base.bits + bits - MLA_MEASURED_BASE.bits))
        if unit.split("@")[0] == "attn_kv_b":
            want = max(want, 8)
        bits_ = next(b for b in SUPPORTED_BITS if b >= want)
        group_ = min(128, max(32, group * base.group_size // MLA_MEASURED_BASE.group_size))
        spec = QuantSpec(bits_, group_)
        # a layer entry equal to the base still has to win over its class entry
        if spec != base or "@" in unit:
            table[unit] = spec
    return table


@dataclass(frozen=True)
class Recipe:
    """A base spec plus per-class overrides (None in an override: keep that class float)."""

    name: str
    base: QuantSpec
    overrides: dict  # class or "class@layer" -> QuantSpec | None

    def spec_for(self, module: str, in_dim: int):
        """The QuantSpec for a module, or None to keep it float.

        A module whose input dim is not a multiple of its group size stays float, as in
        mlx-lm, since `mx.quantize` cannot group it.
        """
        cls = tensor_class(module)
        spec = self.overrides.get(f"{cls}@{layer_of(module)}", self.overrides.get(cls, self.base))
        if spec is None or in_dim % spec.group_size:
            return None
        return spec


def make_recipe(name: str, bits: int, group_size: int, overrides: dict | None = None,
                mode: str = "affine") -> Recipe:
    """Build a recipe by name for a base of `bits` and `group_size` in `mode`.

    `mla` applies MLA_TABLE (measured at 4-bit, group 64) relative to the base; an
    override key is a class or "class@layer" (that class in one decoder layer). A mode of
    `FIXED_MODES` takes only its own bits and group size, and only the `uniform` recipe.

    Raises:
        ValueError: unknown recipe, mode, bits or group size, or a recipe, bits or group
            size the mode does not take (message lists the valid ones).
    """
    if mode in FIXED_MODES:
        fixed = FIXED_MODES[mode]
        if (bits, group_size) != fixed:
            raise ValueError(
                f"--q-mode {mode} stores {fixed[0]} bits in groups of {fixed[1]}; got "
                f"--q-bits {bits} --q-group-size {group_size}: leave them out"
            )
        if name != "uniform":
            raise ValueError(
                f"--quant-recipe {name} is for --q-mode affine (its bits and group sizes were "
                f"measured there); --q-mode {mode} takes --quant-recipe uniform"
            )
        return Recipe(name, QuantSpec(bits, group_size, mode), {})
    if mode != "affine":
        raise ValueError(f"--q-mode {mode} is not known; choose one of {', '.join(Q_MODES)}")
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
