"""``python -m mlx_mla.chat``: mlx-lm's chat REPL, on an MLA model's latent cache.

mlx-lm's own pieces: its flags (``mlx_lm.chat.setup_arg_parser``: --model, --temp, --top-p,
--xtc-probability, --xtc-threshold, --seed, --max-kv-size, --prefill-step-size, --max-tokens,
--system-prompt, …), its terminal UI (``mlx_lm.cli_ui.ChatUI``: q quits, r resets, h helps),
``stream_generate`` and its sampler; plus --mla-strategy and --dtype. The conversation lives
in one latent cache: each turn sends only its new tokens (what the chat template adds for one
more user message, ``next_turn``), so the system prompt and earlier turns are never re-encoded
(mlx_lm.chat renders the system prompt and BOS again every turn). With --max-kv-size the cache rotates
(the first 4 tokens kept). Positions keep counting either way: a turn that would pass the
model's context is refused with one line and the chat goes on (r starts over).
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator, List, Optional

from . import DEMO_MODEL
from .attention import STRATEGIES
from .cache import cache_bytes_per_token
from .checkpoint import ModelLoadError
from .cli import fail, quiet_on_broken_pipe, sampling_error
from .dtypes import DTYPES
from .generate import encode_prompt
from .loader import load


class ContextFull(ValueError):
    """A turn that does not fit in the model's context."""


class Conversation:
    """A chat's state: the model's latent cache and every token it has been given.

    Args:
        model, tokenizer: from ``mlx_mla.load``.
        system_prompt: the system message of the first turn, if any.
        max_kv_size: bound the cache (a ``RotatingLatentCache``), or None.
    """

    def __init__(self, model, tokenizer, system_prompt: Optional[str] = None,
                 max_kv_size: Optional[int] = None):
        self.model, self.tokenizer = model, tokenizer
        self.system_prompt, self.max_kv_size = system_prompt, max_kv_size
        self.reset()

    def reset(self) -> None:
        """Forget the conversation: an empty cache. Raises ValueError for a bad bound."""
        self.cache = self.model.make_cache(self.max_kv_size)
        self.tokens: List[int] = []

    def turn_tokens(self, query: str) -> List[int]:
        """The tokens a turn feeds: any earlier tokens not yet in the cache, then the turn —
        the whole templated prompt (BOS, system prompt, user message, assistant prompt)
        first, then only what the chat template adds for one more user message (``next_turn``).
        """
        tokenizer = self.tokenizer
        pending = self.tokens[self.cache[0].offset:]
        if not self.tokens:
            return encode_prompt(tokenizer, query, self.system_prompt, ignore_template=False)
        if not tokenizer.has_chat_template:
            return pending + tokenizer.encode(query, add_special_tokens=False)
        closed = self.tokens[-1] in tokenizer.eos_token_ids
        text = next_turn(tokenizer, query, self.system_prompt, closed)
        return pending + tokenizer.encode(text, add_special_tokens=False)

    def reply(self, query: str, max_tokens: int, **generate_kwargs) -> Iterator:
        """Stream the model's answer to ``query`` (mlx-lm ``GenerationResponse``s), keeping
        the turn in the cache. ``max_tokens`` is lowered to what the model's context has
        left; ``generate_kwargs`` go to ``mlx_lm.stream_generate`` (sampler, …).

        Raises:
            ContextFull: no room left in the model's context (a rotating cache's positions
                count every token too).
        """
        from mlx_lm import stream_generate

        prompt = self.turn_tokens(query)
        context = self.model.args.max_position_embeddings
        seen = self.cache[0].offset + len(prompt)
        if seen >= context:
            raise ContextFull(
                f"this turn would bring the conversation to {seen} tokens, past the model's "
                f"context of {context}: type r to start over")
        generated = []
        for response in stream_generate(self.model, self.tokenizer, prompt,
                                        max_tokens=min(max_tokens, context - seen),
                                        prompt_cache=self.cache, **generate_kwargs):
            generated.append(response.token)
            yield response
        self.tokens += prompt + generated


REPLY = "<mlx-mla reply>"  # a stand-in assistant message, found again in the rendered text


def next_turn(tokenizer, query: str, system_prompt: Optional[str], closed: bool) -> str:
    """The text the chat template adds for one more user message ``query`` after an assistant
    reply: rendered after a stand-in exchange and cut where that exchange ends. ``closed``:
    the reply ended with an EOS token (which stands for the template's end of the assistant
    message); otherwise that end is prepended. A template whose earlier text changes when a
    message is added gets mlx_lm.chat's rule instead: the user message rendered alone, as a
    new conversation."""
    base = [{"role": "system", "content": system_prompt}] if system_prompt else []
    base += [{"role": "user", "content": "?"}, {"role": "assistant", "content": REPLY}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + [{"role": "user", "content": query}],
                                          tokenize=False, add_generation_prompt=True)
    if not after.startswith(before) or REPLY not in before:
        return tokenizer.apply_chat_template([{"role": "user", "content": query}],
                                             tokenize=False, add_generation_prompt=True)
    end_of_reply = before[before.rindex(REPLY) + len(REPLY):]
    return ("" if closed else end_of_reply) + after[len(before):]


