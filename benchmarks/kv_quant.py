"""Quantized latent cache quality: KL and top-1 against the float cache, and whether k_pe
should be quantized too.

The demo model (the fixture's weights) reads the held-out text in 32-token chunks, its
cache quantized after the first chunk (what ``--kv-bits`` does past ``--quantized-kv-start``):
c_kv at 8 and 4 bits (group 64, MLX's affine format, as stored), and k_pe either kept in
float or quantized too. The demo model's k_pe has 16 values, fewer than MLX's smallest group
(32), so quantizing it is emulated (round to ``bits`` with one scale and minimum per 16
values, finer than MLX could store): a lower bound on what quantizing k_pe would cost.
Metric per position: KL(float cache ‖ quantized cache) of next-token distributions, and
agreement of the arg-max.

    python -m benchmarks.kv_quant            # ~2 minutes; --corpus for other text
Writes benchmarks/results/kv_quant.{csv,json,png}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

import mlx_mla
from mlx_mla.cache import LatentCache

from .common import (summary, RESULTS, SHARED_CORPUS, machine_info, pyplot, save_figure, shared_file,
                     write_csv)

PLANS = [(8, None), (8, 8), (4, None), (4, 8), (4, 4)]  # (c_kv bits, k_pe bits or float)


def fake_quantize(x: mx.array, bits: int, group: int = 16) -> mx.array:
    """x rounded to ``bits`` with one scale and minimum per ``group`` values (last axis)."""
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // group, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = mx.maximum((hi - lo) / (2**bits - 1), 1e-12)
    return (mx.round((g - lo) / scale) * scale + lo).reshape(shape)


class QuantizedKpeCache(LatentCache):
    """A LatentCache whose k_pe entries are rounded to ``KPE_BITS`` before they are stored."""

    KPE_BITS = 8

    def update_and_fetch(self, c_kv, k_pe):
        return super().update_and_fetch(c_kv, fake_quantize(k_pe, self.KPE_BITS))


def logits(model, tokens, bits=None, kpe_bits=None, chunk: int = 32) -> mx.array:
    """(len(tokens), vocab) float32 logits, the cache quantized after the first chunk."""
    if kpe_bits:
        QuantizedKpeCache.KPE_BITS = kpe_bits
        cache = [QuantizedKpeCache() for _ in model.layers]
    else:
        cache = model.make_cache()
    out = []
    for i in range(0, len(tokens), chunk):
        out.append(model(mx.array([tokens[i:i + chunk]]), cache=cache)[0])
        if bits:
            cache = [c.to_quantized(group_size=64, bits=bits) for c in cache]
    return mx.concatenate(out).astype(mx.float32)


def compare(ref: mx.array, q: mx.array) -> dict:
    lp = ref - mx.logsumexp(ref, -1, keepdims=True)
    lq = q - mx.logsumexp(q, -1, keepdims=True)
    kl = (mx.exp(lp) * (lp - lq)).sum(-1)
    return {"kl": kl.mean().item(), "top1": (ref.argmax(-1) == q.argmax(-1)).mean().item()}


def run(text: str, n_tokens: int, strategy: str = "absorb") -> list:
    model, tok = mlx_mla.load(mlx_mla.DEMO_MODEL, mla_strategy=strategy, dtype="float32")
    tokens = tok.encode(text)[:n_tokens]
    ref = logits(model, tokens)
    rows = []
    for bits, kpe_bits in PLANS:
        m = compare(ref, logits(model, tokens, bits, kpe_bits))
        rows.append({"c_kv_bits": bits, "k_pe": f"{kpe_bits}-bit (emulated, group 16)"
                     if kpe_bits else "float", "tokens": len(tokens), **m})
        print(f"c_kv {bits}-bit, k_pe {rows[-1]['k_pe']:28s} KL {m['kl']:.2e}  top-1 {m['top1']:.2%}")
    return rows


def plot(rows, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"c_kv {r['c_kv_bits']}b\nk_pe {r['k_pe'].split(' ')[0]}" for r in rows]
    ax.bar(labels, [r["kl"] for r in rows], color=["tab:green" if r["k_pe"] == "float" else "tab:gray"
                                                   for r in rows])
    ax.axhline(1e-3, ls="--", c="k", lw=1, label="8-bit target: KL ≤ 1e-3")
    ax.set(yscale="log", ylabel="KL(float cache ‖ quantized)", title="Quantized latent cache, demo model")
    ax.legend()
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--corpus", type=Path, default=SHARED_CORPUS,
                   help="held-out text to read (default: ../shared/corpus/shakespeare-heldout.txt)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of it to read (default 4096)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    args = p.parse_args(argv)
    t0 = time.time()
    text = shared_file(args.corpus, "held-out text to measure the KL on").read_text()
    rows = run(text, args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "kv_quant.csv")
    (args.out / "kv_quant.json").write_text(json.dumps(
        {"meta": {**machine_info(), "corpus": str(args.corpus), "seconds": time.time() - t0},
         "rows": rows}, indent=2))
    plot(rows, args.out / "kv_quant.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
