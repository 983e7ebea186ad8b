"""What the `mla` recipe plans for the released DeepSeek-V2 models, from their shapes alone.

For each config in benchmarks.common.MODEL_CONFIGS (no weights needed: convert.layout
builds mlx-lm's model lazily for the shapes), the default budget with a 4-bit, group-64
base and bf16 scales: the planned bits per weight, the floor, the parameters left float
besides norms and router gates, our uniform recipe, and mlx_lm.convert -q (uniform, a
module whose input dim 64 does not divide left float), plus each class's choices.

    python -m benchmarks.quant_shapes      # seconds
Writes benchmarks/results/quant_shapes.csv and quant_shapes_classes.csv.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from convert import layout, plan, sensitivity
from convert.recipes import TENSOR_CLASSES, QuantSpec

from .common import MODEL_CONFIGS, RESULTS, write_csv, summary

BASE = QuantSpec(4, 64)


def mlx_lm_q_bpw(lay) -> float:
    """mlx_lm.convert -q's bits per weight on these shapes: the base where its group
    divides the input dim, else float (mlx-lm's quantization predicate)."""
    units, rest = plan.units_of(lay)
    bits = sum(16 * n for n in rest.values())
    params = sum(rest.values())
    for u in units.values():
        spec = BASE if u.in_dim % BASE.group_size == 0 else None
        bits += sum(plan.spec_bits(n, spec) for _, n in u.modules)
        params += u.params
    return bits / params


def shape_rows(prior) -> tuple:
    """(one row per model, one row per model and class with its options and layer counts)."""
    rows, class_rows = [], []
    for name, config in MODEL_CONFIGS.items():
        lay = layout.Layout.for_config(config)
        budget = plan.default_bits_per_weight(BASE)
        p = plan.plan_mla(lay, BASE, budget, prior)
        units, rest = plan.units_of(lay)
        float_left = sum(u.params for k, u in units.items() if p.units[k] is None)
        rows.append({
            "model": name, "params": sum(u.params for u in units.values()) + sum(rest.values()),
            "layers": config["num_hidden_layers"], "budget": budget, "mla_bpw": p.planned_bpw,
            "floor_bpw": p.floor_bpw, "float_params_left": float_left,
            "uniform_bpw": plan.plan_uniform(lay, BASE).planned_bpw, "mlx_lm_q_bpw": mlx_lm_q_bpw(lay),
        })
        counts = Counter((units[k].cls, sensitivity.option_key(s) if s else "float") for k, s in p.units.items())
        for cls in TENSOR_CLASSES:
            opts = {o: n for (c, o), n in counts.items() if c == cls}
            if opts:
                class_rows.append({"model": name, "class": cls,
                                   "choice": "; ".join(f"{o} x{n}" for o, n in sorted(opts.items()))})
    return rows, class_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder for the results (default: benchmarks/results)")
    args = ap.parse_args()
    rows, class_rows = shape_rows(sensitivity.load_prior())
    write_csv(rows, args.out / "quant_shapes.csv")
    write_csv(class_rows, args.out / "quant_shapes_classes.csv")
    print("| model | parameters | layers | mla bits/weight (budget 4.6) | floor | float left | uniform | mlx_lm.convert -q |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e9:.1f}B | {r['layers']} | **{r['mla_bpw']:.3f}** | "
              f"{r['floor_bpw']:.3f} | {r['float_params_left']} | {r['uniform_bpw']:.3f} | {r['mlx_lm_q_bpw']:.3f} |")


if __name__ == "__main__":
    main()
