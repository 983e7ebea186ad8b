"""Pipeline and tensor parallel over 2 ranks on this machine, and what fits on N Macs.

**Measured** (``mlx.launch -n 2 --backend ring --hosts 127.0.0.1``; the single-process runs
as 1 rank): a DeepSeek-V2-Lite-shaped model (its real dimensions, 4 layers: the dense layer
0 and 3 MoE layers) with random weights, quantized 4-bit **group 32** (at group 64 V2-Lite's
dense layer, 10944 = 171 groups, cannot be split two ways, by mlx_mla or mlx-lm) and written
as an mlx-lm folder with one file per layer. Per engine (mlx_mla ``auto``; mlx-lm
``deepseek_v2``, parameters cast to float32 as ours are on the CPU) and split (one process,
pipeline, tensor parallel): each rank's parameter bytes, its cache bytes per token (after a
64-token prefill), the weight files it opened, and decode tok/s (1 / median step of mlx-lm's
``generate_step``, from ``e2e_decode.decode``). Two ranks share this machine's 2 cores: the
tok/s say the split runs and what its communication costs here, not a speed-up.

**Computed** (no weights; ``--fit-only`` runs just this): for DeepSeek-V2-Lite /
Coder-V2-Lite and DeepSeek-V2 / V2.5 / Coder-V2 (real configs; each pair has one shape), at
4-bit group 64 with bfloat16 activations and cache (a Mac's defaults), the parameter bytes
of every rank for N = 1..4 ranks, pipeline and tensor parallel, from the model classes built
lazily (shapes only) and split as the loaders split them; then, on Macs of 64 / 128 / 192 GB
with 75% of RAM usable (macOS's default GPU working-set limit; ``sudo sysctl
iogpu.wired_limit_mb`` raises it), how many tokens of cache the fullest rank has room for:
mlx_mla's latent cache (``costs.step_costs(..., "absorb")``: kv_lora_rank + qk_rope_head_dim
values per layer) against mlx-lm's decompressed K/V cache (``"kv-cache"``: H·(dn + dr + dv),
split by heads under tensor parallelism). Activations and the OS are not counted.

    python -m benchmarks.distributed             # ~6 minutes on 2 cores
    python -m benchmarks.distributed --fit-only  # the computed table, seconds
Writes benchmarks/results/distributed.{csv,json,png} and distributed_fit.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mla.attention.costs import step_costs
from mlx_mla.config import ModelArgs
from mlx_mla.distributed import (
    barrier, layer_of, pipeline_problem, pipeline_range, tensor_parallel_problem,
)
from mlx_mla.dtypes import cast_floating

from .common import (summary, RESULTS, ROOT, V2, V2_LITE, machine_info, pyplot, save_figure, with_layers,
                     write_csv)
from .engines import lazy_model

GB = 1e9
MODELS = {"DeepSeek-V2-Lite / Coder-V2-Lite": V2_LITE, "DeepSeek-V2 / V2.5 / Coder-V2": V2}
MAC_GB = (64, 128, 192)
USABLE = 0.75
ENGINES = ("mlx_mla", "mlx-lm")
ENGINE_NAMES = {"mlx_mla": "mlx_mla auto", "mlx-lm": "mlx-lm v2"}  # as benchmarks.engines names them
SPLITS = ("single", "pipeline", "tensor")


# ---------------------------------------------------------------- sizes from shapes


class Rank:
    """An ``mx.distributed.Group`` as the splitting code reads it (rank(), size()), to size
    a rank's share without starting any process; nothing is communicated."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def rank_weight_bytes(engine: str, config: dict, n: int, split: str, bits: Optional[int] = 4,
                      group_size: int = 64, dtype: mx.Dtype = mx.bfloat16) -> List[int]:
    """Parameter bytes of each of ``n`` ranks, from shapes alone: ``engine``'s model
    ("mlx_mla" or "mlx-lm" ``deepseek_v2``) as ``engines.lazy_model`` builds it (quantized as
    its loader quantizes a ``bits``-bit folder, float parameters in ``dtype``), then
    pipelined (``model.model.pipeline``) or sharded (``model.shard``) as rank r of n.
    Raises ValueError when ``n`` cannot split the model that way."""
    out = []
    for r in range(n if split != "single" else 1):
        model = lazy_model(ENGINE_NAMES[engine], config, dtype, bits, group_size)
        if split == "pipeline":
            model.model.pipeline(Rank(r, n))
        elif split == "tensor" and n > 1:
            model.shard(Rank(r, n))
        out.append(sum(v.nbytes for _, v in tree_flatten(model.parameters())))
    return out


