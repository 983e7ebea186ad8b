"""The front door: `python -m mlx_mla.generate` on the demo checkpoint, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mlx_mla
from mlx_mla.generate import main
from testdata import KNOWN_ROMEO as KNOWN
from testdata import corrupt_offsets, writable_copy


def test_main_command_prints_known_continuation_and_stats():
    out = subprocess.run(
        [sys.executable, "-m", "mlx_mla.generate", "--prompt", "ROMEO:", "--max-tokens", "40",
         "--temp", "0"], capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert KNOWN in text
    for stat in ("Prompt: 3 tokens", "Generation: 40 tokens", "Peak memory:", "Latent cache:"):
        assert stat in text
    # 4 layers × (64 + 16) values × 4 bytes (float32)
    assert "1280 bytes/token" in text


def test_chat_template_applied_with_one_bos(fixture_dir):
    _, tokenizer = mlx_mla.load(fixture_dir)
    from mlx_mla.generate import encode_prompt

    templated = encode_prompt(tokenizer, "ROMEO:", None, ignore_template=False)
    assert templated.count(tokenizer.bos_token_id) == 1 and templated[0] == tokenizer.bos_token_id
    assert len(templated) > 3
    assert encode_prompt(tokenizer, "ROMEO:", None, ignore_template=True) == [0, 836, 27]


def run_main(capsys, *argv):
    rc = main(list(map(str, argv)))
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines()


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "does not exist"),
        ("no_config", "has no config.json"),
        ("no_weights", "has no model*.safetensors"),
        ("llama", "model_type 'llama' is not supported"),
        ("missing_shard", "missing weight shard"),
        ("strategy", "unknown MLA strategy 'fastest'"),
        ("too_long", "exceeds the model's context of 2048 tokens"),
        ("dtype", "unknown dtype 'float8'"),
        ("truncated_shard", "model-00002-of-00004.safetensors is truncated"),
        ("corrupt_shard", "model-00002-of-00004.safetensors is not a readable safetensors file"),
        ("garbage_shard", "model-00004-of-00004.safetensors is not a readable safetensors file"),
        ("no_tokenizer", "has no tokenizer files"),
        ("temp", "--temp must be 0 (greedy) or more"),
        ("top_p_0", "--top-p must be in (0, 1]"),
        ("top_p_big", "--top-p must be in (0, 1]"),
        ("min_p_negative", "--min-p must be in [0, 1]"),
        ("min_p_big", "--min-p must be in [0, 1]"),
        ("seed", "--seed must be in [0, 2**64)"),
        ("max_tokens", "--max-tokens must be at least 1"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(capsys, fixture_dir, tmp_path, case, expected):
    model = writable_copy(fixture_dir, tmp_path / "model")
    argv = ["--model", model, "--max-tokens", "2"]
    if case == "missing":
        argv[1] = tmp_path / "nowhere"
    elif case == "no_config":
        (model / "config.json").unlink()
    elif case == "no_weights":
        for f in model.glob("*.safetensors"):
            f.unlink()
    elif case == "llama":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    elif case == "missing_shard":
        (model / "model-00003-of-00004.safetensors").unlink()
    elif case == "strategy":
        argv += ["--mla-strategy", "fastest"]
    elif case == "too_long":
        argv[3] = 2046
    elif case == "dtype":
        argv += ["--dtype", "float8"]
    elif case == "truncated_shard":
        shard = model / "model-00002-of-00004.safetensors"
        shard.write_bytes(shard.read_bytes()[:-1000])
    elif case == "corrupt_shard":
        corrupt_offsets(model / "model-00002-of-00004.safetensors")
    elif case == "garbage_shard":
        (model / "model-00004-of-00004.safetensors").write_bytes(b"\xff" * 64)
    elif case == "no_tokenizer":
        (model / "tokenizer.json").unlink()
    elif case == "max_tokens":
        argv[3] = 0
    else:  # sampler ranges, as mlx-lm's make_sampler takes them
        flag, value = {"temp": ("--temp", -1), "top_p_0": ("--top-p", 0),
                       "top_p_big": ("--top-p", 1.5), "min_p_negative": ("--min-p", -0.1),
                       "min_p_big": ("--min-p", 2), "seed": ("--seed", -1)}[case]
        argv += [flag, value]
    rc, err = run_main(capsys, *argv)
    assert rc != 0
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_mla.generate", "--model", str(tmp_path / "nowhere")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0


def test_hub_repo_id_goes_through_snapshot_download(monkeypatch, fixture_dir):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, tuple(allow_patterns)))
        return str(fixture_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, _ = mlx_mla.load("deepseek-ai/DeepSeek-V2-Lite", revision="main")
    assert calls and calls[0][:2] == ("deepseek-ai/DeepSeek-V2-Lite", "main")
    assert "model*.safetensors" in calls[0][2] and "*.json" in calls[0][2]
    assert model.args.num_hidden_layers == 4


def test_failed_download_is_one_clear_error(monkeypatch):
    import huggingface_hub

    def offline(*a, **k):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(mlx_mla.ModelLoadError, match="could not download owner/model"):
        mlx_mla.load("owner/model")


@pytest.mark.skipif(
    __import__("mlx.core").core.default_device() != __import__("mlx.core").core.cpu,
    reason="the CPU build's gather_mm is float32-only; GPU backends run bfloat16",
)
def test_unsupported_expert_dtype_fails_at_load_with_advice(capsys, fixture_dir):
    rc, err = run_main(capsys, "--model", fixture_dir, "--dtype", "bfloat16", "--max-tokens", "2")
    assert rc != 0 and len(err) == 1 and "--dtype float32" in err[0]


def test_system_prompt_without_chat_template_warns_once(capsys):
    # the demo checkpoint has no chat template (a base model)
    rc = main(["--system-prompt", "Be brief.", "--max-tokens", "2", "--verbose", "off"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0
    assert err == ["warning: --system-prompt is ignored: the tokenizer has no chat template"]


@pytest.mark.parametrize("text, value", [
    ("0", False), ("no", False), ("off", False), ("False", False), ("f", False),
    ("1", True), ("yes", True), ("ON", True), ("true", True),
])
def test_verbose_spellings(text, value):
    from mlx_mla.generate import build_parser

    assert build_parser().parse_args(["--verbose", text]).verbose is value


def test_verbose_rejects_other_words(capsys):
    from mlx_mla.generate import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--verbose", "maybe"])
    assert e.value.code == 2
    assert "argument --verbose: expected true or false" in capsys.readouterr().err


def test_reader_closing_the_pipe_early_is_a_quiet_exit():
    """`python -m mlx_mla.generate | head -2`: the reader goes away mid-stream."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_mla.generate", "--max-tokens", "300", "--temp", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    lines = [proc.stdout.readline() for _ in range(2)]
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err  # 128 + SIGPIPE, as a shell reports `yes | head`
    assert lines[0].startswith(b"==========")
    assert err == "", err
