"""benchmarks/e2e_decode.py at a tiny size: the engines load the same folder and agree, and
the measurement functions return well-formed results (shapes and sanity, not timings)."""

from __future__ import annotations

import csv
import json

import mlx.core as mx
import numpy as np
import pytest

import benchmarks.e2e_decode as bench

TINY = {**bench.V2_LITE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 64, "v_head_dim": 64}  # v3 re-quantizes W_UK along dn: dn % 64 == 0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return bench.write_folders(TINY, tmp_path_factory.mktemp("e2e"))


def test_engines_read_the_same_folder_and_agree(folders):
    tokens = mx.array([[3, 17, 99, 5, 42, 7]])
    ref = bench.load_engine("mlx-lm v2", folders, mx.float32)(tokens)
    for engine in ("mlx_mla auto", "mlx_mla absorb", "mlx_mla naive"):
        ours = bench.load_engine(engine, folders, mx.float32)(tokens)
        assert mx.abs(ours - ref).max().item() < 1e-3, engine
    # v3: same attention math (its kv_b is re-quantized, router differs) -> only close-ish
    v3 = bench.load_engine("mlx-lm v3", folders, mx.float32)(tokens)
    assert v3.shape == ref.shape and bool(mx.isfinite(v3).all())


def test_lazy_sizing_equals_a_loaded_model(tmp_path):
    """Weight bytes from shapes alone equal the bytes of the same model loaded from disk."""
    big = bench.make_config(5, TINY)
    loaded = bench.write_folders(big, tmp_path)
    for engine in ("mlx_mla auto", "mlx-lm v2", "mlx-lm v3"):
        model = bench.load_engine(engine, loaded, mx.float32)
        assert bench.full_weight_bytes(engine, TINY, mx.float32, layers=5) == bench.weight_bytes(model), engine


def test_run_budget_and_outputs(folders, tmp_path):
    rows = bench.run(TINY, contexts=(8, 40), prefill_tokens=12, decode_steps=2,
                     strategies=bench.ALL_STRATEGIES, folders=folders, log=lambda *_: None)
    plans = bench.plans(bench.ALL_STRATEGIES)
    assert len(rows) == 2 * len(plans)
    for r in rows:
        assert r["decode_tps"] > 0 and r["weight_bytes"] > 0 and r["peak_bytes"] >= r["weight_bytes"]
        if r["comparison"] == "defaults":
            assert r["attention_ms"] is None
            continue
        assert r["attention_ms"] > 0
        assert r["attention_share"] == pytest.approx(r["attention_ms"] * r["decode_tps"] / 1e3)
        assert r["cache_bytes"] >= r["context"] * r["cache_bytes_per_token"]
    by = {(r["comparison"], r["engine"], r["context"]): r for r in rows}
    f32 = "same dtype (float32)"
    # physical cache sizes: latent 2 layers x (64 + 16) vs 2 x 2 heads x (80 + 64), float32
    assert by[(f32, "mlx_mla auto", 8)]["cache_bytes_per_token"] == 2 * 80 * 4
    assert by[(f32, "mlx-lm v3", 8)]["cache_bytes_per_token"] == 2 * 80 * 4
    assert by[(f32, "mlx-lm v2", 8)]["cache_bytes_per_token"] == 2 * 2 * 144 * 4
    assert by[("defaults", "mlx-lm v2", 8)]["cache_bytes_per_token"] == 2 * 2 * 144 * 2  # bf16
    assert by[(f32, "mlx_mla auto", 8)]["prefill_tps"] > 0
    assert by[(f32, "mlx_mla absorb", 8)]["prefill_tps"] is None

    budget = bench.budget_table(rows, TINY, 2**30)
    assert {b["engine"] for b in budget} == {"mlx_mla auto", "mlx-lm v2", "mlx-lm v3"}
    for b in budget:
        assert b["layers"] == 27 and b["max_context"] > 0
    b = {(x["comparison"], x["engine"]): x for x in budget}
    assert b[(f32, "mlx_mla auto")]["max_context"] > b[(f32, "mlx-lm v2")]["max_context"]

    checks = bench.verify_budget(rows, TINY, folders, 2**20, log=lambda *_: None)
    assert [c["engine"] for c in checks] == ["mlx_mla auto", "mlx-lm v2"]
    for c in checks:
        assert c["context"] > 0 and np.isfinite(c["relative_error"])

    meta = {"machine": "test"}
    paths = bench.write_results(rows, budget, checks, meta, tmp_path)
    assert paths["png"].stat().st_size > 0
    data = json.loads(paths["json"].read_text())
    ratios = data["ratios"][""]  # per BLAS; these rows carry none
    assert set(ratios) >= {"cache_bytes_ratio_vs_v2", "decode_8_vs_v2_same_dtype",
                           "decode_40_vs_v3_same_dtype", "prefill_vs_v2_same_dtype",
                           "decode_40_vs_v2_same_dtype", "attention_share_40_mlx_mla_auto"}
    assert ratios["cache_bytes_ratio_vs_v2"] == pytest.approx(80 / 288)
    with open(paths["csv"]) as f:
        assert len(list(csv.DictReader(f))) == len(rows)


def test_without_strips_flags_and_their_values():
    argv = ["--layers", "2", "--blas", "reference", "openblas", "--out", "x", "--prefill-v3"]
    assert bench._without(argv, "--blas", "--out") == ["--layers", "2", "--prefill-v3"]


def test_main_worker_then_parent_merges_per_blas(tmp_path, monkeypatch):
    """The worker half (one BLAS, tiny model) writes its rows; the parent half merges the
    workers' results (here the same one twice, as two BLAS) into one set of files."""
    monkeypatch.setattr(bench, "make_config", lambda layers, base=None: bench.with_layers(TINY, layers))
    worker = tmp_path / "w.json"
    assert bench.main(["--worker-out", str(worker), "--contexts", "8", "40", "--prefill-tokens",
                       "12", "--decode-steps", "2", "--check-extra-mib", "1"]) == 0
    result = json.loads(worker.read_text())
    assert {r["blas"] for r in result["rows"]} == {result["meta"]["blas"]}
    assert result["meta"]["layers"] == 2 and result["meta"]["budget"]

    def fake(module, argv, names, log=print):
        assert module == "benchmarks.e2e_decode" and "--blas" not in argv
        return [{"meta": {**result["meta"], "blas": n},
                 "rows": [{**r, "blas": n} for r in result["rows"]]} for n in names]

    monkeypatch.setattr(bench, "run_per_blas", fake)
    assert bench.main(["--blas", "reference", "openblas", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "e2e_decode.json").read_text())
    assert set(data["ratios"]) == set(data["meta"]) == {"reference", "openblas"}
    with open(tmp_path / "e2e_decode.csv") as f:
        assert {r["blas"] for r in csv.DictReader(f)} == {"reference", "openblas"}
