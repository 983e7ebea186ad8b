"""End-to-end decode/prefill: mlx_mla vs mlx-lm ``deepseek_v2`` and ``deepseek_v3`` on one model.

The model: DeepSeek-V2-Lite's real dimensions (hidden 2048, 16 heads, kv_lora_rank 512,
rope 64 / nope 128 / v 128, 64 routed experts top-6 + 2 shared of 1408, dense
intermediate 10944 in layer 0, vocab 102400, YaRN factor 40) with fewer layers (default 2,
both MoE layers, as 26 of V2-Lite's 27 are; ``--dense-layers K`` makes the first K dense,
V2-Lite has 1), random
weights, quantized 4-bit / group 64 once and written as an mlx-lm folder (mlx-lm's
``quantize_model`` / ``save_model``, as ``mlx_lm.convert -q`` does, ``kv_b_proj`` included)
in a temporary directory. Every engine reads that folder through its own loader:

- ``mlx_mla <strategy>``: ``mlx_mla.load`` (splits the projections, and dequantizes
  ``kv_b_proj`` to float W_UK / W_UV);
- ``mlx-lm v2``: stock ``mlx_lm.load`` (``deepseek_v2``, decompressed K/V cache);
- ``mlx-lm v3``: stock ``mlx_lm.load`` of the same weights as a ``deepseek_v3`` folder
  (same dimensions; its ``sanitize`` re-quantizes kv_b_proj into ``embed_q`` /
  ``unembed_out``): absorbed attention over a latent cache. Its router is V3's (sigmoid,
  ``noaux_tc``, zero correction bias) rather than V2's softmax — same expert count and
  top-k, so the same work per token; what is compared is the attention and the cache.

Measured, per engine: decode tok/s at contexts 512 and 16K (``--contexts``; the caches are filled
directly with random latents / keys — prefilling 16K tokens through the MoE would take
minutes on 2 cores — then mlx-lm's ``generate_step`` runs a few steps on top); prefill
tok/s for 2K tokens (``generate_step`` with prefill_step_size 2048, which evaluates only
the cache state, so the last layer's FFN never runs for prompt tokens: with the default two
MoE layers a prompt token goes through embedding, attention + MoE (routed and shared
experts) in layer 0 and attention in layer 1; with one layer no MoE would run), for
mlx_mla auto and mlx-lm v2 (``--prefill-v3`` adds v3: minutes on 2 cores); the attention
share of a decode step (every layer's attention module timed alone on the same cache,
over the whole step's time); weight bytes, cache
bytes per token, peak memory (weights + cache + the step's transient, from
``mx.get_peak_memory``). Two comparisons: each engine at its defaults (mlx_mla: float32
activations on CPU; mlx-lm: the checkpoint's bfloat16), and every engine in float32.

Longest context for a memory budget (default 16 GiB), at V2-Lite's full 27 layers:
weights(27) + S · (cache/token(27) + transient slope) + transient intercept ≤ budget, with
weights extrapolated per layer from the measured model and the transient fitted over the
measured contexts; verified here at small scale by running at the context the same formula
gives for a small budget and comparing the measured peak with the prediction.

Each BLAS (``--blas``; default both where ``mlx-mla[openblas]`` is installed) runs in its own
process; every row carries a ``blas`` column, the JSON the meta and ratios per BLAS.

    python -m benchmarks.e2e_decode                # ~15 minutes per BLAS on a 2-core CPU
Writes benchmarks/results/e2e_decode.{csv,json}, e2e_budget.csv, e2e_decode.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from mlx_mla.cache import cache_bytes_per_token
from mlx_mla.dtypes import DTYPES

from .common import (summary, RESULTS, V2_LITE, default_blas, pyplot, run_per_blas, save_figure, with_layers,
                     worker_result, write_csv)
from .engines import load_engine, lazy_weight_bytes, weight_bytes, write_folders

FULL_LAYERS = 27
# mlx_mla strategies timed by default (``--strategies`` for naive / absorb-materialized: at
# 16K on 2 cores, naive's decode step takes tens of seconds).
STRATEGIES = ("auto", "absorb")
ALL_STRATEGIES = ("auto", "naive", "absorb-materialized", "absorb")
GiB = 2**30


# ---------------------------------------------------------------- weights and engines


def make_config(layers: int, base: Optional[dict] = None) -> dict:
    """``base`` (default V2_LITE) with ``layers`` decoder layers."""
    return with_layers(base or V2_LITE, layers)


# ---------------------------------------------------------------- caches


def fill_cache(engine: str, model, config: dict, S: int, dtype: mx.Dtype, seed: int = 1):
    """A prompt cache as if S tokens had been processed: random latents (mlx_mla, mlx-lm
    v3) or random decompressed keys/values (mlx-lm v2), in each engine's own cache class."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    H, r, dr = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    dn, dv = config["qk_nope_head_dim"], config["v_head_dim"]
    key = mx.random.key(seed)
    for c in cache:
        k1, k2, key = mx.random.split(key, 3)
        if engine.startswith("mlx_mla"):
            a, b = (1, S, r), (1, S, dr)
        elif engine == "mlx-lm v3":
            a, b = (1, 1, S, r), (1, 1, S, dr)
        else:
            a, b = (1, H, S, dn + dr), (1, H, S, dv)
        c.update_and_fetch(mx.random.normal(a, dtype, key=k1), mx.random.normal(b, dtype, key=k2))
        mx.eval(c.state)
    return cache


