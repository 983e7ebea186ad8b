"""Opening a source checkpoint: the folder checks of ``mlx_mla.checkpoint``, then lazy shards.

Everything that can be checked without reading tensor data is checked up front (config,
index, every shard's header and length), so a bad checkpoint fails before any output
exists.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlx_mla import checkpoint
from mlx_mla.checkpoint import ModelLoadError

from .errors import ConvertError


@contextlib.contextmanager
def as_convert_error():
    """Re-raise the checkpoint module's one-line errors as the converter's own type."""
    try:
        yield
    except ModelLoadError as e:
        raise ConvertError(str(e)) from e


@dataclass
class Shard:
    """One source safetensors file and the header entries of its tensors."""

    path: Path
    tensors: dict = field(default_factory=dict)  # name -> checkpoint.TensorInfo

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size

    def load(self) -> dict:
        """The shard's tensors as lazy `mx.array`s: data is read when each is evaluated."""
        try:
            return mx.load(str(self.path))
        except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
            raise ConvertError(f"cannot read {self.path}: {e}; re-download the checkpoint") from e


@dataclass
class Source:
    """A validated source checkpoint.

    Attributes:
        path: the local folder.
        hub_id: the Hub repo id it came from, or None for a local folder.
        config: config.json as a dict, with generation_config.json's eos_token_id merged in
            (as mlx-lm does, so the output config matches mlx-lm's).
        shards: the safetensors files in index order.
    """

    path: Path
    hub_id: str | None
    config: dict
    shards: list

    @property
    def tensor_names(self) -> list:
        return [n for s in self.shards for n in s.tensors]

    @property
    def is_quantized(self) -> bool:
        return "quantization" in self.config


def _merge_generation_eos(folder: Path, config: dict) -> dict:
    """generation_config.json's eos_token_id wins over config.json's, as in mlx-lm's convert."""
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        if eos:
            config["eos_token_id"] = eos
    return config


def open_source(hf_path: str) -> Source:
    """Resolve, read and validate a source checkpoint (no tensor data is read).

    Raises:
        ConvertError: anything ``mlx_mla.checkpoint`` refuses (missing folder, failed
            download, config, missing or truncated shards, a tensor in two shards), or an
            index that lists tensors the shards do not hold.
    """
    with as_convert_error():
        folder, hub_id = checkpoint.resolve(hf_path)
        config = _merge_generation_eos(folder, checkpoint.read_config(folder))
        headers = checkpoint.check_weights(folder)
    shards = [Shard(path, tensors) for path, tensors in headers.items()]
    index = folder / checkpoint.INDEX_NAME
    if index.is_file():
        listed = set(json.loads(index.read_text())["weight_map"])
        missing = sorted(listed - {n for s in shards for n in s.tensors})
        if missing:
            raise ConvertError(
                f"{len(missing)} tensors listed in {index.name} are not in the shards "
                f"(first: {missing[0]}); re-download the checkpoint"
            )
    return Source(folder, hub_id, config, shards)
