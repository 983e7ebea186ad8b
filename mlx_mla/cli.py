"""What the commands (``generate``, ``compare``, ``chat``, ``server``) share: argument checks
made before any model is loaded, their one-line error exit, and a quiet exit when the reader
of their output goes away."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, Optional


def str2bool(text: str) -> bool:
    """A command-line boolean: true/t/yes/y/on/1 or false/f/no/n/off/0 (any case).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints it as a usage error).
    """
    value = text.strip().lower()
    if value in ("true", "t", "yes", "y", "on", "1"):
        return True
    if value in ("false", "f", "no", "n", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(
        f"expected true or false (or yes/no, on/off, 1/0), got {text!r}")


def sampling_error(temp: float, top_p: float, min_p: float,
                   seed: Optional[int] = None) -> Optional[str]:
    """Why mlx-lm's sampler cannot take these settings, or None when it can: ``temp`` ≥ 0
    (0 = greedy), ``top_p`` in (0, 1] (1 = off), ``min_p`` in [0, 1] (0 = off), ``seed``
    None or an unsigned 64-bit integer (``mx.random.seed``)."""
    if seed is not None and not 0 <= seed < 2**64:
        return f"--seed must be in [0, 2**64), got {seed}"
    if not temp >= 0:
        return f"--temp must be 0 (greedy) or more, got {temp}"
    if not 0 < top_p <= 1:
        return f"--top-p must be in (0, 1] (1 = off), got {top_p}"
    if not 0 <= min_p <= 1:
        return f"--min-p must be in [0, 1] (0 = off), got {min_p}"
    return None


def context_error(prompt_tokens: int, max_tokens: int, limit: int) -> Optional[str]:
    """Why ``prompt_tokens`` + ``max_tokens`` cannot be generated within a context of
    ``limit`` positions (config.json's ``max_position_embeddings``), or None."""
    if prompt_tokens + max_tokens > limit:
        return (f"prompt ({prompt_tokens} tokens) + --max-tokens ({max_tokens}) exceeds the "
                f"model's context of {limit} tokens: shorten the prompt or lower --max-tokens")
    return None


def fail(message: str) -> int:
    """Print ``error: MESSAGE`` (one line) on stderr; returns 1, the exit status."""
    print(f"error: {message}", file=sys.stderr)
    return 1


# The exit status of a process ended by SIGPIPE in a shell (128 + 13), as `yes | head` gives.
BROKEN_PIPE_STATUS = 141


def quiet_on_broken_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command's ``main`` so that output piped into a reader that closes early
    (``… | head -2``) ends it quietly with status 141, without a ``BrokenPipeError``.

    stdout is pointed at /dev/null first, so that the interpreter's final flush of the
    dead pipe does not print "Exception ignored ..." (the recipe in Python's ``signal``
    documentation, "Note on SIGPIPE")."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()  # here, not at exit, where a broken pipe cannot be caught
            return status
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError):  # stdout without a file descriptor (a test's capture)
                pass
            return BROKEN_PIPE_STATUS

    return wrapper


__all__ = ["str2bool", "sampling_error", "context_error", "fail", "quiet_on_broken_pipe",
           "BROKEN_PIPE_STATUS"]
