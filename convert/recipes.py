"""Which tensors get how many bits.

A recipe maps a module path to a `QuantSpec` (or None: keep float). Tensors are grouped
into classes by role (`tensor_class`), because sensitivity to quantization follows the
role first (at 4-bit, per parameter, 60-80x between kv_a_proj and the routed experts);
within a class it varies with the layer's position (`convert.sensitivity.band_of`).
`uniform` is the base everywhere; `mla` gives each module its own spec, solved for the
model being converted under a bits-per-weight budget (`convert.plan`).
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
# `uniform` (the `mla` recipe's figures were measured for affine).
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
    ("attn_q", r"self_attn\.q_proj$"),
    ("attn_q_a", r"self_attn\.q_a_proj$"),
    ("attn_q_b", r"self_attn\.q_b_proj$"),
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


def fit_group(spec: QuantSpec, in_dim: int):
    """`spec` with the largest supported group size <= its own that divides `in_dim`
    (128 -> 64 -> 32), or None when none does (`mx.quantize` groups along the input dim).

    E.g. DeepSeek-V2-Lite's dense down_proj (input 10944 = 64 * 171) at group 128 -> 64.
    A floating-point mode (`FIXED_MODES`) has one group size: that or None.
    """
    if spec.mode in FIXED_MODES:
        return spec if in_dim % spec.group_size == 0 else None
    for group in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if group <= spec.group_size and in_dim % group == 0:
            return QuantSpec(spec.bits, group)
    return None


@dataclass(frozen=True)
class Recipe:
    """A base spec plus overrides (None in an override: keep that module float).

    An override key is a module path, "class@layer" (a class in one decoder layer) or a
    class; the most specific present wins.
    """

    name: str
    base: QuantSpec
    overrides: dict  # module path, "class@layer" or class -> QuantSpec | None

    def spec_for(self, module: str, in_dim: int):
        """The QuantSpec for a module (group size fitted to `in_dim`, see `fit_group`), or
        None to keep it float."""
        cls = tensor_class(module)
        spec = self.overrides.get(module, self.overrides.get(
            f"{cls}@{layer_of(module)}", self.overrides.get(cls, self.base)))
        return None if spec is None else fit_group(spec, in_dim)


def make_recipe(name: str, bits: int, group_size: int, mode: str = "affine") -> Recipe:
    """Build a recipe by name for a base of `bits` and `group_size` in `mode`.

    `uniform` is the base everywhere; `mla` starts as the base too and gets its
    per-module specs from `convert.plan.plan_mla`, which needs the model's shapes. A mode
    of `FIXED_MODES` takes only its own bits and group size, and only the `uniform` recipe.

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
    if name not in RECIPES:
        raise ValueError(f"--quant-recipe {name} is not known; choose one of {', '.join(RECIPES)}")
    return Recipe(name, QuantSpec(bits, group_size), {})
