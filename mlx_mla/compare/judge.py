"""How ``compare`` decides: thresholds by activation dtype, and a verdict per strategy.

Agreement is max |Δlogit| and mean KL(mlx-lm ‖ mlx_mla) over positions (float64 KL of
float32 logits), and greedy tokens identical — a divergence at a near-tie, where mlx-lm's
top two logits are within the logit bound, is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from .measure import Run

# Agreement thresholds by activation dtype: (max |Δlogit|, mean KL over positions).
# float32: the two engines compute the same math in a different order (split vs fused
# projections, absorbed vs decompressed attention); on the fixture they agree to ~1e-5.
# Quantized folders get the same bound: both engines read the same quantized tensors, and
# every strategy keeps what it derives from them in float (absorb-materialized included;
# measured on every folder the converter writes, ``benchmarks/compare_quantized.py``).
THRESHOLDS: Dict[str, Tuple[float, float]] = {
    "float32": (1e-3, 1e-6),
    "float16": (0.25, 1e-3),
    "bfloat16": (0.5, 5e-3),
}


@dataclass
class Threshold:
    """Agreement bound for one strategy: max |Δlogit| and mean KL(mlx-lm ‖ mlx_mla) over
    positions; ``note`` says which rule produced it."""

    max_abs_logit: float
    mean_kl: float
    note: str = ""

    def describe(self) -> str:
        return (f"max |Δlogit| ≤ {self.max_abs_logit:g}, mean KL ≤ {self.mean_kl:g}, "
                f"greedy tokens identical (a divergence at a near-tie, where mlx-lm's top two "
                f"logits are within {self.max_abs_logit:g}, is allowed)")


@dataclass
class Verdict:
    """One strategy against the reference.

    first_logit_divergence: the first absolute position outside the bound (None: none);
    first_token_divergence: the first differing generated token's index (None: none).
    """

    max_abs_logit: float
    mean_kl: float
    first_logit_divergence: Optional[int]
    first_token_divergence: Optional[int]
    tie_at_divergence: bool
    problems: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def threshold_for(dtype_name: str,
                  override: Tuple[Optional[float], Optional[float]] = (None, None)) -> Threshold:
    """The stated bound for the activation dtype (``THRESHOLDS``; an unlisted dtype gets
    bfloat16's), with any ``--max-logit-diff`` / ``--max-kl`` override applied."""
    max_abs, kl = THRESHOLDS.get(dtype_name, THRESHOLDS["bfloat16"])
    if override[0] is not None:
        max_abs = override[0]
    if override[1] is not None:
        kl = override[1]
    return Threshold(max_abs, kl, dtype_name)


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


def judge(ours: Run, ref: Run, ref_logits: np.ndarray, ours_logits: np.ndarray,
          prompt_len: int, thr: Threshold) -> Verdict:
    """The verdict on ``ours`` against the reference run and its teacher-forced logits."""
    diff, kl = logit_stats(ref_logits, ours_logits)
    bad = np.nonzero((diff > thr.max_abs_logit) | (kl > thr.mean_kl))[0]
    a, b = ours.tokens, ref.tokens
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None and len(a) != len(b):
        first = n
    tie = False
    if first is not None and first < n:
        # logits at absolute position prompt_len - 1 + first chose generated token `first`
        row = ref_logits[prompt_len - 1 + first].astype(np.float64)
        tie = bool(row[b[first]] - row[a[first]] <= thr.max_abs_logit)
    v = Verdict(float(diff.max()), float(kl.mean()), int(bad[0]) if bad.size else None,
                first, tie)
    if v.max_abs_logit > thr.max_abs_logit:
        v.problems.append(f"max |Δlogit| {v.max_abs_logit:.3g} > {thr.max_abs_logit:g}")
    if v.mean_kl > thr.mean_kl:
        v.problems.append(f"mean KL {v.mean_kl:.3g} > {thr.mean_kl:g}")
    if first is not None and not tie:
        v.problems.append(f"greedy tokens differ from generated token {first}")
    return v
