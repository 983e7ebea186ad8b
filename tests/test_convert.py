"""Converting the fixture checkpoint: format, loading with mlx-lm and mlx_mla, shards, bits."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from convert import ConvertOptions, convert
from convert_helpers import config, index, load_tensors, logits, run_cli, to_float32, tree_digest
from testdata import writable_copy


@pytest.fixture(scope="module")
def converted(tmp_path_factory, fixture_dir):
    """The fixture converted with `-q` (default recipe), with the source's digest before."""
    out = tmp_path_factory.mktemp("conv") / "q4"
    before = tree_digest(fixture_dir)
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q") == 0
    assert tree_digest(fixture_dir) == before, "the source must never be modified"
    return out


@pytest.fixture(scope="module")
def mlx_lm_converted(tmp_path_factory, fixture_dir):
    from mlx_lm.convert import convert as mlx_lm_convert

    out = tmp_path_factory.mktemp("mlxlm") / "q4"
    mlx_lm_convert(str(fixture_dir), str(out), quantize=True)
    return out


def test_folder_is_mlx_lm_format(converted):
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json", "README.md"} <= names
    cfg = config(converted)
    q = cfg["quantization"]
    assert cfg["quantization_config"] == q
    assert (q["bits"], q["group_size"], q["mode"]) == (4, 64, "affine")
    # the mla recipe mixes bits: per-module overrides, none of them float here
    assert q["model.layers.1.mlp.switch_mlp.down_proj"] == {"group_size": 128, "bits": 4, "mode": "affine"}
    assert False not in q.values()
    _, meta = mx.load(str(converted / "model.safetensors"), return_metadata=True)
    assert meta == {"format": "mlx"}
    tensors = load_tensors(converted)
    assert "model.layers.1.mlp.switch_mlp.down_proj.weight" in tensors
    assert not any(".experts." in k for k in tensors)
    assert "model.layers.0.self_attn.kv_b_proj.weight" in tensors  # kept whole
    # router gate and norms stay float
    assert "model.layers.1.mlp.gate.scales" not in tensors
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == mx.bfloat16
    assert "model.norm.scales" not in tensors
    card = (converted / "README.md").read_text()
    assert "library_name: mlx" in card and "- mlx" in card


def test_mla_folder_is_the_plan_within_budget(converted):
    """Every module's entry is what convert.plan solves on the fixture's shapes, and the
    folder's bits per weight is the plan's, within the default 4.6."""
    from convert import layout, plan, sensitivity
    from convert.recipes import QuantSpec

    cfg = config(converted)
    p = plan.plan_mla(layout.Layout.for_config(cfg), QuantSpec(4, 64), 4.6, sensitivity.load_prior())
    q = cfg["quantization"]
    modules = {k: v for k, v in q.items() if k not in ("group_size", "bits", "mode")}
    assert modules == {m: s.as_config() for m, s in p.recipe.overrides.items()}
    meta = json.loads((converted / "model.safetensors.index.json").read_text())["metadata"]
    assert meta["total_size"] * 8 / meta["total_parameters"] == pytest.approx(p.planned_bpw, abs=1e-12)
    assert p.planned_bpw <= 4.6


def test_stock_mlx_lm_and_mlx_mla_agree(converted):
    import mlx_lm
    import mlx_mla

    ref, _ = mlx_lm.load(str(converted))
    ours, _ = mlx_mla.load(str(converted), dtype="float32")
    a, b = logits(to_float32(ref)), logits(ours)
    assert mx.abs(a - b).max().item() < 1e-4


def test_mlx_mla_loads_mlx_lm_convert_output(mlx_lm_converted):
    import mlx_lm
    import mlx_mla

    ref, _ = mlx_lm.load(str(mlx_lm_converted))
    ours, _ = mlx_mla.load(str(mlx_lm_converted), dtype="float32")
    a, b = logits(to_float32(ref)), logits(ours)
    assert mx.abs(a - b).max().item() < 1e-4


def test_uniform_is_byte_identical_to_mlx_lm(tmp_path, mlx_lm_converted, fixture_dir):
    out = tmp_path / "u"
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q", "--quant-recipe", "uniform") == 0
    ours, theirs = load_tensors(out), load_tensors(mlx_lm_converted)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and mx.array_equal(ours[k], theirs[k]).item(), k
    assert config(out) == config(mlx_lm_converted)
    assert index(out) == index(mlx_lm_converted)


