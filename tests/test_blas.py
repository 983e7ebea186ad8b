"""mlx_mla.blas: OpenBLAS loaded in place of MLX's bundled reference BLAS, and detected.

Each case runs in a fresh interpreter (a process cannot change its BLAS once MLX is
loaded). The reference for the products is numpy in float64.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_mla import blas

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = blas._mlx_bundled_libs()
needs_bundled = pytest.mark.skipif(BUNDLED is None, reason="MLX does not bundle the reference BLAS here")
needs_openblas = pytest.mark.skipif(
    BUNDLED is None or blas.openblas_library() is None,
    reason='needs Linux, mlx[cpu] and cmeel-openblas (pip install "mlx-mla[openblas]")')

PROBE = """
import json, sys
{pre}
import mlx_mla
import mlx.core as mx
import numpy as np
from mlx_mla import blas
a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((200, 100)).astype(np.float32)
ref = a.astype(np.float64) @ b.astype(np.float64)
err = float(np.abs(np.array(mx.array(a) @ mx.array(b)) - ref).max() / np.abs(ref).max())
x = mx.array(np.eye(64, dtype=np.float32) * 3 + a[:64, :64] * 0.01)
inv_err = float(mx.abs(mx.linalg.inv(x, stream=mx.cpu) @ x - mx.eye(64)).max())  # LAPACK
print(json.dumps({{**blas.describe(), "err": err, "inv_err": inv_err}}))
"""


def probe(env_blas=None, pre="", cache=None):
    env = {k: v for k, v in os.environ.items() if k != "MLX_MLA_BLAS"}
    if env_blas is not None:
        env["MLX_MLA_BLAS"] = env_blas
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    out = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_openblas
def test_openblas_is_loaded_before_mlx_and_computes_right(tmp_path):
    d = probe(cache=tmp_path)
    assert d["kind"] == "openblas" and d["preload"] == "loaded", d
    assert d["label"].startswith("OpenBLAS 0.3.") and "threads" in d["label"]
    assert d["err"] < 1e-5 and d["inv_err"] < 1e-4
    if not any(Path(p, "libgfortran.so.5").exists() for p in ("/lib", "/usr/lib",
               "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu")):
        # no system libgfortran: the renamed copy of mlx[cpu]'s was written to the cache
        copies = list((tmp_path / "mlx-mla").glob(f"libgfortran-*.{blas.GFORTRAN}"))
        assert len(copies) == 1 and blas.read_soname(copies[0]) == blas.GFORTRAN


@needs_bundled
def test_reference_when_asked_for_or_when_mlx_came_first():
    d = probe("reference")
    assert d["kind"] == "reference" and d["preload"] == "MLX_MLA_BLAS=reference"
    assert d["err"] < 1e-5 and d["inv_err"] < 1e-4
    d = probe(pre="import mlx.core")  # too late to preload: says so, and stays on reference
    assert d["kind"] == "reference"
    assert d["preload"] in ("mlx.core was imported before mlx_mla",
                            'cmeel-openblas not installed (pip install "mlx-mla[openblas]")')
    assert blas._try_preload("fast") == "MLX_MLA_BLAS='fast' is not one of auto, reference: not loaded"


@needs_bundled
def test_with_soname_rewrites_only_the_soname(tmp_path):
    src = next(iter(sorted(BUNDLED.glob("libgfortran-*.so*"))))
    old = blas.read_soname(src)
    dst = blas.with_soname(src, tmp_path / "copy.so", "libgfortran.so.5")
    assert blas.read_soname(dst) == "libgfortran.so.5"
    a = np.frombuffer(src.read_bytes(), np.uint8)
    b = np.frombuffer(dst.read_bytes(), np.uint8)
    diff = np.flatnonzero(a != b)
    assert a.size == b.size and diff.size and diff[-1] - diff[0] < len(old)
    with pytest.raises(ValueError, match="longer"):
        blas.with_soname(src, tmp_path / "x.so", old + "-longer")
    with pytest.raises(ValueError, match="ELF"):
        blas.read_soname(Path(__file__))


@needs_openblas
def test_generate_prints_the_blas():
    out = subprocess.run([sys.executable, "-m", "mlx_mla.generate", "--max-tokens", "2",
                          "--temp", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "MLX_MLA_BLAS"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("BLAS: OpenBLAS 0.3.")


def test_machine_info_records_the_blas_this_process_uses():
    from benchmarks.common import machine_info

    info = machine_info()
    assert info["blas"] == blas.kind() and info["blas_label"] == blas.describe()["label"]
    assert isinstance(info["blas_env"], dict)


def test_run_per_blas_refuses_an_unknown_blas():
    from benchmarks.common import BLAS_CHOICES, default_blas, run_per_blas

    with pytest.raises(SystemExit, match="unknown BLAS 'mkl'"):
        run_per_blas("benchmarks.prefill_gemm", [], ["mkl"], log=lambda *_: None)
    assert set(default_blas()) <= set(BLAS_CHOICES) | {blas.kind()}
