"""``python -m mlx_mla.compare``: mlx_mla against stock mlx-lm on one model folder.

Loads the folder with mlx-lm (``deepseek_v2``, the reference; ``peer``) and with mlx_mla
(each requested strategy), one engine at a time, and runs both on the same tokens
(``measure``):

1. **Generation.** ``mlx_lm.generate.stream_generate`` with a greedy sampler drives each
   engine (mlx_mla's latent cache plugs into the same loop). Its responses give prompt
   tok/s, generation tok/s and peak memory; the cache it filled gives bytes per token.
   Greedy agreement = the generated tokens are identical; the first differing one is named.
2. **Logits.** Both engines are then teacher-forced over the *same* sequence — the prompt
   plus mlx-lm's greedy tokens — as one prefill call for the prompt and one decode call per
   generated token (so prefill and decode paths of every strategy are both checked). Per
   position: max |Δlogit| and KL(mlx-lm ‖ mlx_mla) in float32.

Each strategy then gets a verdict against a stated threshold (``judge``), printed as a
table and optionally written as JSON (``report``). Exit status: 0 when every strategy is
within the threshold, 1 when one is not, 2 on a usage or load error.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx

from ..cli import context_error, quiet_on_broken_pipe
from .judge import THRESHOLDS, Threshold, Verdict, judge, logit_stats, threshold_for
from .measure import Run, greedy_run, teacher_forced_logits
from .peer import load_peer, peer_config_adjustments
from . import report

DEFAULT_PROMPT = "ROMEO:"


def build_parser() -> argparse.ArgumentParser:
    from .. import DEMO_MODEL, STRATEGIES
    from ..dtypes import DTYPES

    p = argparse.ArgumentParser(
        prog="python -m mlx_mla.compare",
        description="Check mlx_mla against stock mlx-lm (deepseek_v2) on one model folder: "
                    "logit agreement, greedy agreement, speed, peak memory, cache bytes per token. "
                    "Exit 0 = agree within the printed threshold, 1 = disagree, 2 = error.",
    )
    p.add_argument("--model", default=str(DEMO_MODEL),
                   help="model folder (Hugging Face or mlx-lm layout); default: the bundled demo model")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"prompt text (default {DEFAULT_PROMPT!r})")
    src.add_argument("--text-file", type=Path, help="read the prompt from this file")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="truncate the encoded prompt to this many tokens (default 512)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--mla-strategy", nargs="+", default=list(STRATEGIES),
                   choices=list(STRATEGIES), metavar="S",
                   help=f"mlx_mla strategies to compare (default: all of {', '.join(STRATEGIES)})")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="activation dtype for both engines (default: mlx_mla's, float32 on CPU)")
    p.add_argument("--max-logit-diff", type=float, help="override the max |Δlogit| threshold")
    p.add_argument("--max-kl", type=float, help="override the mean KL threshold")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    return p


def input_error(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the arguments themselves (no model needed), or None."""
    if args.max_tokens < 1:
        return f"--max-tokens must be at least 1, got {args.max_tokens}"
    if args.max_prompt_tokens < 1:
        return f"--max-prompt-tokens must be at least 1, got {args.max_prompt_tokens}"
    for flag, value in (("--max-logit-diff", args.max_logit_diff), ("--max-kl", args.max_kl)):
        if value is not None and not value >= 0:
            return f"{flag} must be 0 or more, got {value}"
    if args.text_file is not None and not args.text_file.is_file():
        return f"--text-file {args.text_file} does not exist or is not a file"
    if args.json is not None:
        folder = args.json.parent
        if args.json.is_dir():
            return f"--json {args.json} is a folder: name the file to write"
        if not folder.is_dir():
            return f"--json {args.json}: folder {folder} does not exist; create it first"
        if not os.access(folder, os.W_OK):
            return f"--json {args.json}: folder {folder} is not writable"
    return None


