"""Pipeline and tensor parallel over two ranks on this machine (ring backend, 127.0.0.1),
against single-process runs of the same folders.

One launch of two ranks runs every case (``rank_worker.py``): for each folder and each
strategy, the prompt's logits, 32 greedy tokens and their log probabilities, then the files
each rank opened and its latent-cache bytes per token; and a load where one rank lacks a
file. The generate command runs under ``mlx.launch``, and on 2 ranks that cannot split the
heads (every rank's exit status and stderr checked). Group-size rules: ``test_distributed_unit``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_mla
from convert_helpers import run_cli
from benchmarks.distributed import (
    free_port_pair, rank_cache_bytes_per_token, rank_weight_bytes, reshard_by_layer,
)
from distributed_helpers import TIMEOUT, greedy, partial_copy, run_ranks
from mlx_mla.cache import cache_bytes_per_token
from mlx_mla.generate import main
from reference import make_checkpoint
from testdata import CORPUS

WORKER = Path(__file__).resolve().parent / "rank_worker.py"
STRATEGIES = list(mlx_mla.STRATEGIES)
MAX_TOKENS = 32
TOL = 1e-4  # max |Δ| of float32 logits and log probabilities vs one process
DEMO_FILES = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]


def prompt_ids(n: int = 48, vocab: int = 2048) -> list:
    """The first n tokens of the held-out excerpt (the demo tokenizer), folded into vocab."""
    _, tokenizer = mlx_mla.load(mlx_mla.DEMO_MODEL)
    return [t % vocab for t in tokenizer.encode(CORPUS.read_text()[: 8 * n])[:n]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, fixture_dir):
    """The checkpoints the cases run on:
    demo      the fixture (Hugging Face layout, 4 shards; layers 1-3 straddle shards);
    demo-q4   the fixture converted to an mlx-lm folder, 4-bit group 64, 1 MB shards;
    tiny-q    a random tiny config with q_lora_rank set, 3 layers, one file per layer
              plus one for the embeddings, norm and head (``reshard_by_layer``)."""
    root = tmp_path_factory.mktemp("distributed")
    q4 = root / "demo-q4"
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", q4, "-q", "--quant-recipe",
                   "uniform", "--shard-size", "1MB") == 0
    make_checkpoint(root / "tiny-q-hf", seed=3, q_lora_rank=24)
    files = reshard_by_layer(root / "tiny-q-hf", root / "tiny-q")
    assert sorted(files) == ["model-layer00.safetensors", "model-layer01.safetensors",
                             "model-layer02.safetensors", "model-rest.safetensors"]
    return {"demo": fixture_dir, "demo-q4": q4, "tiny-q": root / "tiny-q", "root": root}


# Pipeline over 2 ranks (mlx-lm's split: rank 0 the last layers): the files each rank needs,
# by hand from the folders' layouts. demo: 4 layers, rank 0 = layers 2-3, rank 1 = 0-1;
# shard 1 holds layers 0-1, the embeddings and head, 2 layers 1-2, 3 layers 2-3, 4 layer 3 and
# the final norm. tiny-q: 3 layers, rank 0 = layers 1-2, rank 1 = layer 0.
PIPELINE_FILES = {
    "demo": {0: DEMO_FILES, 1: [DEMO_FILES[0], DEMO_FILES[1], DEMO_FILES[3]]},
    "tiny-q": {0: ["model-layer01.safetensors", "model-layer02.safetensors",
                   "model-rest.safetensors"],
               1: ["model-layer00.safetensors", "model-rest.safetensors"]},
}
PIPELINE_LAYERS = {"demo": {0: [2, 4], 1: [0, 2]}, "tiny-q": {0: [1, 3], 1: [0, 1]},
                   "demo-q4": {0: [2, 4], 1: [0, 2]}}


@pytest.fixture(scope="module")
def two_ranks(folders):
    """Both modes, every case, one launch of two ranks: (output folder, per-rank reports)."""
    root = folders["root"]
    out = root / "out"
    out.mkdir()
    demo_prompt, tiny_prompt = prompt_ids(), prompt_ids(vocab=512)
    # Pipeline: the demo from per-rank folders holding only the rank's files (as on two Macs
    # that each fetched their own); tiny-q from a fake Hub that serves only what is asked.
    for rank, files in PIPELINE_FILES["demo"].items():
        partial_copy(folders["demo"], root / f"demo-rank{rank}", files)
    hub = {"test/tiny-q": str(folders["tiny-q"])}
    # Rank 1's only layer file is absent; rank 0 has all it needs.
    partial_copy(folders["tiny-q"], root / "tiny-q-no-layer0", PIPELINE_FILES["tiny-q"][0])
    runs = [
        {"name": "missing-file", "mode": "pipeline", "model": str(root / "tiny-q-no-layer0"),
         "expect_error": True},
        {"name": "pipeline-demo", "mode": "pipeline", "model": str(root / "demo-rank{rank}"),
         "prompt": demo_prompt},
        {"name": "pipeline-tiny-q", "mode": "pipeline", "model": "test/tiny-q", "hub": hub,
         "prompt": tiny_prompt},
        # An mlx-lm folder split by layers; one strategy: the pipeline does not touch MLA.
        {"name": "pipeline-demo-q4", "mode": "pipeline", "model": str(folders["demo-q4"]),
         "prompt": demo_prompt, "strategies": ["auto"]},
    ] + [
        {"name": f"tensor-{case}", "mode": "tensor", "model": str(folders[case]),
         "prompt": tiny_prompt if case == "tiny-q" else demo_prompt}
        for case in ("demo", "tiny-q", "demo-q4")
    ]
    spec = {"out": str(out), "strategies": STRATEGIES, "max_tokens": MAX_TOKENS, "runs": runs}
    (root / "spec.json").write_text(json.dumps(spec))
    results = run_ranks(2, [str(WORKER), str(root / "spec.json")])
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stderr[-3000:]}"
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    return out, {run["name"]: run for run in runs}, reports


@pytest.fixture(scope="module")
def single(folders):
    """One process per folder and strategy: {(case, strategy): (logits, tokens, logprobs,
    cache bytes per token)}, what the ranks must reproduce."""
    refs = {}
    for case, vocab in (("demo", 2048), ("demo-q4", 2048), ("tiny-q", 512)):
        prompt = prompt_ids(vocab=vocab)
        model, _ = mlx_mla.load(folders[case])
        for strategy in STRATEGIES:
            model.set_mla_strategy(strategy)
            cache = model.make_cache()
            logits = model(mx.array([prompt]), cache=cache).astype(mx.float32)
            tokens, logprobs = greedy(model, prompt, MAX_TOKENS)
            refs[case, strategy] = (np.array(logits[0]), tokens, logprobs,
                                    cache_bytes_per_token(cache))
    return refs


def latent_bytes(folder: Path, layers: int) -> int:
    """Latent-cache bytes per token of ``layers`` layers, from config.json: float32
    (kv_lora_rank + qk_rope_head_dim) values per layer."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
