"""What the tests read, all inside the repository (a clone has nothing beside it).

- The demo checkpoint shipped in the package (``mlx_mla.DEMO_MODEL``): the shared fixture
  tiny-dsv2-lite-shakespeare, byte for byte, without its chat template.
- ``data/chat_template.jinja``: that fixture's chat template, so ``make_hub_fixture`` can
  rebuild the fixture exactly (weights, tokenizer and template).
- ``data/shakespeare-heldout-excerpt.txt``: the first 16 KB of the held-out corpus (never
  trained on), for the quality checks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mlx_mla import DEMO_MODEL

DATA = Path(__file__).resolve().parent / "data"
CHAT_TEMPLATE = DATA / "chat_template.jinja"
CORPUS = DATA / "shakespeare-heldout-excerpt.txt"
# "ROMEO:" plus a few ids: enough positions to exercise attention and the MoE routing.
TOKENS = [0, 836, 27, 10, 79, 11, 300, 45, 1200, 7, 99, 512]
# The demo checkpoint's float32 greedy continuation of "ROMEO:" (ids [0, 836, 27]), as the
# fixture's data sheet records it for transformers and mlx-lm alike
# (test_model.test_greedy_64_tokens_identical_to_transformers checks our greedy tokens
# against transformers' generate on the same weights).
KNOWN_ROMEO = "\nO, I am in brief with a tale language.\n\nBENVOLIO:\nO, I am cried.\n\nMERCUTIO:"


def make_hub_fixture(dst: Path, read_only: bool = True) -> Path:
    """The shared fixture in Hub layout at ``dst``: the demo checkpoint plus its chat template.

    ``read_only`` makes every file 0444, as the shared fixture is, so a test that writes to
    its source fails.
    """
    shutil.copytree(DEMO_MODEL, dst)
    tok_cfg = dst / "tokenizer_config.json"
    cfg = json.loads(tok_cfg.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE.read_text()
    tok_cfg.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    for p in dst.iterdir():
        p.chmod(0o444 if read_only else 0o644)
    return dst


def writable_copy(src: Path, dst: Path) -> Path:
    """A copy of a model folder whose files can be changed or deleted."""
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def corrupt_offsets(shard: Path) -> None:
    """Make the first tensor of a safetensors file claim 2 bytes fewer than its shape needs
    (header rewritten in place, same length): the corruption ``mx.load`` reports as
    "invalid data offsets" mid-load."""
    import struct

    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end - 2]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(data[:8] + text.ljust(n) + data[8 + n:])
