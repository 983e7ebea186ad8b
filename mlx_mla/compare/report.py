"""How ``compare`` reports: the printed table and failure details, and the JSON file."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Dict, List, Sequence

from .judge import Threshold, Verdict
from .measure import Run


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def quoted(tokenizer, ids: Sequence[int]) -> str:
    return json.dumps(tokenizer.decode(list(ids)), ensure_ascii=False)


def threshold_lines(thresholds: Dict[str, Threshold]) -> List[str]:
    """One line if every strategy has the same bound, else one per strategy."""
    distinct = {(t.max_abs_logit, t.mean_kl) for t in thresholds.values()}
    if len(distinct) == 1:
        thr = next(iter(thresholds.values()))
        return [f"threshold ({thr.note}): {thr.describe()}"]
    return [f"threshold [{s}] ({t.note}): {t.describe()}" for s, t in thresholds.items()]


def table_lines(ref: Run, runs: List[Run], verdicts: List[Verdict]) -> List[str]:
    """The side-by-side table: agreement, speed, memory and cache size per engine."""
    header = (f"{'engine':<30} {'max|Δlogit|':>11} {'mean KL':>9} {'greedy':>14} "
              f"{'prompt tok/s':>12} {'gen tok/s':>9} {'peak MiB':>9} {'cache B/tok':>11} "
              f"{'vs mlx-lm':>9}")
    lines = [header, "-" * len(header),
             f"{ref.engine:<30} {'-':>11} {'-':>9} {'(reference)':>14} {ref.prompt_tps:>12.1f} "
             f"{ref.generation_tps:>9.1f} {_mib(ref.peak_memory_bytes):>9} "
             f"{ref.cache_bytes_per_token:>11,.0f} {'1.00x':>9}"]
    n_gen = len(ref.tokens)
    for r, v in zip(runs, verdicts):
        if v.first_token_divergence is None:
            greedy = f"{n_gen}/{n_gen} same"
        else:
            greedy = f"differ @{v.first_token_divergence}" + (" tie" if v.tie_at_divergence else "")
        ratio = ref.cache_bytes_per_token / r.cache_bytes_per_token if r.cache_bytes_per_token else 0
        lines.append(
            f"{r.engine:<30} {v.max_abs_logit:>11.2e} {v.mean_kl:>9.1e} {greedy:>14} "
            f"{r.prompt_tps:>12.1f} {r.generation_tps:>9.1f} {_mib(r.peak_memory_bytes):>9} "
            f"{r.cache_bytes_per_token:>11,.0f} {'1/' + format(ratio, '.2f'):>9}")
    return lines


def failure_lines(run: Run, v: Verdict, ref: Run, prompt: List[int], tokenizer) -> List[str]:
    """What failed and where: the first diverging position and the first differing token."""
    lines = [f"FAIL {run.engine}: {'; '.join(v.problems)}"]
    if v.first_logit_divergence is not None:
        pos = v.first_logit_divergence
        where = (f"prompt token {pos}" if pos < len(prompt)
                 else f"after generated token {pos - len(prompt)}")
        seq = prompt + ref.tokens
        lines.append(f"  first diverging position: {pos} ({where}; input token {seq[pos]} "
                     f"{quoted(tokenizer, [seq[pos]])})")
    if v.first_token_divergence is not None and not v.tie_at_divergence:
        i = v.first_token_divergence
        lines.append(
            f"  first differing generated token: {i} (position {len(prompt) + i}): "
            f"mlx-lm {quoted(tokenizer, ref.tokens[i:i + 1])} vs mlx_mla "
            f"{quoted(tokenizer, run.tokens[i:i + 1])}")
    return lines


def summary_line(verdicts: List[Verdict]) -> str:
    failed = sum(not v.passed for v in verdicts)
    if failed:
        return f"result: FAIL ({failed} of {len(verdicts)} strategies outside the threshold)"
    return f"result: PASS (all {len(verdicts)} strategies within the threshold)"


def as_json(header: dict, ref: Run, runs: List[Run], verdicts: List[Verdict],
            thresholds: Dict[str, Threshold]) -> str:
    """Everything printed, as JSON: ``header`` (model, dtype, …), the thresholds, the
    reference run, and each strategy's run merged with its verdict."""
    results = [{**asdict(r), **asdict(v), "passed": v.passed} for r, v in zip(runs, verdicts)]
    return json.dumps({
        **header, "thresholds": {s: asdict(t) for s, t in thresholds.items()},
        "reference": asdict(ref), "results": results,
        "passed": all(v.passed for v in verdicts),
    }, indent=2)
