"""Which DeepSeek-V2 tensors need more bits? Measure it (the `mla` recipe's prior), then check
the recipe on the fixture and on a second trained checkpoint against mlx_lm.convert.

Quality metric: KL(reference || quantized) of next-token distributions, nats per position,
averaged over 256-token windows of held-out text; the reference is the bf16 checkpoint run
in float32. Also top-1 agreement with the reference.

``--model fixture`` (default; the shared fixture = the package's demo model, Shakespeare):
 1. Sensitivity: for each tensor class and each (bits, group) option, quantize only that
    class (every layer; the others float) and measure KL on the first --sweep-windows.
 2. Bands: for each class spread over several position bands (first layer, first MoE
    layer, middle, last), quantize one band's layers at 4-bit/group 64 and turn the KLs
    into per-layer weights. Steps 1-2 are the prior, written to convert/mla_prior.json.
 3. Choice: convert.plan solves the recipe on the fixture's shapes under the budget; its
    predicted (summed) KL is compared with the KL measured with all choices together.
 4. Folders: our converter (uniform; mla with the prior; mla with --calibration-file) and
    mlx_lm.convert (-q; --quant-predicate mixed_4_6), each a real converted folder, over
    every evaluation window.
``--model code`` (benchmarks/train_code_checkpoint.py: q_lora_rank, group-limited routing,
hidden 192, 6 layers, Python source): step 4, plus per-layer KLs (each class quantized one
layer at a time) that show whether the fixture's position rules hold on another model.

Engine: this CPU build of MLX runs these models ~15x slower than PyTorch, so forward passes
run in transformers' DeepseekV2ForCausalLM (float32). Quantized weights still come from
`mx.quantize` and are expanded with `mx.dequantize` (float32 scales, as an mlx-lm model cast
to float32 computes them); a check compares against stock mlx_lm.load on one window.
(--calibration-file itself runs in MLX, inside the converter.)

    python -m benchmarks.quant_recipe                 # fixture, ~25 minutes on 2 cores
    python -m benchmarks.quant_recipe --model code    # after train_code_checkpoint, ~15 minutes
    python -m benchmarks.quant_recipe --steps 3,4     # keep the prior, re-check the recipe
Writes benchmarks/results/quant_recipe_{sensitivity,bands}.csv, quant_recipe.{csv,json,png}
(fixture), quant_recipe_code{,_layers}.csv, quant_recipe_code.json (code), and
convert/mla_prior.json (fixture).
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

from convert import ConvertOptions, convert, layout, plan, sensitivity
from convert.recipes import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantSpec
from convert.source import open_source
from mlx_mla import DEMO_MODEL as FIXTURE

from .common import RESULTS, SHARED_CORPUS, machine_info, shared_file, write_csv, summary

WINDOW = 256
BASE = QuantSpec(4, 64)
BAND_OPTION = QuantSpec(4, 64)  # the option the band split is measured at
CALIBRATION_CHARS = 16_000  # fixture: the corpus's last 16 KB calibrate, the rest evaluates


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


def fake_quant(state: dict, modules: dict) -> dict:
    """`state` in float32 with each module of `modules` ({path: QuantSpec}) quantized and
    expanded again, as the converter would store it and a float32 model would compute it."""
    out = {}
    for name, a in state.items():
        spec = modules.get(name.rpartition(".")[0]) if name.endswith(".weight") else None
        if spec is not None:
            w, s, b = mx.quantize(a, group_size=spec.group_size, bits=spec.bits)
            a = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32),
                              group_size=spec.group_size, bits=spec.bits)
        out[name] = a.astype(mx.float32)
    mx.eval(out)
    return out


def class_units(lay) -> dict:
    """{class: [Unit]} of a Layout (convert.plan's units)."""
    units, _ = plan.units_of(lay)
    out = {}
    for u in units.values():
        out.setdefault(u.cls, []).append(u)
    return out


def modules_of(units, spec) -> dict:
    return {m: spec for u in units for m, _ in u.modules}


# ---------------------------------------------------------------- evaluation (PyTorch)
class Evaluator:
    """Runs a state through transformers' float32 DeepSeek-V2 and compares to the reference."""

    def __init__(self, model_dir: Path, text: str, max_windows: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"]
        n = len(ids) // WINDOW
        if max_windows:
            n = min(n, max_windows)
        self.windows = torch.tensor(ids[: n * WINDOW]).reshape(n, WINDOW)
        self.ref_logp = None

    def _load(self, state: dict) -> None:
        sd, experts = {}, {}
        for name, a in state.items():
            t = torch.from_numpy(np.array(a.astype(mx.float32)))
            if ".switch_mlp." in name:
                prefix, rest = name.split(".switch_mlp.")
                experts.setdefault(prefix, {})[rest.split(".")[0]] = t
            else:
                sd[name] = t
        for prefix, parts in experts.items():
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


# ---------------------------------------------------------------- 1. sensitivity
def all_options(in_dim: int, bits=SUPPORTED_BITS, groups=SUPPORTED_GROUP_SIZES) -> list:
    return [QuantSpec(b, g) for b in bits for g in groups if in_dim % g == 0]


def measure_sensitivity(ev, state, lay, windows: int, bits=SUPPORTED_BITS,
                        groups=SUPPORTED_GROUP_SIZES) -> tuple:
    """Each class alone at every option (`bits` x the `groups` its input dim takes):
    ({class: {QuantSpec: KL}}, CSV rows)."""
    per_class = class_units(lay)
    total = sum(int(np.prod(s)) for s in lay.shapes.values())
    kl, rows = {}, []
    for cls, units in per_class.items():
        n = sum(u.params for u in units)
        kl[cls] = {}
        for opt in all_options(units[0].in_dim, bits, groups):
            m = ev.measure(fake_quant(state, modules_of(units, opt)), windows)
            kl[cls][opt] = m["kl"]
            stored = sum(plan.spec_bits(p, opt) for u in units for _, p in u.modules)
            rows.append({"class": cls, "params": n, "share": n / total,
                         "option": sensitivity.option_key(opt), "class_bpw": stored / n,
                         "kl": m["kl"], "top1": m["top1"]})
            print(f"  {cls:16s} {sensitivity.option_key(opt):6s} kl={m['kl']:.5f} top1={m['top1']:.3f}", flush=True)
    return kl, rows


# ---------------------------------------------------------------- 2. bands
def measure_bands(ev, state, lay, windows: int) -> tuple:
    """Each class's layers one position band at a time, at BAND_OPTION:
    ({class: {band: per-layer weight, mean 1 over the class's layers}}, CSV rows)."""
    n_layers, first_moe = plan.model_layers(lay)
    bands, rows = {}, []
    for cls, units in class_units(lay).items():
        by_band = {}
        for u in units:
            if u.layer is not None:
                by_band.setdefault(sensitivity.band_of(u.layer, n_layers, first_moe), []).append(u)
        if len(by_band) < 2:
            continue
        per = {}
        for band, us in by_band.items():
            m = ev.measure(fake_quant(state, modules_of(us, BAND_OPTION)), windows)
            per[band] = (m["kl"], len(us))
            print(f"  {cls:16s} {band:9s} kl={m['kl']:.5f}", flush=True)
        mean = sum(k for k, _ in per.values()) / sum(n for _, n in per.values())
        bands[cls] = {b: (k / n) / mean for b, (k, n) in per.items()}
        rows += [{"class": cls, "band": b, "layers": n, "option": sensitivity.option_key(BAND_OPTION),
                  "kl": k, "layer_weight": bands[cls][b]} for b, (k, n) in per.items()]
    return bands, rows


def measure_layers(ev, state, lay, windows: int) -> list:
    """Each class quantized one layer at a time at BAND_OPTION (the evidence for position
    rules on a deeper model): CSV rows with each layer's share of the class's summed KL."""
    n_layers, first_moe = plan.model_layers(lay)
    rows = []
    for cls, units in class_units(lay).items():
        if len(units) < 2:
            continue
        got = [(u, ev.measure(fake_quant(state, modules_of([u], BAND_OPTION)), windows)["kl"]) for u in units]
        total = sum(k for _, k in got)
        for u, k in got:
            rows.append({"class": cls, "layer": u.layer, "band": sensitivity.band_of(u.layer, n_layers, first_moe),
                         "kl": k, "share_of_class": k / total, "layer_weight": k * len(units) / total})
            print(f"  {u.name:20s} kl={k:.5f} weight={k * len(units) / total:.2f}", flush=True)
    return rows


# ---------------------------------------------------------------- 3. the plan's prediction
def check_plan(ev, state, lay, prior, budget: float, windows: int, min_bits: int | None = None) -> dict:
    """The plan convert.plan solves on this model vs its measured KL, and uniform 4-bit."""
    p = plan.plan_mla(lay, BASE, budget, prior, min_bits=min_bits)
    units, _ = plan.units_of(lay)
    chosen = {m: p.units[k] for k, u in units.items() for m, _ in u.modules if p.units[k] is not None}
    measured = ev.measure(fake_quant(state, chosen), windows)
    uniform = ev.measure(fake_quant(state, {m: BASE for u in units.values() for m, _ in u.modules}), windows)
    print(f"  plan (min bits {min_bits or BASE.bits}): {p.planned_bpw:.3f} bpw, predicted KL {p.predicted_kl:.4f}, measured {measured['kl']:.4f} "
          f"(uniform 4-bit/g64 {uniform['kl']:.4f})", flush=True)
    return {"planned_bpw": p.planned_bpw, "predicted_kl": p.predicted_kl, "measured_kl": measured["kl"],
            "uniform_kl": uniform["kl"], "units": {k: sensitivity.option_key(s) for k, s in p.units.items() if s}}


# ---------------------------------------------------------------- 4. real folders
def converters(model_dir: Path, calibration: Path, budget: float | None, with_mixed: bool) -> dict:
    """{label: function(output path)}: mlx-lm's converter and ours, each writing a folder."""
    from mlx_lm.convert import convert as mlx_lm_convert

    def ours(**kw):
        return lambda p: convert(ConvertOptions(str(model_dir), str(p), quantize=True, progress=False, **kw))

    runs = {"mlx-lm -q (uniform 4-bit, g64)":
            lambda p: mlx_lm_convert(str(model_dir), str(p), quantize=True, q_bits=4, q_group_size=64)}
    if with_mixed:
        runs["mlx-lm mixed_4_6"] = lambda p: mlx_lm_convert(
            str(model_dir), str(p), quantize=True, q_bits=4, q_group_size=64, quant_predicate="mixed_4_6")
    runs["ours uniform (4-bit, g64)"] = ours(quant_recipe="uniform")
    for min_bits in (3, 4):  # 3 is the default for --q-bits 4
        runs[f"ours mla (prior, --min-bits {min_bits})"] = ours(bits_per_weight=budget, min_bits=min_bits)
        runs[f"ours mla (--calibration-file, --min-bits {min_bits})"] = ours(
            bits_per_weight=budget, min_bits=min_bits, calibration_file=str(calibration))
    return runs


def measure_folders(ev, runs: dict, tmp: Path) -> tuple:
    """Each converter's folder over every evaluation window: (rows, {label: folder})."""
    table, folders = [], {}
    for i, (label, run) in enumerate(runs.items()):
        path = tmp / f"run{i}"
        t0 = time.time()
        report = run(path)
        seconds = time.time() - t0
        index = json.loads((path / "model.safetensors.index.json").read_text())["metadata"]
        bpw = index["total_size"] * 8 / index["total_parameters"]
        m = ev.measure(folder_state(path))
        row = {"method": label, "bpw": bpw, "kl": m["kl"], "top1": m["top1"], "convert_seconds": seconds}
        if report is not None and getattr(report, "calibration", None):
            row["calibration"] = "\n".join(report.calibration)
        table.append(row)
        folders[label] = path
        print(f"  {label:32s} bpw={bpw:.3f} kl={m['kl']:.4f} top1={m['top1']:.3f} ({seconds:.0f} s)", flush=True)
    for r in table:
        r["kl_vs_mlx_lm_q"] = r["kl"] / table[0]["kl"]
    return table, folders


def engine_check(ev, folder: Path) -> float:
    """max |log p| difference between stock mlx_lm.load (float32) and our PyTorch
    evaluation of the same folder, on one window."""
    from mlx.utils import tree_map
    from mlx_lm import load as mlx_lm_load

    model, _ = mlx_lm_load(str(folder))
    model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))
    x = ev.windows[:1]
    logits = model(mx.array(x.numpy())).astype(mx.float32)
    ml = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    ev._load(folder_state(folder))
    with torch.no_grad():
        tl = torch.log_softmax(ev.model(x).logits, -1).numpy()
    return float(np.abs(ml - tl).max())


