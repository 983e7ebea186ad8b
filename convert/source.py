"""Finding, validating and lazily reading a source checkpoint.

Everything that can be checked without reading tensor data is checked up front (config,
index, every shard's header and length), so a bad checkpoint fails before any output
exists.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlx_mla.config import read_config_file

from .errors import ConvertError

# The Hub id of a model: "owner/name" (no leading dot or slash, no path separators beyond one).
_HUB_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")


# What a snapshot of a Hub repo needs for conversion (weights, config, tokenizer, card).
HUB_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
    "README.md",
]


def snapshot_download(repo_id: str, **kwargs) -> str:
    """Indirection over `huggingface_hub.snapshot_download` so tests can fake the Hub."""
    from huggingface_hub import snapshot_download as _download

    return _download(repo_id, **kwargs)


@dataclass
class TensorInfo:
    """A tensor's header entry: dtype string as safetensors writes it, and shape."""

    dtype: str
    shape: tuple


@dataclass
class Shard:
    """One source safetensors file and the header entries of its tensors."""

    path: Path
    tensors: dict = field(default_factory=dict)  # name -> TensorInfo

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


def resolve(hf_path: str) -> tuple:
    """Map `--hf-path` to a local folder.

    Returns:
        (Path, hub_id or None).
    Raises:
        ConvertError: the path is neither an existing folder nor a Hub id, or the download
            failed.
    """
    local = Path(hf_path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ConvertError(f"--hf-path {hf_path} is a file; give the model's folder")
        return local, None
    if not _HUB_ID.match(hf_path):
        raise ConvertError(
            f"--hf-path {hf_path} is not an existing folder nor a Hub id like 'deepseek-ai/DeepSeek-V2-Lite'"
        )
    try:
        folder = snapshot_download(hf_path, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConvertError(
            f"could not download {hf_path} from the Hugging Face Hub ({first}); "
            "check the id, your network and `hf auth login`, or pass a local folder"
        ) from e
    return Path(folder), hf_path


def read_config(folder: Path) -> dict:
    """config.json (plus generation_config.json's eos_token_id), with model_type checked.

    Raises:
        ConvertError: missing or unreadable config, or a model_type outside DeepSeek-V2.
    """
    try:
        config = read_config_file(folder)
    except ValueError as e:
        raise ConvertError(str(e)) from e
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        if eos:
            config["eos_token_id"] = eos
    return config


def read_header(path: Path) -> dict:
    """Parse a safetensors header and check the file holds all the data it declares.

    Returns:
        {name: TensorInfo} in file order (the `__metadata__` entry dropped).
    Raises:
        ConvertError: unreadable header, or a file shorter than its header says (truncated).
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header length exceeds the file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ConvertError(
            f"{path.name} is not a readable safetensors file ({e}); re-download it"
        ) from e
    header.pop("__metadata__", None)
    end = max((e["data_offsets"][1] for e in header.values()), default=0)
    if size < 8 + n + end:
        raise ConvertError(
            f"{path.name} is truncated ({size} bytes, its header needs {8 + n + end}); re-download it"
        )
    return {k: TensorInfo(v["dtype"], tuple(v["shape"])) for k, v in header.items()}


def shard_files(folder: Path) -> list:
    """The weight files, from model.safetensors.index.json when there is one.

    Raises:
        ConvertError: an index entry names a missing file, or there are no weights.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConvertError(f"{index} is not a valid safetensors index ({e})") from e
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:
            if not (folder / name).is_file():
                raise ConvertError(
                    f"{name} is listed in {index.name} but missing from {folder}; "
                    "re-download the checkpoint"
                )
        return [folder / n for n in names]
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise ConvertError(f"no model*.safetensors in {folder}")
    return files


def open_source(hf_path: str) -> Source:
    """Resolve, read and validate a source checkpoint (no tensor data is read).

    Raises:
        ConvertError: see `resolve`, `read_config`, `shard_files`, `read_header`; also a
            tensor that appears in two shards, or an index that disagrees with the shards.
    """
    folder, hub_id = resolve(hf_path)
    config = read_config(folder)
    shards = []
    seen = {}
    for path in shard_files(folder):
        shard = Shard(path, read_header(path))
        for name in shard.tensors:
            if name in seen:
                raise ConvertError(f"{name} is in both {seen[name]} and {path.name}")
            seen[name] = path.name
        shards.append(shard)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        listed = set(json.loads(index.read_text())["weight_map"])
        missing = sorted(listed - set(seen))
        if missing:
            raise ConvertError(
                f"{len(missing)} tensors listed in {index.name} are not in the shards "
                f"(first: {missing[0]}); re-download the checkpoint"
            )
    return Source(folder, hub_id, config, shards)
