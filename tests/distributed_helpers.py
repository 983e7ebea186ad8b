"""Running several ranks on this machine, and what the distributed tests share with the
script those ranks run (``rank_worker.py``).

``run_ranks`` starts each rank as ``mlx.launch --backend ring --hosts 127.0.0.1`` does
(MLX_RANK, and MLX_HOSTFILE naming a JSON ring of loopback addresses), but as separate
processes, so each rank's exit status and output can be checked: ``mlx.launch`` itself exits
0 whatever its ranks do, and terminates the others when one fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import mlx.core as mx

# Ranks get this long (s) before they count as hung; the longest run here (every case on
# two ranks) takes 30-40 s on 2 loaded cores.
TIMEOUT = 240


@dataclass
class RankResult:
    """One rank's exit status and its whole stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def free_ports(n: int) -> List[int]:
    """n loopback ports free right now (held open together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_ranks(n: int, argv: Sequence[str], timeout: float = TIMEOUT) -> List[RankResult]:
    """Run ``python argv`` as ranks 0..n-1 of a ring group on 127.0.0.1; wait for all.

    Raises:
        AssertionError: a rank still running after ``timeout`` seconds (all are killed).
    """
    ring = [[f"127.0.0.1:{p}"] for p in free_ports(n)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ring, f)
    procs = []
    try:
        for rank in range(n):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": f.name}
            procs.append(subprocess.Popen(
                [sys.executable, *argv], env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            ))
        results = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a rank was still running after {timeout} s: hung")
            results.append(RankResult(p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.unlink(f.name)


def greedy(model, prompt: List[int], n: int):
    """n greedy tokens after ``prompt`` through mlx-lm's ``generate_step`` (prefill in
    chunks of 16, each evaluated through the cache only, as mlx-lm does), with the log
    probabilities of every step: (tokens [n], logprobs (n, vocab) float32 numpy)."""
    import numpy as np
    from mlx_lm.generate import generate_step, generation_stream

    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=16,
                                 sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(tok))
        logprobs.append(np.array(lp.astype(mx.float32)))
    mx.synchronize(generation_stream)
    return tokens, np.stack(logprobs)


def partial_copy(src: Path, dst: Path, weight_files: Sequence[str]) -> Path:
    """``src`` with only ``weight_files`` of its weights (as a Mac that fetched only its
    rank's files holds it); other files linked."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name.endswith(".safetensors") and p.name not in weight_files:
            continue
        (dst / p.name).symlink_to(p.resolve())
    return dst
