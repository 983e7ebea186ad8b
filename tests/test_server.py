"""``python -m mlx_mla.server`` as users run it: a real process on a free port of 127.0.0.1,
driven by the ``openai`` client (and raw HTTP for what a client would not send), its greedy
outputs compared with ``python -m mlx_mla.generate``'s and with single runs of mlx-lm's
``generate`` on the same model."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from mlx_lm import generate as mlx_lm_generate
from openai import OpenAI

import mlx_mla
from mlx_mla.generate import main as generate_main
from server_helpers import ServerProcess

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(fixture_dir, tmp_path_factory):
    """One server for the module: the fixture (with its chat template), default flags."""
    proc = ServerProcess(["--model", fixture_dir], tmp_path_factory.mktemp("server") / "log")
    yield proc
    assert proc.stop() == 0, proc.log()[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def demo(fixture_dir):
    return mlx_mla.load(fixture_dir)


def generate_cli(capsys, fixture_dir, prompt, *flags, max_tokens=MAX_TOKENS) -> str:
    """The text ``python -m mlx_mla.generate`` prints (greedy, --verbose false)."""
    capsys.readouterr()
    rc = generate_main(["--model", str(fixture_dir), "--prompt", prompt, "--temp", "0",
                        "--max-tokens", str(max_tokens), "--verbose", "false", *flags])
    out = capsys.readouterr().out
    assert rc == 0 and out.endswith("\n")
    return out[:-1]


def greedy(demo, tokens, max_tokens=MAX_TOKENS) -> str:
    """One request's greedy text from mlx-lm's ``generate`` on the same model, alone."""
    model, tokenizer = demo
    return mlx_lm_generate(model, tokenizer, tokens, max_tokens=max_tokens)


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_models_lists_only_the_served_model(server, client, fixture_dir):
    assert [m.id for m in client.models.list().data] == [str(fixture_dir)]
    status, body = server.request("GET", f"/v1/models/{fixture_dir}")
    assert status == 200 and body["id"] == str(fixture_dir)
    assert server.request("GET", "/v1/models/someone/else")[0] == 404


@pytest.mark.parametrize("system", [None, "You are a poet."])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_generate(capsys, client, fixture_dir, stream, system):
    expected = generate_cli(capsys, fixture_dir, "ROMEO:",
                            *(["--system-prompt", system] if system else []))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "ROMEO:"}]
    kwargs = dict(model=str(fixture_dir), messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kwargs)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.model == str(fixture_dir)
        assert r.usage.completion_tokens == MAX_TOKENS  # no EOS within 24 tokens here
    assert text == expected
    assert finish == "length"


def test_text_completion_greedy_equals_generate_and_stops(capsys, client, fixture_dir):
    expected = generate_cli(capsys, fixture_dir, "ROMEO:", "--ignore-chat-template")
    r = client.completions.create(model="default_model", prompt="ROMEO:",
                                  max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected and r.usage.completion_tokens == MAX_TOKENS
    # stop sequences: the text ends where the stop string would begin
    for stop in ["BENVOLIO", "\n\n"]:
        r = client.completions.create(model="default_model", prompt="ROMEO:", stop=[stop],
                                      max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == expected[:expected.index(stop)], stop
    r = client.completions.create(model="default_model", prompt="ROMEO:", max_tokens=5,
                                  temperature=0)
    assert r.usage.completion_tokens == 5 and expected.startswith(r.choices[0].text)


def test_sixteen_concurrent_clients_each_get_their_single_output(client, demo, corpus_text):
    """Continuous batching: prompts of 16 lengths at once (half streamed), every answer equal
    to its request run alone; a 5xx would raise in the client (no retries)."""
    _, tokenizer = demo
    words = corpus_text.split(" ")
    prompts = [" ".join(words[40 * i: 40 * i + 3 + 5 * i]) for i in range(16)]
    expected = [greedy(demo, tokenizer.encode(p), 10) for p in prompts]

    def ask(i):
        kwargs = dict(model="default_model", prompt=prompts[i], max_tokens=10, temperature=0)
        if i % 2:
            return "".join(c.choices[0].text for c in
                           client.completions.create(stream=True, **kwargs))
        return client.completions.create(**kwargs).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert len({len(tokenizer.encode(p)) for p in prompts}) == 16
    assert got == expected


def test_a_shared_prefix_is_reused(client, demo, corpus_text):
    """The second request's prompt shares ~300 tokens with the first: the server reports them
    as cached (mlx-lm's LRU prompt cache, trimmed to the common prefix) and its answer is
    still the uncached greedy one."""
    _, tokenizer = demo
    head = corpus_text[6000:7200]
    first, second = head + " Away!", head + " Nay, my lord, I will not."
    t1, t2 = tokenizer.encode(first), tokenizer.encode(second)
    client.completions.create(model="default_model", prompt=first, max_tokens=4, temperature=0)
    r = client.completions.create(model="default_model", prompt=second, max_tokens=8,
                                  temperature=0)
    common = lcp(t1, t2)
    assert common > 250 and common < len(t1)
    assert r.usage.prompt_tokens == len(t2)
    assert r.usage.prompt_tokens_details.cached_tokens == min(len(t2) - 1, common)
    assert r.choices[0].text == greedy(demo, t2, 8)


def _long_prompt(corpus_text, tokenizer, n_tokens):
    text = corpus_text
    while len(tokenizer.encode(text)) < n_tokens:
        text += " " + corpus_text
    return tokenizer.decode(tokenizer.encode(text)[1:n_tokens])


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/chat/completions", b"{not json", 400, "Invalid JSON"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "no messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "no messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]},
     400, "text-only"),
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": -3}, 400, "max_tokens must be at least 1"),
    ("/v1/completions", {"prompt": "ROMEO:", "temperature": -0.5}, 400, "temperature must be at least 0"),
    ("/v1/completions", {"prompt": "ROMEO:", "stop": 5}, 400, "stop must be"),
    ("/v1/completions", {"prompt": "ROMEO:", "stop": [""]}, 400, "stop must be"),
    ("/v1/completions", {"prompt": "ROMEO:", "logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt must be a non-empty string"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, 400, "prompt must be a non-empty string"),
    ("/v1/completions", {"prompt": "ROMEO:", "adapters": "lora"}, 400, "adapters"),
    ("/v1/completions", {"prompt": "ROMEO:", "draft_model": "small"}, 400, "draft models"),
    ("/v1/completions", {"prompt": "ROMEO:", "model": "mlx-community/Llama-3.2-1B-4bit"},
     404, "is not served here"),
    ("/v1/completions", "LONG", 400, "does not fit the model's context of 2048 tokens"),
])
def test_a_bad_request_gets_its_4xx_and_the_server_serves_on(
        server, client, demo, corpus_text, path, body, status, message):
    if body == "LONG":
        body = {"prompt": _long_prompt(corpus_text, demo[1], 2100), "max_tokens": 4}
    got, reply = server.request("POST", path, body)
    assert got == status, reply
    error = reply["error"]
    assert message in error and "\n" not in error, error
    assert server.alive()
    r = client.completions.create(model="default_model", prompt="ROMEO:", max_tokens=6,
                                  temperature=0)
    assert r.choices[0].text == greedy(demo, demo[1].encode("ROMEO:"), 6)


def test_another_model_is_refused_and_nothing_is_loaded(server, client, fixture_dir):
    before = server.log().count("INFO - loading ")
    with pytest.raises(openai.NotFoundError) as e:  # a valid model folder, not the served one
        client.completions.create(model=str(mlx_mla.DEMO_MODEL), prompt="ROMEO:", max_tokens=2)
    assert "is not served here" in e.value.body
    assert before == 1 and server.log().count("INFO - loading ") == 1
    # the names a client may send for the served model all work, and load nothing either
    for name in ["default_model", str(fixture_dir)]:
        r = client.completions.create(model=name, prompt="ROMEO:", max_tokens=2, temperature=0)
        assert r.model == str(fixture_dir)
    assert server.log().count("INFO - loading ") == 1


def _stream_then_hang_up(server, prompt, chunks):
    """Open a streamed completion on a raw socket, read ``chunks`` data events, close it."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1500, "temperature": 0, "stream": True})
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     f"{body}".encode())
        lines = sock.makefile("rb")
        assert lines.readline().split()[1] == b"200"
        seen = 0
        while seen < chunks:
            seen += lines.readline().startswith(b"data: ")
        lines.close()


def test_a_client_hanging_up_mid_stream_does_not_disturb_another(server, client, demo):
    """A streams a long answer and hangs up after 3 tokens while B streams beside it in the
    same batch: B's answer is its single-run answer; the server logs that it stopped A's
    generation (mlx-lm removes it from the batch) and serves on."""
    _, tokenizer = demo
    prompt_b = "JULIET:\nO Romeo, Romeo!"
    expected = greedy(demo, tokenizer.encode(prompt_b), 80)
    result = {}

    def b():
        result["b"] = "".join(c.choices[0].text for c in client.completions.create(
            model="default_model", prompt=prompt_b, max_tokens=80, temperature=0, stream=True))

    thread = threading.Thread(target=b)
    thread.start()
    _stream_then_hang_up(server, "ROMEO:", 3)
    thread.join(timeout=120)
    assert result.get("b") == expected
    r = client.completions.create(model="default_model", prompt="ROMEO:", max_tokens=6,
                                  temperature=0)
    assert r.choices[0].text == greedy(demo, tokenizer.encode("ROMEO:"), 6)
    assert "client disconnected mid-response; its generation was stopped" in server.log()