def rank_cache_bytes_per_token(engine: str, config: dict, n: int, split: str,
                               itemsize: int = 2) -> List[int]:
    """Cache bytes per token of each rank: mlx_mla's latent cache, (kv_lora_rank +
    qk_rope_head_dim)·itemsize per layer it holds (every layer, under tensor parallelism);
    mlx-lm's decompressed K/V, H·(dn + dr + dv)·itemsize per layer (H/n heads under tensor
    parallelism) (``mlx_mla.attention.costs.step_costs``'s cache terms at S = 1)."""
    args = ModelArgs.from_dict(config)
    L = args.num_hidden_layers
    if engine == "mlx_mla":
        per_layer = step_costs(args, "absorb", S=1, itemsize=itemsize).cache_bytes
    else:
        heads = args.num_attention_heads // (n if split == "tensor" else 1)
        per_layer = step_costs(ModelArgs.from_dict({**config, "num_attention_heads": heads}),
                               "kv-cache", S=1, itemsize=itemsize).cache_bytes
    if split != "pipeline":
        return [L * per_layer] * (n if split == "tensor" else 1)
    spans = [pipeline_range(L, Rank(r, n)) for r in range(n)]
    return [(end - start) * per_layer for start, end in spans]


def fit_table(models: Dict[str, dict] = MODELS, ranks=(2, 3, 4), macs=MAC_GB,
              usable: float = USABLE, bits: int = 4, group_size: int = 64) -> List[dict]:
    """One row per (model, split, ranks, Mac size) the model can be split into: the fullest
    rank's parameter bytes and cache bytes per token, and how many tokens of cache fit beside
    the weights in ``usable`` of the Mac's RAM on every rank (None: the weights do not fit),
    for mlx_mla (latent cache) and mlx-lm (decompressed K/V)."""
    rows = []
    for name, config in models.items():
        q = {**config, "quantization": {"group_size": group_size, "bits": bits}}
        args = ModelArgs.from_dict(q)
        plans = [("single", 1)] + [(split, n) for split in ("pipeline", "tensor") for n in ranks]
        for split, n in plans:
            problem = {"pipeline": pipeline_problem, "tensor": tensor_parallel_problem}.get(split)
            if problem is not None and problem(args, n):
                continue
            sizes = {e: rank_weight_bytes(e, q, n, split, bits, group_size) for e in ENGINES}
            caches = {e: rank_cache_bytes_per_token(e, q, n, split) for e in ENGINES}
            for mac in macs:
                budget = mac * GB * usable
                row = {"model": name, "split": split, "ranks": n, "mac_gb": mac,
                       "context": config["max_position_embeddings"]}
                for e in ENGINES:
                    room = [budget - w for w in sizes[e]]
                    key = e.replace("-", "_")
                    row[f"{key}_weights_gb"] = max(sizes[e]) / GB
                    row[f"{key}_cache_bytes_per_token"] = max(caches[e])
                    row[f"{key}_tokens"] = (min(int(b // c) for b, c in zip(room, caches[e]))
                                            if min(room) > 0 else None)
                rows.append(row)
    return rows


def _count(n: Optional[int]) -> str:
    if n is None:
        return "—"
    for unit, div in (("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def fit_markdown(rows: List[dict]) -> str:
    """The README's table: per model, split and rank count, the fullest rank's weights and,
    per Mac size, tokens of cache room on every rank, mlx_mla / mlx-lm ("—": the weights do
    not fit)."""
    macs = sorted({r["mac_gb"] for r in rows})
    head = ["model (4-bit)", "split", "Macs", "mlx_mla weights per Mac"] + [f"{m} GB Macs" for m in macs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keyed = {(r["model"], r["split"], r["ranks"], r["mac_gb"]): r for r in rows}
    for model, split, n in dict.fromkeys((r["model"], r["split"], r["ranks"]) for r in rows):
        first = keyed[model, split, n, macs[0]]
        cells = [f"{_count(keyed[model, split, n, m]['mlx_mla_tokens'])} / "
                 f"{_count(keyed[model, split, n, m]['mlx_lm_tokens'])}" for m in macs]
        lines.append(f"| {model} | {split} | {n} | {first['mlx_mla_weights_gb']:.1f} GB | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the measured model


def reshard_by_layer(src: Path, dst: Path) -> Dict[str, List[str]]:
    """``src``'s weights written to ``dst`` as one file per decoder layer
    (``model-layerNN.safetensors``) plus ``model-rest.safetensors`` (embeddings, final norm,
    head), with an index and the source's safetensors metadata; its other files copied. Which
    files a pipeline rank reads then says which layers it read. Returns {file: tensor names}."""
    dst.mkdir(parents=True)
    tensors, metadata = {}, {}
    for f in sorted(src.glob("model*.safetensors")):
        arrays, metadata = mx.load(str(f), return_metadata=True)
        tensors.update(arrays)
    files: Dict[str, List[str]] = {}
    for name in tensors:
        i = layer_of(name)
        files.setdefault("model-rest.safetensors" if i is None
                         else f"model-layer{i:02d}.safetensors", []).append(name)
    for file, names in files.items():
        mx.save_safetensors(str(dst / file), {k: tensors[k] for k in names}, metadata)
    index = {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for p in src.iterdir():
        if not p.name.startswith("model"):
            (dst / p.name).write_bytes(p.read_bytes())
    return files


def measured_config(layers: int = 4) -> dict:
    """V2-Lite's dimensions with ``layers`` layers (layer 0 dense, as in V2-Lite)."""
    return with_layers(V2_LITE, layers)


def load_split(engine: str, split: str, folder: Path):
    """One rank's model: ``mlx_mla`` through ``mlx_mla.load`` / ``load_sharded`` (auto),
    ``mlx-lm`` through ``mlx_lm.load`` / ``mlx_lm.utils.sharded_load``, float parameters in
    float32 (mlx_mla's CPU default)."""
    world = mx.distributed.init()
    groups = {"single": {}, "pipeline": {"pipeline_group": world},
              "tensor": {"tensor_group": world}}[split]
    if engine == "mlx_mla":
        import mlx_mla
        from mlx_mla.distributed import load_sharded

        return (load_sharded(folder, **groups) if groups else mlx_mla.load(folder))[0]
    import mlx_lm
    from mlx_lm.utils import sharded_load

    model = (sharded_load(str(folder), **groups) if groups else mlx_lm.load(str(folder)))[0]
    return cast_floating(model, mx.float32)


def worker(spec_file: Path) -> None:
    """One rank of a measured run (``python -m benchmarks.distributed --worker SPEC``): load,
    prefill ``prompt_tokens`` random tokens, then decode ``steps`` steps; writes
    OUT/ENGINE-SPLIT-rankR.json."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_mla.cache import cache_bytes_per_token

    from .e2e_decode import decode
    from .engines import weight_bytes

    spec = json.loads(Path(spec_file).read_text())
    opened = []
    load = mx.load

    def recording_load(file, *args, **kwargs):
        opened.append(Path(file).resolve())  # mlx_mla reads through links it then removes
        return load(file, *args, **kwargs)

    mx.load = recording_load
    model = load_split(spec["engine"], spec["split"], Path(spec["folder"]))
    mx.load = load
    world = mx.distributed.init()
    prompt = mx.random.randint(0, 1000, (1, spec["prompt_tokens"]), key=mx.random.key(0))
    cache = make_prompt_cache(model)
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    files = set(opened)
    row = {"engine": spec["engine"], "split": spec["split"], "ranks": world.size(),
           "rank": world.rank(), "layers": len(cache), "weight_bytes": weight_bytes(model),
           "cache_bytes_per_token": cache_bytes_per_token(cache),
           "files_opened": len(files), "file_bytes_opened": sum(f.stat().st_size for f in files)}
    row.update(decode(model, cache, spec["steps"]))
    out = Path(spec["out"]) / f"{spec['engine']}-{spec['split']}-rank{world.rank()}.json"
    out.write_text(json.dumps(row))
    barrier(world)


def launch(engine: str, split: str, folder: Path, out: Path, steps: int,
           prompt_tokens: int) -> List[dict]:
    """Run ``worker`` as 1 process (single) or 2 ranks (``mlx.launch -n 2 --backend ring
    --hosts 127.0.0.1``); returns each rank's row."""
    spec = out / f"{engine}-{split}.json"
    spec.write_text(json.dumps({"engine": engine, "split": split, "folder": str(folder),
                                "out": str(out), "steps": steps,
                                "prompt_tokens": prompt_tokens}))
    cmd = [sys.executable, "-m", "benchmarks.distributed", "--worker", str(spec)]
    n = 1 if split == "single" else 2
    if n > 1:
        launcher = Path(sys.executable).parent / "mlx.launch"
        cmd = [str(launcher), "-n", str(n), "--backend", "ring", "--hosts", "127.0.0.1",
               "--starting-port", str(free_port_pair()), "--", *cmd]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    rows = []
    for r in range(n):
        f = out / f"{engine}-{split}-rank{r}.json"
        if done.returncode or not f.is_file():
            raise SystemExit(f"error: {engine} {split} rank {r} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(f.read_text()))
    return rows


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (mlx.launch's ring uses one per rank)."""
    import socket

    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", 0))
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
                return a.getsockname()[1]
            except OSError:
                continue
    raise SystemExit("error: no two consecutive free ports on 127.0.0.1")


def measure(workdir: Path, layers: int, steps: int, prompt_tokens: int, log=print) -> List[dict]:
    """The random 4-bit group-32 folder, then every (engine, split) run; one row per rank."""
    from .engines import write_random_folder

    config = measured_config(layers)
    src = write_random_folder(config, workdir / "src", bits=4, group_size=32)
    reshard_by_layer(src, workdir / "model")
    for f in src.glob("model*.safetensors"):
        f.unlink()
    out = workdir / "out"
    out.mkdir()
    rows = []
    for engine in ENGINES:
        for split in SPLITS:
            t = time.time()
            ranks = launch(engine, split, workdir / "model", out, steps, prompt_tokens)
            rows += ranks
            log(f"{engine} {split}: {ranks[0]['decode_tps']:.2f} tok/s on rank 0 "
                f"({time.time() - t:.0f} s)")
    return rows


# ---------------------------------------------------------------- results


def ratios(rows: List[dict]) -> Dict[str, float]:
    """Decode tok/s ratios (rank 0's figure): each split against one process, and mlx_mla
    against mlx-lm for the same split."""
    tps = {(r["engine"], r["split"]): r["decode_tps"] for r in rows if r["rank"] == 0}
    out = {}
    for e in ENGINES:
        for split in ("pipeline", "tensor"):
            out[f"{e} {split} / single"] = tps[e, split] / tps[e, "single"]
    for split in SPLITS:
        out[f"mlx_mla / mlx-lm, {split}"] = tps["mlx_mla", split] / tps["mlx-lm", split]
    return out


def measured_markdown(rows: List[dict]) -> str:
    """The README's table of the measured runs: one line per rank."""
    lines = ["| engine | split | rank | layers | parameters | weight files opened | "
             "cache per token | decode tok/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['split']} | {r['rank']} of {r['ranks']} | {r['layers']} | "
            f"{r['weight_bytes'] / GB:.2f} GB | {r['files_opened']} ({r['file_bytes_opened'] / GB:.2f} GB) | "
            f"{r['cache_bytes_per_token'] / 1e3:.1f} KB | {r['decode_tps']:.2f} |")
    return "\n".join(lines)


def plot(rows: List[dict], path: Path) -> None:
    """distributed.png: parameters and cache per token of every rank, rank 0's decode tok/s."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    labels = [f"{r['engine']}\n{r['split']} r{r['rank']}" for r in rows]
    axes[0].bar(labels, [r["weight_bytes"] / GB for r in rows])
    axes[0].set(ylabel="GB", title="parameters per rank")
    axes[1].bar(labels, [r["cache_bytes_per_token"] / 1e3 for r in rows])
    axes[1].set(ylabel="KB per token", title="cache per rank (float32)")
    zero = [r for r in rows if r["rank"] == 0]
    axes[2].bar([f"{r['engine']}\n{r['split']}" for r in zero], [r["decode_tps"] for r in zero])
    axes[2].set(ylabel="tokens/s", title="decode (2 cores shared by the ranks)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=60)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--fit-only", action="store_true", help="only the computed table")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--workdir", type=Path, default=None,
                   help="where to write the random model folder (a temporary one inside it)")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    t0 = time.time()
    fit = fit_table()
    write_csv(fit, args.out / "distributed_fit.csv")
    if args.fit_only:
        print(fit_markdown(fit))
        print(f"wrote {args.out / 'distributed_fit.csv'}")
        return 0
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        rows = measure(Path(tmp), args.layers, args.steps, args.prompt_tokens)
    meta = {**machine_info(), "load_average_before_after": [load_before, os.getloadavg()],
            "layers": args.layers, "steps": args.steps,
            "prompt_tokens": args.prompt_tokens, "backend_distributed": "ring, 127.0.0.1",
            "quantization": "4-bit, group 32 (mlx_lm.utils.quantize_model)",
            "seconds": time.time() - t0}
    write_csv(rows, args.out / "distributed.csv")
    result = {"meta": meta, "rows": rows, "ratios": ratios(rows), "fit": fit}
    (args.out / "distributed.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out / "distributed.png")
    print(measured_markdown(rows))
    print(json.dumps(result["ratios"], indent=2))
    print(f"wrote {args.out}/distributed.{{csv,json,png}}, distributed_fit.csv in "
          f"{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
