"""A model folder on disk: where it is, its config.json, and weight files that are whole.

The loader (``mlx_mla.load``) and the converter (``python -m convert``) both start here, so
a local path or Hub id is resolved by one rule, and a bad folder fails with the same one-line
message, before any tensor data is read:

- ``resolve``: an existing local folder, or a Hub repo id (``owner/name``) fetched with
  ``huggingface_hub.snapshot_download``;
- ``read_config``: config.json, checked to be a DeepSeek-V2-family model;
- ``weight_files``: the safetensors files, in the order the index names them, none missing;
- ``read_header``: one file's safetensors header, each tensor's byte range checked against
  its dtype and shape and against the file's length;
- ``check_tokenizer``: the files a tokenizer is built from are there.

Every error is a ``ModelLoadError`` (a ``ValueError``) whose message names the file and says
what to do.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .config import check_model_type

# A Hub repo id: "owner/name", no leading dot or slash, one separator.
HUB_ID = re.compile(r"^[\w\-][\w.\-]*/[\w.\-]+$")
# What a snapshot needs: weights, config, tokenizer files, the card (for its license), and
# remote code files, which the converter copies along.
HUB_ALLOW_PATTERNS = [
    "*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt",
    "*.jinja", "README.md",
]
INDEX_NAME = "model.safetensors.index.json"
# Bytes per element of each safetensors dtype (the format's specification).
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
# What a tokenizer is built from (transformers' AutoTokenizer): a fast tokenizer's
# tokenizer.json, a sentencepiece tokenizer.model, tiktoken files, or a BPE vocab.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "*.tiktoken", "vocab.json")


class ModelLoadError(ValueError):
    """A model folder or repo that cannot be read; the message says why and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's safetensors header entry: dtype as written (e.g. "BF16", "U32") and shape."""

    dtype: str
    shape: tuple


def resolve(path_or_repo: str, revision: Optional[str] = None,
            allow_patterns: Optional[List[str]] = None) -> Tuple[Path, Optional[str]]:
    """A local folder as is; a Hub repo id downloaded (the files ``allow_patterns`` match,
    default ``HUB_ALLOW_PATTERNS``; a sharded load fetches only a rank's weight files).

    Returns:
        (local folder, the Hub id it came from or None).
    Raises:
        ModelLoadError: a path that is a file, a local-looking path that does not exist, or
            a failed download.
    """
    text = str(path_or_repo)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(
                f"{path} is a file, not a model folder: pass the folder that holds config.json"
            )
        return path, None
    if not HUB_ID.match(text):
        raise ModelLoadError(
            f"model folder {text} does not exist: check the path, or pass a Hub repo id "
            f"such as deepseek-ai/DeepSeek-V2-Lite"
        )
    import huggingface_hub  # looked up at call time, so tests can fake the Hub

    try:
        folder = huggingface_hub.snapshot_download(
            text, revision=revision, allow_patterns=allow_patterns or HUB_ALLOW_PATTERNS
        )
    except Exception as e:  # network, auth, 404: all end the same way for the user
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"could not download {text} from the Hugging Face Hub ({reason}): check the "
            f"repo id, your network and `hf auth login`, or pass a local folder"
        ) from e
    return Path(folder), text


def read_config(folder: Path) -> Dict[str, Any]:
    """config.json of a model folder, with ``model_type`` checked to be DeepSeek-V2's.

    Raises:
        ModelLoadError: no config.json, invalid JSON, or a model_type outside the family.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json: pass a Hugging Face or mlx-lm model folder"
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}): restore the file") from e
    try:
        check_model_type(config.get("model_type"))
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return config


def weight_files(folder: Path) -> List[Path]:
    """The folder's safetensors files: in the order model.safetensors.index.json names them
    when there is one, else every ``model*.safetensors``.

    Raises:
        ModelLoadError: no weights, an unreadable index, or a file the index lists missing.
    """
    folder = Path(folder)
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{folder} has no model*.safetensors weights: download the weights too, or "
            f"convert the checkpoint with `python -m convert`"
        )
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(
                f"{index} is not a valid safetensors index ({e}): fetch the model again"
            ) from e
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:
            if not (folder / name).is_file():
                raise ModelLoadError(
                    f"{folder} is missing weight shard {name}, listed in {INDEX_NAME}: "
                    f"the download is incomplete; fetch it again"
                )
        return [folder / n for n in names]
    return files


def read_header(path: Path) -> Dict[str, TensorInfo]:
    """Parse a safetensors header and check that the file holds all the data it declares:
    each tensor's ``data_offsets`` span exactly prod(shape) × its dtype's size, inside the
    file (what ``mx.load`` would otherwise refuse mid-load with "invalid data offsets").

    Returns:
        {tensor name: TensorInfo} in file order (the ``__metadata__`` entry dropped).
    Raises:
        ModelLoadError: an unreadable header, an unknown dtype, a tensor whose byte range
            does not fit its shape, or a file shorter than its header says.
    """
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header length exceeds the file")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        infos = {k: TensorInfo(v["dtype"], tuple(v["shape"])) for k, v in header.items()}
        for name, entry in header.items():
            _check_offsets(name, entry)
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError,
            AttributeError) as e:
        raise ModelLoadError(
            f"{path.name} is not a readable safetensors file ({e}): re-download it"
        ) from e
    if size < 8 + n + end:
        raise ModelLoadError(
            f"{path.name} is truncated ({size} bytes, its header needs {8 + n + end}): "
            f"re-download it"
        )
    return infos


def _check_offsets(name: str, entry: dict) -> None:
    """Raises ValueError unless ``entry``'s data_offsets span exactly its shape's bytes."""
    if entry["dtype"] not in DTYPE_SIZES:
        raise ValueError(f"tensor {name!r} has unknown dtype {entry['dtype']!r}")
    begin, end = entry["data_offsets"]
    need = math.prod(entry["shape"]) * DTYPE_SIZES[entry["dtype"]]
    if not 0 <= begin <= end or end - begin != need:
        raise ValueError(f"tensor {name!r} has data offsets ({begin}, {end}), its shape "
                         f"{list(entry['shape'])} of {entry['dtype']} needs {need} bytes")


def check_weights(folder: Path) -> Dict[Path, Dict[str, TensorInfo]]:
    """Every weight file of ``folder`` with its header, each checked whole.

    Raises:
        ModelLoadError: see ``weight_files`` and ``read_header``; also a tensor stored in
            two files.
    """
    headers, seen = {}, {}
    for path in weight_files(folder):
        headers[path] = read_header(path)
        for name in headers[path]:
            if name in seen:
                raise ModelLoadError(
                    f"{name} is in both {seen[name]} and {path.name}: fetch the model again"
                )
            seen[name] = path.name
    return headers


def check_tokenizer(folder: Path) -> None:
    """Check that ``folder`` has the files a tokenizer is built from (``TOKENIZER_FILES``).

    Raises:
        ModelLoadError: none of them is there.
    """
    folder = Path(folder)
    if not any(next(folder.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): copy "
            f"them from the original checkpoint into the folder"
        )


__all__ = ["ModelLoadError", "TensorInfo", "HUB_ID", "HUB_ALLOW_PATTERNS", "DTYPE_SIZES",
           "TOKENIZER_FILES", "resolve", "read_config", "weight_files", "read_header",
           "check_weights", "check_tokenizer"]
