"""``python -m mlx_mla.compare``: mlx_mla against stock mlx-lm on one model folder.

Loads the folder with mlx-lm (``deepseek_v2``, the reference) and with mlx_mla (each
requested strategy), one engine at a time, and runs both on the same tokens:

1. **Generation.** ``mlx_lm.generate.stream_generate`` with a greedy sampler
   (``make_sampler(temp=0)``) drives each engine (mlx_mla's latent cache plugs into the same
   loop). Its responses give prompt tok/s, generation tok/s and peak memory; the cache it
   filled gives bytes per token. Greedy agreement = the generated tokens are identical; the
   first differing one is named.
2. **Logits.** Both engines are then teacher-forced over the *same* sequence — the prompt
   plus mlx-lm's greedy tokens — as one prefill call for the prompt and one decode call per
   generated token (so prefill and decode paths of every strategy are both checked). Per
   position: max |Δlogit| and KL(mlx-lm ‖ mlx_mla) in float32.

Exit status: 0 when every strategy is within the threshold, 1 when one is not, 2 on a usage
or load error. The threshold (``THRESHOLDS``, by activation dtype; looser for quantized
folders) is printed with the results. Where mlx-lm cannot take the folder or dtype as it
is, only its side is adjusted, and the adjustment is printed:

- a config with ``rope_parameters`` (transformers 5) but no ``rope_scaling``: mlx-lm's
  ``deepseek_v2`` reads ``rope_scaling["factor"]``, so it gets ``rope_scaling`` copied from
  ``rope_parameters`` (``factor`` 1.0, i.e. plain RoPE, when there is no scaling);
- float parameters in another dtype than mlx_mla's activation dtype (e.g. a bfloat16
  checkpoint, which this CPU build cannot run through a bfloat16 MoE ``gather_mm``): cast to
  that dtype, as ``mlx_mla.load`` casts its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

DEFAULT_PROMPT = "ROMEO:"

# Agreement thresholds by activation dtype: (max |Δlogit|, mean KL over positions).
# float32: the two engines compute the same math in a different order (split vs fused
# projections, absorbed vs decompressed attention); on the fixture they agree to ~1e-5.
# Quantized folders: both read the same quantized weights, but ``absorb-materialized``
# re-quantizes its precomputed W_UQ·W_UKᵀ / W_O·W_UV (see that strategy), so the bound is
# wider there and stated per strategy.
THRESHOLDS: Dict[str, Tuple[float, float]] = {
    "float32": (1e-3, 1e-6),
    "float16": (0.25, 1e-3),
    "bfloat16": (0.5, 5e-3),
}
QUANTIZED_MATERIALIZED = (2.0, 1e-2)


@dataclass
class Threshold:
    """Agreement bound for one strategy: max |Δlogit| and mean KL(mlx-lm ‖ mlx_mla) over
    positions (float64 KL of float32 logits); ``note`` says which rule produced it."""

    max_abs_logit: float
    mean_kl: float
    note: str = ""

    def describe(self) -> str:
        return (f"max |Δlogit| ≤ {self.max_abs_logit:g}, mean KL ≤ {self.mean_kl:g}, "
                f"greedy tokens identical (a divergence at a near-tie, where mlx-lm's top two "
                f"logits are within {self.max_abs_logit:g}, is allowed)")


@dataclass
class RunResult:
    """One engine's run; logits-derived fields are None for the reference."""

    engine: str
    tokens: List[int]
    prompt_tps: float
    generation_tps: float
    peak_memory_bytes: int
    cache_bytes_per_token: float
    cache_layers: int
    max_abs_logit: Optional[float] = None
    mean_kl: Optional[float] = None
    first_logit_divergence: Optional[int] = None  # absolute position, None = none
    first_token_divergence: Optional[int] = None  # index into generated tokens
    tie_at_divergence: bool = False
    passed: Optional[bool] = None
    problems: List[str] = field(default_factory=list)


# ---------------------------------------------------------------- peer (mlx-lm) side