# ---------------------------------------------------------------- runs
def _update_json(path: Path, values: dict) -> None:
    """Merge `values` into the JSON results file at `path` (steps not run keep theirs)."""
    meta = json.loads(path.read_text()) if path.is_file() else {}
    meta.update(values)
    path.write_text(json.dumps(meta, indent=2))


def _folders_step(ev, model_dir: Path, calibration_text: str, with_mixed: bool) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        calib = Path(tmp) / "calibration.txt"
        calib.write_text(calibration_text)
        table, folders = measure_folders(ev, converters(model_dir, calib, None, with_mixed), Path(tmp))
        diff = engine_check(ev, folders["mlx-lm -q (uniform 4-bit, g64)"])
    print(f"[quant_recipe] engine check: max |logp mlx_lm - torch| on one window = {diff:.2e}")
    calibration = {r["method"]: r.pop("calibration") for r in table if "calibration" in r}
    return table, {"calibration_tables": calibration, "engine_check_max_abs_logp_diff": diff}


def run_fixture(args) -> None:
    corpus = shared_file(args.corpus, "the held-out text the KL is measured on").read_text()
    text, calib_text = corpus[:-CALIBRATION_CHARS], corpus[-CALIBRATION_CHARS:]
    lay = layout.Layout.for_config(json.loads((FIXTURE / "config.json").read_text()))
    state = source_state(FIXTURE)
    ev = Evaluator(FIXTURE, text, args.max_windows)
    ev.set_reference({k: v.astype(mx.float32) for k, v in state.items()})
    print(f"[quant_recipe] fixture: {ev.windows.numel()} held-out tokens in {len(ev.windows)} windows")
    t0, meta = time.time(), {"model": "tiny-dsv2-lite-shakespeare", "tokens": ev.windows.numel(), "window": WINDOW}
    if {1, 2} & args.steps:
        print("[quant_recipe] 1. sensitivity per class and option")
        kl, sens_rows = measure_sensitivity(ev, state, lay, args.sweep_windows)
        write_csv(sens_rows, args.out / "quant_recipe_sensitivity.csv")
        print("[quant_recipe] 2. bands")
        bands, band_rows = measure_bands(ev, state, lay, args.sweep_windows)
        write_csv(band_rows, args.out / "quant_recipe_bands.csv")
        prior = sensitivity.Sensitivity(
            f"built-in prior (tiny-dsv2-lite-shakespeare, {args.sweep_windows} windows of {WINDOW} tokens)",
            kl, bands)
        sensitivity.PRIOR_FILE.write_text(json.dumps(prior.to_json(), indent=1) + "\n")
        meta["sweep_windows"] = args.sweep_windows
    budget = plan.default_bits_per_weight(BASE)
    if 3 in args.steps:
        print("[quant_recipe] 3. the plan on the fixture's shapes")
        prior = sensitivity.load_prior()  # as the converter reads it
        meta["plan_check"] = {f"min_bits_{b}": check_plan(ev, state, lay, prior, budget, args.sweep_windows, b)
                              for b in (4, 3)}
    if 4 in args.steps:
        print("[quant_recipe] 4. converted folders, every window")
        table, extra = _folders_step(ev, FIXTURE, calib_text, with_mixed=True)
        write_csv(table, args.out / "quant_recipe.csv")
        meta.update(extra)
        with open(args.out / "quant_recipe_sensitivity.csv") as f:
            sens_rows = [{**r, "kl": float(r["kl"])} for r in csv.DictReader(f)]
        plot(sens_rows, table, args.out / "quant_recipe.png")
    _update_json(args.out / "quant_recipe.json", {**meta, "budget_bpw": budget, "seconds": time.time() - t0,
                                                   **machine_info()})


