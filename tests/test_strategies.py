"""All four MLA strategy names compute the same function as transformers (float32, 1e-4 on
logits), for a prefill, a chunked prefill and 64 decode steps; and on 4-bit weights the
absorbed strategy picks the same top-1 token as the naive one."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest

import mlx_mla
from reference import fixture_tokens, hf_logits, load_reference, make_checkpoint

TOL = 1e-4
NAMES = ["naive", "absorb-materialized", "absorb", "auto"]


def ours(model, tokens, cache=None) -> np.ndarray:
    return np.array(model(mx.array([tokens], dtype=mx.int32), cache=cache)[0])


@pytest.fixture(scope="module", params=["fixture", "tiny-q_lora-null", "tiny-q_lora-set"])
def case(request, fixture_dir, tmp_path_factory):
    """(folder, reference logits over 72 tokens, the tokens)."""
    if request.param == "fixture":
        folder, ref = fixture_dir, load_reference(fixture_dir)
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
    # W_UQ·W_UKᵀ: (hidden → H·r) and W_O·W_UV: (H·r → hidden), float32, held by each layer's
    # own strategy object
    materialized = attn.strategy
    assert materialized.derived_nbytes == 2 * args.hidden_size * H * r * 4
    assert model.derived_nbytes == args.num_hidden_layers * materialized.derived_nbytes
    assert model.layers[1].self_attn.strategy is not materialized
    model.set_mla_strategy("absorb")
    assert model.mla_strategy == "absorb" and model.derived_nbytes == 0
    assert materialized.derived_nbytes == 0  # released
    with pytest.raises(ValueError, match="unknown MLA strategy"):
        model.set_mla_strategy("fast")


def test_auto_chooses_by_phase_and_context():
    from mlx_mla.attention.strategies.auto import Auto, Table

    auto = Auto(Table(decode=((0, "naive"), (100, "absorb")), prefill=((0, "naive"),),
                      short_prefill=((0, "naive"), (1000, "absorb-materialized")), short_chunk=16))
    assert auto.choose(L=17, S=5000) == "naive"
    assert auto.choose(L=16, S=5000) == "absorb-materialized"  # a short chunk over a long cache
    assert auto.choose(L=16, S=999) == "naive"
    assert auto.choose(L=1, S=99) == "naive"
    assert auto.choose(L=1, S=100) == "absorb"
    assert set(auto.strategies) == {"naive", "absorb", "absorb-materialized"}
    assert Auto(Table(decode=((0, "absorb"),), prefill=((0, "naive"),))).choose(L=2, S=9999) == "naive"


def test_auto_tables_per_backend_and_blas():
    from mlx_mla import blas
    from mlx_mla.attention import costs
    from mlx_mla.attention.strategies import auto
    from mlx_mla.config import ModelArgs

    v2_lite = ModelArgs(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512,
                        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    # the analytic default's third phase ends where costs puts the crossover (170.7)
    assert auto.DEFAULT_TABLE.short_chunk == int(costs.short_chunk_tokens(v2_lite)) == 170
    assert auto.backend_key() == f"cpu/{blas.kind()}"  # the suite runs on MLX's CPU backend
    assert auto.table_for("cuda") is auto.table_for("metal") is auto.DEFAULT_TABLE
    for key, table in auto.CROSSOVER_TABLES.items():
        assert key.startswith("cpu/") and table.names() <= set(auto._CANDIDATES)
        assert auto.choose(table, 1, 16384) == "absorb"


@pytest.fixture(scope="module")
def quantized_fixture(fixture_dir, tmp_path_factory):
    from convert.__main__ import main as convert

    out = tmp_path_factory.mktemp("q4") / "model"
    argv = ["--hf-path", str(fixture_dir), "--mlx-path", str(out), "-q", "--q-bits", "4",
            "--quant-recipe", "uniform"]
    assert convert(argv) == 0
    return out


def test_absorb_agrees_with_naive_on_4bit_weights(quantized_fixture, corpus_text):
    model, tokenizer = mlx_mla.load(quantized_fixture, mla_strategy="naive", dtype="float32")
    assert model.layers[0].self_attn.w_uq.bits == 4
    tokens = tokenizer.encode(corpus_text[:8000])[:1000]
    assert len(tokens) == 1000
    naive = ours(model, tokens).argmax(-1)
    model.set_mla_strategy("absorb")
    absorb = ours(model, tokens).argmax(-1)
    agreement = (naive == absorb).mean()
    assert agreement >= 0.99, f"top-1 agreement {agreement:.3%}"


# ---------------------------------------------------------------- one layer, random weights

LAYER = dict(hidden_size=128, num_attention_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
             qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096)


def random_layer(strategy: str, bits=None, seed: int = 0):
    """One MLAttention at LAYER's dims, random N(0, 1/fan_in) weights, Linears optionally
    quantized, ``strategy`` prepared on it."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_mla.attention import MLAttention, make_strategy
    from mlx_mla.config import ModelArgs

    attn = MLAttention(ModelArgs(**LAYER))
    params = []
    for i, (name, p) in enumerate(tree_flatten(attn.parameters())):
        k = mx.random.split(mx.random.key(seed + 1000 * i))[0]
        params.append((name, mx.random.normal(p.shape, key=k) / np.sqrt(p.shape[-1])
                       if p.ndim >= 2 else mx.ones(p.shape)))
    attn.update(tree_unflatten(params))
    if bits:
        nn.quantize(attn, group_size=32, bits=bits, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    attn.strategy = make_strategy(strategy)
    attn.strategy.prepare(attn)
    return attn


def filled_latent_cache(S: int, seed: int = 1):
    from mlx_mla.cache import LatentCache

    cache = LatentCache()
    k1, k2 = mx.random.split(mx.random.key(seed))
    cache.update_and_fetch(mx.random.normal((1, S, LAYER["kv_lora_rank"]), key=k1),
                           mx.random.normal((1, S, LAYER["qk_rope_head_dim"]), key=k2))
    return cache


@pytest.mark.parametrize("bits", [None, 4])
def test_every_strategy_computes_naives_function_on_a_layer(bits):
    """Same weights, same cache of 300 positions, one decode step and a 5-token chunk."""
    x1 = mx.random.normal((1, 1, LAYER["hidden_size"]), key=mx.random.key(3))
    x5 = mx.random.normal((1, 5, LAYER["hidden_size"]), key=mx.random.key(4))
    outs = {}
    for name in NAMES:
        attn = random_layer(name, bits)
        outs[name] = []
        for x in (x1, x5):
            cache = filled_latent_cache(300)
            outs[name].append(attn(x, cache.make_mask(x.shape[1]), cache))
    for name in NAMES:
        for got, want in zip(outs[name], outs["naive"]):
            if name == "absorb-materialized" and bits:
                # its precomputed matrices are re-quantized to 4 bits: close, not equal
                assert mx.abs(got - want).max().item() < 0.25 * mx.abs(want).max().item()
            else:
                assert mx.allclose(got, want, atol=1e-4, rtol=1e-3).item(), name


@pytest.mark.parametrize("S,L", [(300, 1), (1000, 1), (257, 3), (40, 40)])
def test_latent_attention_layouts_agree(S, L, monkeypatch):
    """The decode layout (scores as c_kv·qᵀ, blocked P·c_kv) equals the direct one."""
    from mlx_mla.attention.strategies import base

    k = mx.random.split(mx.random.key(0), 4)
    q = mx.random.normal((2, 4, L, 64), key=k[0])
    qp = mx.random.normal((2, 4, L, 16), key=k[1])
    c = mx.random.normal((2, S, 64), key=k[2])
    kp = mx.random.normal((2, S, 16), key=k[3])
    mask = None if L == 1 else (mx.arange(S)[None] <= mx.arange(S - L, S)[:, None])
    fast = base.latent_attention(q, qp, c, kp, mask, 0.1)
    monkeypatch.setattr(base, "DECODE_ROWS", 0)
    direct = base.latent_attention(q, qp, c, kp, mask, 0.1)
    assert mx.allclose(fast, direct, atol=1e-5).item()


def test_model_without_a_strategy_says_what_to_do():
    from mlx_mla import Model, ModelArgs

    model = Model(ModelArgs(**LAYER, vocab_size=64, num_hidden_layers=1, intermediate_size=64))
    with pytest.raises(RuntimeError, match="call model.set_mla_strategy"):
        model(mx.array([[1, 2]]))
