"""``python -m mlx_mla.server``: mlx-lm's OpenAI-compatible server, running an MLA model.

Everything that serves is mlx-lm's (``mlx_lm.server``): the HTTP handler (chat and text
completions, streaming, stop sequences, logprobs, tool calls), the generation thread with
continuous batching (``BatchGenerator``, on our batchable latent caches) and the LRU prompt
cache that reuses a cached prefix across requests. What is ours, as subclasses:

- ``MLAModelProvider``: loads with ``mlx_mla.load`` (``--mla-strategy``, ``--dtype``), sets
  the model's default cache bound (``--max-kv-size``), and **pins the served model**: a request
  naming another model is answered 404 and nothing is loaded, unless the operator started the
  server with ``--allow-other-models``.
- ``MLAResponseGenerator``: rejects a prompt the model cannot hold (longer than its context or
  than ``--max-kv-size``; an empty one) with HTTP 400 before it reaches the batch, and stops
  generation at the context's end (finish_reason "length").
- ``MLAAPIHandler``: ``/v1/models`` lists only the served model (mlx-lm lists its Hub cache);
  request fields mlx-lm would pass unchecked to the generation thread, where they could stop
  it (a ``stop`` that is not strings, malformed ``messages``, images, an out-of-vocabulary
  ``logit_bias``), are refused with 400; a client that hangs up mid-stream is logged, its
  generation having been stopped by mlx-lm (``ctx.stop()`` → ``BatchGenerator.remove``).

Under ``mlx.launch`` (2+ ranks) each rank loads its part with ``mlx_mla.distributed.
load_sharded`` (``--pipeline``: its layers; else tensor parallel, as mlx_lm.server); rank 0
serves HTTP and the others follow its requests (mlx-lm's distributed ``ResponseGenerator``).

Flags: mlx_lm.server's, same names and defaults, plus --mla-strategy, --dtype, --max-kv-size
and --allow-other-models. Binds 127.0.0.1 unless told otherwise (one warning line then).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import List, Optional, Sequence
from urllib.parse import unquote

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, get_system_fingerprint
from mlx_lm.utils import _parse_size

from . import DEMO_MODEL
from .attention import STRATEGIES
from .cache import quantized_codec
from .checkpoint import ModelLoadError
from .cli import fail, sampling_error
from .dtypes import DTYPES
from .distributed import load_sharded
from .generate import add_cache_arguments
from .loader import load

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class ModelNotServed(LookupError):
    """A request named a model this server does not serve (HTTP 404)."""


class PromptRejected(ValueError):
    """A prompt the served model cannot take (HTTP 400)."""


class MLAModelProvider(ModelProvider):
    """mlx-lm's ``ModelProvider`` loading DeepSeek-V2-family models with ``mlx_mla.load``.

    ``cli_args`` is ``build_parser()``'s namespace. The served model is ``cli_args.model``
    (the demo checkpoint when None); ``served_id`` is how ``/v1/models`` lists it.
    """

    def __init__(self, cli_args: argparse.Namespace):
        self.served_id = cli_args.model or str(DEMO_MODEL)
        cli_args.model = self.served_id
        super().__init__(cli_args)
        local = Path(self.served_id).expanduser()
        # Names a client may reasonably send for the served model: mlx-lm's "default_model",
        # the --model string, and the folder's absolute path (what mlx_lm.server lists).
        self.aliases = {"default_model", self.served_id}
        if local.exists():
            self.aliases.add(str(local.resolve()))
        self.ready = threading.Event()
        self.load_error: Optional[Exception] = None

    def served_name(self, requested: str) -> str:
        """The model name a request is served under: ``served_id`` for any alias of the
        served model (so mlx-lm batches them together and loads nothing), ``requested``
        itself when the operator allows other models.

        Raises:
            ModelNotServed: another model, and ``--allow-other-models`` was not given.
        """
        if requested in self.aliases:
            return self.served_id
        if self.cli_args.allow_other_models:
            return requested
        raise ModelNotServed(
            f"model {requested!r} is not served here: this server serves {self.served_id!r} "
            "(see /v1/models; the operator can allow others with --allow-other-models)")

    def load_default(self):
        """Load the served model (in mlx-lm's generation thread, where its arrays live);
        a failure is kept in ``load_error`` for ``main`` to report, and ``ready`` is set
        either way."""
        try:
            super().load_default()
        except Exception as e:  # reported as one line by main(), not a dead thread
            self.load_error = e
        finally:
            self.ready.set()

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        """``mlx_mla.load`` in place of ``mlx_lm.load``; adapters and draft models are refused
        by the handler before a request gets here. Raises ModelLoadError (one line)."""
        self.reset()
        gc.collect()
        mx.clear_cache()
        logging.info(f"loading {model_path} (MLA strategy {self.cli_args.mla_strategy})")
        if self.is_distributed:  # this rank's part: pipeline (--pipeline) or tensor parallel
            model, tokenizer = load_sharded(
                model_path, pipeline_group=self.pipeline_group, tensor_group=self.tensor_group,
                mla_strategy=self.cli_args.mla_strategy, dtype=self.cli_args.dtype)
        else:
            model, tokenizer = load(model_path, self.cli_args.mla_strategy, self.cli_args.dtype)
        model.max_kv_size = self.cli_args.max_kv_size
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer = model, tokenizer
        self.is_batchable = all(hasattr(c, "merge") for c in model.make_cache())


class MLAResponseGenerator(ResponseGenerator):
    """mlx-lm's ``ResponseGenerator`` (generation thread, continuous batching, prompt cache)
    with a length check on every prompt."""

    def _tokenize(self, tokenizer, request, args):
        """mlx-lm's tokenization, then: the prompt must be non-empty, shorter than the
        model's context (``max_position_embeddings``: room for one generated token) and no
        longer than ``--max-kv-size``; ``args.max_tokens`` is lowered so generation stops at
        the context's end.

        Raises:
            PromptRejected: one line saying which limit and by how much.
        """
        result = super()._tokenize(tokenizer, request, args)
        n = len(result[0])
        context = self.model_provider.model.args.max_position_embeddings
        bound = self.model_provider.cli_args.max_kv_size
        if n == 0:
            raise PromptRejected("the prompt is empty")
        if n >= context:
            raise PromptRejected(
                f"the prompt ({n} tokens) does not fit the model's context of {context} "
                "tokens (with room for one generated token): shorten it")
        if bound is not None and n > bound:
            raise PromptRejected(
                f"the prompt ({n} tokens) is longer than this server's --max-kv-size of "
                f"{bound} tokens: shorten it")
        args.max_tokens = min(args.max_tokens, context - n)
        return result


class MLAAPIHandler(APIHandler):
    """mlx-lm's ``APIHandler`` for the pinned model: see the module docstring."""

    def _error(self, status: int, message: str) -> None:
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps({"error": message}).encode())

    def _set_completion_headers(self, status_code: int = 200):
        # mlx-lm's handle_completion answers every exception from generate() with 404; a
        # prompt our generation thread rejected is the client's error: 400.
        if status_code == 404 and isinstance(sys.exc_info()[1], PromptRejected):
            status_code = 400
        super()._set_completion_headers(status_code)

    def validate_model_parameters(self) -> None:
        """mlx-lm's checks, plus the fields it hands unchecked to the generation thread.

        Raises:
            ValueError: one line (answered 400 by mlx-lm's do_POST).
        """
        super().validate_model_parameters()
        stop = self.body.get("stop")
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise ValueError("stop must be a string or a list of non-empty strings")
        if self.adapter is not None:
            raise ValueError("adapters are not supported by mlx_mla.server: fuse the adapter "
                             "into the model (mlx_lm.fuse) and serve the fused folder")
        if self.requested_draft_model != "default_model":
            raise ValueError("draft models (speculative decoding) are not supported by "
                             "mlx_mla.server")
        model = self.response_generator.model_provider.model
        vocab = model.args.vocab_size if model is not None else None
        if self.logit_bias and vocab and any(not 0 <= t < vocab for t in self.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")

    def handle_chat_completions(self):
        """Check ``messages`` before mlx-lm reads them (its reader fetches image URLs).

        Raises:
            ValueError: malformed or image-bearing messages (400).
        """
        check_messages(self.body.get("messages"))
        return super().handle_chat_completions()

    def handle_text_completions(self):
        """Raises ValueError (400) unless ``prompt`` is a non-empty string."""
        prompt = self.body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        return super().handle_text_completions()

    def handle_completion(self, request, stop_words: List[str]):
        """Pin the model (404 for another one, nothing loaded), then mlx-lm's completion."""
        try:
            self.requested_model = self.response_generator.model_provider.served_name(
                self.requested_model)
        except ModelNotServed as e:
            self._error(404, str(e))
            return
        try:
            super().handle_completion(request, stop_words)
        except (BrokenPipeError, ConnectionResetError):
            # mlx-lm's finally already called ctx.stop(): the sequence leaves the batch.
            logging.info("client disconnected mid-response; its generation was stopped")

    def handle_models_request(self):
        """``/v1/models``: the served model only; ``/v1/models/NAME``: it, or 404."""
        provider = self.response_generator.model_provider
        entry = {"id": provider.served_id, "object": "model", "created": self.created,
                 "owned_by": "mlx_mla"}
        rest = self.path.split("?")[0][len("/v1/models"):]
        name = unquote(rest[1:] if rest.startswith("/") else rest)
        if not name:
            body = {"object": "list", "data": [entry]}
        elif name in provider.aliases:
            body = entry
        else:
            self._error(404, f"model {name!r} is not served here")
            return
        self._set_completion_headers(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())


def check_messages(messages) -> None:
    """Raise ValueError (one line) unless ``messages`` is a non-empty list of
    ``{"role": str, "content": str | None | [{"type": "text", "text": str}, ...]}``."""
    how = 'send a non-empty list of {"role": ..., "content": ...} objects'
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"the request has no messages: {how}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] is not a message with a role: {how}")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        for p in content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError(f"messages[{i}] has a {p.get('type')!r} part: mlx_mla.server "
                                 "serves text-only models (parts of type 'text' only)")