def cache_nbytes(cache) -> int:
    return int(sum(c.nbytes for c in cache))


# ---------------------------------------------------------------- measurements


def decode(model, cache, steps: int, token: int = 1000) -> Dict[str, float]:
    """``steps`` decode steps through mlx-lm's ``generate_step`` on ``cache``, after one
    untimed step; tok/s is 1 / the median interval between tokens (robust to other work on
    the machine). The cache is trimmed back afterwards. Also returns the peak transient
    bytes above what was allocated before (weights and the filled cache)."""
    from mlx_lm.generate import generate_step

    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    times = []
    gen = generate_step(mx.array([token]), model, max_tokens=steps + 1, prompt_cache=cache,
                        sampler=lambda lp: mx.argmax(lp, axis=-1))
    for _ in gen:
        times.append(time.perf_counter())
    transient = mx.get_peak_memory() - base
    for c in cache:
        c.trim(steps + 1)
    intervals = np.diff(times)
    return {"decode_tps": 1.0 / float(np.median(intervals)), "transient_bytes": float(transient)}


def attention_step_ms(model, cache, hidden: int, steps: int = 3, seed: int = 3) -> float:
    """ms of one decode step's attention: every layer's attention module (``self_attn``,
    the same call signature in mlx_mla and mlx-lm) on a random (1, 1, hidden) input over
    that layer's cache, all layers evaluated together as a step is; median of ``steps``
    after one warm-up, the caches trimmed back after each."""
    x = mx.random.normal((1, 1, hidden), key=mx.random.key(seed)).astype(
        model.layers[0].input_layernorm.weight.dtype)
    mx.eval(x)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        mx.eval([layer.self_attn(x, None, c) for layer, c in zip(model.layers, cache)])
        if i:
            times.append(time.perf_counter() - t0)
        for c in cache:
            c.trim(1)
    return 1e3 * float(np.median(times))


def prefill(model, n_tokens: int, vocab: int, seed: int = 2) -> Dict[str, float]:
    """Prefill ``n_tokens`` random tokens with ``generate_step`` (one chunk), timed to the
    first generated token. Returns tok/s and peak bytes above the weights."""
    from mlx_lm.generate import generate_step

    tokens = mx.random.randint(0, vocab, (n_tokens,), key=mx.random.key(seed))
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    for _ in generate_step(tokens, model, max_tokens=1, prefill_step_size=n_tokens,
                           sampler=lambda lp: mx.argmax(lp, axis=-1)):
        pass
    t = time.perf_counter() - tic
    return {"prefill_tps": n_tokens / t, "prefill_peak_bytes": float(mx.get_peak_memory() - base)}


