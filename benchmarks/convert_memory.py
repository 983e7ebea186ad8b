"""Peak memory of converting a multi-shard checkpoint: ours (streaming) vs mlx_lm.convert.

Generates a random bf16 checkpoint with DeepSeek-V2-Lite's shapes but fewer layers
(hidden 2048, 64 experts of 1408, vocab 102400; default 4 layers = ~4.4 GB in ~1 GB
shards), converts it with `-q` by both converters, each in a fresh subprocess, and
records the child's peak RSS (`os.wait4` rusage). The checkpoint lives in a temporary
folder that is deleted afterwards.

    python -m benchmarks.convert_memory                 # ~5 minutes, ~10 GB of disk
Writes benchmarks/results/convert_memory.csv and convert_memory.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_mla import DEMO_MODEL

from .common import RESULTS, ROOT, V2_LITE, summary


def hf_shapes(config: dict) -> dict:
    """{HF tensor name: shape} of a DeepSeek-V2 checkpoint (per-expert names, as on the Hub)."""
    h, v = config["hidden_size"], config["vocab_size"]
    heads, nope, rope, vd = (config["num_attention_heads"], config["qk_nope_head_dim"],
                             config["qk_rope_head_dim"], config["v_head_dim"])
    kv, e, moe = config["kv_lora_rank"], config["n_routed_experts"], config["moe_intermediate_size"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (heads * (nope + rope), h),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (kv + rope, h),
            f"{p}.self_attn.kv_a_layernorm.weight": (kv,),
            f"{p}.self_attn.kv_b_proj.weight": (heads * (nope + vd), kv),
            f"{p}.self_attn.o_proj.weight": (h, heads * vd),
        })
        if i < config["first_k_dense_replace"]:
            inter = config["intermediate_size"]
            shapes.update({f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
                           f"{p}.mlp.down_proj.weight": (h, inter)})
            continue
        shapes[f"{p}.mlp.gate.weight"] = (e, h)
        for j in range(e):
            shapes.update({f"{p}.mlp.experts.{j}.gate_proj.weight": (moe, h),
                           f"{p}.mlp.experts.{j}.up_proj.weight": (moe, h),
                           f"{p}.mlp.experts.{j}.down_proj.weight": (h, moe)})
        s = moe * config["n_shared_experts"]
        shapes.update({f"{p}.mlp.shared_experts.gate_proj.weight": (s, h),
                       f"{p}.mlp.shared_experts.up_proj.weight": (s, h),
                       f"{p}.mlp.shared_experts.down_proj.weight": (h, s)})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def make_checkpoint(folder: Path, config: dict, shard_bytes: int, seed: int = 0) -> int:
    """Write a random bf16 checkpoint as the Hub lays it out (shards + index + tokenizer).

    Generates one shard at a time, so the generator itself stays within one shard of memory.
    Returns the total bytes of tensor data.
    """
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    shapes = hf_shapes(config)
    groups, size = [[]], 0
    for name, shape in shapes.items():
        n = 2 * int(mx.prod(mx.array(shape)).item())
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map, total = {}, 0
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        arrays = {}
        for name in names:
            shape = shapes[name]
            a = mx.ones(shape) if len(shape) == 1 else 0.02 * mx.random.normal(shape)
            arrays[name] = a.astype(mx.bfloat16)
        mx.eval(arrays)
        mx.save_safetensors(str(folder / file), arrays, metadata={"format": "pt"})
        total += sum(a.nbytes for a in arrays.values())
        weight_map.update({n: file for n in names})
        del arrays
        mx.clear_cache()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(DEMO_MODEL / f, folder / f)
    return total


def peak_rss(cmd: list) -> tuple:
    """Run `cmd` in a fresh process; returns (peak RSS in bytes, seconds). Raises on failure."""
    t = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[2:4]} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return usage.ru_maxrss * 1024, time.time() - t  # ru_maxrss is in KiB on Linux


def converters(src: Path, out: Path) -> dict:
    py = sys.executable
    return {
        "mlx-mla convert -q": [py, "-m", "convert", "--hf-path", str(src), "--mlx-path", str(out / "ours"), "-q"],
        "mlx_lm.convert -q": [py, "-m", "mlx_lm", "convert", "--hf-path", str(src),
                              "--mlx-path", str(out / "mlx_lm"), "-q"],
    }


def run(config: dict, shard_bytes: int, workdir: Path) -> list:
    """Generate, convert with both, measure; returns rows (sizes in bytes)."""
    src = workdir / "src"
    total = make_checkpoint(src, config, shard_bytes)
    largest = max(f.stat().st_size for f in src.glob("*.safetensors"))
    rows = []
    for label, cmd in converters(src, workdir).items():
        rss, secs = peak_rss(cmd)
        out = Path(cmd[cmd.index("--mlx-path") + 1])
        out_files = list(out.glob("*.safetensors"))
        rows.append({
            "converter": label, "layers": config["num_hidden_layers"], "source_bytes": total,
            "largest_source_shard_bytes": largest, "output_bytes": sum(f.stat().st_size for f in out_files),
            "largest_output_shard_bytes": max(f.stat().st_size for f in out_files),
            "peak_rss_bytes": rss, "seconds": round(secs, 1),
        })
        shutil.rmtree(out)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (DeepSeek-V2-Lite has 27)")
    ap.add_argument("--shard-gb", type=float, default=1.0, help="source shard size")
    ap.add_argument("--workdir", type=Path, default=None, help="where to put the checkpoint (temp)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    config = {**V2_LITE, "num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        rows = run(config, int(args.shard_gb * (1 << 30)), Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "convert_memory.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    gb = 1 << 30
    for r in rows:
        print(f"{r['converter']:20s} source {r['source_bytes'] / gb:.2f} GiB (largest shard "
              f"{r['largest_source_shard_bytes'] / gb:.2f}) -> {r['output_bytes'] / gb:.2f} GiB; "
              f"peak RSS {r['peak_rss_bytes'] / gb:.2f} GiB, {r['seconds']} s")
    plot(rows, args.out / "convert_memory.png")


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gb = 1 << 30
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [r["converter"] for r in rows]
    ax.bar(labels, [r["peak_rss_bytes"] / gb for r in rows], color=["tab:green", "tab:gray"])
    ax.axhline(rows[0]["source_bytes"] / gb, ls="--", c="k", lw=1, label="whole source checkpoint")
    ax.axhline(rows[0]["largest_source_shard_bytes"] / gb, ls=":", c="tab:blue", lw=1, label="largest source shard")
    ax.set_ylabel("peak RSS (GiB)")
    ax.set_title(f"Converting {rows[0]['source_bytes'] / gb:.1f} GiB (DeepSeek-V2-Lite shapes, "
                 f"{rows[0]['layers']} layers) with -q")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
