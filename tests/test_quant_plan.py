"""The `mla` plan on many DeepSeek-V2 shapes (config only: convert.layout gives the shapes),
the group-size fallback, the knapsack against brute force, and the position bands."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from benchmarks.common import MODEL_CONFIGS, V2_LITE
from convert import layout, plan, sensitivity
from convert.recipes import FIXED_MODES, SUPPORTED_GROUP_SIZES, QuantSpec, fit_group, make_recipe

SMALL = {**V2_LITE, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 640,
         "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}

# Dims in mixes of multiples of 32, 64 and 128 (and one of none: 100), as the issue lists.
SHAPES = {
    "fixture-like": {},
    "intermediate 10944": {"hidden_size": 128, "intermediate_size": 10944},
    "hidden 192, q_lora": {"hidden_size": 192, "q_lora_rank": 96, "intermediate_size": 448,
                           "moe_intermediate_size": 192},
    "kv_lora 96, 7 layers": {"kv_lora_rank": 96, "num_hidden_layers": 7, "first_k_dense_replace": 2},
    "hidden 160, kv_lora 160": {"hidden_size": 160, "kv_lora_rank": 160, "q_lora_rank": 64,
                                "moe_intermediate_size": 96},
    "moe 100 (no group divides)": {"moe_intermediate_size": 100},
    "no dense layer, 2 layers": {"first_k_dense_replace": 0, "num_hidden_layers": 2},
    **{name: cfg for name, cfg in MODEL_CONFIGS.items() if name in ("DeepSeek-V2-Lite", "DeepSeek-V2")},
}


def _layout(overrides: dict):
    cfg = overrides if "architectures" in overrides else {**SMALL, **overrides}
    return layout.Layout.for_config(cfg)


def _check_plan(lay, base, budget, p, min_bits=None):
    units, _ = plan.units_of(lay)
    for key, unit in units.items():
        divisible = any(unit.in_dim % g == 0 for g in SUPPORTED_GROUP_SIZES)
        spec = p.units[key]
        assert (spec is not None) == divisible, (key, unit.in_dim, spec)
        if spec is not None:
            assert unit.in_dim % spec.group_size == 0
            assert spec.bits >= (min_bits or plan.default_min_bits(base.bits))
    if p.floor_bpw > budget:
        assert p.planned_bpw == pytest.approx(p.floor_bpw, abs=1e-12)
        assert p.notes()[0].startswith(f"--bits-per-weight {budget:g} is below this model's floor")
    else:
        assert budget - 0.01 <= p.planned_bpw <= budget + 1e-12


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("base,budget,min_bits", [(QuantSpec(4, 64), None, None), (QuantSpec(3, 128), None, None),
                                                  (QuantSpec(4, 64), 4.25, None), (QuantSpec(4, 64), None, 3)])
def test_plan_keeps_the_budget_on_any_shape(name, base, budget, min_bits):
    """Within the budget to 0.01 (or exactly the floor), nothing quantizable left float,
    nothing below --min-bits."""
    lay = _layout(SHAPES[name])
    budget = budget or plan.default_bits_per_weight(base)
    p = plan.plan_mla(lay, base, budget, sensitivity.load_prior(), min_bits=min_bits)
    _check_plan(lay, base, budget, p, min_bits)


def test_random_shapes_keep_the_budget():
    rng = random.Random(0)
    prior = sensitivity.load_prior()
    for _ in range(6):
        cfg = {
            "hidden_size": rng.choice([96, 128, 160, 192, 256]),
            "intermediate_size": rng.choice([96, 192, 448, 640, 10944 // 8]),
            "moe_intermediate_size": rng.choice([32, 64, 96, 100, 128]),
            "kv_lora_rank": rng.choice([32, 64, 96, 160]),
            "q_lora_rank": rng.choice([None, 64, 96, 192]),
            "num_hidden_layers": rng.choice([2, 3, 5, 8]),
            "first_k_dense_replace": rng.choice([0, 1, 2]),
        }
        lay = _layout(cfg)
        p = plan.plan_mla(lay, QuantSpec(4, 64), 4.6, prior)
        _check_plan(lay, QuantSpec(4, 64), 4.6, p)


def test_written_bits_formula_matches_mx_quantize():
    """spec_bits counts what mx.quantize returns (packed weight, bf16 scales and biases)."""
    import mlx.core as mx

    w = mx.zeros((96, 192), mx.bfloat16)
    for spec in (QuantSpec(3, 32), QuantSpec(4, 64), QuantSpec(5, 64), QuantSpec(6, 32), QuantSpec(8, 64)):
        q = mx.quantize(w, group_size=spec.group_size, bits=spec.bits)
        assert sum(a.nbytes for a in q) * 8 == plan.spec_bits(w.size, spec, 16), spec


@pytest.mark.parametrize("mode", list(FIXED_MODES))
def test_written_bits_formula_matches_mx_quantize_fp_modes(mode):
    """The floating-point modes: packed weight and one 8-bit scale per group, no bias."""
    import mlx.core as mx

    bits, group = FIXED_MODES[mode]
    w = mx.zeros((96, 192), mx.bfloat16)
    try:
        q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    except (ValueError, RuntimeError):
        pytest.skip(f"this MLX cannot quantize with mode {mode}")
    assert sum(a.nbytes for a in q) * 8 == plan.spec_bits(w.size, QuantSpec(bits, group, mode), 16)


def test_group_size_fallback():
    """The issue's case: DeepSeek-V2-Lite's dense down_proj (input 10944 = 64 * 171)."""
    assert fit_group(QuantSpec(4, 128), 10944) == QuantSpec(4, 64)
    assert fit_group(QuantSpec(4, 128), 96) == QuantSpec(4, 32)
    assert fit_group(QuantSpec(4, 64), 256) == QuantSpec(4, 64)  # never coarser than asked
    assert fit_group(QuantSpec(4, 32), 100) is None
    r = make_recipe("uniform", 4, 128)
    assert r.spec_for("model.layers.0.mlp.down_proj", 10944) == QuantSpec(4, 64)


def test_floor_above_the_budget_is_said_and_used():
    lay = _layout({})
    p = plan.plan_mla(lay, QuantSpec(4, 64), 3.0, sensitivity.load_prior())
    assert p.floor_bpw > 3.0
    _check_plan(lay, QuantSpec(4, 64), 3.0, p)


def test_budget_above_the_ceiling_is_said():
    """Every module at 8 bits with its finest group is the most the options allow; a larger
    budget plans exactly that and says so."""
    lay = _layout({})
    p = plan.plan_mla(lay, QuantSpec(4, 64), 20.0, sensitivity.load_prior())
    units, rest = plan.units_of(lay)
    most = sum(plan.spec_bits(n, max((s for s in plan.unit_options(u, 8)), key=lambda s: -s.group_size))
               for u in units.values() for _, n in u.modules)
    most += 16 * sum(rest.values())
    params = sum(u.params for u in units.values()) + sum(rest.values())
    assert p.ceiling_bpw == pytest.approx(most / params, rel=1e-12)
    assert p.planned_bpw <= p.ceiling_bpw + 1e-12
    assert any(n.startswith("--bits-per-weight 20 is more than this model can take") for n in p.notes())
    assert not any("more than this model" in n for n in plan.plan_mla(lay, QuantSpec(4, 64), 4.6,
                                                                      sensitivity.load_prior()).notes())


def test_default_budget_scales_with_the_base():
    assert plan.default_bits_per_weight(QuantSpec(4, 64)) == 4.6
    assert plan.default_bits_per_weight(QuantSpec(3, 64)) == 3.6
    assert plan.default_bits_per_weight(QuantSpec(8, 128)) == 8.35


def test_solve_matches_brute_force():
    """The knapsack's pick has the least summed KL of all picks within the capacity."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        options = [[(int(c), float(k)) for c, k in zip(np.sort(rng.integers(10, 200, 4)),
                                                      np.sort(rng.random(4))[::-1])]
                   for _ in range(5)]
        cap = rng.integers(sum(o[0][0] for o in options), sum(o[-1][0] for o in options))
        picks = plan.solve(options, float(cap))
        best = min(sum(options[u][j][1] for u, j in enumerate(c))
                   for c in itertools.product(range(4), repeat=5)
                   if sum(options[u][j][0] for u, j in enumerate(c)) <= cap)
        assert sum(options[u][j][0] for u, j in enumerate(picks)) <= cap
        assert sum(options[u][j][1] for u, j in enumerate(picks)) == pytest.approx(best)