def engines_for(strategies=STRATEGIES) -> List[str]:
    return [f"mlx_mla {s}" for s in strategies] + ["mlx-lm v2", "mlx-lm v3"]


def plans(strategies=STRATEGIES, default_dtypes=None):
    """[(comparison, engine, dtype name)]: every engine in float32, then each engine at its
    defaults (mlx_mla: float32 on the CPU backend, the checkpoint's bfloat16 on a GPU;
    mlx-lm: the checkpoint's bfloat16)."""
    default_dtypes = default_dtypes or {
        "mlx_mla": "float32" if mx.default_device() == mx.cpu else "bfloat16", "mlx-lm": "bfloat16"}
    out = [("same dtype (float32)", e, "float32") for e in engines_for(strategies)]
    for e in ("mlx_mla auto", "mlx-lm v2", "mlx-lm v3"):
        out.append(("defaults", e, default_dtypes[e.split(" ")[0]]))
    return out


def run(config: dict, contexts=(512, 4096, 16384), prefill_tokens: int = 2048,
        decode_steps: int = 4, strategies=STRATEGIES, default_dtypes=None,
        prefill_for=(("same dtype (float32)", "mlx_mla auto"), ("same dtype (float32)", "mlx-lm v2")),
        folders: Dict[str, Path] = None, log=print) -> List[dict]:
    """One row per (comparison, engine, context), every engine loaded from ``folders``
    (``write_folders``). Prefill is measured only for the (comparison, engine) pairs in
    ``prefill_for`` (others: None) — on 2 cores a 2K-token prefill through mlx-lm's 4-bit
    MoE takes minutes per engine, and ``auto`` prefills a 2K chunk with ``naive``, so
    naive's prefill is auto's. ``attention_ms``: ``attention_step_ms`` on the same cache
    (float32 comparison only; None for the defaults)."""
    rows = []
    for comparison, engine, dtype_name in plans(strategies, default_dtypes):
        dtype = DTYPES[dtype_name]
        model = load_engine(engine, folders, dtype)
        wbytes = weight_bytes(model)
        pf = {"prefill_tps": None, "prefill_peak_bytes": None}
        if (comparison, engine) in prefill_for:
            pf = prefill(model, prefill_tokens, config["vocab_size"])
            log(f"[{comparison}] {engine} {dtype_name}: prefill {prefill_tokens} tokens "
                f"{pf['prefill_tps']:.2f} tok/s")
        warm = fill_cache(engine, model, config, 16, dtype)
        decode(model, warm, 1)  # first calls build kernels / compile
        for S in contexts:
            cache = fill_cache(engine, model, config, S, dtype)
            d = decode(model, cache, decode_steps)
            attn_ms = (attention_step_ms(model, cache, config["hidden_size"])
                       if comparison == "same dtype (float32)" else None)
            row = {
                "comparison": comparison, "engine": engine, "dtype": dtype_name,
                "layers": config["num_hidden_layers"], "context": S,
                "decode_tps": d["decode_tps"], "attention_ms": attn_ms,
                "attention_share": attn_ms * d["decode_tps"] / 1e3 if attn_ms else None,
                "prefill_tokens": prefill_tokens,
                "prefill_tps": pf["prefill_tps"], "weight_bytes": wbytes,
                "cache_bytes_per_token": cache_bytes_per_token(cache),
                "cache_bytes": cache_nbytes(cache), "transient_bytes": d["transient_bytes"],
                "peak_bytes": wbytes + cache_nbytes(cache) + d["transient_bytes"],
                "prefill_peak_bytes": (wbytes + pf["prefill_peak_bytes"]
                                       if pf["prefill_peak_bytes"] is not None else None),
            }
            rows.append(row)
            share = f" (attention {row['attention_share']:.0%})" if attn_ms else ""
            log(f"[{comparison}] {engine} {dtype_name} S={S}: decode {d['decode_tps']:.2f} tok/s{share}, cache {row['cache_bytes_per_token']:.0f} B/tok, peak {row['peak_bytes'] / GiB:.2f} GiB")
            del cache
        del model, warm
        gc.collect()
        mx.clear_cache()
    return rows


