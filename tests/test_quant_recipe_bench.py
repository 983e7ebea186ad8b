"""benchmarks/quant_recipe.py's steps on a tiny random checkpoint: each returns well-formed
figures, and its PyTorch evaluation of a folder matches stock mlx_lm.load's."""

from __future__ import annotations

import json

import pytest

import benchmarks.quant_recipe as bench
from convert import layout
from convert.recipes import QuantSpec
from reference import make_checkpoint
from testdata import CORPUS

SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=128, moe_intermediate_size=64, kv_lora_rank=64,
             num_hidden_layers=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qr") / "src"
    make_checkpoint(folder, seed=2, **SHAPE)
    lay = layout.Layout.for_config(json.loads((folder / "config.json").read_text()))
    state = bench.source_state(folder)
    ev = bench.Evaluator(folder, CORPUS.read_text(), max_windows=1)
    ev.set_reference(state)
    return folder, lay, state, ev


def test_sensitivity_falls_with_bits(model):
    _, lay, state, ev = model
    kl, rows = bench.measure_sensitivity(ev, state, lay, 1, bits=(2, 8), groups=(64,))
    assert set(kl) == set(bench.class_units(lay))
    for cls, curve in kl.items():
        assert curve[QuantSpec(2, 64)] > 10 * curve[QuantSpec(8, 64)] > 0, cls
    assert len(rows) == 2 * len(kl)


def test_band_weights_average_one_over_the_layers(model):
    _, lay, state, ev = model
    bands, rows = bench.measure_bands(ev, state, lay, 1)
    assert set(bands["attn_o"]) == {"first", "first_moe", "middle", "last"}
    assert set(bands["experts_down"]) == {"first_moe", "middle", "last"}
    for cls, weights in bands.items():
        layers = {r["band"]: r["layers"] for r in rows if r["class"] == cls}
        assert sum(w * layers[b] for b, w in weights.items()) == pytest.approx(sum(layers.values()))


def test_layer_shares_sum_to_one(model):
    _, lay, state, ev = model
    rows = bench.measure_layers(ev, state, lay, 1)
    for cls in {r["class"] for r in rows}:
        assert sum(r["share_of_class"] for r in rows if r["class"] == cls) == pytest.approx(1.0)


def test_folders_and_engine_check(model, tmp_path):
    folder, lay, state, ev = model
    from convert import ConvertOptions, convert

    runs = {"ours uniform": lambda p: convert(ConvertOptions(str(folder), str(p), quantize=True,
                                                            quant_recipe="uniform", progress=False)),
            "ours mla": lambda p: convert(ConvertOptions(str(folder), str(p), quantize=True, progress=False,
                                                        dtype="bfloat16"))}
    table, folders = bench.measure_folders(ev, runs, tmp_path)
    assert [r["method"] for r in table] == list(runs) and table[0]["kl_vs_mlx_lm_q"] == 1.0
    assert table[1]["bpw"] <= 4.6
    assert all(r["kl"] > 0 for r in table)
    assert bench.engine_check(ev, folders["ours uniform"]) < 1e-4
