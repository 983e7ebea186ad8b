"""MLX's floating-point quantization modes (mxfp4, mxfp8, nvfp4), against stock mlx-lm.

Folders written by stock ``mlx_lm.convert --q-mode MODE`` load in ``mlx_mla.load`` and run
every strategy within the bounds affine folders have; ``python -m convert -d`` turns them
back into float (exactly MLX's round trip of the source weights); our ``--q-mode`` writes
the same folder as mlx-lm's. Bits, group size and mode come from config.json.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import mlx_mla
from convert import recipes
from convert_helpers import config, index, load_tensors, logits, run_cli, to_float32
from mlx_mla import STRATEGIES
from testdata import writable_copy


def _supported(mode: str) -> bool:
    bits, group = recipes.FIXED_MODES[mode]
    try:
        mx.eval(mx.quantize(mx.zeros((32, 128)), group_size=group, bits=bits, mode=mode))
        return True
    except (ValueError, RuntimeError):
        return False


MODES = [pytest.param(m, marks=pytest.mark.skipif(not _supported(m), reason=f"this MLX lacks {m}"))
         for m in recipes.FIXED_MODES]


@pytest.fixture(scope="module")
def stock(fixture_dir, tmp_path_factory):
    """{mode: the fixture converted by stock mlx_lm.convert -q --q-mode mode}, made on first use."""
    from mlx_lm.convert import convert as mlx_lm_convert

    root, made = tmp_path_factory.mktemp("stock-modes"), {}

    def get(mode):
        if mode not in made:
            made[mode] = root / mode
            mlx_lm_convert(str(fixture_dir), str(made[mode]), quantize=True, q_mode=mode)
        return made[mode]

    return get


@pytest.mark.parametrize("mode", MODES)
def test_stock_folder_runs_every_strategy_like_mlx_lm(stock, mode):
    import mlx_lm

    folder = stock(mode)
    bits, group = recipes.FIXED_MODES[mode]
    assert config(folder)["quantization"] == {"group_size": group, "bits": bits, "mode": mode}
    ref, _ = mlx_lm.load(str(folder))
    expected = logits(to_float32(ref))
    model, _ = mlx_mla.load(folder, dtype="float32")
    attn = model.layers[0].self_attn
    assert (attn.w_uq.mode, attn.w_uq.bits, attn.w_uq.group_size) == (mode, bits, group)
    for name in STRATEGIES:
        model.set_mla_strategy(name)
        diff = mx.abs(logits(model) - expected).max().item()
        # as on affine folders (test_convert): the same quantized tensors, float32 math
        assert diff < 1e-4, (name, diff)


@pytest.mark.parametrize("mode", MODES)
def test_our_q_mode_writes_what_mlx_lm_writes(tmp_path, stock, mode, fixture_dir):
    out = tmp_path / mode
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q", "--q-mode", mode) == 0
    ours, theirs = load_tensors(out), load_tensors(stock(mode))
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and mx.array_equal(ours[k], theirs[k]).item(), k
    assert config(out) == config(stock(mode))
    assert index(out) == index(stock(mode))


@pytest.mark.parametrize("mode", MODES)
def test_dequantize_is_the_round_trip_of_the_source(tmp_path, stock, mode, fixture_dir):
    import mlx_lm

    out = tmp_path / "float"
    assert run_cli("--hf-path", stock(mode), "--mlx-path", out, "-d") == 0
    assert "quantization" not in config(out) and "quantization_config" not in config(out)
    bits, group = recipes.FIXED_MODES[mode]
    src, dst, stored = load_tensors(fixture_dir), load_tensors(out), load_tensors(stock(mode))
    assert not any(k.endswith(".scales") for k in dst)
    quantized = [k[: -len(".scales")] for k in stored if k.endswith(".scales")]
    assert len(quantized) > 20
    for module in quantized:
        w = dst[f"{module}.weight"]
        if ".switch_mlp." in module:  # the source holds experts one by one
            layer, proj = module.split(".mlp.switch_mlp.")
            source = mx.stack([src[f"{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(16)])
        else:
            source = src[f"{module}.weight"]
        # within quantization error: exactly MLX's quantize → dequantize of the source
        expected = mx.dequantize(*mx.quantize(source, group_size=group, bits=bits, mode=mode),
                                 group_size=group, bits=bits, mode=mode)
        assert w.dtype == mx.bfloat16 and w.shape == source.shape, module
        assert mx.array_equal(w, expected.astype(mx.bfloat16)).item(), module
    mlx_lm.load(str(out))


def test_modes_come_from_the_config_not_the_shapes(tmp_path, stock):
    """An mxfp4 folder whose config claims affine: one clear error from load and -d."""
    folder = writable_copy(stock("mxfp4"), tmp_path / "liar")
    cfg = config(folder)
    cfg["quantization"] = cfg["quantization_config"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mlx_mla.ModelLoadError, match="Biases must be provided"):
        mlx_mla.load(folder)
    assert run_cli("--hf-path", folder, "--mlx-path", tmp_path / "out", "-d") == 1