def build_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's flags (same names and defaults) plus MLA's."""
    p = argparse.ArgumentParser(
        prog="python -m mlx_mla.server",
        description="OpenAI-compatible HTTP server (mlx-lm's) for a DeepSeek-V2-family model "
                    "on MLA's latent cache, with continuous batching and prompt reuse.")
    p.add_argument("--model", default=None,
                   help="local folder or Hub repo id to serve (default: the demo checkpoint "
                        "shipped with mlx-mla); requests naming another model get a 404")
    p.add_argument("--allow-other-models", action="store_true",
                   help="load a model a request names (it replaces the served one; mlx-lm's "
                        "behaviour) instead of refusing it")
    p.add_argument("--host", default="127.0.0.1", help="host to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080,
                   help="port (default: 8080; 0 picks a free one, printed at start)")
    p.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*",
                   help="CORS allowed origins, comma-separated (default: *)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="logging level (default: INFO)")
    p.add_argument("--temp", type=float, default=0.0, help="default sampling temperature (0.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="default top-p (1.0)")
    p.add_argument("--top-k", type=int, default=0, help="default top-k (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="default min-p (0.0: off)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="default maximum tokens to generate (512)")
    p.add_argument("--chat-template-args", type=json.loads, default="{}",
                   help="JSON object of arguments for the tokenizer's apply_chat_template")
    p.add_argument("--decode-concurrency", type=int, default=32,
                   help="sequences decoded together in one batch (32)")
    p.add_argument("--prompt-concurrency", type=int, default=8,
                   help="prompts processed together in one batch (8)")
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prompt tokens per prefill step (2048)")
    p.add_argument("--prompt-cache-size", type=int, default=10,
                   help="most latent caches kept for prompt reuse (10)")
    p.add_argument("--prompt-cache-bytes", type=_parse_size,
                   help="most bytes of latent caches kept for prompt reuse (e.g. 2GB)")
    add_cache_arguments(p)  # generate's cache flags; the server's help adds what serving does
    serving = {"max_kv_size": "; here every sequence's, and longer prompts are refused (400)",
               "kv_bits": "; as in mlx-lm, this serves requests one at a time (no batching)"}
    for action in p._actions:
        if action.dest in serving:
            action.help += serving[action.dest]
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch, split the model's layers over the ranks (pipeline "
                        "parallel); without it, ranks split every layer (tensor parallel), "
                        "as mlx_lm.server does")
    p.add_argument("--mla-strategy", default="auto",
                   help=f"MLA strategy: {', '.join(STRATEGIES)} (default: auto)")
    p.add_argument("--dtype", default=None,
                   help=f"activation dtype: {', '.join(DTYPES)} (default: float32 on CPU, "
                        "the checkpoint's on a GPU)")
    # Read by mlx-lm's ModelProvider / APIHandler; not offered (no adapters, draft models
    # or remote tokenizer code in mlx_mla.load).
    p.set_defaults(adapter_path=None, draft_model=None, num_draft_tokens=3,
                   trust_remote_code=False, chat_template="", use_default_chat_template=False)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError (one line) for flag values the server cannot start with."""
    if args.pipeline and mx.distributed.init().size() == 1:
        raise ValueError(
            "--pipeline splits the model over the ranks mlx.launch starts (e.g. mlx.launch "
            "-n 2 --hosts ... -- python -m mlx_mla.server --pipeline); this process has none")
    error = sampling_error(args.temp, args.top_p, args.min_p)
    if error:
        raise ValueError(error)
    if args.top_k < 0:
        raise ValueError(f"--top-k must be 0 (off) or more, got {args.top_k}")
    if not isinstance(args.chat_template_args, dict):
        raise ValueError("--chat-template-args must be a JSON object")
    for flag in ("max_tokens", "decode_concurrency", "prompt_concurrency",
                 "prefill_step_size", "prompt_cache_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")