def peer_config_adjustments(config: dict) -> Tuple[dict, List[str]]:
    """``model_config`` overrides mlx-lm's ``deepseek_v2`` needs to take ``config``, and one
    line per override saying what was adjusted and why."""
    if config.get("rope_scaling"):
        return {}, []
    params = dict(config.get("rope_parameters") or {})
    overrides: dict = {}
    if "rope_theta" in params:
        overrides["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        scaling = {"type": "yarn", "factor": 1.0}  # factor 1 = plain RoPE in mlx-lm's YaRN
        why = "no rope scaling; mlx-lm's deepseek_v2 needs rope_scaling['factor'], given 1.0 (plain RoPE)"
    else:
        scaling = {"type": rope_type, **params}
        why = "mlx-lm's deepseek_v2 reads rope_scaling only; copied from rope_parameters"
    overrides["rope_scaling"] = scaling
    source = "rope_parameters" if config.get("rope_parameters") else "no rope config"
    return overrides, [f"config: {source} -> rope_scaling={json.dumps(scaling)} ({why})"]


def load_peer(path: Path, dtype: mx.Dtype, config: dict):
    """Stock ``mlx_lm.load`` of ``path`` with only the adjustments it needs.

    Returns (model, tokenizer, adjustments: list of printed lines).
    """
    import mlx_lm

    overrides, notes = peer_config_adjustments(config)
    model, tokenizer = mlx_lm.load(str(path), model_config=overrides or None)
    cast_from = sorted({
        str(v.dtype).replace("mlx.core.", "") for _, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype
    })
    if cast_from:
        model.update(tree_map(
            lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        ))
        mx.eval(model.parameters())
        target = str(dtype).replace("mlx.core.", "")
        notes.append(
            f"dtype: mlx-lm's float parameters cast {', '.join(cast_from)} -> {target}, "
            f"mlx_mla's activation dtype (mlx-lm would run the checkpoint dtype; this CPU "
            f"build has no bfloat16 gather_mm for the MoE)"
        )
    return model, tokenizer, notes


# ---------------------------------------------------------------- measurement


def cache_bytes_per_token(cache) -> float:
    """Physical cache bytes per cached token, all layers (sequence axis is -2 in both the
    mlx-lm KVCache (B, H, S, D) and the LatentCache (B, S, r))."""
    total = 0.0
    for c in cache:
        for a in c.state:
            if isinstance(a, mx.array) and a.ndim >= 2 and a.shape[-2] > 0:
                total += a.nbytes / a.shape[-2]
    return total


def generate(model, tokenizer, prompt: List[int], max_tokens: int):
    """Greedy generation through mlx-lm's ``stream_generate``.

    Returns (generated tokens, prompt_tps, generation_tps, peak memory bytes, cache).
    """
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=0.0)
    # warm-up: first calls allocate buffers and build kernels
    for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=2, sampler=sampler):
        pass
    cache = make_prompt_cache(model)
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    tokens, last = [], None
    for last in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                                sampler=sampler, prompt_cache=cache):
        tokens.append(int(last.token))
    peak = mx.get_peak_memory()
    return tokens, last.prompt_tps, last.generation_tps, peak, cache


