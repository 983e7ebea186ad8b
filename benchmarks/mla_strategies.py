"""One MLA layer's decode step (and a prefill chunk): our strategies vs mlx-lm's peers.

At DeepSeek-V2-Lite's attention shape (hidden 2048, 16 heads, kv_lora_rank 512,
qk_rope 64, qk_nope 128, v 128, q_lora_rank null), random weights, Linears quantized to
4 bits (group 64; our W_UK/W_UV stay float, by design), float32 activations. Caches are
filled directly (random latents), no prefill. Timed per point: warm-up, then the median of
``repeats`` calls, each ``mx.eval``'d; all rows of a point come from the same run, so their
ratios are what to read on a noisy machine.

Points: decode steps (L = 1) at ``contexts``; a prefill chunk of ``prefill`` tokens on an
empty cache; short prefill chunks of ``chunks`` tokens over ``chunk_cache`` cached
positions (the phase where ``auto`` may switch from naive to absorb for prefill).

Rows: ``naive``, ``absorb-materialized``, ``absorb``, ``auto`` (mlx_mla.attention
strategies over a ``LatentCache``); ``mlx-lm deepseek_v2`` (``DeepseekV2Attention`` over a
full K/V ``KVCache``) and ``mlx-lm deepseek_v3`` (``DeepseekV3Attention``: absorbed, latent
``KVCache``). Beside each time: the analytic FLOPs and bytes read
(``mlx_mla.attention.costs``) and the cache bytes.

Each BLAS (``--blas``; default both where ``mlx-mla[openblas]`` is installed) runs in its own
process; rows carry a ``blas`` column.

    python -m benchmarks.mla_strategies            # ~8 + 4 minutes on a 2-core CPU
Writes benchmarks/results/mla_strategies.csv, .json (meta per BLAS) and .png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_mla.attention import MLAttention, costs, make_strategy
from mlx_mla.attention.strategies.auto import Table, backend_key, backend_name, choose, table_for
from mlx_mla.cache import LatentCache
from mlx_mla.config import ModelArgs

from .common import (summary, RESULTS, V2_LITE, default_blas, pyplot, run_per_blas, save_figure,
                     worker_result, write_csv)

STRATEGY_ROWS = ["naive", "absorb-materialized", "absorb", "auto"]
PEER_ROWS = ["mlx-lm deepseek_v2", "mlx-lm deepseek_v3"]
CONTEXTS = [512, 2048, 8192, 16384]
PREFILL = 2048
CHUNKS = [16, 64, 128, 256]  # short prefill chunks ...
CHUNK_CACHE = 4096  # ... over this many cached positions
BITS, GROUP = 4, 64
DTYPE = mx.float32


def _quantize(module: nn.Module) -> None:
    """4-bit group-64 affine on the nn.Linear layers only (as a converted model has them)."""
    nn.quantize(module, group_size=GROUP, bits=BITS,
                class_predicate=lambda _, m: isinstance(m, nn.Linear))


def _randomize(module: nn.Module, seed: int) -> None:
    """Random normal weights with std 1/sqrt(fan_in) for every ≥2-D parameter; norms at 1."""
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed)
    new = []
    for i, (name, p) in enumerate(tree_flatten(module.parameters())):
        if p.ndim >= 2:
            k = mx.random.split(mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in")
                                else mx.random.key(seed + i))[0]
            new.append((name, (mx.random.normal(p.shape, key=k) / np.sqrt(p.shape[-1])).astype(DTYPE)))
        else:
            new.append((name, mx.ones(p.shape, DTYPE)))
    module.update(tree_unflatten(new))


def ours(config: Dict, strategy: str, seed: int = 0) -> MLAttention:
    """Our MLA layer at ``config``'s dims, random 4-bit weights, ``strategy`` prepared."""
    args = ModelArgs.from_dict(config)
    attn = MLAttention(args)
    _randomize(attn, seed)
    _quantize(attn)
    attn.strategy = make_strategy(strategy)
    attn.strategy.prepare(attn)  # the layer's own strategy object, as Model.set_mla_strategy does
    mx.eval(attn.parameters())
    return attn