def test_bands_by_relative_position():
    assert [sensitivity.band_of(i, 4, 1) for i in range(4)] == ["first", "first_moe", "middle", "last"]
    assert [sensitivity.band_of(i, 27, 1) for i in (0, 1, 2, 13, 25, 26)] == [
        "first", "first_moe", "middle", "middle", "middle", "last"]
    assert sensitivity.band_of(0, 60, None) == "first"
    lay = _layout({"num_hidden_layers": 7, "first_k_dense_replace": 2})
    assert plan.model_layers(lay) == (7, 2)


def test_prior_covers_every_class_and_option():
    """Every class (q_a/q_b through their analogues) has a figure at every option a base
    may need, and more bits never measured worse at the same group by more than noise."""
    prior = sensitivity.load_prior()
    from convert.recipes import SUPPORTED_BITS, TENSOR_CLASSES

    for cls in TENSOR_CLASSES:
        curve = prior.curve(cls)
        for g in (32, 64, 128):  # kv_b_proj at 128 estimated (fill_groups)
            ks = [curve[QuantSpec(b, g)] for b in SUPPORTED_BITS]
            assert all(k > 0 for k in ks), cls
            assert ks[0] > 10 * ks[-1], (cls, g)  # 2-bit vs 8-bit
            assert all(more <= fewer for fewer, more in zip(ks, ks[1:])), (cls, g)


def test_fill_groups_estimates_a_missing_group_from_the_others():
    a, b = QuantSpec(4, 64), QuantSpec(4, 128)
    kl = {"x": {a: 1.0, b: 1.2}, "y": {a: 2.0, b: 2.6}, "z": {a: 3.0, b: 3.3}, "kv": {a: 0.5}}
    filled = sensitivity.fill_groups(kl)
    assert filled["kv"][b] == pytest.approx(0.5 * 1.2)  # the median ratio of 1.1, 1.2, 1.3
    assert filled["x"] == kl["x"]
