"""What the benchmarks share: DeepSeek-V2 shapes, the shared data folder, result files.

Benchmarks are modules of the ``benchmarks`` package, run from the repository root as
``python -m benchmarks.NAME``; tests import them the same way.
"""

from __future__ import annotations

import csv
import os
import platform
from pathlib import Path
from typing import Dict, List

import mlx.core as mx

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


# DeepSeek-V2 (236B) and V2.5: the same shapes; they differ from V2-Lite in the fields below
# (deepseek-ai/DeepSeek-V2 and DeepSeek-V2.5 config.json; V2.5's YaRN mscale is 1.0).
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


def machine_info() -> Dict:
    """Where a benchmark ran: CPU, cores, OS, MLX backend and versions."""
    import mlx_lm

    return {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, {platform.system()}",
        "backend": "MLX CPU" if mx.default_device() == mx.cpu else "MLX GPU",
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
    }


def write_csv(rows: List[Dict], path: Path, fields: List[str] = None) -> None:
    """Rows as CSV (columns: ``fields``, or the first row's keys; missing cells empty)."""
    fields = fields or list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in fields})