def build_parser() -> argparse.ArgumentParser:
    """mlx_lm.chat's flags plus --mla-strategy and --dtype."""
    from mlx_lm.chat import setup_arg_parser

    p = setup_arg_parser()
    p.prog = "python -m mlx_mla.chat"
    p.description = "Chat with a DeepSeek-V2-family model on MLA's latent cache."
    p.set_defaults(model=None)
    helps = {
        "model": "local folder or Hub repo id (default: the demo checkpoint shipped with mlx-mla)",
        "trust_remote_code": "accepted for mlx_lm.chat compatibility; mlx_mla runs no "
                             "remote tokenizer code",
        "max_kv_size": "bound the latent cache to this many tokens (the first 4 kept, the "
                       "rest rotate)",
        "pipeline": "mlx-lm's distributed chat (not available for MLA models yet: refused)",
        "adapter_path": "not supported by mlx-mla (refused): fuse the adapter into the model "
                        "with mlx_lm.fuse",
    }
    for action in p._actions:
        if action.dest in helps:
            action.help = helps[action.dest]
    p.add_argument("--mla-strategy", default="auto",
                   help=f"MLA strategy: {', '.join(STRATEGIES)} (default: auto)")
    p.add_argument("--dtype", default=None,
                   help=f"activation dtype: {', '.join(DTYPES)} (default: float32 on CPU, "
                        "the checkpoint's on a GPU)")
    return p


def make_ui(args: argparse.Namespace):
    """mlx-lm's ``ChatUI`` with our title and MLA rows in the header, and the latent cache's
    size after each turn."""
    from mlx_lm.cli_ui import ChatUI, print_chat_help, print_header_panel

    class MLAChatUI(ChatUI):
        conversation: Optional[Conversation] = None

        def __enter__(self):
            rows = [("model", str(args.model)), ("MLA strategy", args.mla_strategy),
                    ("max tokens", f"{args.max_tokens:,}"),
                    ("max kv size", f"{args.max_kv_size:,}" if args.max_kv_size else "unbounded")]
            if args.system_prompt:
                sp = args.system_prompt
                rows.append(("system", sp if len(sp) <= 60 else sp[:57] + "..."))
            print_header_panel(self._console, "mlx_mla.chat", rows)
            print_chat_help(self._console)
            return self

        def end_turn(self, response):
            super().end_turn(response)
            cache = self.conversation.cache if self.conversation else None
            if cache:
                tokens = cache[0].size()
                self._console.print(
                    f"  [ui.muted]latent cache {tokens:,} tokens · "
                    f"{tokens * cache_bytes_per_token(cache) / 1e6:.2f} MB[/ui.muted]")

    return MLAChatUI(args)


@quiet_on_broken_pipe
def main(argv: Optional[List[str]] = None) -> int:
    """Run the REPL until q or end of input; returns the exit status (1 with one
    ``error:`` line on stderr when it cannot start)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    args = build_parser().parse_args(argv)
    if args.adapter_path is not None:
        return fail("--adapter-path is not supported by mlx-mla: fuse the adapter first "
                    "(mlx_lm.fuse) and pass the fused folder as --model")
    if args.pipeline or mx.distributed.init().size() > 1:
        return fail("distributed chat (--pipeline, mlx.launch ranks) is not available in "
                    "mlx_mla.chat yet: run it as one process without --pipeline")
    if args.max_tokens < 1:
        return fail(f"--max-tokens must be at least 1, got {args.max_tokens}")
    error = sampling_error(args.temp, args.top_p, 0.0, args.seed)
    if error:
        return fail(error)
    mx.random.seed(args.seed)
    args.model = args.model or str(DEMO_MODEL)
    try:
        model, tokenizer = load(args.model, args.mla_strategy, args.dtype)
        conversation = Conversation(model, tokenizer, args.system_prompt, args.max_kv_size)
    except (ModelLoadError, ValueError) as e:
        return fail(str(e))
    sampler = make_sampler(args.temp, args.top_p, xtc_probability=args.xtc_probability,
                           xtc_threshold=args.xtc_threshold,
                           xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))

    with make_ui(args) as ui:
        ui.conversation = conversation
        while True:
            try:
                query = ui.prompt()
            except EOFError:
                query = "q"
            if query == "q":
                ui.say_bye()
                return 0
            if query == "r":
                conversation.reset()
                ui.say_reset()
                continue
            if query == "h":
                ui.say_help()
                continue
            last = None
            try:
                for last in conversation.reply(query, args.max_tokens, sampler=sampler,
                                               prefill_step_size=args.prefill_step_size):
                    ui.stream_token(last.text)
            except ContextFull as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            ui.end_turn(last)


if __name__ == "__main__":
    sys.exit(main())
