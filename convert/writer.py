"""Writing an mlx-lm model folder: shards as they fill, atomically as a whole."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from .errors import ConvertError

MAX_SHARD_BYTES = 5 << 30  # mlx-lm's MAX_FILE_SIZE_GB
INDEX_NAME = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """'5GB', '200MB', '4096' -> bytes (binary units, as mlx-lm's 5 GB shards are 5 << 30).

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise ValueError(f"shard size {text!r} is not a size like 5GB or 500MB")
    return int(float(m[1]) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m[2]])


class ShardedWriter:
    """Accumulates evaluated tensors and writes a safetensors shard each time one fills.

    Shards follow mlx-lm's rule (a new shard when the next tensor would pass the limit; a
    tensor larger than the limit gets a shard of its own) and naming
    (`model.safetensors` alone, else `model-00001-of-0000N.safetensors`, fixed at `finish`
    since N is known only then). Each shard carries metadata {"format": "mlx"}.
    """

    def __init__(self, folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._pending = {}
        self._pending_bytes = 0
        self._parts = []  # (temporary file name, [tensor names])
        self.total_bytes = 0
        self.total_parameters = 0

    def add(self, name: str, array: mx.array, parameters: int | None = None) -> None:
        """Add one tensor; `parameters` is the float element count it stands for
        (mlx-lm counts a packed weight as the weights it encodes, scales/biases as 0)."""
        mx.eval(array)
        if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = array
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes
        self.total_parameters += array.size if parameters is None else parameters

    def _flush(self) -> None:
        part = f"part-{len(self._parts) + 1:05d}.safetensors"
        mx.save_safetensors(str(self.folder / part), self._pending, metadata={"format": "mlx"})
        self._parts.append((part, list(self._pending)))
        self._pending = {}
        self._pending_bytes = 0
        mx.clear_cache()  # hand the shard's buffers back to the OS, not to MLX's cache

    def finish(self) -> list:
        """Write the last shard, give shards their final names, write the index.

        Returns:
            the shard file names.
        """
        if self._pending or not self._parts:
            self._flush()
        n = len(self._parts)
        names = ["model.safetensors"] if n == 1 else [
            f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
        ]
        weight_map = {}
        for (part, tensors), final in zip(self._parts, names):
            os.replace(self.folder / part, self.folder / final)
            weight_map.update({t: final for t in tensors})
        index = {
            "metadata": {
                "total_size": self.total_bytes,
                "total_parameters": self.total_parameters,
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=4))
        return names

    @property
    def bits_per_weight(self) -> float:
        """Stored bits over parameters, as mlx-lm's compute_bits_per_weight counts them."""
        return self.total_bytes * 8 / max(self.total_parameters, 1)


def check_target(target: Path, force: bool, source: Path | None = None) -> None:
    """Refuse a target that exists (unless `force`) or that would overwrite the source.

    Raises:
        ConvertError: with the reason and the fix.
    """
    target = Path(target)
    if source is not None:
        t, s = target.resolve(), Path(source).resolve()
        if t == s or s in t.parents or t in s.parents:
            raise ConvertError(
                f"--mlx-path {target} overlaps the source folder {source}; choose another folder"
            )
    if target.exists() and not force:
        raise ConvertError(
            f"--mlx-path {target} already exists; pass --force to replace it or choose another path"
        )
    if target.exists() and not target.is_dir():
        raise ConvertError(f"--mlx-path {target} is a file; choose a folder path")


@contextlib.contextmanager
def staged_output(target: Path, force: bool = False):
    """Yield a temporary folder beside `target`; rename it to `target` on success.

    On any exception (including KeyboardInterrupt) the temporary folder, and any parent
    folders created for it, are removed, so no partial target is ever visible. With
    `force` an existing target is replaced only after the new one is complete.
    """
    target = Path(target).absolute()
    check_target(target, force)
    created = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the published folder private
    try:
        yield tmp
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # innermost first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
