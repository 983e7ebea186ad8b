"""The latent cache on every path mlx-lm takes a cache: batched generation with left padding,
continuous batching, prompt-cache files, a bounded (rotating) cache, and a quantized latent.

References: the same model run one sequence at a time (batching must not change a row's
logits: 1e-4, float32 summation order only), stock mlx-lm's deepseek_v2 on the same weights
(1e-4), and attention over the dequantized copy of the very same quantized c_kv (1e-4).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import mlx_mla
from mlx_mla.cache import (
    BatchLatentCache, BatchRotatingLatentCache, LatentCache, QuantizedLatent, RotatingLatentCache,
)
from mlx_mla.dtypes import cast_floating

TOL = 1e-4
NAMES = ["naive", "absorb-materialized", "absorb", "auto"]


@pytest.fixture(scope="module")
def demo():
    return mlx_mla.load(mlx_mla.DEMO_MODEL, mla_strategy="absorb", dtype="float32")


@pytest.fixture(scope="module")
def peer():
    import mlx_lm

    model, _ = mlx_lm.load(str(mlx_mla.DEMO_MODEL))
    return cast_floating(model, mx.float32)


@pytest.fixture(scope="module")
def text_tokens(demo, corpus_text):
    _, tok = demo
    return tok.encode(corpus_text)


def prompts_of(tok):
    texts = ["ROMEO:", "JULIET:\nO Romeo, Romeo, wherefore art thou", "To be, or not to be"]
    return [tok.encode(t) for t in texts]


# ---------------------------------------------------------------- batching


@pytest.mark.parametrize("name", NAMES)
def test_left_padded_rows_equal_single_runs(demo, name):
    """Prefill of different-length prompts in one left-padded batch, then 4 decode steps:
    every row's logits equal its own single-sequence run (padding gets no probability)."""
    model, tok = demo
    model.set_mla_strategy(name)
    prompts = prompts_of(tok)
    n = max(map(len, prompts))
    pad = [n - len(p) for p in prompts]
    cache = [BatchLatentCache(pad) for _ in model.layers]
    x = mx.array([[0] * k + p for k, p in zip(pad, prompts)])
    batched = [model(x, cache=cache)[:, -1]]
    nxt = [[7], [9], [11]]
    for _ in range(4):
        batched.append(model(mx.array(nxt), cache=cache)[:, -1])
    for row, p in enumerate(prompts):
        single = model.make_cache()
        ref = [model(mx.array([p]), cache=single)[0, -1]]
        for _ in range(4):
            ref.append(model(mx.array([nxt[row]]), cache=single)[0, -1])
        got = mx.stack([b[row] for b in batched])
        assert mx.abs(got - mx.stack(ref)).max().item() <= TOL, (name, row)
    assert cache[0].offset.tolist() == [len(p) + 4 for p in prompts]


def test_batch_generate_matches_one_by_one_and_mlx_lm(demo, peer):
    model, tok = demo
    prompts = prompts_of(tok)
    for name in NAMES:
        model.set_mla_strategy(name)
        got = batch_generate(model, tok, prompts, max_tokens=10, return_token_ids=True).token_ids
        singles = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=10)] for p in prompts]
        assert got == singles, name
    theirs = batch_generate(peer, tok, prompts, max_tokens=10, return_token_ids=True).token_ids
    assert got == theirs


def test_continuous_batching_join_and_leave(demo):
    """BatchGenerator: a sequence joins after others have generated, one finishes early;
    every sequence's tokens equal its own single run."""
    model, tok = demo
    model.set_mla_strategy("auto")
    prompts = prompts_of(tok)
    lengths = [12, 4, 9]
    gen = BatchGenerator(model, max_tokens=12)
    uids = gen.insert(prompts[:2], lengths[:2])
    out = {u: [] for u in uids}
    steps = 0
    while responses := gen.next_generated():
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
        steps += 1
        if steps == 3:
            uids += gen.insert([prompts[2]], [lengths[2]])
    gen.close()
    for uid, p, n in zip(uids, prompts, lengths):
        assert out[uid] == [t for t, _ in generate_step(mx.array(p), model, max_tokens=n)]


