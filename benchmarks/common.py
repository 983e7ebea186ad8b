"""What the benchmarks share: DeepSeek-V2 shapes, the shared data folder, result files.

Benchmarks are modules of the ``benchmarks`` package, run from the repository root as
``python -m benchmarks.NAME``; tests import them the same way.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import mlx.core as mx

from mlx_mla import blas

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Bigger data than the repository carries (a clone has no such folder; see ``shared_file``).
SHARED = ROOT.parent / "shared"
SHARED_CORPUS = SHARED / "corpus" / "shakespeare-heldout.txt"

# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), the shape every benchmark
# sizes its models by; benchmarks change num_hidden_layers (and tests shrink the rest).
V2_LITE: Dict = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
    "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 100000, "eos_token_id": 100001,
}

# DeepSeek-V2 (236B, 21B active) and V2.5: the same shapes; they differ from V2-Lite in the
# fields below (deepseek-ai/DeepSeek-V2 and DeepSeek-V2.5 config.json; V2.5's YaRN mscale is 1.0).
V2: Dict = {
    **V2_LITE, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_routed_experts": 160, "q_lora_rank": 1536, "topk_method": "group_limited_greedy",
    "n_group": 8, "topk_group": 3, "routed_scaling_factor": 16.0,
}
V2_5: Dict = {**V2, "rope_scaling": {**V2["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0}}
# The released models, for tables computed from shapes alone (no weights). V2-Lite-Chat and
# Coder-V2-Lite (continued pre-training of V2-Lite) have V2-Lite's shapes.
MODEL_CONFIGS: Dict[str, Dict] = {
    "DeepSeek-V2-Lite": V2_LITE,
    "DeepSeek-V2-Lite-Chat": V2_LITE,
    "DeepSeek-Coder-V2-Lite": V2_LITE,
    "DeepSeek-V2": V2,
    "DeepSeek-V2.5": V2_5,
}


def summary(doc: str) -> str:
    """A module docstring's first paragraph on one line: a benchmark's --help description."""
    return " ".join(doc.split("\n\n")[0].split())


def with_layers(config: Dict, layers: int) -> Dict:
    """``config`` with ``layers`` decoder layers."""
    return {**config, "num_hidden_layers": layers}


def shared_file(path: Path, what: str) -> Path:
    """``path`` under ../shared/ if it exists.

    Raises:
        SystemExit: it is absent (a clone has no ../shared/), with one line saying what
            the benchmark needs it for and how to give another file.
    """
    if not Path(path).is_file():
        raise SystemExit(
            f"error: {path} is absent (../shared/ sits beside a development checkout, not a "
            f"clone); this benchmark needs it for {what}: pass another file with --corpus"
        )
    return Path(path)


# Environment variables that change which BLAS kernels run (recorded with every result).
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
            "MLX_MLA_BLAS", "LD_PRELOAD")


def machine_info() -> Dict:
    """Where a benchmark ran: CPU, cores, OS, MLX backend and versions, and the BLAS MLX
    multiplies with (``mlx_mla.blas.describe``; "gpu" on a GPU backend, whose matmuls do
    not use it) with the BLAS-related variables set."""
    import mlx_lm

    b = blas.describe()
    cpu = mx.default_device() == mx.cpu
    return {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, {platform.system()}",
        "backend": "MLX CPU" if cpu else "MLX GPU",
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
        "blas": b["kind"] if cpu else "gpu", "blas_label": b["label"] if cpu else "none (GPU backend)",
        "blas_preload": b["preload"],
        "blas_env": {k: os.environ[k] for k in BLAS_ENV if k in os.environ},
    }


# The BLAS a benchmark can be asked to run under (one fresh process each: a process cannot
# change its BLAS once MLX is loaded). "reference" keeps MLX's bundled netlib BLAS;
# "openblas" needs `pip install "mlx-mla[openblas]"` (mlx_mla.blas); "current": whatever
# this environment gives (a GPU backend, macOS' Accelerate), not checked.
BLAS_CHOICES = ("reference", "openblas", "current")


def default_blas() -> List[str]:
    """On MLX's CPU backend: OpenBLAS then reference where OpenBLAS is installed (and MLX
    bundles the reference BLAS), else the one this process has; on a GPU: "current"."""
    if mx.default_device() != mx.cpu or blas.describe()["kind"] not in ("reference", "openblas"):
        return ["current"]
    if blas.openblas_library() is not None:
        return ["openblas", "reference"]
    return [blas.describe()["kind"]]


def run_per_blas(module: str, argv: Sequence[str], names: Sequence[str],
                 log: Callable = print) -> List[Dict]:
    """Run ``python -m module *argv --worker-out FILE`` once per BLAS in ``names``, each in a
    fresh process with ``MLX_MLA_BLAS`` set for it, and return their results in order:
    [{"meta": machine_info() of that process, "rows": [...]}], every row with a ``blas``
    field. The worker writes that JSON to FILE (see ``worker_result``).

    Raises:
        SystemExit: a worker failed, or did not get the BLAS it was started for.
    """
    out = []
    for name in names:
        if name not in BLAS_CHOICES:
            raise SystemExit(f"error: unknown BLAS {name!r}: choose from {', '.join(BLAS_CHOICES)}")
        env = dict(os.environ)
        if name != "current":
            env["MLX_MLA_BLAS"] = "reference" if name == "reference" else "auto"
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "rows.json"
            log(f"--- {module} under {name} BLAS")
            proc = subprocess.run([sys.executable, "-m", module, *argv, "--worker-out", str(result)],
                                  env=env, cwd=ROOT)
            if proc.returncode != 0 or not result.exists():
                raise SystemExit(f"error: {module} under {name} BLAS failed (exit {proc.returncode})")
            data = json.loads(result.read_text())
        if name != "current" and data["meta"]["blas"] != name:
            raise SystemExit(f"error: asked for {name} BLAS, the worker ran on "
                             f"{data['meta']['blas_label']} ({data['meta']['blas_preload']})")
        out.append(data)
    return out


def worker_result(path: Path, rows: List[Dict], meta: Dict = None) -> None:
    """Write a ``run_per_blas`` worker's rows (each tagged with this process's BLAS) and
    meta (``machine_info()`` plus ``meta``) to ``path`` as JSON."""
    info = {**machine_info(), **(meta or {})}
    tagged = [{"blas": info["blas"], **r} for r in rows]
    Path(path).write_text(json.dumps({"meta": info, "rows": tagged}))


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (benchmarks write PNGs; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out ``fig``, write it to ``path`` (a PNG at ``dpi``) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def write_csv(rows: List[Dict], path: Path, fields: List[str] = None) -> None:
    """Rows as CSV (columns: ``fields``, or the first row's keys; missing cells empty)."""
    fields = fields or list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in fields})
