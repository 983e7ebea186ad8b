"""``python -m mlx_mla.compare`` against stock mlx-lm on the fixture checkpoint.

Agreement is checked on the real checkpoint; disagreement by making only *our* side wrong
(RoPE layout, softmax scale): perturbing the weights would not do, since both engines would
read the same perturbed weights and still agree.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from mlx_mla import STRATEGIES, compare
from mlx_mla import rope as rope_mod
from mlx_mla.attention import mla as mla_mod


def run(capsys, model, *extra):
    rc = compare.main(["--model", str(model), "--max-tokens", "10", *map(str, extra)])
    return rc, capsys.readouterr().out


def test_fixture_agrees_with_mlx_lm_for_every_strategy(capsys, fixture_dir, tmp_path):
    out_json = tmp_path / "cmp.json"
    rc, out = run(capsys, fixture_dir, "--json", out_json)
    assert rc == 0, out
    assert "result: PASS" in out
    assert "threshold (float32): max |Δlogit| ≤ 0.001, mean KL ≤ 1e-06" in out
    # the bf16 checkpoint cannot run mlx-lm's MoE in bf16 on the CPU: the peer is cast, and says so
    assert "adjusted for mlx-lm: dtype" in out
    data = json.loads(out_json.read_text())
    assert data["passed"] and data["dtype"] == "float32"
    assert [r["engine"] for r in data["results"]] == [f"mlx_mla {s}" for s in STRATEGIES]
    ref = data["reference"]
    assert len(ref["tokens"]) == 10
    for r in data["results"]:
        assert r["tokens"] == ref["tokens"]
        assert r["max_abs_logit"] < 1e-3 and r["mean_kl"] < 1e-6
        assert r["prompt_tps"] > 0 and r["generation_tps"] > 0 and r["peak_memory_bytes"] > 0
        # latent cache: 4 layers x (64 + 16) float32 vs 4 x 8 heads x (48 + 32) float32
        assert r["cache_bytes_per_token"] == 4 * (64 + 16) * 4
    assert ref["cache_bytes_per_token"] == 4 * 8 * (48 + 32) * 4


def test_wrong_rope_layout_on_our_side_fails_and_names_position(capsys, fixture_dir, monkeypatch):
    monkeypatch.setattr(rope_mod.RoPE, "traditional", False)  # half-split pairs, Llama's layout
    rc, out = run(capsys, fixture_dir, "--mla-strategy", "auto", "naive")
    assert rc == 1, out
    assert "result: FAIL (2 of 2" in out
    # position 0 attends only to itself (and rotates by 0): the first wrong logits are at 1
    assert re.search(r"first diverging position: 1 \(prompt token 1", out), out
    assert "first differing generated token:" in out


def test_wrong_softmax_scale_on_our_side_fails(capsys, fixture_dir, monkeypatch):
    monkeypatch.setattr(mla_mod, "softmax_scale", lambda q_head_dim, rope: q_head_dim ** -0.5)
    rc, out = run(capsys, fixture_dir, "--mla-strategy", "absorb")
    assert rc == 1, out
    assert "FAIL mlx_mla absorb" in out
    assert re.search(r"first diverging position: \d+", out), out


def test_rope_parameters_only_config_is_adjusted_on_the_peer(capsys, fixture_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(fixture_dir, folder)
    cfg_path = folder / "config.json"
    cfg_path.chmod(0o644)
    cfg = json.loads(cfg_path.read_text())
    scaling = cfg.pop("rope_scaling")
    scaling["rope_type"] = scaling.pop("type")
    scaling["rope_theta"] = cfg.pop("rope_theta")
    cfg["rope_parameters"] = scaling
    cfg_path.write_text(json.dumps(cfg))
    rc, out = run(capsys, folder, "--mla-strategy", "auto")
    assert rc == 0, out
    assert "adjusted for mlx-lm: config: rope_parameters -> rope_scaling=" in out


def test_peer_adjustment_for_plain_rope():
    overrides, notes = compare.peer_config_adjustments(
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}})
    assert overrides == {"rope_theta": 5000.0, "rope_scaling": {"type": "yarn", "factor": 1.0}}
    assert len(notes) == 1
    assert compare.peer_config_adjustments({"rope_scaling": {"type": "yarn", "factor": 4}}) == ({}, [])


def test_missing_folder_is_exit_2(capsys, tmp_path):
    rc = compare.main(["--model", str(tmp_path / "nope")])
    assert rc == 2
    assert "error:" in capsys.readouterr().err


def test_threshold_policy():
    assert compare.threshold_for("float32").max_abs_logit == 1e-3
    t = compare.threshold_for("bfloat16", (0.1, None))
    assert (t.max_abs_logit, t.mean_kl) == (0.1, 5e-3)


@pytest.mark.parametrize("case, extra, expected", [
    ("max_tokens", ["--max-tokens", "0"], "--max-tokens must be at least 1"),
    ("text_file", ["--text-file", "{tmp}/no-such.txt"], "does not exist"),
    ("json_folder", ["--json", "{tmp}/no-such-folder/out.json"], "does not exist; create it first"),
    ("context", ["--max-tokens", "2046"], "exceeds the model's context of 2048 tokens"),
    ("no_tokenizer", [], "has no tokenizer files"),
    ("corrupt_shard", [], "model-00002-of-00004.safetensors is not a readable safetensors file"),
    pytest.param("bfloat16", ["--dtype", "bfloat16"], "--dtype float32", marks=pytest.mark.skipif(
        __import__("mlx.core").core.default_device() != __import__("mlx.core").core.cpu,
        reason="the CPU build's gather_mm is float32-only; GPU backends run bfloat16")),
])
def test_bad_input_is_one_line_exit_2_before_any_model_runs(capsys, fixture_dir, tmp_path, case,
                                                            extra, expected):
    from testdata import corrupt_offsets, writable_copy

    model = fixture_dir
    if case in ("no_tokenizer", "corrupt_shard"):
        model = writable_copy(fixture_dir, tmp_path / "model")
        if case == "no_tokenizer":
            (model / "tokenizer.json").unlink()
        else:
            corrupt_offsets(model / "model-00002-of-00004.safetensors")
    argv = ["--model", str(model), *(a.format(tmp=tmp_path) for a in extra)]
    rc = compare.main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert captured.out == ""  # nothing ran: the report starts with the model line


@pytest.fixture(scope="module")
def converted_folders(fixture_dir, tmp_path_factory):
    """The demo checkpoint as every folder the converter writes: affine 2-8 bits with
    both recipes, and each floating-point --q-mode."""
    from convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("converted")
    folders = {}
    options = [dict(q_bits=b, quant_recipe=r) for r in ("mla", "uniform") for b in (2, 3, 4, 6, 8)]
    options += [dict(q_mode=m) for m in ("mxfp4", "mxfp8", "nvfp4")]
    for fields in options:
        name = "-".join(str(v) for v in fields.values())
        convert(ConvertOptions(str(fixture_dir), str(root / name), quantize=True, progress=False,
                               **fields))
        folders[name] = root / name
    return folders


@pytest.mark.parametrize("name", [f"{b}-{r}" for r in ("mla", "uniform") for b in (2, 3, 4, 6, 8)]
                         + ["mxfp4", "mxfp8", "nvfp4"])
def test_compare_passes_on_every_converted_folder(capsys, converted_folders, name, tmp_path):
    out_json = tmp_path / "cmp.json"
    rc = compare.main(["--model", str(converted_folders[name]), "--max-tokens", "8",
                       "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads(out_json.read_text())
    assert data["quantized"] and [r["engine"] for r in data["results"]] == [
        f"mlx_mla {s}" for s in STRATEGIES]


def test_requantized_derived_matrices_are_what_made_materialized_differ(converted_folders):
    """benchmarks.compare_quantized's claim, on the 2-bit uniform folder: float derived
    matrices agree with mlx-lm like the other strategies; re-quantized at the folder's bits
    (the earlier rule) they do not, and the module default is restored afterwards."""
    from benchmarks.compare_quantized import measure_folder
    from mlx_mla.attention.strategies import absorb_materialized

    rows = {(r["strategy"], r["derived"]): r
            for r in measure_folder(converted_folders["2-uniform"], "ROMEO:", 8)}
    assert absorb_materialized.DERIVED_QUANTIZATION is None
    limit = compare.THRESHOLDS["float32"][0]
    assert rows[("absorb-materialized", "float")]["max_abs_logit"] < limit
    assert all(rows[(s, "")]["max_abs_logit"] < limit for s in ("naive", "absorb", "auto"))
    assert rows[("absorb-materialized", "folder")]["max_abs_logit"] > 100 * limit
