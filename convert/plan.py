"""The `mla` plan: one QuantSpec per module, solved on the shapes of the model converted.

Units are a tensor class in one decoder layer ("attn_o@3") or embed / lm_head. A unit's
options are (bits, group) with bits from --min-bits (default: one supported step below
--q-bits) up to 8 and groups 32/64/128 that divide its input dim, so nothing that can be
quantized is left float. Going one step below lets the least sensitive units pay for the
most sensitive ones where coarser groups cannot (input dims that take groups of 64 at
most); on the released DeepSeek-V2 shapes the plan takes nothing below --q-bits.
An option's estimated KL is its class's figure (`convert.sensitivity`) times the unit's
share of the class: its band weight over the sum of weights of the class's layers in
this model. KLs of units are treated as additive (measured close at
these error levels, benchmarks/quant_recipe.py step 3), so the plan is a multiple-choice
knapsack: minimise summed KL with stored bits <= budget x parameters. Bits are counted as
the writer stores them (packed weights, a scale and a bias per group in the float dtype),
so the written folder's bits per weight is the plan's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import layout as layout_mod
from .recipes import (FIXED_MODES, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, TENSOR_CLASSES, QuantSpec, Recipe,
                      fit_group, layer_of, tensor_class)
from .sensitivity import Sensitivity, band_of


def default_min_bits(bits: int) -> int:
    """The fewest bits the `mla` plan gives a module for a --q-bits of `bits`: the next
    supported width below it (3 for 4, 6 for 8), or `bits` itself at the lowest (2)."""
    return max((b for b in SUPPORTED_BITS if b < bits), default=bits)


def default_bits_per_weight(base: QuantSpec, float_bits: int = 16) -> float:
    """The default budget: uniform quantization at the base (bits + a scale and a bias of
    `float_bits` per group: mlx_lm.convert -q's figure on a large model) + 0.1; 4.6 for
    4-bit, group 64 with bfloat16 scales."""
    return round(base.bits + 2 * float_bits / base.group_size + 0.1, 4)


def spec_bits(n: int, spec, float_bits: int = 16) -> int:
    """Stored bits of `n` weights: packed at spec.bits plus a scale and a bias per group in
    a `float_bits` dtype (as mx.quantize returns them for affine; the floating-point modes
    store one 8-bit scale per group and no bias), or `float_bits` each when float."""
    if spec is None:
        return n * float_bits
    if spec.mode in FIXED_MODES:
        return n * spec.bits + (n // spec.group_size) * 8
    return n * spec.bits + (n // spec.group_size) * 2 * float_bits


@dataclass
class Unit:
    """A class in one layer: its modules [(path, n params)], input dim and position."""

    name: str
    cls: str
    layer: int | None
    in_dim: int
    modules: list = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(n for _, n in self.modules)


def model_layers(lay) -> tuple:
    """(number of decoder layers, index of the first MoE layer or None) of a Layout."""
    layers = {int(n.split(".")[2]) for n in lay.shapes if n.startswith("model.layers.")}
    moe = [int(n.split(".")[2]) for n in lay.shapes if ".switch_mlp." in n]
    return len(layers), (min(moe) if moe else None)


def units_of(lay) -> tuple:
    """({unit name: Unit}, {float parameter name: n}) of a Layout: the quantizable weights
    grouped into units, and every other parameter (norms, router gates, ...)."""
    units, rest = {}, {}
    for name, shape in lay.shapes.items():
        n = int(np.prod(shape))
        module = layout_mod.quantizable_param(lay, name)
        if module is None:
            rest[name] = n
            continue
        cls, layer = tensor_class(module), layer_of(module)
        key = cls if layer is None else f"{cls}@{layer}"
        units.setdefault(key, Unit(key, cls, layer, shape[-1])).modules.append((module, n))
    return units, rest


def unit_options(unit: Unit, min_bits: int) -> list:
    """The QuantSpecs a unit may take under the `mla` rules (see the module docstring)."""
    groups = [g for g in SUPPORTED_GROUP_SIZES if unit.in_dim % g == 0]
    return [QuantSpec(b, g) for b in SUPPORTED_BITS if b >= min_bits for g in groups]


def solve(options: list, capacity: float, resolution: int = 1 << 16):
    """Pick one option per unit minimising summed KL with summed cost <= capacity.

    Args:
        options: per unit, a list of (cost in bits, KL).
    Returns:
        the chosen index per unit, or None when the cheapest options exceed capacity.

    Exact dynamic programme over the cost above each unit's cheapest option, in steps of
    (capacity - cheapest total) / resolution rounded up (so the capacity always holds),
    then a greedy pass that spends what the rounding left on the best KL per bit.
    """
    floor = [min(c for c, _ in opts) for opts in options]
    slack = capacity - sum(floor)
    if slack < 0:
        return None
    step = max(slack / resolution, 1.0)
    cells = int(slack // step)
    best = np.full(cells + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((len(options), cells + 1), np.int8)
    for u, opts in enumerate(options):
        new = np.full(cells + 1, np.inf)
        arg = np.zeros(cells + 1, np.int8)
        for j, (cost, kl) in enumerate(opts):
            s = math.ceil((cost - floor[u]) / step)
            if s > cells:
                continue
            cand = np.full(cells + 1, np.inf)
            cand[s:] = best[: cells + 1 - s] + kl
            better = cand < new
            new[better], arg[better] = cand[better], j
        best, choice[u] = new, arg
    cell = int(np.argmin(best))
    picks = [0] * len(options)
    for u in range(len(options) - 1, -1, -1):
        picks[u] = int(choice[u, cell])
        cell -= math.ceil((options[u][picks[u]][0] - floor[u]) / step)
    used = sum(opts[j][0] for opts, j in zip(options, picks))
    while True:  # spend the rounding slack
        move, gain = None, 0.0
        for u, opts in enumerate(options):
            cost0, kl0 = opts[picks[u]]
            for j, (cost, kl) in enumerate(opts):
                if kl < kl0 and used - cost0 + cost <= capacity:
                    g = (kl0 - kl) / max(cost - cost0, 1)
                    if g > gain:
                        move, gain = (u, j), g
        if move is None:
            return picks
        u, j = move
        used += options[u][j][0] - options[u][picks[u]][0]
        picks[u] = j


@dataclass
class Plan:
    """A recipe with one spec per quantizable module, and what it was solved for.

    Attributes:
        recipe: the Recipe (overrides keyed by module path).
        planned_bpw: bits per weight the written folder will have.
        budget_bpw: the budget (None for `uniform`).
        floor_bpw: the least the rules allow (None for `uniform`).
        predicted_kl: summed estimated KL of the choice (None for `uniform`).
        sensitivity: the figures used (None for `uniform`).
        units: {unit name: QuantSpec or None}.
        ceiling_bpw: the most the options allow: every module at 8 bits, finest group
            (None for `uniform`).
    """

    recipe: Recipe
    planned_bpw: float
    budget_bpw: float | None = None
    floor_bpw: float | None = None
    predicted_kl: float | None = None
    sensitivity: Sensitivity | None = None
    units: dict = field(default_factory=dict)
    ceiling_bpw: float | None = None

    def notes(self) -> list:
        """One-line remarks for the user (the floor above the budget, the figures used)."""
        out = []
        if self.budget_bpw is not None and self.floor_bpw > self.budget_bpw + 1e-9:
            out.append(
                f"--bits-per-weight {self.budget_bpw:g} is below this model's floor of "
                f"{self.floor_bpw:.3f} (every module at --min-bits with the largest group that "
                f"divides it, the rest float); using the floor")
        if self.ceiling_bpw is not None and self.budget_bpw > self.ceiling_bpw + 1e-9:
            out.append(
                f"--bits-per-weight {self.budget_bpw:g} is more than this model can take "
                f"({self.ceiling_bpw:.3f} with every module at 8 bits and its finest group); "
                f"planned {self.planned_bpw:.3f}")
        if self.sensitivity is not None:
            out.append(f"mla recipe: {self.planned_bpw:.3f} bits per weight planned "
                       f"(budget {self.budget_bpw:g}); sensitivities: {self.sensitivity.source}")
        return out


def _total_bits(units, rest, specs, float_bits) -> tuple:
    bits = sum(spec_bits(n, None, float_bits(name)) for name, n in rest.items())
    params = sum(rest.values())
    for key, unit in units.items():
        for module, n in unit.modules:
            bits += spec_bits(n, specs[key], float_bits(f"{module}.weight"))
            params += n
    return bits, params


def plan_uniform(lay, base: QuantSpec, float_bits=lambda name: 16) -> Plan:
    """The base everywhere, each module's group fitted to its input dim (`fit_group`)."""
    units, rest = units_of(lay)
    specs = {k: fit_group(base, u.in_dim) for k, u in units.items()}
    bits, params = _total_bits(units, rest, specs, float_bits)
    return Plan(Recipe("uniform", base, {}), bits / params, units=specs)


def plan_mla(lay, base: QuantSpec, budget_bpw: float, sens: Sensitivity,
             float_bits=lambda name: 16, min_bits: int | None = None) -> Plan:
    """Solve the `mla` recipe for a Layout under `budget_bpw` (see the module docstring).

    Args:
        lay: convert.layout.Layout of the model (shapes only; no weights needed).
        base: --q-bits / --q-group-size (the recipe's base, written as the config default).
        budget_bpw: bits per weight the whole model may take (float tensors included).
        sens: the per-class figures (the prior, or calibrated on this model).
        float_bits: bits of one float parameter of a tensor name as written (16 for bf16).
        min_bits: the fewest bits any module gets (default `default_min_bits(base.bits)`).
    Returns:
        the Plan; when the floor exceeds the budget, every unit at its cheapest option.
    """
    units, rest = units_of(lay)
    n_layers, first_moe = model_layers(lay)
    share = {u.name: sens.weight(u.cls, band_of(u.layer, n_layers, first_moe))
             for u in units.values() if u.layer is not None}
    totals = {}
    for name, w in share.items():
        totals[units[name].cls] = totals.get(units[name].cls, 0.0) + w
    keys, choices, fixed = [], [], {}
    for key, unit in units.items():
        opts = unit_options(unit, default_min_bits(base.bits) if min_bits is None else min_bits)
        if not opts:  # no supported group divides its input dim
            fixed[key] = None
            continue
        frac = share[key] / totals[unit.cls] if unit.layer is not None else 1.0
        curve = sens.curve(unit.cls)
        scored = [(o, curve[o] * frac) for o in opts if o in curve]
        if not scored:
            raise ValueError(f"{sens.source}: no figures for {unit.cls} at any of {opts}")
        keys.append(key)
        choices.append([(o, sum(spec_bits(n, o, float_bits(f"{m}.weight")) for m, n in unit.modules), k)
                        for o, k in scored])
    rest_bits, params = _total_bits({k: units[k] for k in fixed}, rest, fixed, float_bits)
    params += sum(units[k].params for k in keys)
    costs = [[(c, k) for _, c, k in opts] for opts in choices]
    floor_bits = rest_bits + sum(min(c for c, _ in opts) for opts in costs)
    ceiling_bits = rest_bits + sum(max(c for c, _ in opts) for opts in costs)
    picks = solve(costs, budget_bpw * params - rest_bits)
    if picks is None:  # the floor: cheapest, then least KL among equally cheap
        picks = [min(range(len(opts)), key=lambda j: (opts[j][0], opts[j][1])) for opts in costs]
    specs = dict(fixed)
    specs.update({k: choices[i][j][0] for i, (k, j) in enumerate(zip(keys, picks))})
    bits = rest_bits + sum(choices[i][j][1] for i, j in enumerate(picks))
    overrides = {m: specs[k] for k, u in units.items() for m, _ in u.modules if specs[k] != base}
    return Plan(
        Recipe("mla", base, overrides), bits / params, budget_bpw, floor_bits / params,
        sum(choices[i][j][2] for i, j in enumerate(picks)), sens, specs, ceiling_bits / params,
    )


def precision_lines(written: dict, lay) -> list:
    """What a conversion wrote, one line per precision: parameters at each bits/group and
    their classes, then what stayed float and why.

    Args:
        written: {module path: (QuantSpec or None, parameters, input dim)}.
        lay: the Layout (for the parameters that are never quantized).
    """
    _, rest = units_of(lay)
    total = sum(n for _, n, _ in written.values()) + sum(rest.values())
    by_spec, floats = {}, {}
    for module, (spec, n, in_dim) in written.items():
        cls = tensor_class(module)
        if spec is None:
            entry = floats.setdefault(cls, [0, set()])
            entry[0] += n
            entry[1].add(in_dim)
            continue
        entry = by_spec.setdefault(spec, [0, []])
        entry[0] += n
        if cls not in entry[1]:
            entry[1].append(cls)
    lines = []
    for spec, (n, classes) in sorted(by_spec.items(), key=lambda t: (t[0].bits, -t[0].group_size)):
        classes = sorted(classes, key=TENSOR_CLASSES.index)
        mode = "" if spec.mode == "affine" else f" ({spec.mode})"
        lines.append(f"{spec.bits}-bit{mode}, group {spec.group_size}: {n:,} parameters "
                     f"({100 * n / total:.1f}%): {', '.join(classes)}")
    groups = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
    for cls, (n, dims) in floats.items():
        lines.append(f"float: {n:,} parameters ({100 * n / total:.1f}%): {cls}, input dim "
                     f"{', '.join(map(str, sorted(dims)))} (no group size of {groups} divides it)")
    n = sum(rest.values())
    lines.append(f"float: {n:,} parameters ({100 * n / total:.1f}%): norms and router gates "
                 "(never quantized, as in mlx-lm)")
    return lines