@pytest.mark.parametrize("case", ["demo", "demo-q4", "tiny-q"])
def test_two_ranks_match_one_process(two_ranks, single, mode, case):
    """Every strategy (pipeline on the quantized folder: auto): the prompt's logits and 32
    decode steps' log probabilities within 1e-4 of one process, the same 32 greedy tokens."""
    out, runs, _ = two_ranks
    for strategy in runs[f"{mode}-{case}"].get("strategies", STRATEGIES):
        got = np.load(out / f"{mode}-{case}-{strategy}.npz")
        logits, tokens, logprobs, _ = single[case, strategy]
        assert got["logits"].shape == logits.shape and logits.shape[0] >= 32
        assert np.abs(got["logits"] - logits).max() <= TOL, strategy
        assert got["tokens"].tolist() == tokens, strategy
        assert np.abs(got["logprobs"] - logprobs).max() <= TOL, strategy


@pytest.mark.parametrize("case", ["demo", "demo-q4", "tiny-q"])
def test_pipeline_splits_layers_and_latent_cache(two_ranks, single, folders, case):
    """Each rank runs its block of layers and caches only those: the per-rank latent cache
    is its share of one process's, and the two add up to it."""
    _, _, reports = two_ranks
    total = 0
    for rank in range(2):
        report = reports[rank][f"pipeline-{case}"]
        start, end = PIPELINE_LAYERS[case][rank]
        assert report["layers"] == [start, end]
        assert report["cache_bytes_per_token"] == latent_bytes(folders[case], end - start)
        total += report["cache_bytes_per_token"]
    assert total == single[case, "auto"][3]