def test_multi_shard_index(tmp_path, converted, fixture_dir):
    out = tmp_path / "sharded"
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q", "--shard-size", "1MB") == 0
    idx = index(out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    listed = {}
    for f in files:
        for name in mx.load(str(out / f)):
            assert name not in listed, f"{name} stored twice"
            listed[name] = f
    assert listed == idx["weight_map"]  # every tensor once, in the file the index names
    assert list(idx["weight_map"]) == sorted(idx["weight_map"])
    tensors = load_tensors(out)
    assert idx["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    single = load_tensors(converted)
    assert tensors.keys() == single.keys()
    assert all(mx.array_equal(tensors[k], single[k]).item() for k in tensors)
    assert all((out / f).stat().st_size <= (1 << 20) + 4096 for f in files[:-1] if len(mx.load(str(out / f))) > 1)


def test_experts_split_across_source_shards(tmp_path, converted, fixture_dir):
    """Re-shard the source so a layer's experts straddle two files: same output."""
    src = writable_copy(fixture_dir, tmp_path / "src")
    weights = load_tensors(src)
    for f in src.glob("model*.safetensors"):
        f.unlink()
    names = sorted(weights)
    half = [n for n in names if ".experts." in n][50]
    cut = names.index(half)
    parts = {"model-00001-of-00002.safetensors": names[:cut], "model-00002-of-00002.safetensors": names[cut:]}
    weight_map = {}
    for file, keys in parts.items():
        mx.save_safetensors(str(src / file), {k: weights[k] for k in keys}, metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "out"
    assert run_cli("--hf-path", src, "--mlx-path", out, "-q") == 0
    a, b = load_tensors(out), load_tensors(converted)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.parametrize("bits,group", [(2, 32), (3, 64), (5, 128), (6, 64), (8, 32)])
def test_bits_and_group_sizes_round_trip(tmp_path, bits, group, fixture_dir):
    import mlx_lm

    out = tmp_path / f"q{bits}g{group}"
    report = convert(ConvertOptions(str(fixture_dir), str(out), quantize=True, q_bits=bits, q_group_size=group,
                                    quant_recipe="uniform", progress=False))
    q = config(out)["quantization"]
    assert (q["bits"], q["group_size"]) == (bits, group)
    src, dst = load_tensors(fixture_dir), load_tensors(out)
    w = src["model.layers.0.self_attn.o_proj.weight"]
    ref = mx.quantize(w, group_size=group, bits=bits)
    got = [dst[f"model.layers.0.self_attn.o_proj.{p}"] for p in ("weight", "scales", "biases")]
    assert all(mx.array_equal(r, g).item() for r, g in zip(ref, got))
    # kv_b_proj's input dim (64) is not a multiple of 128: it falls back to group 64
    if 64 % group:
        assert q["model.layers.0.self_attn.kv_b_proj"] == {"group_size": 64, "bits": bits, "mode": "affine"}
        kv_b = src["model.layers.0.self_attn.kv_b_proj.weight"]
        assert mx.array_equal(dst["model.layers.0.self_attn.kv_b_proj.scales"],
                              mx.quantize(kv_b, group_size=64, bits=bits)[1]).item()
    expected_bpw = bits + 32 / group
    assert expected_bpw < report.bits_per_weight < expected_bpw + 0.5
    model, _ = mlx_lm.load(str(out))  # loads with the right shapes
    assert model.model.layers[0].self_attn.o_proj.bits == bits


def test_dequantize_restores_float_weights(tmp_path, converted, fixture_dir):
    import mlx_lm

    out = tmp_path / "deq"
    assert run_cli("--hf-path", converted, "--mlx-path", out, "-d") == 0
    cfg = config(out)
    assert "quantization" not in cfg and "quantization_config" not in cfg
    src, dst = load_tensors(fixture_dir), load_tensors(out)
    assert not any(k.endswith(".scales") for k in dst)
    w = src["model.layers.0.self_attn.o_proj.weight"].astype(mx.float32)
    d = dst["model.layers.0.self_attn.o_proj.weight"].astype(mx.float32)
    assert d.shape == w.shape
    # within 4-bit quantization error: at most one step (range / 15) per group
    step = (w.reshape(-1, 64).max(-1) - w.reshape(-1, 64).min(-1)) / 15
    err = mx.abs(d - w).reshape(-1, 64).max(-1)
    assert mx.all(err <= step * 0.5 + 1e-2).item()
    stacked = mx.stack([src[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(16)])
    rel = mx.linalg.norm((dst["model.layers.1.mlp.switch_mlp.down_proj.weight"] - stacked).astype(mx.float32).reshape(-1))
    assert (rel / mx.linalg.norm(stacked.astype(mx.float32).reshape(-1))).item() < 0.15
    mlx_lm.load(str(out))


def test_force_replaces_and_dtype(tmp_path, fixture_dir):
    out = tmp_path / "f"
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out) == 0
    assert load_tensors(out)["lm_head.weight"].dtype == mx.bfloat16
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out, "--force", "--dtype", "float32") == 0
    t = load_tensors(out)
    assert t["lm_head.weight"].dtype == mx.float32
    np.testing.assert_array_equal(
        np.array(t["model.norm.weight"]), np.array(load_tensors(fixture_dir)["model.norm.weight"].astype(mx.float32))
    )
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
