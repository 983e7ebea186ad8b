"""The cache flags of the commands: cache_prompt makes a file, generate continues it, and
--max-kv-size / --kv-bits reach the latent cache; bad values are one line."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, save_prompt_cache

from mlx_mla import DEMO_MODEL
from mlx_mla.cache_prompt import main as cache_prompt
from mlx_mla.generate import main as generate

from testdata import KNOWN_ROMEO as KNOWN


def run(capsys, fn, *argv):
    rc = fn(list(map(str, argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


def test_cache_prompt_then_generate_continues_it(capsys, tmp_path):
    f = tmp_path / "romeo.safetensors"
    rc, out, _ = run(capsys, cache_prompt, "--prompt", "ROMEO:\nO, I am in brief", "--prompt-cache-file", f)
    assert rc == 0 and f.is_file() and "Saved the latent cache of 11 tokens" in out
    rc, out, _ = run(capsys, generate, "--prompt-cache-file", f, "--prompt", " with a tale",
                     "--max-tokens", "12", "--temp", "0", "--verbose", "false")
    # the cache (11 tokens) + the suffix continue as the uncached greedy run of the whole
    # text does: KNOWN goes on "… with a tale language.\n\nBENVOLIO:\nO, …"
    assert rc == 0 and out.startswith("language.\n\nBENVOLIO:\nO,"), out


def test_cache_prompt_names_the_file_it_writes(capsys, tmp_path):
    """MLX's save_safetensors adds ``.safetensors`` to a name without it; the message names
    the file written, and generate continues from that name."""
    rc, out, _ = run(capsys, cache_prompt, "--prompt", "ROMEO:", "--prompt-cache-file", tmp_path / "noext")
    written = tmp_path / "noext.safetensors"
    assert rc == 0 and written.is_file() and out.rstrip().endswith(f"to {written}"), out
    rc, _, err = run(capsys, generate, "--prompt-cache-file", written, "--max-tokens", "2", "--temp", "0")
    assert rc == 0, err


@pytest.mark.parametrize("where, expected", [
    ("nodir/c.safetensors", "the folder {tmp}/nodir does not exist"),
    (".", "is a folder: name a file in it"),
])
def test_cache_prompt_checks_where_it_writes_first(capsys, tmp_path, where, expected):
    rc, out, err = run(capsys, cache_prompt, "--prompt", "ROMEO:", "--prompt-cache-file", tmp_path / where)
    assert rc == 1 and len(err) == 1 and expected.format(tmp=tmp_path) in err[0], err
    assert "Processed" not in out  # refused before the prompt ran
    assert list(tmp_path.iterdir()) == []


def test_bounded_and_quantized_caches_from_the_command_line(capsys):
    rc, out, _ = run(capsys, generate, "--max-tokens", "30", "--temp", "0", "--max-kv-size", "16")
    assert rc == 0 and "Latent cache: " in out and "for 16 tokens" in out
    rc, out, _ = run(capsys, generate, "--max-tokens", "30", "--temp", "0", "--kv-bits", "8",
                     "--quantized-kv-start", "8")
    # 4 layers × (64 8-bit c_kv + a float32 scale and bias + 16 float32 k_pe) per token
    assert rc == 0 and "(544 bytes/token, 4 layers)" in out
    assert KNOWN[:20] in out  # 8-bit keeps the greedy text here


@pytest.mark.parametrize("argv, expected", [
    (["--kv-bits", "7"], "kv bits 7 is not supported"),
    (["--kv-bits", "8", "--kv-group-size", "48"], "kv group size 48 must be 32, 64 or 128"),
    (["--max-kv-size", "3"], "max_kv_size 3 must be larger than the 4 tokens always kept"),
    (["--prompt-cache-file", "/nowhere/c.safetensors"], "does not exist"),
])
def test_bad_cache_flags_are_one_line(capsys, argv, expected):
    rc, _, err = run(capsys, generate, "--max-tokens", "2", *argv)
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_generate_refuses_a_cache_file_for_another_model(capsys, tmp_path):
    f = tmp_path / "mlx-lm.safetensors"
    caches = [KVCache() for _ in range(4)]
    for c in caches:
        c.update_and_fetch(mx.zeros((1, 8, 3, 48)), mx.zeros((1, 8, 3, 32)))
    save_prompt_cache(str(f), caches, {"model": "elsewhere"})
    rc, _, err = run(capsys, generate, "--model", DEMO_MODEL,
                     "--prompt-cache-file", f, "--max-tokens", "2")
    assert rc == 1 and len(err) == 1 and "made for another kind of model" in err[0], err
