"""``python -m mlx_mla.generate``: mlx-lm's generate command, on an MLA latent cache.

Flags, prompt handling (chat template, then encoding without special tokens so BOS appears
once), sampler and the generate loop are mlx-lm's own (``mlx_lm.generate``,
``mlx_lm.sample_utils.make_sampler``); we add ``--mla-strategy`` and ``--dtype`` and report
the latent cache's size. With no ``--model``, it runs the demo checkpoint shipped in the
package. Under ``mlx.launch`` (2+ ranks) every rank loads its part (``--pipeline``, or tensor
parallel, ``mlx_mla.distributed``) and runs the same loop; rank 0 prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import mlx.core as mx

from . import DEMO_MODEL, blas
from .attention import STRATEGIES
from .cache import cache_bytes_per_token, quantized_codec
from .cache import files as prompt_cache_files
from .cache.files import PromptCacheError
from .checkpoint import ModelLoadError
from .cli import context_error, fail, quiet_on_broken_pipe, sampling_error, str2bool
from .dtypes import DTYPES
from .distributed import barrier, load_sharded
from .loader import load

DEFAULT_PROMPT = "ROMEO:"


def build_parser() -> argparse.ArgumentParser:
    from mlx_lm.generate import DEFAULT_MAX_TOKENS, DEFAULT_MIN_P, DEFAULT_TEMP, DEFAULT_TOP_P

    p = argparse.ArgumentParser(
        prog="python -m mlx_mla.generate",
        description="Generate text with a DeepSeek-V2-family model on MLX, using MLA's latent cache.",
    )
    p.add_argument("--model", default=None,
                   help="local folder (Hugging Face or mlx-lm layout) or Hub repo id; "
                        "default: the demo checkpoint shipped with mlx-mla")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                   help=f"prompt text, or - to read stdin (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                   help="maximum number of tokens to generate")
    p.add_argument("--temp", type=float, default=DEFAULT_TEMP,
                   help="sampling temperature, >= 0 (0: greedy)")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P,
                   help="sampling top-p, in (0, 1] (1: off)")
    p.add_argument("--min-p", type=float, default=DEFAULT_MIN_P,
                   help="sampling min-p, in [0, 1] (0: off)")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="encode the prompt as is, even if the tokenizer has a chat template")
    p.add_argument("--verbose", type=str2bool, default=True,
                   help="stream the text and print the stats (true, the default) or print only "
                        "the text (false; also no/off/0)")
    p.add_argument("--mla-strategy", default="auto",
                   help=f"MLA decode strategy: {', '.join(STRATEGIES)} (default: auto)")
    p.add_argument("--dtype", default=None,
                   help=f"activation dtype: {', '.join(DTYPES)} (default: float32 on CPU, "
                        "the checkpoint's on a GPU)")
    add_cache_arguments(p)
    p.add_argument("--prompt-cache-file", default=None,
                   help="a prompt cache made by python -m mlx_mla.cache_prompt: the prompt "
                        "continues it (with a chat template, as the next user message)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--pipeline", action="store_true",
                       help="under mlx.launch: split the decoder layers across the ranks, "
                            "each reading only its layers' files and caching only its layers")
    split.add_argument("--tensor-parallel", action="store_true",
                       help="under mlx.launch: split every layer across the ranks by heads "
                            "and expert widths (the default when launched on 2+ ranks, as "
                            "in mlx-lm)")
    return p


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    """mlx-lm's cache flags (same names and defaults as mlx_lm.generate)."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    p.add_argument("--max-kv-size", type=int, default=None,
                   help="bound the latent cache to this many tokens: the first 4 are kept, the "
                        "rest rotate (mlx-lm's RotatingKVCache rule)")
    p.add_argument("--kv-bits", type=int, default=None,
                   help="store c_kv quantized to this many bits (2, 3, 4, 5, 6 or 8; 4 and 8 measured, "
                        "see README) once the context passes "
                        "--quantized-kv-start; default: unquantized")
    p.add_argument("--kv-group-size", type=int, default=64,
                   help="values per scale/bias of the quantized c_kv (default 64)")
    p.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                   help=f"with --kv-bits, quantize from this many tokens on "
                        f"(default {DEFAULT_QUANTIZED_KV_START})")


def encode_prompt(tokenizer, prompt: str, system_prompt: Optional[str], ignore_template: bool,
                  continues_cache: bool = False) -> List[int]:
    """Token ids for the prompt, as mlx-lm's generate makes them.

    With a chat template the templated text already holds BOS, so it is encoded without
    special tokens; a plain prompt gets the tokenizer's own (BOS prepended). When the prompt
    continues a prompt cache, only what follows the cached text is encoded: with a template,
    the part from the user message on (mlx-lm's "<query>" rule); without one, no BOS.
    """
    use_template = not ignore_template and tokenizer.has_chat_template
    if use_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if continues_cache:
            messages[-1]["content"] = "<query>"
            probe = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            text = text[probe.index("<query>"):]
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt, add_special_tokens=not continues_cache)