def teacher_forced_logits(model, prompt: List[int], continuation: List[int]) -> np.ndarray:
    """float32 logits (positions, vocab) for ``prompt + continuation``: one prefill call for
    the prompt, then one cached decode call per continuation token (its logits at position
    i predict token i + 1). The last continuation token is fed too, so positions =
    len(prompt) + len(continuation)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array(prompt)[None], cache=cache)[0].astype(mx.float32)]
    mx.eval(out[0])
    out[0] = np.array(out[0])
    for t in continuation:
        logits = model(mx.array([[t]]), cache=cache)[0].astype(mx.float32)
        out.append(np.array(logits))
    return np.concatenate(out, axis=0)


def logit_stats(ref: np.ndarray, ours: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per position: max |Δlogit| and KL(softmax(ref) ‖ softmax(ours)), in float64."""
    ref = ref.astype(np.float64)
    ours = ours.astype(np.float64)
    diff = np.abs(ref - ours).max(axis=-1)

    def log_softmax(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(ours)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return diff, np.maximum(kl, 0.0)


def threshold_for(dtype_name: str, quantized: bool, strategy: str,
                  override: Tuple[Optional[float], Optional[float]]) -> Threshold:
    """The stated bound for (activation dtype, quantized folder?, strategy), with any
    ``--max-logit-diff`` / ``--max-kl`` override applied; see ``THRESHOLDS``."""
    max_abs, kl = THRESHOLDS.get(dtype_name, THRESHOLDS["bfloat16"])
    note = dtype_name
    if quantized and strategy == "absorb-materialized":
        max_abs, kl = max(max_abs, QUANTIZED_MATERIALIZED[0]), max(kl, QUANTIZED_MATERIALIZED[1])
        note += ", quantized: re-quantized absorbed weights"
    if override[0] is not None:
        max_abs = override[0]
    if override[1] is not None:
        kl = override[1]
    return Threshold(max_abs, kl, note)


def judge(result: RunResult, ref: RunResult, ref_logits: np.ndarray, ours_logits: np.ndarray,
          prompt_len: int, thr: Threshold) -> None:
    """Fill ``result``'s agreement fields against the reference."""
    diff, kl = logit_stats(ref_logits, ours_logits)
    result.max_abs_logit = float(diff.max())
    result.mean_kl = float(kl.mean())
    bad = np.nonzero((diff > thr.max_abs_logit) | (kl > thr.mean_kl))[0]
    result.first_logit_divergence = int(bad[0]) if bad.size else None

    ours, theirs = result.tokens, ref.tokens
    n = min(len(ours), len(theirs))
    first = next((i for i in range(n) if ours[i] != theirs[i]), None)
    if first is None and len(ours) != len(theirs):
        first = n
    result.first_token_divergence = first
    if first is not None and first < len(theirs) and first < len(ours):
        # logits at absolute position prompt_len - 1 + first chose generated token `first`
        row = ref_logits[prompt_len - 1 + first].astype(np.float64)
        result.tie_at_divergence = bool(row[theirs[first]] - row[ours[first]] <= thr.max_abs_logit)

    if result.max_abs_logit > thr.max_abs_logit:
        result.problems.append(f"max |Δlogit| {result.max_abs_logit:.3g} > {thr.max_abs_logit:g}")
    if result.mean_kl > thr.mean_kl:
        result.problems.append(f"mean KL {result.mean_kl:.3g} > {thr.mean_kl:g}")
    if first is not None and not result.tie_at_divergence:
        result.problems.append(f"greedy tokens differ from generated token {first}")
    result.passed = not result.problems


# ---------------------------------------------------------------- CLI


def _fmt_mem(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return json.dumps(tokenizer.decode(list(ids)), ensure_ascii=False)


def build_parser() -> argparse.ArgumentParser:
    from . import DEMO_MODEL, STRATEGIES

    p = argparse.ArgumentParser(
        prog="python -m mlx_mla.compare",
        description="Check mlx_mla against stock mlx-lm (deepseek_v2) on one model folder: "
                    "logit agreement, greedy agreement, speed, peak memory, cache bytes per token. "
                    "Exit 0 = agree within the printed threshold, 1 = disagree, 2 = error.",
    )
    p.add_argument("--model", default=str(DEMO_MODEL),
                   help="model folder (Hugging Face or mlx-lm layout); default: the bundled demo model")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"prompt text (default {DEFAULT_PROMPT!r})")
    src.add_argument("--text-file", type=Path, help="read the prompt from this file")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="truncate the encoded prompt to this many tokens (default 512)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--mla-strategy", nargs="+", default=list(STRATEGIES),
                   choices=list(STRATEGIES), metavar="S",
                   help=f"mlx_mla strategies to compare (default: all of {', '.join(STRATEGIES)})")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="activation dtype for both engines (default: mlx_mla's, float32 on CPU)")
    p.add_argument("--max-logit-diff", type=float, help="override the max |Δlogit| threshold")
    p.add_argument("--max-kl", type=float, help="override the mean KL threshold")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from . import load as mla_load
    from .loader import ModelLoadError, activation_dtype, read_config, resolve_model_path

    try:
        path = resolve_model_path(args.model)
        config = read_config(path)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = activation_dtype(args.dtype, config)
    dtype_name = str(dtype).replace("mlx.core.", "")
    quantized = bool(config.get("quantization"))
    import mlx_lm

    # Reference first, then free it, so each engine's peak memory holds only its weights.
    try:
        peer, tokenizer, notes = load_peer(path, dtype, config)
    except Exception as e:  # noqa: BLE001 - any failure of the peer is one error line
        print(f"error: mlx-lm could not load {path} ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if args.text_file is not None:
        text = args.text_file.read_text()
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    prompt = list(tokenizer.encode(text))[: args.max_prompt_tokens]
    if not prompt:
        print("error: the prompt encodes to no tokens", file=sys.stderr)
        return 2

    print(f"model: {path} ({config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
          f"{'quantized' if quantized else 'unquantized'}; activations {dtype_name}; "
          f"backend {'cpu' if mx.default_device() == mx.cpu else 'gpu'})")
    print(f"reference: mlx-lm {mlx_lm.__version__} deepseek_v2 (stock mlx_lm.load)")
    for n in notes:
        print(f"adjusted for mlx-lm: {n}")
    if not notes:
        print("adjusted for mlx-lm: nothing")

    ref_tokens, p_tps, g_tps, peak, cache = generate(peer, tokenizer, prompt, args.max_tokens)
    ref = RunResult("mlx-lm deepseek_v2", ref_tokens, p_tps, g_tps, peak,
                    cache_bytes_per_token(cache), len(cache))
    del cache
    ref_logits = teacher_forced_logits(peer, prompt, ref_tokens)
    del peer
    gc.collect()
    mx.clear_cache()
    print(f"tokens: {len(prompt)} prompt + {len(ref_tokens)} generated (greedy); logits compared "
          f"teacher-forced at {ref_logits.shape[0]} positions (prefill + one decode call per token)")

    try:
        model, _ = mla_load(path, mla_strategy=args.mla_strategy[0], dtype=dtype)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    override = (args.max_logit_diff, args.max_kl)
    results, thresholds = [], {}
    for strategy in args.mla_strategy:
        model.set_mla_strategy(strategy)
        toks, p_tps, g_tps, peak, cache = generate(model, tokenizer, prompt, args.max_tokens)
        r = RunResult(f"mlx_mla {strategy}", toks, p_tps, g_tps, peak,
                      cache_bytes_per_token(cache), len(cache))
        del cache
        ours_logits = teacher_forced_logits(model, prompt, ref_tokens)
        thr = threshold_for(dtype_name, quantized, strategy, override)
        thresholds[strategy] = thr
        judge(r, ref, ref_logits, ours_logits, len(prompt), thr)
        results.append(r)

    distinct = {(t.max_abs_logit, t.mean_kl) for t in thresholds.values()}
    for strategy, thr in thresholds.items():
        label = "threshold" if len(distinct) == 1 else f"threshold [{strategy}]"
        print(f"{label} ({thr.note}): {thr.describe()}")
        if len(distinct) == 1:
            break
    print()
    header = (f"{'engine':<30} {'max|Δlogit|':>11} {'mean KL':>9} {'greedy':>14} "
              f"{'prompt tok/s':>12} {'gen tok/s':>9} {'peak MiB':>9} {'cache B/tok':>11} "
              f"{'vs mlx-lm':>9}")
    print(header)
    print("-" * len(header))
    n_gen = len(ref.tokens)
    print(f"{ref.engine:<30} {'-':>11} {'-':>9} {'(reference)':>14} {ref.prompt_tps:>12.1f} "
          f"{ref.generation_tps:>9.1f} {_fmt_mem(ref.peak_memory_bytes):>9} "
          f"{ref.cache_bytes_per_token:>11,.0f} {'1.00x':>9}")
    for r in results:
        if r.first_token_divergence is None:
            greedy = f"{n_gen}/{n_gen} same"
        else:
            greedy = f"differ @{r.first_token_divergence}" + (" tie" if r.tie_at_divergence else "")
        ratio = ref.cache_bytes_per_token / r.cache_bytes_per_token if r.cache_bytes_per_token else 0
        print(f"{r.engine:<30} {r.max_abs_logit:>11.2e} {r.mean_kl:>9.1e} {greedy:>14} "
              f"{r.prompt_tps:>12.1f} {r.generation_tps:>9.1f} {_fmt_mem(r.peak_memory_bytes):>9} "
              f"{r.cache_bytes_per_token:>11,.0f} {'1/' + format(ratio, '.2f'):>9}")
    print()
    failed = [r for r in results if not r.passed]
    for r in results:
        if r.passed:
            continue
        print(f"FAIL {r.engine}: {'; '.join(r.problems)}")
        if r.first_logit_divergence is not None:
            pos = r.first_logit_divergence
            where = (f"prompt token {pos}" if pos < len(prompt)
                     else f"after generated token {pos - len(prompt)}")
            seq = prompt + ref.tokens
            print(f"  first diverging position: {pos} ({where}; input token {seq[pos]} "
                  f"{_decode(tokenizer, [seq[pos]])})")
        if r.first_token_divergence is not None and not r.tie_at_divergence:
            i = r.first_token_divergence
            theirs = ref.tokens[i:i + 1]
            ours = r.tokens[i:i + 1]
            print(f"  first differing generated token: {i} (position {len(prompt) + i}): "
                  f"mlx-lm {_decode(tokenizer, theirs)} vs mlx_mla {_decode(tokenizer, ours)}")
    print(f"mlx-lm continuation: {_decode(tokenizer, ref.tokens)}")
    if failed:
        print(f"result: FAIL ({len(failed)} of {len(results)} strategies outside the threshold)")
    else:
        print(f"result: PASS (all {len(results)} strategies within the threshold)")

    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": str(path), "dtype": dtype_name, "quantized": quantized,
            "mlx_lm_version": mlx_lm.__version__, "adjustments": notes,
            "prompt_tokens": prompt,
            "thresholds": {s: asdict(t) for s, t in thresholds.items()},
            "reference": asdict(ref), "results": [asdict(r) for r in results],
            "passed": not failed,
        }, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
