"""Which DeepSeek-V2 tensors need more bits? Measure it, then pick the `mla` recipe.

Quality metric: KL(reference || quantized) of next-token distributions, averaged over every
position of the held-out corpus (../shared/corpus/shakespeare-heldout.txt, 256-token
windows; ``--corpus`` for another file) on the fixture checkpoint (the package's demo
model: the shared fixture's weights); the reference is the bf16 checkpoint run in float32.
Also top-1 agreement with the reference.

Steps (one run, so every ratio is same-run):
 1. Sensitivity: for each tensor class (recipes.TENSOR_CLASSES) and each (bits, group)
    option, quantize only that class (others float) and measure KL.
 2. Layers: for each class spread over several layers, quantize one layer at a time
    (4-bit, group 64) and split the class's KL per option over its layers in those
    proportions; a unit is a class, or a class in one layer ("attn_o@0").
 3. Choice: per-unit KLs are close to additive at these error levels, so pick one option
    per unit minimising the summed KL under a bits-per-weight budget (exact
    multiple-choice knapsack), then check the pick by measuring it for real.
 4. Table: our converter (uniform, mla) against mlx_lm.convert (-q, and
    --quant-predicate mixed_4_6), each a real converted folder.

Engine: this CPU build of MLX runs the fixture ~25x slower than PyTorch (its CPU matmul
and gather_mm), so forward passes run in transformers' DeepseekV2ForCausalLM (float32).
Quantized weights still come from `mx.quantize` and are expanded with `mx.dequantize`
(scales in float32, as an mlx-lm model cast to float32 computes them); a check at the end
compares against stock mlx_lm.load on one window.

    python -m benchmarks.quant_recipe            # ~15 minutes on 2 cores
Writes benchmarks/results/quant_recipe_sensitivity.csv, quant_recipe_layers.csv,
quant_recipe.csv, quant_recipe.json, quant_recipe.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

from convert import ConvertOptions, convert
from convert import layout, recipes
from convert.source import open_source
from mlx_mla import DEMO_MODEL as FIXTURE

from .common import RESULTS, SHARED_CORPUS, V2_LITE, shared_file
WINDOW = 256
BUDGET_BPW = 4.6
# Options per class in the sensitivity sweep: (bits, group); None = float.
LAYER_OPTION = (4, 64)  # the option the per-layer split is measured at
OPTIONS = [(3, 64), (4, 128), (4, 64), (4, 32), (5, 128), (5, 64), (6, 128), (6, 64), (8, 128), (8, 64), None]


# ---------------------------------------------------------------- weights (mlx-lm layout)
def source_state(folder: Path) -> dict:
    """The source checkpoint in mlx-lm names (experts stacked), as stored (bf16)."""
    src = open_source(str(folder))
    asm = layout.Assembler(src.config["n_routed_experts"])
    state = {}
    for shard in src.shards:
        arrays = shard.load()
        for name in list(arrays):
            for _, key, value in asm.feed(name, arrays.pop(name)):
                state[key] = value
    mx.eval(state)
    return state


def folder_state(folder: Path) -> dict:
    """An mlx-lm folder's weights expanded to float32 (`mx.dequantize`, float32 scales)."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization") or {}
    raw = {}
    for f in sorted(folder.glob("model*.safetensors")):
        raw.update(mx.load(str(f)))
    state = {}
    for name, a in raw.items():
        module, _, part = name.rpartition(".")
        if part in ("scales", "biases"):
            continue
        if f"{module}.scales" in raw:
            spec = quant.get(module) if isinstance(quant.get(module), dict) else quant
            a = mx.dequantize(
                a, raw[f"{module}.scales"].astype(mx.float32), raw[f"{module}.biases"].astype(mx.float32),
                group_size=spec["group_size"], bits=spec["bits"],
            )
        state[name] = a.astype(mx.float32)
    mx.eval(state)
    return state


def unit_key(assignment: dict, module: str):
    """The key of `assignment` that governs a module: "class@layer" if present, else the
    class, else None (as recipes.Recipe.spec_for looks them up)."""
    c = recipes.tensor_class(module)
    u = f"{c}@{recipes.layer_of(module)}"
    return u if u in assignment else (c if c in assignment else None)


