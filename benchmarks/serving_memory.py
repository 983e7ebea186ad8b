"""Serving many sequences: how many fit in memory, and batched decode speed.

Engines (``benchmarks.engines``): mlx_mla (auto; its latent cache in float16, 8-bit and 4-bit
c_kv), stock mlx-lm ``deepseek_v2`` (decompressed K/V cache, float16 and its 8-bit
``QuantizedKVCache``) and stock mlx-lm ``deepseek_v3`` (latent cache, float16; it cannot use
a quantized one) on one random DeepSeek-V2-Lite-shaped model, 4-bit weights, 1 MoE layer.

1. **Concurrent 4K-token sequences in a 16 GiB budget**, computed for V2-Lite's 27 layers:
   (budget − weights) // (27 × cache bytes per token per layer × 4096). Weights are sized
   from the 27-layer shapes (float16 non-quantized parts); cache bytes per token per layer
   are measured on real caches of each kind (the bytes allocated to hold 4096 random
   positions). Transients
   are left out (they do not grow with the number of sequences held). Verified at small
   scale: on the 1-layer model, that many sequences for a budget of 256 MiB of cache are
   allocated and MLX's active memory is compared with the prediction.
2. **Batched decode tok/s** at batch 1, 4 and 16 over a 2K-token context (caches filled
   directly with random latents / keys), every engine in float32 activations (this CPU
   build has no float16 MoE): mlx-lm's batch caches for its models, ``BatchLatentCache`` for
   ours; tok/s = batch / the median step time.

    python -m benchmarks.serving_memory          # ~3 minutes on a 2-core CPU
Writes benchmarks/results/serving_memory.{csv,json,png} (concurrency rows and decode rows).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import numpy as np

from mlx_mla.cache import BatchLatentCache, LatentCache

from .common import RESULTS, V2_LITE, machine_info, pyplot, save_figure, with_layers, write_csv, summary
from .engines import lazy_weight_bytes, load_engine, write_folders

GiB = 2**30
FULL_LAYERS = 27
# (label, engine, cache kind, cache bits or None)
CACHE_PLANS = [
    ("mlx_mla float16 latent", "mlx_mla auto", "latent", None),
    ("mlx_mla 8-bit latent", "mlx_mla auto", "latent", 8),
    ("mlx_mla 4-bit latent", "mlx_mla auto", "latent", 4),
    ("mlx-lm deepseek_v2 float16", "mlx-lm v2", "kv", None),
    ("mlx-lm deepseek_v2 8-bit (QuantizedKVCache)", "mlx-lm v2", "kv", 8),
    ("mlx-lm deepseek_v3 float16 latent", "mlx-lm v3", "v3", None),
]
DECODE_ENGINES = ["mlx_mla auto", "mlx-lm v2", "mlx-lm v3"]


def one_layer_config(base: Dict = V2_LITE) -> Dict:
    """``base`` with one decoder layer, an MoE one (as 26 of V2-Lite's 27 are)."""
    return {**with_layers(base, 1), "first_k_dense_replace": 0}


def _single_cache(kind: str, config: Dict, S: int, dtype: mx.Dtype, bits, seed: int = 0):
    """One layer's cache of one sequence holding S random positions, of the given kind."""
    from mlx_lm.models.cache import KVCache

    H, r, dr = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    dn, dv = config["qk_nope_head_dim"], config["v_head_dim"]
    k1, k2 = mx.random.split(mx.random.key(seed))
    if kind == "latent":
        c = LatentCache()
        c.update_and_fetch(mx.random.normal((1, S, r), dtype, key=k1),
                           mx.random.normal((1, S, dr), dtype, key=k2))
    else:
        c = KVCache()
        a, b = ((1, 1, S, r), (1, 1, S, dr)) if kind == "v3" else ((1, H, S, dn + dr), (1, H, S, dv))
        c.update_and_fetch(mx.random.normal(a, dtype, key=k1), mx.random.normal(b, dtype, key=k2))
    if bits:
        c = c.to_quantized(group_size=64, bits=bits)
    mx.eval(c.state)
    return c


def concurrency_rows(config: Dict, seq_tokens: int = 4096, budget: float = 16 * GiB,
                     dtype: mx.Dtype = mx.float16) -> List[Dict]:
    """Per cache plan: measured cache bytes per token per layer, 27-layer weights, and the
    number of ``seq_tokens``-token sequences that fit ``budget``."""
    rows, weights = [], {}
    full = with_layers(config, FULL_LAYERS)
    for label, engine, kind, bits in CACHE_PLANS:
        if engine not in weights:
            weights[engine] = lazy_weight_bytes(engine, full, dtype)
        cache = _single_cache(kind, config, seq_tokens, dtype, bits)
        per_token_layer = cache.nbytes / seq_tokens  # allocated bytes (blocks of 256 positions)
        per_seq = cache.nbytes * FULL_LAYERS
        rows.append({
            "table": "concurrency", "label": label, "engine": engine,
            "cache_bits": bits or 16, "dtype": "float16", "layers": FULL_LAYERS,
            "seq_tokens": seq_tokens, "budget_bytes": budget,
            "weight_bytes": weights[engine], "cache_bytes_per_token_layer": per_token_layer,
            "bytes_per_sequence": per_seq,
            "sequences": max(int((budget - weights[engine]) // per_seq), 0),
        })
        del cache
    return rows


def verify_concurrency(config: Dict, rows: List[Dict], cache_budget: float = 256 * 2**20,
                       seq_tokens: int = 4096) -> List[Dict]:
    """Allocate, on the 1-layer model, the number of sequences the per-token figure says fit
    ``cache_budget``, and compare MLX's active memory growth with the prediction."""
    out = []
    for r in rows:
        if r["label"] not in ("mlx_mla 8-bit latent", "mlx-lm deepseek_v2 float16"):
            continue
        per_seq = r["cache_bytes_per_token_layer"] * seq_tokens
        n = int(cache_budget // per_seq)
        kind = "latent" if r["engine"].startswith("mlx_mla") else "kv"
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        held = [_single_cache(kind, config, seq_tokens, mx.float16, r["cache_bits"] if r["cache_bits"] < 16 else None, seed=i)
                for i in range(n)]
        gc.collect()
        measured = mx.get_active_memory() - before
        predicted = n * per_seq
        out.append({"table": "verify", "label": r["label"], "sequences": n,
                    "predicted_bytes": predicted, "measured_bytes": measured,
                    "relative_error": (measured - predicted) / predicted})
        del held
    return out


def _batch_cache(engine: str, model, config: Dict, B: int, S: int, seed: int = 1):
    """A batch cache per layer holding S random positions for each of B sequences."""
    from mlx_lm.models.cache import BatchKVCache

    H, r, dr = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    dn, dv = config["qk_nope_head_dim"], config["v_head_dim"]
    cache = []
    for i in range(len(model.layers)):
        k1, k2 = mx.random.split(mx.random.key(seed + i))
        if engine.startswith("mlx_mla"):
            c = BatchLatentCache([0] * B)
            c.update_and_fetch(mx.random.normal((B, S, r), key=k1), mx.random.normal((B, S, dr), key=k2))
        else:
            c = BatchKVCache([0] * B)
            a, b = ((B, 1, S, r), (B, 1, S, dr)) if engine == "mlx-lm v3" else ((B, H, S, dn + dr), (B, H, S, dv))
            c.update_and_fetch(mx.random.normal(a, key=k1), mx.random.normal(b, key=k2))
        mx.eval(c.state)
        cache.append(c)
    return cache


def decode_rows(config: Dict, folders: Dict[str, Path], batches=(1, 4, 16), context: int = 2048,
                steps: int = 4, log=print) -> List[Dict]:
    """Batched decode tok/s per engine and batch size, float32, ``context`` cached tokens."""
    rows = []
    for engine in DECODE_ENGINES:
        model = load_engine(engine, folders, mx.float32)
        for B in batches:
            cache = _batch_cache(engine, model, config, B, context)
            tokens = mx.array([[1000 + b] for b in range(B)])
            times = []
            for i in range(steps + 1):  # the first step builds kernels: not timed
                t0 = time.perf_counter()
                mx.eval(model(tokens, cache=cache))
                if i:
                    times.append(time.perf_counter() - t0)
                for c in cache:
                    c.trim(1)
            step = float(np.median(times))
            rows.append({"table": "decode", "engine": engine, "batch": B, "context": context,
                         "dtype": "float32", "step_seconds": step, "tokens_per_second": B / step,
                         "cache_bytes": sum(c.nbytes for c in cache)})
            log(f"{engine:14s} batch {B:2d}: {B / step:7.2f} tok/s ({step * 1e3:.0f} ms/step)")
            del cache
        del model
        gc.collect()
        mx.clear_cache()
    return rows


def ratios(conc: List[Dict], dec: List[Dict]) -> Dict[str, float]:
    """The issue's targets as same-run ratios."""
    by = {r["label"]: r["sequences"] for r in conc}
    tps = {(r["engine"], r["batch"]): r["tokens_per_second"] for r in dec}
    top = max(r["batch"] for r in dec)
    return {
        "sequences_f16_latent_vs_v2_f16": by["mlx_mla float16 latent"] / by["mlx-lm deepseek_v2 float16"],
        "sequences_8bit_latent_vs_v2_8bit": by["mlx_mla 8-bit latent"]
        / by["mlx-lm deepseek_v2 8-bit (QuantizedKVCache)"],
        "sequences_8bit_latent_vs_v2_f16": by["mlx_mla 8-bit latent"] / by["mlx-lm deepseek_v2 float16"],
        "sequences_4bit_latent_vs_v2_f16": by["mlx_mla 4-bit latent"] / by["mlx-lm deepseek_v2 float16"],
        f"decode_batch{top}_vs_v3": tps[("mlx_mla auto", top)] / tps[("mlx-lm v3", top)],
        f"decode_batch{top}_vs_v2": tps[("mlx_mla auto", top)] / tps[("mlx-lm v2", top)],
    }


def plot(conc: List[Dict], dec: List[Dict], path: Path) -> None:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.8))
    a.barh([r["label"] for r in conc], [r["sequences"] for r in conc],
           color=["tab:green" if r["engine"].startswith("mlx_mla") else "tab:gray" for r in conc])
    a.set_xlabel(f"concurrent {conc[0]['seq_tokens']}-token sequences in "
                 f"{conc[0]['budget_bytes'] / GiB:.0f} GiB (27 layers, weights included)")
    a.tick_params(axis="y", labelsize=8)
    for engine in dict.fromkeys(r["engine"] for r in dec):
        pts = [(r["batch"], r["tokens_per_second"]) for r in dec if r["engine"] == engine]
        b.plot(*zip(*pts), "-o" if engine.startswith("mlx_mla") else "--s", label=engine)
    b.set(xscale="log", xlabel="batch", ylabel="decode tok/s (float32, 1 MoE layer)",
          title=f"batched decode over {dec[0]['context']} cached tokens")
    b.legend()
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--budget-gib", type=float, default=16.0)
    p.add_argument("--seq-tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    t0 = time.time()
    config = one_layer_config()
    conc = concurrency_rows(config, args.seq_tokens, args.budget_gib * GiB)
    checks = verify_concurrency(config, conc, seq_tokens=args.seq_tokens)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        folders = write_folders(config, Path(tmp))
        dec = decode_rows(config, folders, tuple(args.batches), args.context, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(conc + checks + dec, args.out / "serving_memory.csv",
              sorted({k for r in conc + checks + dec for k in r}, key=lambda k: (k != "table", k)))
    result = {"meta": {**machine_info(), "seconds": time.time() - t0}, "concurrency": conc,
              "verify": checks, "decode": dec, "ratios": ratios(conc, dec)}
    (args.out / "serving_memory.json").write_text(json.dumps(result, indent=2))
    plot(conc, dec, args.out / "serving_memory.png")
    for r in conc:
        print(f"{r['label']:45s} {r['cache_bytes_per_token_layer']:8.0f} B/token/layer "
              f"{r['sequences']:6d} sequences")
    for c in checks:
        print(f"verify {c['label']}: {c['sequences']} sequences, measured/predicted - 1 = "
              f"{c['relative_error']:+.1%}")
    print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
