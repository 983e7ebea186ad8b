"""The server's own flags and parts: --max-kv-size and --allow-other-models on a real server
process, start-up errors as one line, and — in-process, where mlx-lm's generation thread can
be watched — a stopped request leaving the batch and freeing its latent cache."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlx_lm import generate as mlx_lm_generate
from mlx_lm.generate import batch_generate, stream_generate
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import (
    CompletionRequest, GenerationArguments, LogitsProcessorArguments, ModelDescription,
    SamplingArguments,
)
from openai import OpenAI

import mlx_mla
from mlx_mla.server import (
    MLAModelProvider, MLAResponseGenerator, bind_warning, build_parser, main,
)
from distributed_helpers import free_ports
from server_helpers import ServerProcess
from testdata import writable_copy

WINDOW, CONTEXT = 200, 256


@pytest.fixture(scope="module")
def demo(fixture_dir):
    return mlx_mla.load(fixture_dir)


@pytest.fixture(scope="module")
def bounded_server(fixture_dir, tmp_path_factory):
    """The fixture with a context of 256 tokens (``max_position_embeddings`` is read only for
    the limits: YaRN's factor is explicit), served with --max-kv-size 200."""
    folder = writable_copy(fixture_dir, tmp_path_factory.mktemp("short") / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    proc = ServerProcess(["--model", folder, "--max-kv-size", WINDOW, "--allow-other-models"],
                         tmp_path_factory.mktemp("bounded") / "log")
    proc.folder = folder
    yield proc
    assert proc.stop() == 0, proc.log()[-2000:]


def _prompt(tokenizer, corpus_text, n):
    """Text that encodes to ``n`` tokens (BOS included)."""
    return tokenizer.decode(tokenizer.encode(corpus_text)[1:n])


@pytest.mark.parametrize("n, message", [
    (WINDOW + 20, f"is longer than this server's --max-kv-size of {WINDOW} tokens"),
    (CONTEXT, f"does not fit the model's context of {CONTEXT} tokens"),
])
def test_prompts_past_the_bound_or_the_context_are_refused(bounded_server, demo, corpus_text,
                                                           n, message):
    prompt = _prompt(demo[1], corpus_text, n)
    assert len(demo[1].encode(prompt)) == n
    status, reply = bounded_server.request("POST", "/v1/completions",
                                           {"prompt": prompt, "max_tokens": 4})
    assert status == 400 and message in reply["error"], reply


def test_generation_rotates_the_cache_and_stops_at_the_context(bounded_server, demo, corpus_text):
    """190 prompt tokens, 100 asked: the answer stops at the context (66 tokens), the cache
    having rotated past the window, as mlx-lm's batch_generate with the same bound does
    (the server's BatchGenerator)."""
    model, tokenizer = demo
    prompt = _prompt(tokenizer, corpus_text, 190)
    client = OpenAI(base_url=bounded_server.base_url, api_key="unused", max_retries=0)
    r = client.completions.create(model="default_model", prompt=prompt, max_tokens=100,
                                  temperature=0)
    ref = batch_generate(model, tokenizer, [tokenizer.encode(prompt)], max_tokens=CONTEXT - 190,
                         max_kv_size=WINDOW, return_token_ids=True).token_ids[0]
    assert r.usage.prompt_tokens == 190 and r.usage.completion_tokens == len(ref)
    assert len(ref) == CONTEXT - 190 or ref[-1] in tokenizer.eos_token_ids
    assert r.choices[0].text == tokenizer.decode([t for t in ref if t not in tokenizer.eos_token_ids])


def test_allow_other_models_loads_the_named_one(bounded_server, demo):
    """With --allow-other-models a request naming another folder loads it (mlx-lm's
    behaviour) and the served model is loaded back for the next default request."""
    client = OpenAI(base_url=bounded_server.base_url, api_key="unused", max_retries=0)
    r = client.completions.create(model=str(mlx_mla.DEMO_MODEL), prompt="ROMEO:", max_tokens=6,
                                  temperature=0)
    assert r.model == str(mlx_mla.DEMO_MODEL)
    assert f"INFO - loading {mlx_mla.DEMO_MODEL} " in bounded_server.log()
    client.completions.create(model="default_model", prompt="ROMEO:", max_tokens=2)
    assert bounded_server.log().count(f"INFO - loading {bounded_server.folder} ") == 2
    model, tokenizer = demo
    expected = stream_generate(model, tokenizer, tokenizer.encode("ROMEO:"), max_tokens=6)
    assert r.choices[0].text == "".join(g.text for g in expected)


@pytest.mark.parametrize("argv, expected", [
    (["--pipeline"], "--pipeline splits the model over the ranks mlx.launch starts"),
    (["--chat-template-args", "[1]"], "--chat-template-args must be a JSON object"),
    (["--decode-concurrency", "0"], "--decode-concurrency must be at least 1"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k must be 0 (off) or more"),
    (["--model", "/nowhere/model"], "/nowhere/model"),
    (["--max-kv-size", "3"], "max_kv_size 3 must be larger than the 4 tokens always kept"),
    (["--kv-bits", "7"], "kv bits 7 is not supported"),
])
def test_start_up_errors_are_one_line(capsys, argv, expected):
    rc = main(["--port", "0", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_bind_warning_only_off_loopback():
    assert bind_warning("127.0.0.1") is None and bind_warning("localhost") is None
    assert "anyone who can reach" in bind_warning("0.0.0.0")


def _request(prompt: str, max_tokens: int):
    """mlx-lm's request objects, as its HTTP handler builds them (greedy, no extras)."""
    args = GenerationArguments(
        model=ModelDescription("default_model", "default_model", None),
        sampling=SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.1),
        logits=LogitsProcessorArguments(None, 0.0, 20, 0.0, 20, 0.0, 20),
        stop_words=[], max_tokens=max_tokens, num_draft_tokens=3, logprobs=False,
        top_logprobs=-1, seed=None, chat_template_kwargs=None)
    return CompletionRequest("text", prompt, [], None, None), args


def _wait(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_stopped_request_leaves_the_batch_and_frees_its_cache(monkeypatch, fixture_dir, demo):
    """What the HTTP handler does when a client hangs up (``ctx.stop()``), in-process: the
    generation thread removes the sequence from the batch (``BatchGenerator.remove``), the
    latent cache bytes it held are freed while the other sequence goes on, and that one's
    tokens equal its single run."""
    import mlx_lm.server

    removals = []

    class Watched(mlx_lm.server.BatchGenerator):
        def remove(self, uids, return_prompt_caches=False):
            before = self.prompt_cache_nbytes
            out = super().remove(uids, return_prompt_caches)
            removals.append((list(uids), before, self.prompt_cache_nbytes))
            return out

    monkeypatch.setattr(mlx_lm.server, "BatchGenerator", Watched)
    provider = MLAModelProvider(build_parser().parse_args(["--model", str(fixture_dir)]))
    generator = MLAResponseGenerator(provider, LRUPromptCache(10))
    try:
        # mlx-lm removes stopped sequences once per time budget (0.5 s); on a fast machine
        # B's tokens all fit in one, so B would be gone too when A is removed.
        generator._time_budget = mlx_lm.server.TimeBudget(budget=0.01)
        assert provider.ready.wait(120), "the model did not load within 120 s"
        ctx_a, stream_a = generator.generate(*_request("ROMEO:", 1500))
        ctx_b, stream_b = generator.generate(*_request("JULIET:", 300))
        for _ in range(3):
            next(stream_a)
        ctx_a.stop()
        got_b = [r.token for r in stream_b]
        _wait(lambda: removals, "the stopped sequence's removal")
        (uids, before, after), = removals
        assert len(set(uids)) == 1 and 0 < after < before  # A alone (listed once per step)
    finally:
        generator.stop_and_join()
    model, tokenizer = demo
    ref = [g.token for g in stream_generate(model, tokenizer, tokenizer.encode("JULIET:"),
                                            max_tokens=300)]
    assert got_b == ref


def test_kv_bits_serves_one_at_a_time_on_a_quantized_latent(fixture_dir, demo):
    """--kv-bits: mlx-lm serves such requests unbatched (``_serve_single``, its
    ``stream_generate``), the c_kv quantized from --quantized-kv-start on; the tokens equal
    that generate run's, which differ from the float cache's here."""
    args = build_parser().parse_args(["--model", str(fixture_dir), "--kv-bits", "4",
                                      "--quantized-kv-start", "8"])
    provider = MLAModelProvider(args)
    generator = MLAResponseGenerator(provider, LRUPromptCache(10))
    try:
        assert provider.ready.wait(120), "the model did not load within 120 s"
        _, stream = generator.generate(*_request("ROMEO:", 20))
        got = [r.token for r in stream]
    finally:
        generator.stop_and_join()
    model, tokenizer = demo
    prompt = tokenizer.encode("ROMEO:")
    ref = [g.token for g in stream_generate(model, tokenizer, prompt, max_tokens=20, kv_bits=4,
                                            quantized_kv_start=8)]
    unquantized = [g.token for g in stream_generate(model, tokenizer, prompt, max_tokens=20)]
    assert got == ref and len(ref) == 20 and ref != unquantized


@pytest.mark.parametrize("split", [["--pipeline"], []], ids=["pipeline", "tensor-parallel"])
def test_two_ranks_serve_as_one_process(fixture_dir, demo, tmp_path, split):
    """Under two ranks of a ring group on 127.0.0.1 (as ``mlx.launch --backend ring`` starts
    them), each loading its part (``mlx_mla.distributed.load_sharded``), rank 0 serves and
    the other follows its requests (mlx-lm's distributed ResponseGenerator): one request
    and four concurrent ones get the single-process greedy answers; both ranks stop on
    SIGTERM with status 0."""
    model, tokenizer = demo
    ring = tmp_path / "ring.json"
    ring.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    ranks = []
    try:
        for rank in (1, 0):
            ranks.append(ServerProcess(
                ["--model", fixture_dir, *split], tmp_path / f"rank{rank}.log",
                env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(ring)}, wait=rank == 0))
        client = OpenAI(base_url=ranks[1].base_url, api_key="unused", max_retries=0)
        prompts = ["ROMEO:", "JULIET:", "To be", "O Romeo"]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.completions.create(
                model="default_model", prompt=p, max_tokens=12, temperature=0).choices[0].text,
                prompts))
        assert got == [mlx_lm_generate(model, tokenizer, tokenizer.encode(p), max_tokens=12)
                       for p in prompts]
    finally:
        statuses = [r.stop() for r in ranks]
    assert statuses == [0, 0], [r.log()[-1500:] for r in ranks]