def fake_quant(state: dict, lay, assignment: dict) -> dict:
    """`state` with each quantizable module quantized per its unit in `assignment`
    (units absent from it stay float), as the converter would store it."""
    out = {}
    for name, a in state.items():
        module = layout.quantizable_param(lay, name)
        key = unit_key(assignment, module) if module is not None else None
        if key is not None:
            spec = assignment[key]
            if spec is not None and a.shape[-1] % spec[1] == 0:
                w, s, b = mx.quantize(a, group_size=spec[1], bits=spec[0])
                a = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32),
                                  group_size=spec[1], bits=spec[0])
        out[name] = a.astype(mx.float32)
    mx.eval(out)
    return out


def bits_of(shape, spec, in_dim_ok=True) -> float:
    """Stored bits of one weight under a spec (bf16 scale + bias per group)."""
    n = int(np.prod(shape))
    if spec is None or not in_dim_ok:
        return 16.0 * n
    bits, group = spec
    return n * bits + (n // group) * 32


def class_params(lay) -> tuple:
    """({class: [weight shapes]}, bits of the never-quantized rest at bf16, total params)."""
    per_class, rest, total = {}, 0.0, 0
    for name, shape in lay.shapes.items():
        total += int(np.prod(shape))
        module = layout.quantizable_param(lay, name)
        if module is None:
            rest += 16.0 * int(np.prod(shape))
        else:
            per_class.setdefault(recipes.tensor_class(module), []).append(shape)
    return per_class, rest, total


def unit_params(lay, split: set) -> dict:
    """{unit: [weight shapes]}: a class, or "class@layer" for the classes in `split`."""
    units = {}
    for name, shape in lay.shapes.items():
        module = layout.quantizable_param(lay, name)
        if module is not None:
            c = recipes.tensor_class(module)
            units.setdefault(f"{c}@{recipes.layer_of(module)}" if c in split else c, []).append(shape)
    return units


def assignment_bpw(lay, assignment: dict) -> float:
    bits, total = 0.0, 0
    for name, shape in lay.shapes.items():
        total += int(np.prod(shape))
        module = layout.quantizable_param(lay, name)
        key = unit_key(assignment, module) if module is not None else None
        spec = assignment[key] if key is not None else None
        bits += bits_of(shape, spec, spec is None or shape[-1] % spec[1] == 0)
    return bits / total


# ---------------------------------------------------------------- evaluation (PyTorch)
class Evaluator:
    """Runs a state through transformers' float32 DeepSeek-V2 and compares to the reference."""

    def __init__(self, fixture: Path, corpus: Path, max_windows: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(str(fixture), dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(str(fixture))(corpus.read_text())["input_ids"]
        n = len(ids) // WINDOW
        if max_windows:
            n = min(n, max_windows)
        self.windows = torch.tensor(ids[: n * WINDOW]).reshape(n, WINDOW)
        self.ref_logp = None

    def _load(self, state: dict) -> None:
        sd = {}
        for name, a in state.items():
            t = torch.from_numpy(np.array(a.astype(mx.float32)))
            if ".switch_mlp." in name:
                prefix = name.split(".switch_mlp.")[0]
                proj = name.split(".switch_mlp.")[1].split(".")[0]
                sd.setdefault(prefix, {})[proj] = t
                continue
            sd[name] = t
        for prefix in [k for k, v in sd.items() if isinstance(v, dict)]:
            parts = sd.pop(prefix)
            # transformers 5 fuses experts: gate_up_proj (E, 2I, H) = [gate; up], down_proj (E, H, I)
            sd[f"{prefix}.experts.gate_up_proj"] = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=1)
            sd[f"{prefix}.experts.down_proj"] = parts["down_proj"]
        self.model.load_state_dict(sd, strict=True)

    @torch.no_grad()
    def logprobs(self, state: dict, n: int | None = None, batch: int = 8) -> torch.Tensor:
        self._load(state)
        windows = self.windows[:n]
        out = [torch.log_softmax(self.model(windows[i : i + batch]).logits.float(), -1)
               for i in range(0, len(windows), batch)]
        return torch.cat(out)  # (windows, WINDOW, vocab)

    def set_reference(self, state: dict) -> None:
        self.ref_logp = self.logprobs(state)

    def measure(self, state: dict, n: int | None = None) -> dict:
        """{'kl': mean KL(ref || q) in nats, 'top1': agreement of argmaxes} over the
        first `n` windows (all by default)."""
        q = self.logprobs(state, n)
        p = self.ref_logp[: len(q)]
        kl = (p.exp() * (p - q)).sum(-1).mean().item()
        top1 = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
        return {"kl": kl, "top1": top1}


# ---------------------------------------------------------------- choosing the recipe
def knapsack(sens: dict, costs: dict, budget_bits: float, unit: float = 256.0) -> dict:
    """Pick one option per class minimising sum KL with sum cost <= budget.

    sens[c][opt] = KL, costs[c][opt] = bits. Exact dynamic programme over costs in
    `unit`-bit steps (rounded up, so the budget is never exceeded).
    """
    classes = list(sens)
    cap = int(budget_bits // unit)
    best = {0: (0.0, {})}  # cost units -> (kl, choice)
    for c in classes:
        nxt = {}
        for used, (kl, choice) in best.items():
            for opt, k in sens[c].items():
                u = used + int(np.ceil(costs[c][opt] / unit))
                if u > cap:
                    continue
                cand = (kl + k, {**choice, c: opt})
                if u not in nxt or cand[0] < nxt[u][0]:
                    nxt[u] = cand
        # keep only the Pareto front: more bits must buy less KL
        front, best_kl = {}, float("inf")
        for u in sorted(nxt):
            if nxt[u][0] < best_kl:
                front[u], best_kl = nxt[u], nxt[u][0]
        best = front
    return min(best.values(), key=lambda t: t[0])[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-windows", type=int, default=None, help="limit the corpus (quick runs)")
    ap.add_argument("--sweep-windows", type=int, default=24,
                    help="windows for the per-class sweep (the final table uses all)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--corpus", type=Path, default=SHARED_CORPUS,
                    help="held-out text (default: ../shared/corpus/shakespeare-heldout.txt)")
    args = ap.parse_args()
    corpus = shared_file(args.corpus, "the held-out text the KL is measured on")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    src = source_state(FIXTURE)
    lay = layout.Layout.for_config(json.loads((FIXTURE / "config.json").read_text()))
    ev = Evaluator(FIXTURE, corpus, args.max_windows)
    ev.set_reference({k: v.astype(mx.float32) for k, v in src.items()})
    n_tok = ev.windows.numel()
    print(f"[quant_recipe] {n_tok} held-out tokens in {len(ev.windows)} windows")

    # 1. sensitivity
    per_class, _, total = class_params(lay)
    sens, costs, rows = {}, {}, []
    for c in recipes.TENSOR_CLASSES:
        if c not in per_class:
            continue
        sens[c], costs[c] = {}, {}
        n = sum(int(np.prod(s)) for s in per_class[c])
        for opt in OPTIONS:
            ok = opt is None or all(s[-1] % opt[1] == 0 for s in per_class[c])
            cost = sum(bits_of(s, opt, ok) for s in per_class[c])
            if not ok:
                continue  # mx.quantize cannot group it: the converter keeps it float
            m = {"kl": 0.0, "top1": 1.0} if opt is None else ev.measure(fake_quant(src, lay, {c: opt}), args.sweep_windows)
            sens[c][opt], costs[c][opt] = m["kl"], cost
            label = "float" if opt is None else f"{opt[0]}b/g{opt[1]}"
            rows.append({"class": c, "params": n, "share": n / total, "option": label,
                         "class_bpw": cost / n, "kl": m["kl"], "top1": m["top1"]})
            print(f"  {c:16s} {label:8s} kl={m['kl']:.4f} top1={m['top1']:.3f}", flush=True)
    with open(args.out / "quant_recipe_sensitivity.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    # 2. per-layer split: one layer of a class at a time, at LAYER_OPTION
    layers_of = {}
    for name in lay.shapes:
        module = layout.quantizable_param(lay, name)
        if module is not None and recipes.layer_of(module) is not None:
            layers_of.setdefault(recipes.tensor_class(module), set()).add(recipes.layer_of(module))
    split = {c for c, ls in layers_of.items() if len(ls) > 1 and c in sens}
    units = unit_params(lay, split)
    layer_kl, layer_rows = {}, []
    for u in units:
        if "@" in u:
            m = ev.measure(fake_quant(src, lay, {u: LAYER_OPTION}), args.sweep_windows)
            layer_kl[u] = m["kl"]
            print(f"  {u:18s} {LAYER_OPTION[0]}b/g{LAYER_OPTION[1]} kl={m['kl']:.4f}", flush=True)
    u_sens, u_costs = {}, {}
    for u, shapes in units.items():
        c = u.split("@")[0]
        share = layer_kl[u] / sum(k for v, k in layer_kl.items() if v.split("@")[0] == c) if "@" in u else 1.0
        if "@" in u:
            layer_rows.append({"unit": u, "params": sum(int(np.prod(s)) for s in shapes),
                               "option": f"{LAYER_OPTION[0]}b/g{LAYER_OPTION[1]}",
                               "kl": layer_kl[u], "share_of_class": share})
        u_sens[u] = {o: k * share for o, k in sens[c].items()}
        u_costs[u] = {o: sum(bits_of(s, o, o is None or s[-1] % o[1] == 0) for s in shapes) for o in sens[c]}
    with open(args.out / "quant_recipe_layers.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(layer_rows[0]))
        w.writeheader()
        w.writerows(layer_rows)

    # 3. choice under the budget (bits of never-quantized tensors come off the top)
    _, rest, _ = class_params(lay)
    # Design rules: no class below the base 4 bits (a 3-bit bulk is what --q-bits 3 is
    # for); kv_b_proj at >= 8 bits, since mlx_mla splits it into the absorbed W_UK / W_UV
    # whose error every head's scores and outputs inherit (see the strategies section).
    def allowed(sens_, unit_):
        low = 8 if unit_.split("@")[0] == "attn_kv_b" else 4
        return {o: k for o, k in sens_.items() if o is None or o[0] >= low}

    class_choice = knapsack({c: allowed(o, c) for c, o in sens.items()}, costs, BUDGET_BPW * total - rest, unit=64)
    class_checked = ev.measure(fake_quant(src, lay, class_choice), args.sweep_windows)
    choice = knapsack({u: allowed(o, u) for u, o in u_sens.items()}, u_costs, BUDGET_BPW * total - rest, unit=64)
    print("[quant_recipe] knapsack choice:", choice)
    predicted = sum(u_sens[c][o] for c, o in choice.items())
    checked = ev.measure(fake_quant(src, lay, choice), args.sweep_windows)
    uniform = ev.measure(fake_quant(src, lay, {c: (4, 64) for c in sens}), args.sweep_windows)
    print(f"  predicted KL {predicted:.4f}, measured {checked['kl']:.4f} "
          f"(uniform 4-bit {uniform['kl']:.4f}), bpw {assignment_bpw(lay, choice):.3f}; "
          f"per-class only: {class_checked['kl']:.4f}")
    base_cfg = {c: (4, 64) for c in recipes.TENSOR_CLASSES}
    table_cfg = {**base_cfg, **{u: (s.bits, s.group_size) if s else None
                                for u, s in recipes.make_recipe("mla", 4, 64).overrides.items()}}
    same = all(fake_spec == table_cfg[unit_key(table_cfg, m)] for m, fake_spec in
               ((layout.quantizable_param(lay, n), choice[unit_key(choice, layout.quantizable_param(lay, n))])
                for n in lay.shapes if layout.quantizable_param(lay, n) is not None))
    print(f"[quant_recipe] recipes.MLA_TABLE {'matches' if same else 'DIFFERS FROM'} this choice")

    # 4. real folders: ours and mlx-lm's
    from mlx_lm.convert import convert as mlx_lm_convert

    table = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = {
            "mlx-lm -q (uniform 4-bit, g64)": lambda p: mlx_lm_convert(str(FIXTURE), str(p), quantize=True, q_bits=4, q_group_size=64),
            "mlx-lm mixed_4_6": lambda p: mlx_lm_convert(str(FIXTURE), str(p), quantize=True, q_bits=4, q_group_size=64, quant_predicate="mixed_4_6"),
            "ours uniform (4-bit, g64)": lambda p: convert(ConvertOptions(str(FIXTURE), str(p), quantize=True, quant_recipe="uniform", progress=False)),
            "ours mla (4-bit base, g64)": lambda p: convert(ConvertOptions(str(FIXTURE), str(p), quantize=True, quant_recipe="mla", progress=False)),
        }
        lite = layout.Layout.for_config(V2_LITE)
        for label, run in runs.items():
            path = tmp / label.split()[0] / label.replace(" ", "_").replace("/", "")
            run(path)
            index = json.loads((path / "model.safetensors.index.json").read_text())["metadata"]
            bpw = index["total_size"] * 8 / index["total_parameters"]
            m = ev.measure(folder_state(path))
            table.append({"method": label, "bpw": bpw, "kl": m["kl"], "top1": m["top1"]})
            print(f"  {label:32s} bpw={bpw:.3f} kl={m['kl']:.4f} top1={m['top1']:.3f}", flush=True)
        uni = table[0]["kl"]
        for r in table:
            r["kl_vs_mlx_lm_uniform"] = r["kl"] / uni
        mla_choice = {c: (s.bits, s.group_size) if s else None
                      for c, s in recipes.make_recipe("mla", 4, 64).overrides.items()}
        base = {c: (4, 64) for c in recipes.TENSOR_CLASSES}
        lite_bpw = assignment_bpw(lite, {**base, **mla_choice})
        print(f"[quant_recipe] mla recipe on DeepSeek-V2-Lite shapes: {lite_bpw:.3f} bpw "
              f"(uniform 4-bit: {assignment_bpw(lite, base):.3f})")

        # engine check: stock mlx_lm (float32) vs our PyTorch evaluation, one window
        from mlx.utils import tree_map
        from mlx_lm import load as mlx_lm_load

        path = tmp / "mlx-lm" / "mlx-lm_-q_(uniform_4-bit,_g64)"
        model, _ = mlx_lm_load(str(path))
        model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                              model.parameters()))
        x = ev.windows[:1]
        logits = model(mx.array(x.numpy())).astype(mx.float32)
        ml = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        ev.model.eval()
        ev._load(folder_state(path))
        with torch.no_grad():
            tl = torch.log_softmax(ev.model(x).logits, -1).numpy()
        diff = float(np.abs(ml - tl).max())
        print(f"[quant_recipe] engine check: max |logp mlx_lm - torch| on one window = {diff:.2e}")

    with open(args.out / "quant_recipe.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    meta = {"tokens": n_tok, "window": WINDOW, "sweep_windows": args.sweep_windows,
            "knapsack_choice": {c: o for c, o in choice.items()},
            "mla_table_matches_choice": same,
            "per_class_knapsack_choice": class_choice, "per_class_measured_kl": class_checked["kl"],
            "knapsack_predicted_kl": predicted, "knapsack_measured_kl": checked["kl"],
            "uniform_fake_quant_kl": uniform["kl"],
            "mla_on_v2_lite_bpw": lite_bpw, "uniform_on_v2_lite_bpw": assignment_bpw(lite, base),
            "engine_check_max_abs_logp_diff": diff, "seconds": time.time() - t0}
    (args.out / "quant_recipe.json").write_text(json.dumps(meta, indent=2, default=str))
    plot(rows, table, args.out / "quant_recipe.png")


def plot(rows, table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    classes = list(dict.fromkeys(r["class"] for r in rows))
    opts = [o for o in dict.fromkeys(r["option"] for r in rows) if o != "float"]
    width = 0.8 / len(opts)
    for i, o in enumerate(opts):
        ks = [next((r["kl"] for r in rows if r["class"] == c and r["option"] == o), np.nan) for c in classes]
        a.bar(np.arange(len(classes)) + i * width, ks, width, label=o)
    a.set_xticks(np.arange(len(classes)) + 0.4, classes, rotation=45, ha="right")
    a.set_yscale("log")
    a.set_ylabel("KL(ref || q), only this class quantized")
    a.legend(fontsize=7, ncol=2)
    a.set_title("Sensitivity per tensor class")
    for r in table:
        b.scatter(r["bpw"], r["kl"], s=40)
        b.annotate(r["method"], (r["bpw"], r["kl"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    b.set_xlabel("bits per weight")
    b.set_ylabel("KL(ref || q)")
    b.set_title("Whole-model quantization, tiny-dsv2-lite-shakespeare")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
