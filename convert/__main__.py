"""`python -m convert` (from a checkout) / `mlx-mla-convert` (installed): the command line
over `convert.pipeline`."""

from __future__ import annotations

import argparse
import signal
import sys

from . import recipes
from .errors import ConvertError

INTERRUPTED = "error: interrupted; nothing was written to --mlx-path"


def build_parser() -> argparse.ArgumentParser:
    from mlx_mla.dtypes import DTYPES

    p = argparse.ArgumentParser(
        # a checkout runs it as `python -m convert`; the wheel installs it as mlx_mla_convert
        prog="python -m convert" if __package__ == "convert" else "mlx-mla-convert",
        description="Convert a DeepSeek-V2 (V2, V2-Lite, V2.5, Coder-V2) Hugging Face checkpoint "
        "to an MLX folder in mlx-lm's format, streaming one shard at a time.",
    )
    p.add_argument("--hf-path", "--model", required=True,
                   help="Local model folder or Hugging Face Hub id (e.g. deepseek-ai/DeepSeek-V2-Lite).")
    p.add_argument("--mlx-path", default="mlx_model", help="Folder to write (default: mlx_model).")
    p.add_argument("-q", "--quantize", action="store_true", help="Quantize the weights (mx.quantize).")
    p.add_argument("--q-bits", type=int, default=None,
                   help=f"Base bits per weight for --q-mode affine: "
                   f"{', '.join(map(str, recipes.SUPPORTED_BITS))} (default 4; the other modes fix it; "
                   "the mla recipe's default budget and --min-bits follow it).")
    p.add_argument("--q-group-size", type=int, default=None,
                   help=f"Group size for --q-mode affine: "
                   f"{', '.join(map(str, recipes.SUPPORTED_GROUP_SIZES))} (default 64; the other modes fix it).")
    p.add_argument("--q-mode", default="affine", choices=recipes.Q_MODES,
                   help="Quantization mode, as mlx_lm.convert: affine (default) or MLX's floating-point "
                   + ", ".join(f"{m} ({b}-bit, group {g})" for m, (b, g) in recipes.FIXED_MODES.items()) + ".")
    p.add_argument("--quant-recipe", default=None,
                   help="Which tensors get which bits: 'mla' (the default for --q-mode affine, "
                   "recommended: each module its own bits and group, from --min-bits to 8, where "
                   "measured KL says they buy the most, solved on this model's shapes within "
                   "--bits-per-weight; see README) or 'uniform' (--q-bits everywhere, like "
                   "mlx_lm.convert -q; the only recipe of the floating-point modes, and their default).")
    p.add_argument("--bits-per-weight", type=float, default=None,
                   help="mla recipe: the budget in bits per weight, float tensors included (default: "
                   "uniform --q-bits with a scale and bias per group + 0.1, i.e. 4.6 for 4-bit, group "
                   "64, bfloat16). Below the model's floor the floor is used, with a note.")
    p.add_argument("--min-bits", type=int, default=None,
                   help="mla recipe: the fewest bits any module may get (default: the next supported "
                   "width below --q-bits, e.g. 3 for 4, so the least sensitive tensors can pay for "
                   "the most sensitive ones; --min-bits 4 with --q-bits 4 keeps everything >= 4).")
    p.add_argument("--calibration-file", default=None,
                   help="mla recipe: a text file like the model's use; per-class sensitivities are "
                   "measured on this model with it (KL of next-token distributions; needs the float "
                   "model in memory) instead of the built-in ones measured on a small model.")
    p.add_argument("--calibration-tokens", type=int, default=None,
                   help="With --calibration-file: tokens of it to use, in whole windows of 256 "
                   "when longer than one (default 2048, or the whole file when shorter).")
    p.add_argument("--dtype", default=None,
                   help=f"Float type of unquantized tensors and scales: {', '.join(DTYPES)} "
                   "(default: config.json's torch_dtype).")
    p.add_argument("--upload-repo", default=None, help="Hugging Face repo to upload the result to.")
    p.add_argument("-d", "--dequantize", action="store_true", help="Dequantize an MLX-quantized model.")
    p.add_argument("--force", action="store_true", help="Replace an existing --mlx-path.")
    p.add_argument("--shard-size", default="5GB",
                   help="Largest output shard (default 5GB, as mlx-lm).")
    return p


_interrupted = []


def _on_signal(signum, frame):
    # Turn SIGINT/SIGTERM into an exception so the staged output folder is cleaned up, and
    # remember it: an import on mlx-lm's chain (transformers, torch) may swallow the
    # exception while it runs, and the import then completes as if nothing happened.
    _interrupted.append(signum)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    """Run the command; returns the exit status: 0, 1 (one ``error:`` line), 2 (a bad
    --shard-size), 130 when interrupted (Ctrl-C or SIGTERM) at any point, the imports of
    MLX and mlx-lm included."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130


def _run(argv) -> int:
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    import mlx_mla  # noqa: F401 - first: without an MLX backend this is one error line

    from . import writer
    from .pipeline import ConvertOptions, convert

    if _interrupted:
        raise KeyboardInterrupt

    args = build_parser().parse_args(argv)

    try:
        opts = ConvertOptions(
            hf_path=args.hf_path,
            mlx_path=args.mlx_path,
            quantize=args.quantize,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            quant_recipe=args.quant_recipe,
            q_mode=args.q_mode,
            dtype=args.dtype,
            upload_repo=args.upload_repo,
            dequantize=args.dequantize,
            force=args.force,
            max_shard_bytes=writer.parse_size(args.shard_size),
            bits_per_weight=args.bits_per_weight,
            calibration_file=args.calibration_file,
            calibration_tokens=args.calibration_tokens,
            min_bits=args.min_bits,
        )
        report = convert(opts)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # e.g. --shard-size
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # disk full, permissions, a bug: still one line, still no partial output
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: conversion failed ({type(e).__name__}: {reason}); nothing was written to "
              "--mlx-path", file=sys.stderr)
        return 1
    for line in report.calibration:
        print(line)
    for line in report.notes + report.precisions:
        print(f"[convert] {line}")
    mb = 1 << 20
    print(
        f"[convert] wrote {report.path} ({len(report.shards)} shard(s)): "
        f"{report.source_bytes / mb:.1f} MiB -> {report.output_bytes / mb:.1f} MiB, "
        f"{report.bits_per_weight:.3f} bits per weight"
    )
    if report.url:
        print(f"[convert] uploaded to {report.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