def peer(config: Dict, which: str, seed: int = 0) -> nn.Module:
    """mlx-lm's ``DeepseekV2Attention`` ('v2') or ``DeepseekV3Attention`` ('v3')."""
    if which == "v2":
        from mlx_lm.models import deepseek_v2 as mod
        args = mod.ModelArgs.from_dict({**config, "model_type": "deepseek_v2"})
        attn = mod.DeepseekV2Attention(args)
    else:
        from mlx_lm.models import deepseek_v3 as mod
        args = mod.ModelArgs.from_dict({**config, "model_type": "deepseek_v3"})
        attn = mod.DeepseekV3Attention(args)
    _randomize(attn, seed)
    _quantize(attn)
    mx.eval(attn.parameters())
    return attn


def _rand(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(DTYPE)


def filled_cache(kind: str, config: Dict, S: int, spare: int, seed: int = 1):
    """A cache holding S random positions, with room for ``spare`` more (no regrowth).

    kind: 'latent' (ours: LatentCache), 'v2' (mlx-lm full K/V: (B, H, S, dn+dr) keys and
    (B, H, S, dv) values) or 'v3' (mlx-lm latent: (B, 1, S, r) and (B, 1, S, dr)).
    """
    from mlx_lm.models.cache import KVCache

    r, dr = config["kv_lora_rank"], config["qk_rope_head_dim"]
    H, dn, dv = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    n = S + spare
    if kind == "latent":
        cache = LatentCache()
        cache.update_and_fetch(_rand((1, n, r), seed), _rand((1, n, dr), seed + 1))
    else:
        cache = KVCache()
        if kind == "v2":
            cache.update_and_fetch(_rand((1, H, n, dn + dr), seed), _rand((1, H, n, dv), seed + 1))
        else:
            cache.update_and_fetch(_rand((1, 1, n, r), seed), _rand((1, 1, n, dr), seed + 1))
    mx.eval(cache.state)
    cache.trim(spare)  # S positions; the room for ``spare`` more stays allocated
    return cache


def cache_bytes(kind: str, config: Dict, S: int) -> int:
    """Bytes of S cached positions (float32), whatever the preallocation."""
    r, dr = config["kv_lora_rank"], config["qk_rope_head_dim"]
    H, dn, dv = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    per = (r + dr) if kind in ("latent", "v3") else H * (dn + dr + dv)
    return per * S * DTYPE.size


def _step_fn(layer, cache, x, mask, S):
    L = x.shape[1]

    def fn():
        mx.eval(layer(x, mask, cache))
        cache.trim(L)  # back to S positions: every call appends at position S (there is room)
    return fn


def measure(config: Dict = V2_LITE, contexts=CONTEXTS, prefill: int = PREFILL,
            repeats: int = 5, rows=STRATEGY_ROWS + PEER_ROWS, chunks=CHUNKS,
            chunk_cache: int = CHUNK_CACHE, log=print) -> List[Dict]:
    """Rows {'phase', 'S', 'L', 'impl', 'ms', 'flops', 'bytes_read', 'cache_bytes'}.

    phase 'decode': L = 1 with S cached positions; phase 'prefill': an L = ``prefill``
    chunk on an empty cache (S = L attended positions, causal); phase 'short_prefill': an
    L-token chunk (each of ``chunks``) over ``chunk_cache`` cached positions
    (S = chunk_cache + L). Per point, every row's
    first call is made; a row whose first call took > 5 s is timed by it alone (warm-up
    effects are noise at that length); the others are warmed up and then timed
    ``repeats`` times round-robin (fewer when slow rows share the point), median.
    """
    args = ModelArgs.from_dict(config)
    layers = {}
    for name in rows:
        if name in STRATEGY_ROWS:
            layers[name] = ("latent", ours(config, name))
        else:
            layers[name] = ("v2" if name.endswith("v2") else "v3",
                            peer(config, "v2" if name.endswith("v2") else "v3"))
    points = [("decode", S, 1) for S in contexts]
    if prefill:
        points.append(("prefill", prefill, prefill))
    points += [("short_prefill", chunk_cache + L, L) for L in chunks]
    out = []
    for phase, S, L in points:
        offset = S if phase == "decode" else S - L
        x = _rand((1, L, config["hidden_size"]), 7)
        fns, times = {}, {}
        for name in rows:  # first call of each; seconds-long ones are timed by it alone
            kind, layer = layers[name]
            cache = filled_cache(kind, config, offset, spare=L + 1)
            mask = cache.make_mask(L, return_array=True, window_size=None)
            fns[name] = _step_fn(layer, cache, x, mask, offset)
            t0 = time.perf_counter()
            fns[name]()
            first = time.perf_counter() - t0
            times[name] = [first] if first > 5.0 else []
        fast = [n for n in rows if not times[n]]
        for n in fast:  # warm-up
            fns[n]()
        reps = repeats if all(len(times[n]) == 0 for n in rows) else max(3, repeats // 2)
        for _ in range(reps):  # round-robin, so load changes hit every row alike
            for n in fast:
                t0 = time.perf_counter()
                fns[n]()
                times[n].append(time.perf_counter() - t0)
        for name in rows:
            kind, layer = layers[name]
            ms = 1e3 * float(np.median(times[name]))
            cost_name = _cost_name(name, args, L, S)
            c = costs.step_costs(args, cost_name, S=S, L=L, itemsize=DTYPE.size, bits=BITS,
                                 group_size=GROUP)
            row = {"phase": phase, "S": S, "L": L, "impl": name, "ms": round(ms, 3),
                   "cost_model": cost_name, "flops": c.flops, "bytes_read": c.bytes_read,
                   "cache_bytes": cache_bytes(kind, config, S)}
            if name == "absorb-materialized":
                row["extra_param_bytes"] = layer.strategy.derived_nbytes
            out.append(row)
            log(f"{phase:13s} S={S:6d} L={L:5d} {name:20s} {ms:9.2f} ms  "
                f"{c.flops / 1e6:9.1f} MFLOP {c.bytes_read / 1e6:8.1f} MB read  "
                f"cache {row['cache_bytes'] / 1e6:7.1f} MB")
        del fns
    return out


def _rules(best: Dict[int, str]) -> tuple:
    """Rules [(minimum S, name)] from the fastest candidate at each measured S (the first
    rule from 0; a new rule starts at the first S where another candidate is fastest)."""
    rules = []
    for S in sorted(best):
        if not rules or rules[-1][1] != best[S]:
            rules.append((0 if not rules else S, best[S]))
    return tuple(rules)


def _fastest(rows: List[Dict], phase: str, key: str, candidates) -> Dict[int, str]:
    """{rows' ``key`` value: fastest candidate} for the rows of ``phase``. An ``auto`` row
    is a second sample of the strategy it ran (its ``cost_model``); a strategy's time is
    the smaller of its samples (on a shared machine, noise only ever adds time)."""
    best = {}
    for r in rows:
        name = r.get("cost_model") if r["impl"] == "auto" else r["impl"]
        if r["phase"] == phase and name in candidates:
            if r[key] not in best or r["ms"] < best[r[key]][0]:
                best[r[key]] = (r["ms"], name)
    return {k: v[1] for k, v in best.items()}


def crossover_table(rows: List[Dict], candidates=("naive", "absorb-materialized", "absorb")) -> Table:
    """The ``auto`` table these rows (one BLAS) measure. Decode and prefill: the fastest
    candidate at each measured S, as rules. Short prefill chunks: ``short_chunk`` is the
    longest measured chunk L such that an absorbed strategy is the fastest at it and at
    every shorter measured chunk (1, no such phase, if none), with the rule of the winner
    at the longest of those (one cache length is measured, so one rule from S = 0)."""
    decode = _rules(_fastest(rows, "decode", "S", candidates))
    prefill = _rules(_fastest(rows, "prefill", "S", candidates))
    chunk = _fastest(rows, "short_prefill", "L", candidates)
    short_chunk, short = 1, ()
    for L in sorted(chunk):
        if chunk[L] == "naive":
            break
        short_chunk, short = L, ((0, chunk[L]),)
    return Table(decode=decode or ((0, "absorb"),), prefill=prefill or ((0, "naive"),),
                 short_prefill=short, short_chunk=short_chunk)


def markdown_table(rows: List[Dict]) -> str:
    """The README table: ms per layer per impl and point, analytic MFLOP / MB read beside."""
    points = list(dict.fromkeys((r["phase"], r["S"], r["L"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    at = {(r["phase"], r["S"], r["impl"]): r for r in rows}
    names = {"decode": "decode S={S}", "prefill": "prefill L={L}",
             "short_prefill": "chunk L={L} @{cached}"}
    head = ["impl"] + [names[ph].format(S=S, L=L, cached=f"{(S - L) // 1024}K")
                       for ph, S, L in points]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for impl in impls:
        cells = [f"`{impl}`" if not impl.startswith("mlx-lm") else impl]
        for ph, S, _ in points:
            r = at[ph, S, impl]
            cells.append(f"{r['ms']:.1f} ms ({r['flops'] / 1e6:,.0f} MF, "
                         f"{r['bytes_read'] / 1e6:,.0f} MB)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cost_name(name: str, args: ModelArgs, L: int, S: int) -> str:
    """The analytic model of a row: peers map onto the strategy they compute."""
    if name == "auto":
        return choose(table_for(backend_key()), L, S)
    if name == "mlx-lm deepseek_v2":
        return "kv-cache"
    if name == "mlx-lm deepseek_v3":
        return "absorb" if L == 1 else "naive"
    return name


FIELDS = ["blas", "phase", "S", "L", "impl", "ms", "cost_model", "flops", "bytes_read",
          "cache_bytes", "extra_param_bytes"]


def plot(rows: List[Dict], path: Path, title: str) -> None:
    """Decode ms per layer against S, one panel per BLAS in ``rows``."""
    plt = pyplot()

    blases = list(dict.fromkeys(r.get("blas", "") for r in rows))
    fig, axes = plt.subplots(1, len(blases), figsize=(7.5 * len(blases), 4.8), squeeze=False,
                             sharey=True)
    for ax, b in zip(axes[0], blases):
        sel = [r for r in rows if r.get("blas", "") == b]
        for impl in dict.fromkeys(r["impl"] for r in sel):
            pts = sorted((r["S"], r["ms"]) for r in sel if r["impl"] == impl and r["phase"] == "decode")
            style = "--" if impl.startswith("mlx-lm") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length S (cached positions)")
        ax.set_ylabel("ms per layer decode step")
        ax.set_title(f"{title}\n{b + ' BLAS' if b else ''}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    p.add_argument("--prefill", type=int, default=PREFILL)
    p.add_argument("--chunks", type=int, nargs="*", default=CHUNKS)
    p.add_argument("--chunk-cache", type=int, default=CHUNK_CACHE)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--blas", nargs="+", default=None,
                   help="reference, openblas (CPU; default: both where OpenBLAS is installed) or current (this backend as it is: a GPU)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker_out:
        rows = measure(V2_LITE, a.contexts, a.prefill, a.repeats, chunks=a.chunks,
                       chunk_cache=a.chunk_cache)
        worker_result(a.worker_out, rows, {"backend_key": backend_key(),
                                           "measured_table": repr(crossover_table(rows))})
        return
    t = time.perf_counter()
    args = ["--contexts", *map(str, a.contexts), "--prefill", str(a.prefill),
            "--chunks", *map(str, a.chunks), "--chunk-cache", str(a.chunk_cache),
            "--repeats", str(a.repeats)]
    results = run_per_blas("benchmarks.mla_strategies", args, a.blas or default_blas())
    rows = [r for res in results for r in res["rows"]]
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, a.out / "mla_strategies.csv", FIELDS)
    (a.out / "mla_strategies.json").write_text(json.dumps(
        {"meta": {res["meta"]["blas"]: res["meta"] for res in results}}, indent=2))
    plot(rows, a.out / "mla_strategies.png",
         f"One MLA layer, DeepSeek-V2-Lite shape, 4-bit weights, float32, MLX {backend_name()}")
    for res in results:
        print(f"\n{res['meta']['blas_label']}:")
        print(markdown_table(res["rows"]))
        print(f"measured crossover table ({res['meta']['backend_key']}): "
              f"{res['meta']['measured_table']}")
    print(f"wrote {a.out / 'mla_strategies.csv'}, .json and .png in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