def test_extract_and_merge_round_trip(demo):
    model, tok = demo
    a, b = prompts_of(tok)[:2]
    ca, cb = model.make_cache(), model.make_cache()
    model(mx.array([a]), cache=ca)
    model(mx.array([b]), cache=cb)
    merged = [LatentCache.merge([x, y]) for x, y in zip(ca, cb)]
    assert isinstance(merged[0], BatchLatentCache)
    back = merged[0].extract(0)
    assert isinstance(back, LatentCache) and back.offset == len(a)
    assert mx.array_equal(back.c_kv, ca[0].c_kv).item()


# ---------------------------------------------------------------- prompt-cache files


def filled(kind, model, tokens):
    cache = {
        "latent": lambda: model.make_cache(),
        "rotating": lambda: model.make_cache(max_kv_size=16),
        "quantized": lambda: [c.to_quantized(64, 8) for c in model.make_cache()],
    }[kind]()
    if kind != "quantized":
        model(mx.array([tokens]), cache=cache)
    else:
        model(mx.array([tokens[:5]]), cache=cache)
        cache = [c.to_quantized(64, 8) for c in cache]
        model(mx.array([tokens[5:]]), cache=cache)
    return cache


@pytest.mark.parametrize("kind", ["latent", "rotating", "quantized", "batch", "batch-rotating"])
def test_prompt_cache_file_round_trip_is_exact(demo, tmp_path, text_tokens, kind):
    model, _ = demo
    tokens = text_tokens[:24]
    if kind.startswith("batch"):
        singles = [filled("rotating" if kind == "batch-rotating" else "latent", model, t)
                   for t in (tokens[:20], tokens[3:24])]
        cache = [type(s0).merge([s0, s1]) for s0, s1 in zip(*singles)]
        step = mx.array([[5], [6]])
    else:
        cache = filled(kind, model, tokens)
        step = mx.array([[5]])
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(str(path), cache, {"model": "demo"})
    loaded, meta = load_prompt_cache(str(path), return_metadata=True)
    assert meta == {"model": "demo"} and type(loaded[0]) is type(cache[0])
    a = model(step, cache=cache)
    b = model(step, cache=loaded)
    assert mx.array_equal(a, b).item()


def test_a_file_for_another_model_is_refused(demo, tmp_path):
    from mlx_mla.cache.files import PromptCacheError, load

    model, _ = demo
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), filled("latent", model, [0, 1, 2])[:3])  # 3 layers, not 4
    with pytest.raises(PromptCacheError, match="made for a model with 3 layers"):
        load(path, model)
    wide = [LatentCache() for _ in model.layers]
    for c in wide:
        c.update_and_fetch(mx.zeros((1, 2, 128)), mx.zeros((1, 2, 16)))
    save_prompt_cache(str(path), wide)
    with pytest.raises(PromptCacheError, match="latent of width 128 \\+ 16"):
        load(path, model)
    from mlx_lm.models.cache import KVCache

    foreign = [KVCache() for _ in model.layers]
    for c in foreign:
        c.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    save_prompt_cache(str(path), foreign)
    with pytest.raises(PromptCacheError, match="KVCache caches, made for another kind of model"):
        load(path, model)


# ---------------------------------------------------------------- bounded cache