def make_cache(model, args) -> List:
    """The latent cache the flags ask for: the --prompt-cache-file's (checked to fit the
    model), or a new one bounded by --max-kv-size; --kv-bits / --kv-group-size checked
    against the model (and against a quantized cache file) before anything runs.

    Raises:
        PromptCacheError, ValueError: one line each.
    """
    if args.kv_bits is not None:
        quantized_codec(args.kv_group_size, args.kv_bits, model.args.kv_lora_rank)
    if args.prompt_cache_file is None:
        return model.make_cache(args.max_kv_size)
    cache, _ = prompt_cache_files.load(args.prompt_cache_file, model)
    codec = cache[0].codec
    if codec.quantized and args.kv_bits is not None and (
            codec.bits, codec.group_size) != (args.kv_bits, args.kv_group_size):
        raise PromptCacheError(
            f"--kv-bits {args.kv_bits} / --kv-group-size {args.kv_group_size} differ from the "
            f"prompt cache's ({codec.bits} / {codec.group_size}): drop them or match them")
    return cache


@quiet_on_broken_pipe
def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; returns the exit status (0, or 1 with one ``error:`` line on stderr;
    141 when the reader of stdout closes it early)."""
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm.sample_utils import make_sampler

    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        return fail(f"--max-tokens must be at least 1, got {args.max_tokens}")
    problem = sampling_error(args.temp, args.top_p, args.min_p, args.seed)
    if problem:
        return fail(problem)
    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    if size > 1:
        # Every rank samples from the same logits: with one seed they pick the same tokens.
        args.seed = agreed_seed(group, args.seed)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model_path = args.model
    if args.prompt_cache_file is not None and model_path is None:
        model_path = prompt_cache_files.named_model(args.prompt_cache_file)
    try:
        if size > 1:
            if args.prompt_cache_file is not None:
                raise ValueError("--prompt-cache-file is for one process: a run over several "
                                 "ranks starts from an empty cache")
            split = {"pipeline_group": group} if args.pipeline else {"tensor_group": group}
            model, tokenizer = load_sharded(
                model_path or DEMO_MODEL, mla_strategy=args.mla_strategy, dtype=args.dtype,
                **split)
        else:
            model, tokenizer = load(model_path or DEMO_MODEL, args.mla_strategy, args.dtype)
        cache = make_cache(model, args)
    except (ModelLoadError, PromptCacheError, ValueError) as e:
        return fail(str(e))
    verbose = args.verbose and rank == 0

    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    if rank == 0 and args.system_prompt and (
            args.ignore_chat_template or not tokenizer.has_chat_template):
        why = ("--ignore-chat-template" if args.ignore_chat_template
               else "the tokenizer has no chat template")
        print(f"warning: --system-prompt is ignored: {why}", file=sys.stderr)
    tokens = encode_prompt(tokenizer, prompt, args.system_prompt, args.ignore_chat_template,
                           continues_cache=args.prompt_cache_file is not None)
    problem = context_error(cache[0].offset + len(tokens), args.max_tokens,
                            model.args.max_position_embeddings)
    if problem:
        return fail(problem)

    sampler = make_sampler(args.temp, args.top_p, args.min_p)
    text = mlx_lm_generate(
        model, tokenizer, tokens, max_tokens=args.max_tokens, verbose=verbose,
        sampler=sampler, prompt_cache=cache, kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start,
    )
    if size > 1:
        barrier(group)  # no rank exits while another still needs its sockets
    if rank != 0:
        return 0
    if not verbose:
        print(text)
        return 0
    positions = cache[0].size()
    per_token = cache_bytes_per_token(cache)
    where = ""
    if size > 1 and args.pipeline:
        m = model.model
        where = (f" on rank 0 of {size} (pipeline: layers {m.start_idx}-{m.end_idx - 1} of "
                 f"{len(m.layers)}; each rank caches its own layers)")
    elif size > 1:
        where = (f" on each of {size} ranks (tensor parallel: every rank caches every "
                 f"layer's whole latent)")
    print(
        f"Latent cache: {per_token * positions / 1e6:.3f} MB for {positions} tokens "
        f"({per_token:.0f} bytes/token, {len(cache)} layers){where}, "
        f"MLA strategy: {args.mla_strategy}"
    )
    if mx.default_device() == mx.cpu:
        print(f"BLAS: {blas.describe()['label']}")
    return 0


def agreed_seed(group, seed: Optional[int]) -> int:
    """``seed`` if given, else rank 0's random one, the same on every rank of ``group``."""
    if seed is not None:
        return seed
    mine = int(time.time_ns() % 2**31) if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine), group=group, stream=mx.cpu).item())


if __name__ == "__main__":
    sys.exit(main())
