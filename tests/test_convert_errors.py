"""Bad input: one clear error line, non-zero exit, no output folder, source untouched."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import convert.writer as writer_mod
from convert_helpers import leftovers, load_tensors, run_cli, tree_digest
from testdata import corrupt_offsets, writable_copy


def _expect_error(capsys, tmp_path, src, *extra, match: str):
    out = tmp_path / "out"
    before = tree_digest(src)
    rc = run_cli("--hf-path", src, "--mlx-path", out, *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert err and err[-1].startswith("error: ") and match in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert not out.exists()
    assert leftovers(tmp_path, "out") == []
    assert tree_digest(src) == before
    return err[-1]


def test_missing_shard(tmp_path, capsys, fixture_dir):
    src = writable_copy(fixture_dir, tmp_path / "src")
    (src / "model-00003-of-00004.safetensors").unlink()
    _expect_error(capsys, tmp_path, src, "-q", match="missing weight shard model-00003-of-00004.safetensors")


def test_truncated_shard(tmp_path, capsys, fixture_dir):
    src = writable_copy(fixture_dir, tmp_path / "src")
    f = src / "model-00002-of-00004.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    _expect_error(capsys, tmp_path, src, "-q", match="truncated")


def test_shard_with_invalid_data_offsets(tmp_path, capsys, fixture_dir):
    src = writable_copy(fixture_dir, tmp_path / "src")
    corrupt_offsets(src / "model-00002-of-00004.safetensors")
    _expect_error(capsys, tmp_path, src, "-q",
                  match="model-00002-of-00004.safetensors is not a readable safetensors file")


def test_garbage_shard(tmp_path, capsys, fixture_dir):
    src = writable_copy(fixture_dir, tmp_path / "src")
    (src / "model-00004-of-00004.safetensors").write_bytes(b"\xff" * 64)
    _expect_error(capsys, tmp_path, src, match="model-00004-of-00004.safetensors")


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_unsupported_model_type(tmp_path, capsys, model_type, fixture_dir):
    src = writable_copy(fixture_dir, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = model_type
    (src / "config.json").write_text(json.dumps(cfg))
    _expect_error(capsys, tmp_path, src, "-q", match=f"model_type '{model_type}' is not supported")


@pytest.mark.parametrize("flag,value,match", [
    ("--q-bits", "7", "--q-bits 7 is not supported"),
    ("--q-bits", "1", "--q-bits 1 is not supported"),
    ("--q-group-size", "48", "--q-group-size 48 is not supported"),
    ("--quant-recipe", "fancy", "--quant-recipe fancy"),
    ("--dtype", "int8", "--dtype int8"),
    ("--bits-per-weight", "0", "--bits-per-weight 0.0 must be a positive number"),
    ("--calibration-file", "no-such-file.txt", "--calibration-file no-such-file.txt is not a file"),
    ("--min-bits", "5", "--min-bits 5: choose one of 2, 3, 4 (at most --q-bits)"),
])
def test_unsupported_options(tmp_path, capsys, flag, value, match, fixture_dir):
    _expect_error(capsys, tmp_path, fixture_dir, "-q", flag, value, match=match)


def test_mla_options_need_the_mla_recipe(tmp_path, capsys, fixture_dir):
    _expect_error(capsys, tmp_path, fixture_dir, "-q", "--quant-recipe", "uniform", "--bits-per-weight", "5",
                  match="--bits-per-weight applies to -q with the mla recipe")


@pytest.mark.parametrize("extra, match", [
    (["--bits-per-weight", "inf"], "--bits-per-weight inf must be a positive number"),
    (["--bits-per-weight", "nan"], "--bits-per-weight nan must be a positive number"),
    (["--calibration-tokens", "512"], "--calibration-tokens applies with --calibration-file"),
])
def test_bad_mla_values(tmp_path, capsys, fixture_dir, extra, match):
    _expect_error(capsys, tmp_path, fixture_dir, "-q", *extra, match=match)


def test_calibration_text_too_short(tmp_path, capsys, fixture_dir):
    text = tmp_path / "short.txt"
    text.write_text("To be")
    _expect_error(capsys, tmp_path, fixture_dir, "-q", "--calibration-file", text,
                  match="short.txt has 3 tokens")


@pytest.mark.parametrize("extra, match", [
    (["--q-mode", "mxfp4", "--quant-recipe", "mla"], "--q-mode mxfp4 takes --quant-recipe uniform"),
    (["--q-mode", "nvfp4", "--q-bits", "8"], "--q-mode nvfp4 stores 4 bits in groups of 16"),
    (["--q-mode", "mxfp8", "--q-group-size", "64"], "--q-mode mxfp8 stores 8 bits in groups of 32"),
])
def test_fixed_modes_take_only_their_bits_and_uniform(tmp_path, capsys, extra, match, fixture_dir):
    _expect_error(capsys, tmp_path, fixture_dir, "-q", *extra, match=match)


def test_quantize_and_dequantize_together(tmp_path, capsys, fixture_dir):
    _expect_error(capsys, tmp_path, fixture_dir, "-q", "-d", match="not both")


def test_existing_target_without_force(tmp_path, capsys, fixture_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc = run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and "already exists" in err[-1] and "--force" in err[-1]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_target_inside_source_is_refused(tmp_path, capsys, fixture_dir):
    src = writable_copy(fixture_dir, tmp_path / "src")
    before = tree_digest(src)
    assert run_cli("--hf-path", src, "--mlx-path", src, "--force") != 0
    assert "overlaps the source" in capsys.readouterr().err
    assert tree_digest(src) == before


def test_missing_source(tmp_path, capsys):
    _expect_error(capsys, tmp_path, tmp_path / "nope" / "x" / "y", match="does not exist")


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_run_leaves_nothing(tmp_path, capsys, monkeypatch, exc, fixture_dir):
    """An exception or Ctrl-C mid-write: no target, no staging folder, created parents gone."""
    calls = []
    real = writer_mod.mx.save_safetensors

    def flaky(path, arrays, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise exc
        return real(path, arrays, metadata=metadata)

    monkeypatch.setattr(writer_mod.mx, "save_safetensors", flaky)
    out = tmp_path / "new" / "out"
    rc = run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q", "--shard-size", "1MB")
    assert rc != 0 and len(calls) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ")
    assert not (tmp_path / "new").exists()


def test_interrupted_force_keeps_old_target(tmp_path, monkeypatch, fixture_dir):
    out = tmp_path / "out"
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out) == 0
    before = tree_digest(out)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer_mod.mx, "save_safetensors", boom)
    assert run_cli("--hf-path", fixture_dir, "--mlx-path", out, "-q", "--force") == 130
    assert tree_digest(out) == before
    assert leftovers(tmp_path, "out") == []
    assert "lm_head.scales" not in load_tensors(out)


def test_ctrl_c_while_imports_load(tmp_path, capsys, monkeypatch, fixture_dir):
    """Ctrl-C while `python -m convert` is still importing MLX / mlx-lm: the one line, 130."""

    class CtrlC:
        def find_spec(self, name, path=None, target=None):
            if name == "convert.pipeline":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "convert.pipeline", raising=False)
    monkeypatch.setattr(sys, "meta_path", [CtrlC(), *sys.meta_path])
    rc = run_cli("--hf-path", fixture_dir, "--mlx-path", tmp_path / "out", "-q")
    assert rc == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: interrupted; nothing was written to --mlx-path"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("after", ["mlx_mla.backend", "torch.fx.passes.runtime_assert"])
def test_sigint_while_mlx_imports(tmp_path, fixture_dir, after):
    """A real SIGINT once `python -m convert` has begun importing MLX (``-X importtime``
    reports each finished import on stderr; mlx_mla.backend is the last before mlx.core),
    or while mlx-lm's import chain is inside torch (via transformers, installed with the
    test extra), where the exception was once swallowed and the conversion ran to the end:
    the one line and 130."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "convert", "--hf-path", str(fixture_dir),
         "--mlx-path", str(tmp_path / "out"), "-q"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    for line in proc.stderr:
        if line.rstrip().endswith(after):
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, rest
    assert rest.strip().splitlines()[-1] == "error: interrupted; nothing was written to --mlx-path"
    assert "Traceback" not in rest
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []
