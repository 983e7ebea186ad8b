"""``python -m mlx_mla.chat``: the conversation kept in the latent cache equals generating from
the whole conversation at once; the REPL as users run it (stdin), and its one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mlx_lm.generate import stream_generate

import mlx_mla
from mlx_mla.cache import RotatingLatentCache
from mlx_mla.chat import ContextFull, Conversation, main, next_turn
from mlx_mla.generate import encode_prompt


@pytest.fixture(scope="module")
def demo(fixture_dir):
    return mlx_mla.load(fixture_dir)


def fresh(demo, tokens, max_tokens):
    """Greedy tokens and text from a new cache over ``tokens``."""
    model, tokenizer = demo
    out = list(stream_generate(model, tokenizer, tokens, max_tokens=max_tokens))
    return [r.token for r in out], "".join(r.text for r in out)


def test_turns_continue_the_cache_as_the_template_renders_the_conversation(demo):
    """Turn 2 feeds only what the chat template adds for it; the tokens in the cache then
    read as the template's rendering of the whole conversation, and turn 2's answer equals
    a fresh run over them; the cache holds every token given."""
    model, tokenizer = demo
    conv = Conversation(model, tokenizer, system_prompt="You are a poet.")
    first = list(conv.reply("ROMEO:", 12))
    t1 = encode_prompt(tokenizer, "ROMEO:", "You are a poet.", False)
    ref1, text1 = fresh(demo, t1, 12)
    assert [r.token for r in first] == ref1 and "".join(r.text for r in first) == text1
    assert first[-1].finish_reason == "length"  # no EOS: the turn must close the reply

    t2 = conv.turn_tokens("JULIET:")
    second = list(conv.reply("JULIET:", 12))
    whole = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "ROMEO:"},
         {"role": "assistant", "content": text1.lstrip(" ")}, {"role": "user", "content": "JULIET:"}],
        tokenize=False, add_generation_prompt=True)
    # the template writes "Assistant: " + content; the model answered "Assistant:" + " ..."
    assert tokenizer.decode(t1 + ref1 + t2) == whole
    ref2, text2 = fresh(demo, t1 + ref1 + t2, 12)
    assert [r.token for r in second] == ref2 and "".join(r.text for r in second) == text2
    assert conv.cache[0].offset == len(conv.tokens) == len(t1 + ref1 + t2 + ref2)


def test_next_turn_text_by_hand(demo):
    """The fixture's template (tests/data/chat_template.jinja) writes a user message as
    "User: " + content + "\n\n", the assistant prompt as "Assistant:", and ends an assistant
    message with the EOS token; a base model's turn is the text alone."""
    tokenizer = demo[1]
    turn = "User: JULIET:\n\nAssistant:"
    assert next_turn(tokenizer, "JULIET:", "Be brief.", closed=True) == turn
    assert next_turn(tokenizer, "JULIET:", None, closed=False) == tokenizer.eos_token + turn
    model, base_tokenizer = mlx_mla.load(mlx_mla.DEMO_MODEL)
    conv = Conversation(model, base_tokenizer)
    list(conv.reply("ROMEO:", 3))
    assert conv.turn_tokens(" JULIET:") == base_tokenizer.encode(" JULIET:", add_special_tokens=False)


def test_a_turn_past_the_context_is_refused_and_reset_starts_over(demo, corpus_text):
    model, tokenizer = demo
    conv = Conversation(model, tokenizer)
    with pytest.raises(ContextFull, match="past the model's context of 2048: type r"):
        list(conv.reply(corpus_text[:12000], 4))
    assert conv.cache[0].offset == 0 and conv.tokens == []  # nothing was fed
    conv.reset()
    assert len(list(conv.reply("ROMEO:", 4))) == 4


def test_max_kv_size_bounds_the_conversation(demo):
    model, tokenizer = demo
    conv = Conversation(model, tokenizer, max_kv_size=32)
    for query in ("ROMEO:", "JULIET:"):
        list(conv.reply(query, 20))
    assert isinstance(conv.cache[0], RotatingLatentCache)
    assert conv.cache[0].size() == 32 < conv.cache[0].offset == len(conv.tokens)


def test_the_repl_from_the_shell(demo, fixture_dir):
    """q quits, r resets (the same question then gets the same answer), end of input quits."""
    _, text = fresh(demo, encode_prompt(demo[1], "ROMEO:", None, False), 12)
    run = subprocess.run(
        [sys.executable, "-m", "mlx_mla.chat", "--model", str(fixture_dir), "--max-tokens", "12"],
        input="ROMEO:\nr\nROMEO:\n", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count(text) == 2 and "context cleared" in run.stdout
    assert "mlx_mla.chat" in run.stdout and "latent cache" in run.stdout and "bye" in run.stdout


@pytest.mark.parametrize("argv, expected", [
    (["--pipeline"], "distributed chat (--pipeline, mlx.launch ranks) is not available"),
    (["--adapter-path", "lora"], "--adapter-path is not supported by mlx-mla"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--temp", "-1"], "--temp must be 0 (greedy) or more"),
    (["--max-kv-size", "2"], "max_kv_size 2 must be larger than the 4 tokens always kept"),
])
def test_bad_flags_are_one_line(capsys, argv, expected):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