def test_generate_step_max_kv_size_bounds_the_cache(demo, text_tokens):
    """The reported bug: generate_step(max_kv_size=16) reaches a rotating latent cache."""
    model, _ = demo
    cache = make_prompt_cache(model, max_kv_size=16)
    assert all(isinstance(c, RotatingLatentCache) for c in cache)
    cache = make_prompt_cache(model, max_kv_size=None)
    assert all(type(c) is LatentCache for c in cache)
    gen = BatchGenerator(model, max_kv_size=16)
    assert isinstance(make_prompt_cache(gen.model, gen.max_kv_size)[0], RotatingLatentCache)
    gen.close()
    steps = list(generate_step(mx.array(text_tokens[:20]), model, max_tokens=20, max_kv_size=16))
    assert len(steps) == 20
    model.max_kv_size = 24  # a server's or chat's default bound
    try:
        assert make_prompt_cache(model)[0].max_size == 24
        assert make_prompt_cache(model, max_kv_size=16)[0].max_size == 16
    finally:
        model.max_kv_size = None


@pytest.mark.parametrize("name", NAMES)
def test_rotating_matches_mlx_lm_over_three_windows(demo, peer, text_tokens, name):
    """Same max_kv_size as stock deepseek_v2: a 40-token prefill (longer than the 16-token
    window), 48 decode steps (3 windows), another chunk while rotated, more steps."""
    model, _ = demo
    model.set_mla_strategy(name)
    W = 16
    ours, theirs = make_prompt_cache(model, max_kv_size=W), make_prompt_cache(peer, max_kv_size=W)
    t = text_tokens
    calls = [t[:40]] + [[x] for x in t[40:88]] + [t[88:94]] + [[x] for x in t[94:100]]
    worst = 0.0
    for chunk in calls:
        a, b = model(mx.array([chunk]), cache=ours), peer(mx.array([chunk]), cache=theirs)
        worst = max(worst, mx.abs(a - b).max().item())
    assert worst <= TOL, f"{name}: {worst:.2e}"
    assert ours[0].size() == W and ours[0].offset == 100


def test_bounded_batch_cache_for_batch_generator(demo, peer):
    """batch_generate(max_kv_size=...) runs on BatchRotatingLatentCache: within the window,
    rows equal single runs; past it (the 13-token prompt in a 12-token window), the tokens
    equal stock mlx-lm's batched ones (its batched rotating cache keeps no first tokens,
    unlike the single one, so batched and single runs differ there, for mlx-lm too)."""
    model, tok = demo
    prompts = prompts_of(tok)

    def batched(m, window):
        return batch_generate(m, tok, prompts, max_tokens=10, max_kv_size=window,
                              return_token_ids=True).token_ids

    singles = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=10, max_kv_size=32)]
               for p in prompts]
    assert batched(model, 32) == singles
    assert batched(model, 12) == batched(peer, 12)
    merged = RotatingLatentCache.merge([RotatingLatentCache(12, 4), RotatingLatentCache(12, 4)])
    assert isinstance(merged, BatchRotatingLatentCache)


# ---------------------------------------------------------------- quantized latent