def check_model_args(args: argparse.Namespace, model) -> None:
    """Flag values checked against the loaded model. Raises ValueError (one line)."""
    model.make_cache(args.max_kv_size)  # --max-kv-size above the 4 tokens always kept
    if args.kv_bits is not None:
        quantized_codec(args.kv_group_size, args.kv_bits, model.args.kv_lora_rank)


def make_http_server(host: str, port: int, response_generator: ResponseGenerator
                     ) -> ThreadingHTTPServer:
    """mlx-lm's HTTP server set-up (``mlx_lm.server._run_http_server`` without its serving
    loop) with ``MLAAPIHandler``; IPv4 or IPv6 by the host's address family.

    Raises:
        OSError: the address cannot be bound.
    """
    import socket

    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MLAHTTPServer", (ThreadingHTTPServer,), {"address_family": family})
    fingerprint = get_system_fingerprint()
    return server_class(address, lambda *a, **k: MLAAPIHandler(
        response_generator, *a, system_fingerprint=fingerprint, **k))


def start(args: argparse.Namespace, provider: MLAModelProvider,
          generator: MLAResponseGenerator) -> Optional[ThreadingHTTPServer]:
    """Wait for the generation thread to load the served model, check the flags against
    it, and bind the HTTP server (rank 0 of a distributed run only: None on the others,
    whose generation threads follow rank 0's requests, as in mlx-lm).

    Raises:
        ModelLoadError, ValueError, OSError: one line each (the model, a flag, the address).
    """
    provider.ready.wait()
    error = provider.load_error
    if isinstance(error, ModelLoadError):
        raise error
    if error is not None:
        raise ModelLoadError(f"cannot load {provider.served_id}: {error}")
    check_model_args(args, provider.model)
    if mx.distributed.init().rank() != 0:
        return None
    return make_http_server(args.host, args.port, generator)