@pytest.mark.parametrize("case", ["demo", "demo-q4", "tiny-q"])
def test_tensor_parallel_keeps_whole_latent_cache(two_ranks, single, case):
    """Tensor parallel splits heads, but c_kv and k_pe are shared by every head: each rank
    holds the whole latent cache, as large as one process's."""
    _, _, reports = two_ranks
    for rank in range(2):
        report = reports[rank][f"tensor-{case}"]
        assert report["cache_bytes_per_token"] == single[case, "auto"][3]


@pytest.mark.parametrize("case, bits", [("demo-q4", 4), ("tiny-q", None)])
def test_sizes_from_shapes_match_the_ranks(two_ranks, folders, case, bits):
    """``benchmarks.distributed`` sizes each rank's parameters and cache from shapes alone
    (for the README's table of what fits on N Macs): what the ranks loaded and cached."""
    _, _, reports = two_ranks
    config = json.loads((folders[case] / "config.json").read_text())
    for split in ("pipeline", "tensor"):
        got = [reports[rank][f"{split}-{case}"] for rank in range(2)]
        assert rank_weight_bytes("mlx_mla", config, 2, split, bits=bits, dtype=mx.float32) == \
            [g["weight_bytes"] for g in got]
        assert rank_cache_bytes_per_token("mlx_mla", config, 2, split, itemsize=4) == \
            [g["cache_bytes_per_token"] for g in got]


def test_pipeline_ranks_open_and_fetch_only_their_files(two_ranks, folders):
    """Instrumented file access: each pipeline rank opened (and, from the Hub, fetched) exactly
    the weight files holding its layers, the embeddings, norm and head; under tensor
    parallelism every rank reads every file."""
    _, _, reports = two_ranks
    for rank in range(2):
        assert reports[rank]["pipeline-demo"]["opened"] == PIPELINE_FILES["demo"][rank]
        tiny = reports[rank]["pipeline-tiny-q"]
        assert tiny["opened"] == PIPELINE_FILES["tiny-q"][rank]
        assert [f for f in tiny["fetched"] if f.endswith(".safetensors")] == \
            PIPELINE_FILES["tiny-q"][rank]
        assert reports[rank]["tensor-demo"]["opened"] == DEMO_FILES


def test_rank_that_cannot_read_its_files_stops_every_rank(two_ranks):
    """Rank 1's layer file is absent: rank 1's error names it, rank 0's says rank 1 failed;
    neither waits for the other (the launch would time out)."""
    _, _, reports = two_ranks
    assert "rank 1 of 2 could not load the model (see its error line)" in \
        reports[0]["missing-file"]["error"]
    assert "is missing weight shard model-layer00.safetensors, which this rank needs" in \
        reports[1]["missing-file"]["error"]


def test_group_size_that_cannot_split_heads_fails_on_every_rank(folders):
    """The generate command on 2 ranks, a model with 3 heads: one error line on every rank,
    exit status 1, no hang."""
    folder = folders["root"] / "three-heads"
    make_checkpoint(folder, seed=4, hidden_size=96, num_attention_heads=3,
                    num_key_value_heads=3)
    argv = ["-m", "mlx_mla.generate", "--model", str(folder), "--tensor-parallel"]
    msg = ("error: cannot split the model over 2 tensor-parallel ranks: num_attention_heads "
           "(3) is not divisible by 2; run it on one rank, or with --pipeline")
    for rank, r in enumerate(run_ranks(2, argv)):
        assert r.returncode == 1, f"rank {rank}: exit {r.returncode}\n{r.stderr[-2000:]}"
        assert r.stderr.strip().splitlines() == [msg], f"rank {rank}"
        assert r.stdout == ""


def test_generate_command_under_mlx_launch(capsys):
    """`mlx.launch -n 2 --backend ring --hosts 127.0.0.1 -- python -m mlx_mla.generate
    --pipeline`, sampled with a seed: rank 0 alone prints, the same text as one process (the
    ranks agree on the seed, so they draw the same tokens)."""
    argv = ["--max-tokens", "24", "--verbose", "False", "--temp", "0.8", "--seed", "3"]
    assert main(argv) == 0
    alone = capsys.readouterr().out
    launcher = Path(sys.executable).parent / "mlx.launch"
    launched = subprocess.run(
        [str(launcher), "-n", "2", "--backend", "ring", "--hosts", "127.0.0.1",
         "--starting-port", str(free_port_pair()), "--", sys.executable,
         "-m", "mlx_mla.generate", "--pipeline", *argv],
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert "exited with code" not in launched.stderr, launched.stderr
    assert launched.stdout == alone and alone.strip()
