"""How close is each MLA strategy to stock mlx-lm on every folder the converter writes?

For each folder converted from the demo checkpoint (``python -m convert -q``): affine at
2, 3, 4, 6 and 8 bits with both recipes (`mla`, `uniform`), and MLX's floating-point
modes mxfp4, mxfp8 and nvfp4 (`--q-mode`, byte-identical to ``mlx_lm.convert --q-mode``):
exactly what ``python -m mlx_mla.compare`` measures (``mlx_mla.compare.measure`` and
``judge``), in float32: mlx-lm's greedy continuation of the prompt, then both engines
teacher-forced over prompt + continuation; per strategy max |Δlogit|, mean KL(mlx-lm ‖
mlx_mla) and greedy agreement.

``absorb-materialized`` precomputes W_UQ·W_UKᵀ and W_O·W_UV; it is measured with them
stored each way in ``DERIVED`` (``absorb_materialized.DERIVED_QUANTIZATION``): float (the
choice), 8-bit at groups 32, 64 and 128, 4-bit/group 64, and at the folder's own base
quantization (bits, group, mode) — for a `uniform` folder exactly the earlier rule
"quantized like the projections they replace".

    python -m benchmarks.compare_quantized          # ~1.5 minutes on 2 cores
Writes benchmarks/results/compare_quantized.csv and compare_quantized.png; prints the
README's table.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path


from convert import ConvertOptions, convert
from mlx_mla import DEMO_MODEL
from mlx_mla import load as mla_load
from mlx_mla.attention.strategies import absorb_materialized
from mlx_mla.compare import greedy_run, judge, load_peer, teacher_forced_logits, threshold_for
from mlx_mla.loader import load_tokenizer, open_folder

from .common import RESULTS, machine_info, write_csv, summary

# (label, ConvertOptions fields) of every folder measured.
FOLDERS = [(f"{recipe} {bits}-bit", dict(q_bits=bits, quant_recipe=recipe))
           for recipe in ("mla", "uniform") for bits in (2, 3, 4, 6, 8)]
FOLDERS += [(mode, dict(q_mode=mode)) for mode in ("mxfp4", "mxfp8", "nvfp4")]
# How absorb-materialized's derived matrices are stored: label -> DERIVED_QUANTIZATION
# value (None = float; "folder" = the folder's base quantization).
DERIVED = {
    "float": None,
    "8-bit g32": {"group_size": 32, "bits": 8, "mode": "affine"},
    "8-bit g64": {"group_size": 64, "bits": 8, "mode": "affine"},
    "8-bit g128": {"group_size": 128, "bits": 8, "mode": "affine"},
    "4-bit g64": {"group_size": 64, "bits": 4, "mode": "affine"},
    "folder": "folder",
}
CHOSEN = "float"
OTHERS = ("naive", "absorb", "auto")


def measure_folder(path: Path, prompt_text: str, max_tokens: int) -> list:
    """One row per (strategy, derived storage): compare's numbers for this folder."""
    path, config, _, dtype = open_folder(path, "float32")
    tokenizer = load_tokenizer(path, config)
    prompt = list(tokenizer.encode(prompt_text))
    peer, _, _ = load_peer(path, dtype, config)
    ref = greedy_run("mlx-lm", peer, tokenizer, prompt, max_tokens)
    ref_logits = teacher_forced_logits(peer, prompt, ref.tokens)
    del peer
    gc.collect()
    model, _ = mla_load(path, mla_strategy="naive", dtype=dtype)
    base = {k: config["quantization"][k] for k in ("group_size", "bits", "mode")}
    runs = [(s, None) for s in OTHERS] + [("absorb-materialized", d) for d in DERIVED]
    rows = []
    default = absorb_materialized.DERIVED_QUANTIZATION
    try:
        for strategy, derived in runs:
            if derived is not None:
                spec = DERIVED[derived]
                absorb_materialized.DERIVED_QUANTIZATION = base if spec == "folder" else spec
            model.set_mla_strategy(strategy)
            run = greedy_run(strategy, model, tokenizer, prompt, max_tokens)
            ours = teacher_forced_logits(model, prompt, ref.tokens)
            thr = threshold_for("float32")
            v = judge(run, ref, ref_logits, ours, len(prompt), thr)
            rows.append({"strategy": strategy, "derived": derived or "",
                         "max_abs_logit": v.max_abs_logit, "mean_kl": v.mean_kl,
                         "greedy": ("same" if v.first_token_divergence is None else
                                    f"differ@{v.first_token_divergence}"
                                    + (" tie" if v.tie_at_divergence else "")),
                         "derived_nbytes": model.derived_nbytes,
                         "passes_compare": v.passed if derived in (None, CHOSEN) else ""})
    finally:
        absorb_materialized.DERIVED_QUANTIZATION = default
    return rows


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folders = list(dict.fromkeys(r["folder"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    series = [("naive / absorb / auto (max)", lambda r: r["strategy"] in OTHERS)]
    series += [(f"absorb-materialized, derived {d}",
                lambda r, d=d: r["strategy"] == "absorb-materialized" and r["derived"] == d)
               for d in DERIVED]
    for label, keep in series:
        ys = [max(r["max_abs_logit"] for r in rows if r["folder"] == f and keep(r)) for f in folders]
        ax.plot(range(len(folders)), ys, marker="o", label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(folders)), folders, rotation=30, ha="right")
    ax.set_ylabel("max |Δlogit| vs mlx-lm (float32)")
    ax.set_title("compare on converted demo-checkpoint folders")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--prompt", default="ROMEO:", help="prompt (compare's default)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (compare's default)")
    args = p.parse_args(argv)
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, fields in FOLDERS:
            out = Path(tmp) / label.replace(" ", "-")
            convert(ConvertOptions(str(DEMO_MODEL), str(out), quantize=True, progress=False, **fields))
            for row in measure_folder(out, args.prompt, args.max_tokens):
                rows.append({"folder": label, **row})
            print(f"[{time.time() - t0:5.0f}s] {label}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    for r in rows:
        r.update(info)
    write_csv(rows, RESULTS / "compare_quantized.csv")
    plot(rows, RESULTS / "compare_quantized.png")

    def cell(folder, keep):
        sel = [r for r in rows if r["folder"] == folder and keep(r)]
        worst = max(sel, key=lambda r: r["max_abs_logit"])
        return f"{worst['max_abs_logit']:.2g} / {max(r['mean_kl'] for r in sel):.1g}"

    print("\n| folder | naive, absorb, auto | absorb-materialized, derived at "
          + " | ".join(DERIVED) + " |")
    print("|---|---|" + "---|" * len(DERIVED))
    for label, _ in FOLDERS:
        cells = [cell(label, lambda r: r["strategy"] in OTHERS)]
        cells += [cell(label, lambda r, d=d: r["derived"] == d) for d in DERIVED]
        print(f"| {label} | " + " | ".join(cells) + " |")
    chosen = [r for r in rows if r["derived"] == CHOSEN]
    print(f"\nlargest at {CHOSEN}: max |Δlogit| {max(r['max_abs_logit'] for r in chosen):.3g}, "
          f"mean KL {max(r['mean_kl'] for r in chosen):.2g}; every folder passes compare: "
          f"{all(r['passes_compare'] for r in rows if r['passes_compare'] != '')}")
    print(f"({time.time() - t0:.0f} s; {RESULTS / 'compare_quantized.csv'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