def run_code(args) -> None:
    from .train_code_checkpoint import CALIBRATION, HELDOUT, ensure_checkpoint, weights_digest

    model_dir = ensure_checkpoint()
    lay = layout.Layout.for_config(json.loads((model_dir / "config.json").read_text()))
    state = source_state(model_dir)
    ev = Evaluator(model_dir, HELDOUT.read_text(), args.max_windows or 64)
    ev.set_reference({k: v.astype(mx.float32) for k, v in state.items()})
    print(f"[quant_recipe] code: {ev.windows.numel()} held-out tokens in {len(ev.windows)} windows")
    t0 = time.time()
    meta = {"model": model_dir.name, "weights_sha256": weights_digest(model_dir), "tokens": ev.windows.numel(),
            "window": WINDOW}
    if 2 in args.steps:
        print("[quant_recipe] 2. per-layer KL, one layer of a class at a time")
        write_csv(measure_layers(ev, state, lay, args.sweep_windows), args.out / "quant_recipe_code_layers.csv")
        meta["layer_windows"] = args.sweep_windows
    budget = plan.default_bits_per_weight(BASE)
    if 3 in args.steps:
        print("[quant_recipe] 3. the plan's prediction")
        prior = sensitivity.load_prior()
        meta["plan_check"] = {f"min_bits_{b}": check_plan(ev, state, lay, prior, budget, args.sweep_windows, b)
                              for b in (4, 3)}
    if 4 in args.steps:
        print("[quant_recipe] 4. converted folders, every window")
        table, extra = _folders_step(ev, model_dir, CALIBRATION.read_text(), with_mixed=False)
        write_csv(table, args.out / "quant_recipe_code.csv")
        meta.update(extra)
    _update_json(args.out / "quant_recipe_code.json", {**meta, "budget_bpw": budget, "seconds": time.time() - t0,
                                                        **machine_info()})


