"""From Hugging Face tensor names to mlx-lm's deepseek_v2 layout.

The target layout is whatever stock `mlx_lm.load` builds for this config, so we ask
mlx-lm's own model class for it (built lazily: no weights are allocated). The only
structural change is stacking routed experts into `switch_mlp`; `kv_b_proj` stays whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from .errors import ConvertError

_EXPERT = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight|scales|biases)$"
)
_QUANT_PARTS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class Layout:
    """The parameters mlx-lm's deepseek_v2 model expects for a config.

    Attributes:
        shapes: {name: shape} of every float parameter (experts stacked: (E, out, in)).
        quantizable: module paths that have `to_quantized` in mlx-lm (Linear, Embedding,
            SwitchLinear); the router gate and norms are not among them.
        n_experts: routed experts per MoE layer (0 if none).
    """

    shapes: dict
    quantizable: frozenset
    n_experts: int

    @classmethod
    def for_config(cls, config: dict) -> "Layout":
        from mlx_lm.models import deepseek_v2

        model = deepseek_v2.Model(deepseek_v2.ModelArgs.from_dict(config))
        shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
        quantizable = frozenset(
            p for p, m in model.named_modules() if hasattr(m, "to_quantized") and p
        )
        return cls(shapes, quantizable, config.get("n_routed_experts") or 0)


def target_name(name: str) -> str:
    """The mlx-lm name a source tensor ends up under (experts map to their stack)."""
    m = _EXPERT.match(name)
    if m:
        return f"{m['prefix']}.switch_mlp.{m['proj']}.{m['kind']}"
    return name


def check_names(layout: Layout, source_tensors: dict) -> None:
    """Check the source holds exactly the parameters mlx-lm's model expects.

    Args:
        source_tensors: {name: TensorInfo} over all shards.
    Raises:
        ConvertError: a missing or unexpected tensor, a wrong shape or an incomplete
            set of experts, naming the first offender.
    """
    found = {}
    for name, info in source_tensors.items():
        tgt = target_name(name)
        module, _, part = tgt.rpartition(".")
        if part in ("scales", "biases"):
            continue
        found.setdefault(tgt, []).append((name, info))
    missing = sorted(set(layout.shapes) - set(found))
    extra = sorted(set(found) - set(layout.shapes))
    if missing:
        raise ConvertError(
            f"the checkpoint lacks {len(missing)} tensors this config needs (first: {missing[0]}); "
            "is config.json the one these weights were saved with?"
        )
    if extra:
        raise ConvertError(
            f"the checkpoint has {len(extra)} tensors DeepSeek-V2 does not use (first: {extra[0]})"
        )
    for tgt, entries in found.items():
        want = layout.shapes[tgt]
        if _EXPERT.match(entries[0][0]):
            experts = sorted(int(_EXPERT.match(n)["e"]) for n, _ in entries)
            if experts != list(range(want[0])):
                raise ConvertError(
                    f"{tgt}: the checkpoint has experts {experts[:3]}...{experts[-1]} "
                    f"({len(experts)}), the config says {want[0]}"
                )
            want = want[1:]
        info = entries[0][1]
        if info.dtype in ("U32", "U8"):
            continue  # packed quantized weight: shape checked when dequantizing
        if tuple(info.shape) != tuple(want):
            raise ConvertError(f"{entries[0][0]} has shape {info.shape}, the config needs {want}")


class Assembler:
    """Buffers source tensors until a unit the writer can process is complete.

    A unit is one stacked expert tensor (all E experts of one layer/projection/part,
    possibly spread over several source shards) or, for a quantized source, the parts of
    one module (weight/scales/biases for affine, weight/scales for the floating-point
    modes). Buffered arrays are lazy (`mx.load`), so buffering costs no memory until the
    unit is stacked.
    """

    def __init__(self, n_experts: int, quantized_modules: dict | None = None):
        """quantized_modules: {module path: the set of parts the source stores for it}."""
        self.n_experts = n_experts
        self.quantized_modules = quantized_modules or {}
        self._experts = {}  # target name -> {e: array}
        self._triples = {}  # module path -> {part: array}

    def feed(self, name: str, array: mx.array):
        """Yield ready units as ("tensor", name, array) or ("quantized", module, parts)."""
        m = _EXPERT.match(name)
        if m:
            tgt = target_name(name)
            bucket = self._experts.setdefault(tgt, {})
            bucket[int(m["e"])] = array
            if len(bucket) < self.n_experts:
                return
            del self._experts[tgt]
            name, array = tgt, mx.stack([bucket[e] for e in range(self.n_experts)])
        module, _, part = name.rpartition(".")
        if module in self.quantized_modules and part in _QUANT_PARTS:
            parts = self._triples.setdefault(module, {})
            parts[part] = array
            if set(parts) == self.quantized_modules[module]:
                yield "quantized", module, self._triples.pop(module)
            return
        yield "tensor", name, array

    def finish(self) -> None:
        """Raises ConvertError if any unit is still incomplete at the end of the source."""
        if self._experts:
            tgt, bucket = next(iter(self._experts.items()))
            raise ConvertError(
                f"{tgt}: only {len(bucket)} of {self.n_experts} experts found in the checkpoint"
            )
        if self._triples:
            module, parts = next(iter(self._triples.items()))
            raise ConvertError(f"{module}: quantized parts {sorted(parts)} found, "
                               f"{sorted(self.quantized_modules[module])} needed")


def quantizable_param(layout: Layout, name: str) -> str | None:
    """The module path if `name` is the weight of a quantizable module, else None."""
    module, _, part = name.rpartition(".")
    if part == "weight" and module in layout.quantizable:
        return module
    return None

