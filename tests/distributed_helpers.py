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
from typing import Dict, List, Sequence

import mlx.core as mx

from mlx_mla.distributed import layer_of

# Ranks get this long (s) before they count as hung; a run here takes ~10 s on 2 cores.
TIMEOUT = 240


@dataclass
class RankResult:
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


def consecutive_free_ports(n: int) -> int:
    """A first port p with p .. p+n-1 free on 127.0.0.1 (``mlx.launch --starting-port``)."""
    import random

    for _ in range(100):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


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


def reshard_by_layer(src: Path, dst: Path) -> Dict[str, List[str]]:
    """``src`` (a Hugging Face folder) copied to ``dst`` with its weights re-sharded into one
    file per decoder layer plus ``model-rest.safetensors`` (embeddings, norm, head) and an
    index, so which file a rank opens says which layers it read.
    Returns {file name: tensor names}."""
    dst.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("model*.safetensors")):
        tensors.update(mx.load(str(f)))
    files: Dict[str, List[str]] = {}
    for name in tensors:
        i = layer_of(name)
        file = "model-rest.safetensors" if i is None else f"model-layer{i:02d}.safetensors"
        files.setdefault(file, []).append(name)
    for file, names in files.items():
        mx.save_safetensors(str(dst / file), {k: tensors[k] for k in names}, {"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    for p in src.iterdir():
        if not p.name.startswith("model"):
            (dst / p.name).write_bytes(p.read_bytes())
    return files


def partial_copy(src: Path, dst: Path, weight_files: Sequence[str]) -> Path:
    """``src`` with only ``weight_files`` of its weights (as a Mac that fetched only its
    rank's files holds it); other files linked."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name.endswith(".safetensors") and p.name not in weight_files:
            continue
        (dst / p.name).symlink_to(p.resolve())
    return dst