def plot(rows, table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    classes = list(dict.fromkeys(r["class"] for r in rows))
    opts = [o for o in dict.fromkeys(r["option"] for r in rows) if o.split("/")[0] in ("3", "4", "5", "6", "8")
            and o.endswith("/64")]
    width = 0.8 / len(opts)
    for i, o in enumerate(opts):
        ks = [next((r["kl"] for r in rows if r["class"] == c and r["option"] == o), np.nan) for c in classes]
        a.bar(np.arange(len(classes)) + i * width, ks, width, label=f"{o.split('/')[0]}-bit, group 64")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--model", choices=("fixture", "code"), default="fixture")
    ap.add_argument("--max-windows", type=int, default=None, help="limit the evaluation text (quick runs)")
    ap.add_argument("--sweep-windows", type=int, default=24,
                    help="windows for the per-class and per-band sweeps (the folders use all)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder for the results (default: benchmarks/results)")
    ap.add_argument("--corpus", type=Path, default=SHARED_CORPUS,
                    help="fixture: held-out text (default: ../shared/corpus/shakespeare-heldout.txt)")
    ap.add_argument("--steps", default="1,2,3,4",
                    help="steps to run (fixture: 1-2 remake the prior, 3 the plan's prediction, 4 the "
                    "folders; code: 2 per-layer KLs, 3, 4); results of steps not run are kept")
    args = ap.parse_args()
    args.steps = {int(x) for x in args.steps.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    (run_code if args.model == "code" else run_fixture)(args)


if __name__ == "__main__":
    main()
