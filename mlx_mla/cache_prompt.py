"""``python -m mlx_mla.cache_prompt``: mlx-lm's cache_prompt on an MLA latent cache.

Processes a prompt once and saves its latent cache to a file that
``python -m mlx_mla.generate --prompt-cache-file`` (and mlx-lm's ``load_prompt_cache``)
reuses. The flags are mlx-lm's own (``mlx_lm.cache_prompt.setup_arg_parser``: --model,
--prompt, --prompt-cache-file, --max-kv-size, --kv-bits, --kv-group-size,
--quantized-kv-start, --eos-token, --trust-remote-code) plus --mla-strategy and --dtype; the
prompt is processed by mlx-lm's ``generate_step`` and saved by its ``save_prompt_cache``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

from . import DEMO_MODEL
from .attention import STRATEGIES
from .cache import quantized_codec
from .cache.files import metadata_for
from .checkpoint import ModelLoadError
from .cli import fail
from .dtypes import DTYPES
from .loader import load


def build_parser() -> argparse.ArgumentParser:
    from mlx_lm.cache_prompt import setup_arg_parser

    p = setup_arg_parser()
    p.prog = "python -m mlx_mla.cache_prompt"
    p.description = ("Process a prompt once with a DeepSeek-V2-family model and save its MLA "
                     "latent cache, for python -m mlx_mla.generate --prompt-cache-file.")
    p.set_defaults(model=None)
    for action in p._actions:  # mlx-lm's help names its own default model folder
        if action.dest == "model":
            action.help = ("local folder or Hub repo id (default: the demo checkpoint shipped "
                           "with mlx-mla)")
    p.add_argument("--mla-strategy", default="auto",
                   help=f"MLA strategy: {', '.join(STRATEGIES)} (default: auto)")
    p.add_argument("--dtype", default=None, help=f"activation dtype: {', '.join(DTYPES)}")
    return p


def output_path(name: str) -> Path:
    """The file ``save_prompt_cache`` will write for --prompt-cache-file ``name``: MLX adds
    ``.safetensors`` when the name lacks it.

    Raises:
        ValueError: the name is a folder, or its folder does not exist (checked before any
            work, so a long prompt is not processed for nothing).
    """
    path = Path(name)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    if Path(name).is_dir() or path.is_dir():
        raise ValueError(f"--prompt-cache-file {name} is a folder: name a file in it, e.g. "
                         f"{Path(name) / 'prompt.safetensors'}")
    if not path.parent.is_dir():
        raise ValueError(f"--prompt-cache-file {name}: the folder {path.parent} does not exist")
    return path


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; returns the exit status (0, or 1 with one ``error:`` line on stderr)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import save_prompt_cache

    args = build_parser().parse_args(argv)
    if args.adapter_path is not None:
        return fail("--adapter-path is not supported by mlx-mla: fuse the adapter first "
                    "(mlx_lm.fuse) and pass the fused folder as --model")
    tokenizer_config = {"trust_remote_code": args.trust_remote_code}
    if args.eos_token is not None:
        tokenizer_config["eos_token"] = args.eos_token
    model_path = args.model or str(DEMO_MODEL)
    try:
        out_file = output_path(args.prompt_cache_file)
        model, tokenizer = load(model_path, args.mla_strategy, args.dtype)
        if args.kv_bits is not None:
            quantized_codec(args.kv_group_size, args.kv_bits, model.args.kv_lora_rank)
        cache = model.make_cache(args.max_kv_size)
    except (ModelLoadError, ValueError) as e:
        return fail(str(e))
    if args.eos_token is not None:
        tokenizer.add_eos_token(args.eos_token)

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if tokenizer.has_chat_template:  # as mlx-lm: the prompt is the start of a user message
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=False,
            continue_final_message=True)
    else:
        prompt = tokenizer.encode(text)
    if len(prompt) > model.args.max_position_embeddings:
        return fail(f"the prompt ({len(prompt)} tokens) exceeds the model's context of "
                    f"{model.args.max_position_embeddings} tokens: shorten it")

    start = time.perf_counter()

    def progress(processed, total):
        speed = processed / max(time.perf_counter() - start, 1e-9)
        print(f"\rProcessed {processed:6d} tokens ({speed:6.2f} tok/s)", end="", flush=True)

    for _ in generate_step(mx.array(prompt), model, max_tokens=0, prompt_cache=cache,
                           kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                           quantized_kv_start=args.quantized_kv_start,
                           prompt_progress_callback=progress):
        pass
    print()
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    save_prompt_cache(str(out_file), cache, metadata_for(model_path, tokenizer_config))
    print(f"Saved the latent cache of {cache[0].offset} tokens to {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
