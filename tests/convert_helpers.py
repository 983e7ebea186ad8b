"""Shared helpers for the converter's tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx

from mlx_mla.dtypes import cast_floating
from testdata import TOKENS


def run_cli(*argv) -> int:
    """Run `python -m convert` in-process with progress bars off; returns the exit code."""
    from convert.__main__ import main

    return main([*map(str, argv)])


def tree_digest(folder: Path) -> dict:
    """{relative path: sha256} of every file, to prove a folder was not modified."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


def load_tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(Path(folder).glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def index(folder: Path) -> dict:
    return json.loads((Path(folder) / "model.safetensors.index.json").read_text())


def config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def to_float32(model):
    return cast_floating(model, mx.float32)


def logits(model) -> mx.array:
    out = model(mx.array([TOKENS], dtype=mx.int32)).astype(mx.float32)
    mx.eval(out)
    return out


def leftovers(parent: Path, name: str) -> list:
    """Staging folders the converter might have left beside `name`."""
    return [p.name for p in Path(parent).iterdir() if p.name.startswith(f".{name}.")]