# ---------------------------------------------------------------- memory budget


def full_weight_bytes(engine: str, config: dict, dtype: mx.Dtype, layers: int = FULL_LAYERS) -> int:
    """Weight bytes of ``engine`` at ``layers`` layers, from shapes only (lazy arrays)."""
    return lazy_weight_bytes(engine, make_config(layers, config), dtype)


def transient_fit(rows: List[dict]) -> Dict[tuple, tuple]:
    """{(comparison, engine): (intercept, slope per token)} of the decode transient over S."""
    fits = {}
    keys = {(r["comparison"], r["engine"]) for r in rows}
    for key in keys:
        pts = sorted((r["context"], r["transient_bytes"]) for r in rows
                     if (r["comparison"], r["engine"]) == key)
        S = np.array([p[0] for p in pts], float)
        T = np.array([p[1] for p in pts], float)
        slope, icpt = np.polyfit(S, T, 1) if len(S) > 1 else (0.0, T[0])
        fits[key] = (float(max(icpt, 0.0)), float(max(slope, 0.0)))
    return fits


def max_context(budget: float, weights: float, cache_per_token: float, fit: tuple) -> int:
    """Largest S with weights + S·(cache/token + slope) + intercept ≤ budget (0 if none)."""
    icpt, slope = fit
    return max(int((budget - weights - icpt) // (cache_per_token + slope)), 0)


def budget_table(rows: List[dict], config: dict, budget: float,
                 engines=(("same dtype (float32)", "mlx_mla auto"), ("same dtype (float32)", "mlx-lm v2"),
                          ("same dtype (float32)", "mlx-lm v3"), ("defaults", "mlx-lm v2"),
                          ("defaults", "mlx-lm v3"))) -> List[dict]:
    """Longest context within ``budget`` bytes at V2-Lite's 27 layers, per engine."""
    fits = transient_fit(rows)
    n = config["num_hidden_layers"]
    out = []
    for comparison, engine in engines:
        sel = [r for r in rows if (r["comparison"], r["engine"]) == (comparison, engine)]
        if not sel:
            continue
        dtype = DTYPES[sel[0]["dtype"]]
        w27 = full_weight_bytes(engine, config, dtype)
        per_tok27 = sel[0]["cache_bytes_per_token"] / n * FULL_LAYERS
        out.append({
            "comparison": comparison, "engine": engine, "dtype": sel[0]["dtype"],
            "layers": FULL_LAYERS, "budget_bytes": budget, "weight_bytes": w27,
            "cache_bytes_per_token": per_tok27, "transient_intercept": fits[(comparison, engine)][0],
            "transient_per_token": fits[(comparison, engine)][1],
            "max_context": max_context(budget, w27, per_tok27, fits[(comparison, engine)]),
        })
    return out


def verify_budget(rows: List[dict], config: dict, folders: Dict[str, Path], extra_budget: float,
                  engines=("mlx_mla auto", "mlx-lm v2"), steps: int = 2, cap: int = 200_000,
                  log=print) -> List[dict]:
    """Small-scale check of the formula on the measured model (float32): budget = its
    weights + ``extra_budget``; run at the context the formula allows and compare the
    measured peak (weights + cache + transient) with the predicted one."""
    fits = transient_fit(rows)
    out = []
    for engine in engines:
        key = ("same dtype (float32)", engine)
        sel = [r for r in rows if (r["comparison"], r["engine"]) == key]
        model = load_engine(engine, folders, mx.float32)
        wbytes = weight_bytes(model)
        per_tok = sel[0]["cache_bytes_per_token"]
        budget = wbytes + extra_budget
        S = min(max_context(budget, wbytes, per_tok, fits[key]), cap)
        predicted = wbytes + S * (per_tok + fits[key][1]) + fits[key][0]
        cache = fill_cache(engine, model, config, S, mx.float32)
        d = decode(model, cache, steps)
        measured = wbytes + cache_nbytes(cache) + d["transient_bytes"]
        out.append({"engine": engine, "layers": config["num_hidden_layers"], "budget_bytes": budget,
                    "context": S, "predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
                    "relative_error": (measured - predicted) / predicted})
        log(f"[budget check] {engine}: S={S}, predicted {predicted / GiB:.3f} GiB, measured "
            f"{measured / GiB:.3f} GiB ({out[-1]['relative_error']:+.1%})")
        del cache, model
        gc.collect()
        mx.clear_cache()
    return out


# ---------------------------------------------------------------- output


def ratios(rows: List[dict]) -> Dict[str, float]:
    """The issue's targets, as same-run ratios (float32 comparison unless named)."""
    def get(engine, S, comparison="same dtype (float32)"):
        return next(r for r in rows if (r["comparison"], r["engine"], r["context"]) == (comparison, engine, S))
    lo, hi = min(r["context"] for r in rows), max(r["context"] for r in rows)
    ours_lo, ours_hi = get("mlx_mla auto", lo), get("mlx_mla auto", hi)
    extra = {}
    if ours_lo["prefill_tps"] and get("mlx-lm v2", lo)["prefill_tps"]:
        extra["prefill_vs_v2_same_dtype"] = ours_lo["prefill_tps"] / get("mlx-lm v2", lo)["prefill_tps"]
    return {
        **extra,
        f"decode_{hi}_vs_v2_same_dtype": ours_hi["decode_tps"] / get("mlx-lm v2", hi)["decode_tps"],
        f"attention_share_{hi}_mlx_mla_auto": ours_hi["attention_share"],
        f"attention_share_{hi}_mlx_lm_v2": get("mlx-lm v2", hi)["attention_share"],
        "cache_bytes_ratio_vs_v2": ours_lo["cache_bytes_per_token"] / get("mlx-lm v2", lo)["cache_bytes_per_token"],
        f"decode_{lo}_vs_v2_same_dtype": ours_lo["decode_tps"] / get("mlx-lm v2", lo)["decode_tps"],
        f"decode_{hi}_vs_v3_same_dtype": ours_hi["decode_tps"] / get("mlx-lm v3", hi)["decode_tps"],
        f"decode_{lo}_vs_v2_defaults": get("mlx_mla auto", lo, "defaults")["decode_tps"]
        / get("mlx-lm v2", lo, "defaults")["decode_tps"],
        f"decode_{hi}_vs_v3_defaults": get("mlx_mla auto", hi, "defaults")["decode_tps"]
        / get("mlx-lm v3", hi, "defaults")["decode_tps"],
    }


def write_results(rows, budget, checks, meta, out_dir: Path = RESULTS) -> Dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "e2e_decode.csv", "budget": out_dir / "e2e_budget.csv",
             "json": out_dir / "e2e_decode.json", "png": out_dir / "e2e_decode.png"}
    write_csv(rows, paths["csv"])
    write_csv(budget, paths["budget"])
    per_blas = {b: ratios([r for r in rows if r.get("blas", "") == b])
                for b in dict.fromkeys(r.get("blas", "") for r in rows)}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": rows, "budget": budget,
                                         "budget_checks": checks, "ratios": per_blas}, indent=2))
    plot(rows, budget, paths["png"])
    return paths