@pytest.mark.parametrize("name", ["absorb", "absorb-materialized", "naive"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_cache_equals_attention_over_its_dequantized_copy(demo, text_tokens, name, bits):
    """Each strategy reads the quantized c_kv as stored; the reference is attention over the
    dequantized copy of the very same c_kv by another path — ordinary (naive) attention for
    the absorbed strategies, the absorbed float path for naive (which dequantizes itself,
    so a naive reference would check only its dispatch) — for a decode step and a 5-token
    chunk."""
    from mlx_mla.attention.strategies import Absorb, Naive

    model, _ = demo
    model.set_mla_strategy(name)
    q = [c.to_quantized(64, bits) for c in model.make_cache()]
    model(mx.array([text_tokens[:30]]), cache=q)
    c_kv, k_pe = q[0].c_kv, q[0].k_pe
    assert isinstance(c_kv, QuantizedLatent) and c_kv.bits == bits and c_kv.shape[1] == 30
    attn = model.layers[0].self_attn
    a = model.args
    for L in (1, 5):
        k = mx.random.split(mx.random.key(L))
        c_q = mx.random.normal((1, L, a.hidden_size), key=k[0])
        q_pe = mx.random.normal((1, a.num_attention_heads, L, a.qk_rope_head_dim), key=k[1])
        mask = None if L == 1 else mx.arange(30)[None] <= mx.arange(30 - L, 30)[:, None]
        got = attn.strategy(attn, c_q, q_pe, c_kv, k_pe, mask)
        reference = Absorb() if name == "naive" else Naive()
        reference.prepare(attn)
        ref = reference(attn, c_q, q_pe, c_kv.dequantize(), k_pe, mask)
        assert mx.abs(got - ref).max().item() <= TOL, (name, bits, L)


def test_quantized_cache_quality_on_held_out_text(demo, text_tokens):
    """8-bit latent vs the float cache over 512 held-out tokens (chunks of 32, quantized
    after the first): KL ≤ 1e-3 and top-1 ≥ 99%, as the issue asks."""
    model, _ = demo
    model.set_mla_strategy("absorb")
    tokens = text_tokens[:512]

    def run(bits):
        cache, out = model.make_cache(), []
        for i in range(0, len(tokens), 32):
            out.append(model(mx.array([tokens[i:i + 32]]), cache=cache)[0])
            if bits:
                cache = [c.to_quantized(64, bits) for c in cache]
        return mx.concatenate(out).astype(mx.float32)

    ref, q8 = run(None), run(8)
    lp = ref - mx.logsumexp(ref, -1, keepdims=True)
    lq = q8 - mx.logsumexp(q8, -1, keepdims=True)
    kl = (mx.exp(lp) * (lp - lq)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == q8.argmax(-1)).astype(mx.float32).mean().item()
    assert kl <= 1e-3 and top1 >= 0.99, (kl, top1)


def test_generate_step_quantizes_from_quantized_kv_start(demo, text_tokens):
    """mlx-lm's kv_bits path (maybe_quantize_kv_cache → to_quantized) reaches our cache,
    bounded or not, and generation goes on; to_quantized is idempotent."""
    model, _ = demo
    for max_kv in (None, 16):
        cache = model.make_cache(max_kv_size=max_kv)
        list(generate_step(mx.array(text_tokens[:20]), model, max_tokens=8, prompt_cache=cache,
                           kv_bits=8, kv_group_size=32, quantized_kv_start=10))
        assert cache[0].codec.bits == 8 and cache[0].codec.group_size == 32
        assert cache[0].to_quantized(32, 8) is cache[0]
        with pytest.raises(ValueError, match="already quantized to 8 bits"):
            cache[0].to_quantized(64, 4)


def test_quantized_batch_rows_equal_single_runs(demo, text_tokens):
    model, _ = demo
    model.set_mla_strategy("absorb")
    singles = []
    for p in (text_tokens[:9], text_tokens[20:34]):
        c = [x.to_quantized(64, 8) for x in model.make_cache()]
        model(mx.array([p]), cache=c)
        singles.append(c)
    merged = [LatentCache.merge([a, b]) for a, b in zip(*singles)]
    out = model(mx.array([[5], [6]]), cache=merged)
    for row, c in enumerate(singles):
        ref = model(mx.array([[5 + row]]), cache=c)
        assert mx.abs(out[row] - ref[0]).max().item() <= TOL


def test_cache_bytes_per_token_by_hand(demo):
    from mlx_mla.cache import cache_bytes_per_token

    model, _ = demo
    a = model.args
    cache = model.make_cache()
    model(mx.array([[0, 1, 2]]), cache=cache)
    assert cache_bytes_per_token(cache) == a.num_hidden_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    q = [c.to_quantized(64, 8) for c in cache]
    # 8-bit c_kv (64 B) + one float32 scale and bias per 64 values (8 B) + float32 k_pe (64 B)
    assert cache_bytes_per_token(q) == a.num_hidden_layers * (64 + 8 + 16 * 4)
