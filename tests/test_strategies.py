"""All four MLA strategy names compute the same function as transformers (float32, 1e-4 on
logits), for a prefill, a chunked prefill and 64 decode steps; and on 4-bit weights the
absorbed strategy picks the same top-1 token as the naive one."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest

import mlx_mla
from mlx_mla.attention.strategies.materialized import Materialized
from reference import fixture_tokens, hf_logits, load_fixture_reference, make_checkpoint

TOL = 1e-4
NAMES = ["naive", "absorb-materialized", "absorb", "auto"]


def ours(model, tokens, cache=None) -> np.ndarray:
    return np.array(model(mx.array([tokens], dtype=mx.int32), cache=cache)[0])


@pytest.fixture(scope="module", params=["fixture", "tiny-q_lora-null", "tiny-q_lora-set"])
def case(request, fixture_dir, tmp_path_factory):
    """(folder, reference logits over 72 tokens, the tokens)."""
    if request.param == "fixture":
        folder, ref = fixture_dir, load_fixture_reference()
        tokens = fixture_tokens(72)
    else:
        folder = tmp_path_factory.mktemp(request.param)
        q_lora = 24 if request.param.endswith("set") else None
        ref = make_checkpoint(folder, seed=3, q_lora_rank=q_lora)
        tokens = [int(t) for t in np.random.RandomState(4).randint(2, 512, 72)]
    return folder, hf_logits(ref, tokens), tokens


@pytest.mark.parametrize("name", NAMES)
def test_strategy_matches_transformers(case, name):
    folder, expected, tokens = case
    model, _ = mlx_mla.load(folder, mla_strategy=name, dtype="float32")

    prefill = ours(model, tokens[:40])
    assert np.abs(prefill - expected[:40]).max() <= TOL, "prefill"

    cache = model.make_cache()
    chunks = [ours(model, tokens[a:b], cache) for a, b in ((0, 17), (17, 18), (18, 40))]
    assert np.abs(np.concatenate(chunks) - expected[:40]).max() <= TOL, "chunked prefill"

    cache = model.make_cache()
    ours(model, tokens[:8], cache)
    steps = [ours(model, [t], cache)[0] for t in tokens[8:72]]
    assert len(steps) == 64 and cache[0].offset == 72
    diff = np.abs(np.stack(steps) - expected[8:72])
    assert diff.max() <= TOL, f"decode step {diff.max(-1).argmax()}: {diff.max():.2e}"


def test_set_mla_strategy_switches_and_frees(fixture_dir):
    model, _ = mlx_mla.load(fixture_dir, mla_strategy="absorb-materialized", dtype="float32")
    attn = model.layers[0].self_attn
    args = model.args
    r, H = args.kv_lora_rank, args.num_attention_heads
    # W_UQ·W_UKᵀ: (hidden → H·r) and W_O·W_UV: (H·r → hidden), float32
    assert Materialized.extra_nbytes(attn) == 2 * args.hidden_size * H * r * 4
    model.set_mla_strategy("absorb")
    assert model.mla_strategy == "absorb" and Materialized.extra_nbytes(attn) == 0
    with pytest.raises(ValueError, match="unknown MLA strategy"):
        model.set_mla_strategy("fast")


def test_auto_chooses_by_phase_and_context():
    from mlx_mla.attention.strategies.auto import Auto

    auto = Auto({"prefill": [(0, "naive")], "decode": [(0, "naive"), (100, "absorb")]})
    assert auto.choose(L=8, S=5000) == "naive"
    assert auto.choose(L=1, S=99) == "naive"
    assert auto.choose(L=1, S=100) == "absorb"


@pytest.fixture(scope="module")
def quantized_fixture(fixture_dir, tmp_path_factory):
    from convert.__main__ import main as convert

    out = tmp_path_factory.mktemp("q4") / "model"
    argv = ["--hf-path", str(fixture_dir), "--mlx-path", str(out), "-q", "--q-bits", "4",
            "--quant-recipe", "uniform"]
    assert convert(argv) == 0
    return out


def test_absorb_agrees_with_naive_on_4bit_weights(quantized_fixture, corpus_path):
    model, tokenizer = mlx_mla.load(quantized_fixture, mla_strategy="naive", dtype="float32")
    assert model.layers[0].self_attn.w_uq.bits == 4
    tokens = tokenizer.encode(corpus_path.read_text()[:8000])[:1000]
    assert len(tokens) == 1000
    naive = ours(model, tokens).argmax(-1)
    model.set_mla_strategy("absorb")
    absorb = ours(model, tokens).argmax(-1)
    agreement = (naive == absorb).mean()
    assert agreement >= 0.99, f"top-1 agreement {agreement:.3%}"
