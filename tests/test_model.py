"""The model against transformers (float32) and mlx-lm, on the fixture checkpoint and on random
tiny configs; cache behaviour. Tolerances: 1e-4 on logits (both sides float32; the observed
gap is ~3e-6, so 1e-4 leaves room for summation order and nothing else)."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest

import mlx_mla
from reference import (
    fixture_tokens, hf_greedy, hf_logits, load_reference, make_checkpoint,
)

TOL = 1e-4


def ours(model, tokens, cache=None) -> np.ndarray:
    out = model(mx.array([tokens], dtype=mx.int32), cache=cache)
    return np.array(out[0].astype(mx.float32))


@pytest.fixture(scope="module")
def fixture_pair(fixture_dir):
    model, tokenizer = mlx_mla.load(fixture_dir, mla_strategy="naive", dtype="float32")
    return model, tokenizer, load_reference(fixture_dir)


@pytest.fixture(scope="module")
def tokens48():
    return fixture_tokens(48)


def test_fixture_matches_transformers_at_every_position(fixture_pair, tokens48):
    model, _, ref = fixture_pair
    assert len(tokens48) == 48
    diff = np.abs(ours(model, tokens48) - hf_logits(ref, tokens48))
    assert diff.max() <= TOL, f"max |Δlogit| {diff.max():.2e} at position {diff.max(-1).argmax()}"


VARIANTS = {
    "plain": {},
    "q_lora_rank": {"q_lora_rank": 24},
    "group_limited_greedy": {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1},
    "norm_topk_prob": {"norm_topk_prob": True, "routed_scaling_factor": 2.0},
    "routed_scaling_factor": {"routed_scaling_factor": 2.5},
    "first_k_dense_0": {"first_k_dense_replace": 0},
    "first_k_dense_2": {"first_k_dense_replace": 2},
    "rope_parameters_only": {"rope_key": "rope_parameters"},
    "no_rope_scaling": {"rope_key": None},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_random_config_matches_transformers(tmp_path, variant):
    ref = make_checkpoint(tmp_path, seed=1, **VARIANTS[variant])
    model, _ = mlx_mla.load(tmp_path, mla_strategy="naive", dtype="float32")
    tokens = [int(t) for t in np.random.RandomState(2).randint(2, 512, 40)]
    expected = hf_logits(ref, tokens)
    diff = np.abs(ours(model, tokens) - expected)
    assert diff.max() <= TOL, f"{variant}: max |Δlogit| {diff.max():.2e}"
    assert np.abs(expected).max() > 1.0  # logits of real magnitude, not a vacuous match


def test_group_limited_greedy_changes_routing(tmp_path):
    """The variant above is only a test if limiting groups changes which experts run."""
    make_checkpoint(tmp_path, seed=1, **VARIANTS["group_limited_greedy"])
    model, _ = mlx_mla.load(tmp_path, mla_strategy="naive", dtype="float32")
    tokens = [int(t) for t in np.random.RandomState(2).randint(2, 512, 40)]
    limited = ours(model, tokens)
    for layer in model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.topk_method = "greedy"
    assert np.abs(limited - ours(model, tokens)).max() > 1e-3


def test_fixture_matches_mlx_lm(fixture_dir, fixture_pair, tokens48):
    import mlx_lm
    from mlx.utils import tree_map

    peer, _ = mlx_lm.load(str(fixture_dir))
    peer.update(tree_map(lambda p: p.astype(mx.float32), peer.parameters()))
    model, _, _ = fixture_pair
    expected = np.array(peer(mx.array([tokens48]))[0])
    assert np.abs(ours(model, tokens48) - expected).max() <= TOL


def test_greedy_64_tokens_identical_to_transformers(fixture_pair):
    from mlx_lm.generate import generate_step

    model, tokenizer, ref = fixture_pair
    prompt = tokenizer.encode("ROMEO:")
    assert prompt == [0, 836, 27]
    expected = hf_greedy(ref, prompt, 64)
    steps = generate_step(mx.array(prompt), model, max_tokens=64, sampler=lambda lp: mx.argmax(lp, -1))
    got = [int(t) for t, _ in steps]
    assert got == expected
    assert tokenizer.decode(got).startswith("\nO, I am in brief with a tale language.")


def test_prefill_then_decode_and_chunked_prefill_equal_one_pass(fixture_pair, tokens48):
    model, _, _ = fixture_pair
    tokens = tokens48[:12]
    full = ours(model, tokens)

    cache = model.make_cache()
    pre = ours(model, tokens[:11], cache)
    assert [c.offset for c in cache] == [11] * len(cache)
    step = ours(model, tokens[11:], cache)
    assert cache[0].offset == 12
    np.testing.assert_allclose(np.concatenate([pre, step]), full, atol=TOL)

    cache = model.make_cache()
    parts, offsets = [], []
    for chunk in (tokens[:5], tokens[5:6], tokens[6:]):
        parts.append(ours(model, chunk, cache))
        offsets.append(cache[-1].offset)
    assert offsets == [5, 6, 12]
    np.testing.assert_allclose(np.concatenate(parts), full, atol=TOL)


def test_changing_a_later_token_leaves_earlier_logits_unchanged(fixture_pair, tokens48):
    model, _, _ = fixture_pair
    a = list(tokens48[:20])
    b = a[:15] + [(t + 7) % 2048 for t in a[15:]]
    la, lb = ours(model, a), ours(model, b)
    np.testing.assert_array_equal(la[:15], lb[:15])
    assert np.abs(la[15:] - lb[15:]).max() > 1e-2


def test_latent_cache_bytes_per_token(fixture_pair):
    model, _, _ = fixture_pair
    args = model.args
    from mlx_lm.models.cache import KVCache

    cache = model.make_cache()
    n = KVCache.step  # a whole number of preallocation blocks: allocated == used
    model(mx.zeros((1, n), dtype=mx.int32), cache=cache)
    per_token = sum(c.nbytes for c in cache) / n
    expected = args.num_hidden_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 4
    assert per_token == expected == 4 * 80 * 4


def test_cache_grows_past_one_block(fixture_pair):
    """Appending across the 256-position preallocation boundary keeps earlier entries."""
    model, _, _ = fixture_pair
    args = model.args
    tokens = fixture_tokens(300)
    cache = model.make_cache()
    parts = [ours(model, tokens[i : i + 100], cache) for i in range(0, 300, 100)]
    np.testing.assert_allclose(np.concatenate(parts), ours(model, tokens), atol=TOL)
    assert cache[0].offset == 300 and cache[0].c_kv.shape[1] == 300
    # mlx-lm's KVCache growth: the third chunk finds 200 of 256 used, keeps those 200 and
    # appends a new 256-position block: 456 positions of float32
    assert cache[0].nbytes == 456 * (args.kv_lora_rank + args.qk_rope_head_dim) * 4