def plot(rows, budget, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    blases = list(dict.fromkeys(r.get("blas", "") for r in rows))
    for b, style in zip(blases, ("-o", "--s", ":^")):
        for engine in dict.fromkeys(r["engine"] for r in rows):
            sel = sorted((r for r in rows if (r.get("blas", ""), r["comparison"], r["engine"])
                          == (b, "same dtype (float32)", engine)), key=lambda r: r["context"])
            if sel:
                axes[0].plot([r["context"] for r in sel], [r["decode_tps"] for r in sel], style,
                             label=f"{engine} (f32{', ' + b if b else ''})")
    axes[0].set(xscale="log", xlabel="context (tokens)", ylabel="decode tok/s",
                title=f"decode, {rows[0]['layers']}-layer V2-Lite-shaped 4-bit model, float32")
    axes[0].legend(fontsize=7)
    f32 = [r for r in rows if r["comparison"] == "same dtype (float32)" and r["context"] == rows[0]["context"]
           and r.get("blas", "") == blases[0]]
    axes[1].bar([r["engine"].replace("mlx_mla ", "mla ") for r in f32],
                [r["cache_bytes_per_token"] / r["layers"] / 1024 for r in f32])
    axes[1].set(ylabel="KiB per token per layer (float32)", title="cache bytes per token")
    axes[1].tick_params(axis="x", rotation=30, labelsize=7)
    budget = [b for b in budget if b.get("blas", "") == blases[0]]  # bytes: the same per BLAS
    axes[2].bar([f"{b['engine']}\n{b['dtype']}" for b in budget], [b["max_context"] / 1000 for b in budget])
    axes[2].set(ylabel="thousand tokens", title=f"longest context in {budget[0]['budget_bytes'] / GiB:.0f} GiB, 27 layers")
    axes[2].tick_params(axis="x", labelsize=7)
    save_figure(fig, path)


def _without(argv: List[str], *flags: str) -> List[str]:
    """``argv`` without ``flags`` and the values that follow each."""
    out, skip = [], False
    for a in argv:
        if a in flags:
            skip = True
        elif skip and not a.startswith("--"):
            continue
        else:
            skip = False
            out.append(a)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dense-layers", type=int, default=0,
                   help="how many first layers are dense (V2-Lite: 1); default 0, so the layer "
                        "whose FFN prefill runs is an MoE layer")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 16384])
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--prefill-v3", action="store_true", help="also time mlx-lm v3's prefill")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=ALL_STRATEGIES,
                   help=f"mlx_mla strategies to time (default: {' '.join(STRATEGIES)})")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--budget-gib", type=float, default=16.0)
    p.add_argument("--check-extra-mib", type=float, default=256.0)
    p.add_argument("--blas", nargs="+", default=None,
                   help="reference, openblas (CPU; default: both where OpenBLAS is installed) or current (this backend as it is: a GPU)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--workdir", type=Path, default=None,
                   help="where to write the random model folder (a temporary one inside it)")
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    t0 = time.time()
    if not args.worker_out:
        forward = _without(sys.argv[1:] if argv is None else list(argv), "--blas", "--out")
        results = []
        for name in args.blas or default_blas():  # files rewritten after each BLAS's run
            results += run_per_blas("benchmarks.e2e_decode", forward, [name])
            rows = [r for res in results for r in res["rows"]]
            budget = [{"blas": res["meta"]["blas"], **b} for res in results
                      for b in res["meta"]["budget"]]
            checks = [{"blas": res["meta"]["blas"], **c} for res in results
                      for c in res["meta"]["budget_checks"]]
            meta = {res["meta"]["blas"]: {k: v for k, v in res["meta"].items()
                                          if k not in ("budget", "budget_checks")} for res in results}
            paths = write_results(rows, budget, checks, meta, args.out)
        print(json.dumps(json.loads(paths["json"].read_text())["ratios"], indent=2))
        print(f"wrote {', '.join(str(v) for v in paths.values())} in {time.time() - t0:.0f} s")
        return 0
    config = make_config(args.layers)
    config["first_k_dense_replace"] = args.dense_layers
    prefill_for = [("same dtype (float32)", e) for e in
                   ("mlx_mla auto", "mlx-lm v2") + (("mlx-lm v3",) if args.prefill_v3 else ())]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        folders = write_folders(config, Path(tmp))
        rows = run(config, tuple(args.contexts), args.prefill_tokens, args.decode_steps,
                   strategies=tuple(args.strategies), prefill_for=tuple(prefill_for),
                   folders=folders)
        budget = budget_table(rows, config, args.budget_gib * GiB)
        checks = verify_budget(rows, config, folders, args.check_extra_mib * 2**20)
    worker_result(args.worker_out, rows, {
        "layers": args.layers, "dense_layers": args.dense_layers,
        "decode_steps": args.decode_steps, "quantization": "4-bit, group 64 (mlx_lm.utils.quantize_model)",
        "seconds": time.time() - t0, "budget": budget, "budget_checks": checks})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
