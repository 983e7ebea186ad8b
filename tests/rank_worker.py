"""One rank of the distributed tests (started by ``distributed_helpers.run_ranks``).

    python tests/rank_worker.py SPEC.json

SPEC: {"out": folder, "strategies": [...], "max_tokens": n, "runs": [{"name", "mode"
("pipeline" or "tensor"), "model" (a folder, "{rank}" replaced by the rank, or a Hub id),
"prompt": [ids], optional: "hub": {id: source folder} (a fake Hub serving those folders),
"strategies" (instead of the spec's), "expect_error" (only load, and record the error)}]}.

For each run the rank loads its part with ``mlx_mla.distributed.load_sharded`` and records
which safetensors files it opened (Python's ``open``, through an audit hook, and
``mx.load``, which opens files in C++ and is how mlx-lm's ``load_model`` reads weights) and,
for a Hub id, which files it fetched. Then, per strategy: the prompt's logits in one
forward pass and ``max_tokens`` greedy tokens with their log probabilities
(``distributed_helpers.greedy``). Rank 0 writes those to OUT/RUN-STRATEGY.npz; every rank
writes OUT/rankR.json (files opened and fetched, its layers, its parameter bytes, its
latent-cache bytes per token; or the load error's message).
"""

import os
import sys

OPENED = []


def _audit(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)

import fnmatch  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

_mx_load = mx.load


def _recording_load(file, *args, **kwargs):
    OPENED.append(os.fsdecode(file))
    return _mx_load(file, *args, **kwargs)


mx.load = _recording_load

from distributed_helpers import greedy  # noqa: E402
from mlx_mla import ModelLoadError  # noqa: E402
from mlx_mla.cache import cache_bytes_per_token  # noqa: E402
from mlx_mla.distributed import barrier, load_sharded  # noqa: E402


def fake_hub(sources, into: Path, fetched: list):
    """A ``snapshot_download`` serving local folders: copies the files ``allow_patterns``
    match into ``into`` (kept across calls, like the Hub cache) and lists them in ``fetched``."""

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        into.mkdir(parents=True, exist_ok=True)
        for p in Path(sources[repo_id]).iterdir():
            if any(fnmatch.fnmatch(p.name, pat) for pat in allow_patterns or ["*"]):
                shutil.copyfile(p, into / p.name)
                fetched.append(p.name)
        return str(into)

    return snapshot_download


def main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    out = Path(spec["out"])
    world = mx.distributed.init()
    rank = world.rank()
    report = {}
    for run in spec["runs"]:
        fetched = []
        if "hub" in run:
            import huggingface_hub

            into = out / f"hub-cache-{run['name']}-rank{rank}"
            huggingface_hub.snapshot_download = fake_hub(run["hub"], into, fetched)
        OPENED.clear()
        split = {"pipeline_group": world} if run["mode"] == "pipeline" else {"tensor_group": world}
        if run.get("expect_error"):
            try:
                load_sharded(run["model"].format(rank=rank), **split)
                report[run["name"]] = {"error": None}
            except ModelLoadError as e:
                report[run["name"]] = {"error": str(e)}
            continue
        model, _ = load_sharded(run["model"].format(rank=rank), **split)
        opened = sorted({Path(os.path.realpath(p)).name for p in OPENED
                         if p.endswith(".safetensors")})
        prompt = run["prompt"]
        for strategy in run.get("strategies", spec["strategies"]):
            model.set_mla_strategy(strategy)
            cache = model.make_cache()
            logits = model(mx.array([prompt]), cache=cache).astype(mx.float32)
            mx.eval(logits)
            tokens, logprobs = greedy(model, prompt, spec["max_tokens"])
            if rank == 0:
                np.savez(out / f"{run['name']}-{strategy}.npz", logits=np.array(logits[0]),
                         tokens=np.array(tokens), logprobs=logprobs)
        m = model.model
        report[run["name"]] = {
            "opened": opened, "fetched": sorted(set(fetched)),
            "layers": [m.start_idx, m.end_idx if m.end_idx is not None else len(m.layers)],
            "weight_bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
            "cache_bytes_per_token": cache_bytes_per_token(cache),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    barrier(world)


if __name__ == "__main__":
    main(sys.argv[1])