@quiet_on_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (0 agree, 1 disagree, 2 usage or load error,
    with one ``error:`` line; 141 when the reader of stdout closes it early). Every input
    is checked before any model is loaded: the arguments, the folder, the backend/dtype
    pair (``mlx_mla.loader.open_folder``, as ``mlx_mla.load`` checks it), and prompt +
    ``--max-tokens`` against the model's context."""
    args = build_parser().parse_args(argv)
    from .. import load as mla_load
    from ..checkpoint import ModelLoadError
    from ..dtypes import dtype_name
    from ..loader import load_tokenizer, open_folder

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    problem = input_error(args)
    if problem:
        return fail(problem)
    if args.text_file is not None:
        try:
            text = args.text_file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            return fail(f"cannot read --text-file {args.text_file} ({e}): pass a UTF-8 text file")
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    try:
        path, config, model_args, dtype = open_folder(args.model, args.dtype)
        tokenizer = load_tokenizer(path, config)
    except ModelLoadError as e:
        return fail(str(e))
    prompt = list(tokenizer.encode(text))[: args.max_prompt_tokens]
    if not prompt:
        return fail("the prompt encodes to no tokens")
    problem = context_error(len(prompt), args.max_tokens, model_args.max_position_embeddings)
    if problem:
        return fail(problem)
    quantized = bool(config.get("quantization"))
    import mlx_lm

    # Reference first, then free it, so each engine's peak memory holds only its weights.
    try:
        peer, _, notes = load_peer(path, dtype, config)
    except Exception as e:  # noqa: BLE001 - any failure of the peer is one error line
        return fail(f"mlx-lm could not load {path} ({type(e).__name__}: {e})")

    print(f"model: {path} ({config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
          f"{'quantized' if quantized else 'unquantized'}; activations {dtype_name(dtype)}; "
          f"backend {'cpu' if mx.default_device() == mx.cpu else 'gpu'})")
    print(f"reference: mlx-lm {mlx_lm.__version__} deepseek_v2 (stock mlx_lm.load)")
    for n in notes or ["nothing"]:
        print(f"adjusted for mlx-lm: {n}")

    ref = greedy_run("mlx-lm deepseek_v2", peer, tokenizer, prompt, args.max_tokens)
    ref_logits = teacher_forced_logits(peer, prompt, ref.tokens)
    del peer
    gc.collect()
    mx.clear_cache()
    print(f"tokens: {len(prompt)} prompt + {len(ref.tokens)} generated (greedy); logits compared "
          f"teacher-forced at {ref_logits.shape[0]} positions (prefill + one decode call per token)")

    try:
        model, _ = mla_load(path, mla_strategy=args.mla_strategy[0], dtype=dtype)
    except ModelLoadError as e:
        return fail(str(e))
    override = (args.max_logit_diff, args.max_kl)
    runs: List[Run] = []
    verdicts: List[Verdict] = []
    thresholds = {}
    for strategy in args.mla_strategy:
        model.set_mla_strategy(strategy)
        run = greedy_run(f"mlx_mla {strategy}", model, tokenizer, prompt, args.max_tokens)
        ours_logits = teacher_forced_logits(model, prompt, ref.tokens)
        thresholds[strategy] = threshold_for(dtype_name(dtype), override)
        verdicts.append(judge(run, ref, ref_logits, ours_logits, len(prompt), thresholds[strategy]))
        runs.append(run)

    lines = report.threshold_lines(thresholds) + [""]
    lines += report.table_lines(ref, runs, verdicts) + [""]
    for run, v in zip(runs, verdicts):
        if not v.passed:
            lines += report.failure_lines(run, v, ref, prompt, tokenizer)
    lines.append(f"mlx-lm continuation: {report.quoted(tokenizer, ref.tokens)}")
    lines.append(report.summary_line(verdicts))
    print("\n".join(lines))
    if args.json is not None:
        header = {"model": str(path), "dtype": dtype_name(dtype), "quantized": quantized,
                  "mlx_lm_version": mlx_lm.__version__, "adjustments": notes,
                  "prompt_tokens": prompt}
        args.json.write_text(report.as_json(header, ref, runs, verdicts, thresholds))
    return 0 if all(v.passed for v in verdicts) else 1


__all__ = ["main", "build_parser", "judge", "threshold_for", "logit_stats", "Threshold",
           "Verdict", "Run", "THRESHOLDS", "peer_config_adjustments",
           "load_peer", "greedy_run", "teacher_forced_logits"]