def bind_warning(host: str) -> Optional[str]:
    """The one warning line for a server bound to ``host``; None on the loopback names."""
    if host in LOCAL_HOSTS:
        return None
    return (f"warning: listening on {host}: anyone who can reach this address can use the "
            "model (mlx-lm's server has only basic security checks)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Start the server and serve until SIGINT/SIGTERM; returns the exit status (1 with one
    ``error:`` line on stderr when it cannot start)."""
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        return fail(str(e))
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s - %(levelname)s - %(message)s")

    provider = MLAModelProvider(args)
    generator = MLAResponseGenerator(provider, LRUPromptCache(args.prompt_cache_size))
    try:
        httpd = start(args, provider, generator)
    except (ModelLoadError, ValueError, OSError) as e:
        generator.stop_and_join()
        return fail(str(e))

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if httpd is None:  # a rank other than 0: follow rank 0's requests until ended
        try:
            generator.join()
        except KeyboardInterrupt:
            pass
        return 0
    port = httpd.server_address[1]
    warning = bind_warning(args.host)
    if warning:
        print(warning, file=sys.stderr)
    print(f"mlx_mla.server: serving {provider.served_id} at http://{args.host}:{port}/v1 "
          f"(MLA strategy {args.mla_strategy}, max kv size {args.max_kv_size or 'unbounded'})",
          file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()
    return 0


def cli() -> None:
    """The command's entry point (``python -m mlx_mla.server``, ``mlx-mla-server``): ``main``,
    then ``os._exit``. Python's own shutdown would race mlx-lm's generation thread: after
    ``join`` returns, that thread's MLX thread-local compile cache is still being destroyed
    and takes the GIL, which aborts the process ("terminate called without an active
    exception") if the interpreter is finalizing by then."""
    status = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    cli()
