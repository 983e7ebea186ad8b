"""How much each tensor class costs in quality when quantized: the figures `convert.plan`
trades bits against.

A figure is KL(reference || quantized) of next-token distributions, in nats per position,
with only one tensor class quantized (all its layers) at one (bits, group) option. How a
class's KL splits over its layers is given per *band*, a layer's position in the model
(`band_of`), so figures measured on a 4-layer model mean something on a 27- or 60-layer
one. The built-in prior (`load_prior`, data in mla_prior.json) was measured on the shared
fixture by `python -m benchmarks.quant_recipe`; `convert.calibrate` measures the user's own
model and rescales the prior with it (`Sensitivity.rescaled`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .recipes import QuantSpec

PRIOR_FILE = Path(__file__).with_name("mla_prior.json")
BANDS = ("first", "first_moe", "middle", "last")
# Classes the fixture lacks (q_lora_rank is null there) borrow the option curve of the
# class doing the same job: q_a_proj, like kv_a_proj_with_mqa, projects down to a latent
# every head reads (through an RMSNorm); q_b_proj, like q_proj, makes per-head queries.
ANALOGUES = {"attn_q_a": "attn_kv_a", "attn_q_b": "attn_q"}


def band_of(layer: int, n_layers: int, first_moe) -> str:
    """The position band of decoder layer `layer`: "first" (layer 0), "first_moe" (the
    first MoE layer, when dense layers precede it), "last", else "middle"."""
    if layer == 0:
        return "first"
    if layer == first_moe:
        return "first_moe"
    if layer == n_layers - 1:
        return "last"
    return "middle"


def option_key(spec: QuantSpec) -> str:
    """"bits/group", e.g. "4/64": how mla_prior.json and the tables name an option."""
    return f"{spec.bits}/{spec.group_size}"


def parse_option(key: str) -> QuantSpec:
    """The affine QuantSpec of a "bits/group" key (`option_key`'s inverse).

    Raises:
        ValueError: a key not of that form.
    """
    bits, group = key.split("/")
    return QuantSpec(int(bits), int(group))


@dataclass(frozen=True)
class Sensitivity:
    """Per-class KL figures and per-band layer weights.

    Attributes:
        source: where the figures come from (one line, printed and written to the card).
        kl: {class: {QuantSpec: KL in nats}}, the whole model's KL with only that class
            quantized (all its layers) at that option.
        bands: {class: {band: weight}}: a layer's share of its class's KL is its band's
            weight over the sum of weights of the class's layers (1.0 for a band not
            measured).
        measured: {class: KL} at the option each class was measured at, when calibrated.
    """

    source: str
    kl: dict
    bands: dict
    measured: dict = field(default_factory=dict)

    def curve(self, cls: str) -> dict:
        """{QuantSpec: KL} for `cls` (its analogue's for a class not measured; {} if none)."""
        return self.kl.get(cls) or self.kl.get(ANALOGUES.get(cls), {})

    def weight(self, cls: str, band: str) -> float:
        """The band weight of `cls` at `band` (1.0 when not measured)."""
        return self.bands.get(cls, {}).get(band, 1.0)

    def rescaled(self, measured: dict, anchors: dict, bands: dict, source: str) -> "Sensitivity":
        """These figures moved to another model: each class's curve scaled so that it
        passes through the KL measured there at its anchor option (the shape of the
        curve, what each extra bit or smaller group buys, stays this one's), with the
        measured band weights.

        Args:
            measured: {class: KL} measured at `anchors[class]` (a QuantSpec).
            bands: {class: {band: weight}} measured (classes absent keep these).
        """
        kl = {}
        for cls, value in measured.items():
            curve = self.curve(cls)
            ref = curve.get(anchors[cls])
            scale = max(value, 1e-9) / ref if ref else None
            kl[cls] = {o: k * scale for o, k in curve.items()} if scale else {anchors[cls]: value}
        return Sensitivity(source, kl, {**self.bands, **bands}, dict(measured))

    def to_json(self) -> dict:
        """mla_prior.json's form: {"source", "classes": {class: {"kl": {"b/g": KL}, "bands"}},
        "measured"?}."""
        return {
            "source": self.source,
            "classes": {
                c: {"kl": {option_key(o): k for o, k in sorted(curve.items(), key=lambda t: (t[0].bits, t[0].group_size))},
                    "bands": self.bands.get(c, {})}
                for c, curve in self.kl.items()
            },
            **({"measured": self.measured} if self.measured else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Sensitivity":
        """`to_json`'s inverse (raises KeyError/ValueError on a malformed document)."""
        kl = {c: {parse_option(o): k for o, k in v["kl"].items()} for c, v in data["classes"].items()}
        bands = {c: dict(v.get("bands", {})) for c, v in data["classes"].items()}
        return cls(data["source"], kl, bands, dict(data.get("measured", {})))


def fill_groups(kl: dict) -> dict:
    """{class: curve} with the options a class could not be measured at (a group its input
    dim did not take on the measured model, e.g. kv_b_proj at group 128 on the fixture, whose
    kv_lora_rank is 64) estimated: the next smaller group's figure at the same bits times the
    median ratio between the two groups over the classes measured at both."""
    out = {c: dict(curve) for c, curve in kl.items()}
    options = {o for curve in kl.values() for o in curve}
    for o in sorted(options, key=lambda o: (o.bits, o.group_size)):
        finer = QuantSpec(o.bits, o.group_size // 2)
        ratios = sorted(curve[o] / curve[finer] for curve in kl.values()
                        if o in curve and curve.get(finer, 0) > 0)
        if not ratios:
            continue
        median = ratios[len(ratios) // 2]
        for curve in out.values():
            if o not in curve and finer in curve:
                curve[o] = curve[finer] * median
    return out


def load_prior(path: Path = PRIOR_FILE) -> Sensitivity:
    """The built-in figures (measured on the shared fixture by benchmarks/quant_recipe.py),
    completed by `fill_groups`."""
    prior = Sensitivity.from_json(json.loads(Path(path).read_text()))
    return Sensitivity(prior.source, fill_groups(prior.kl), prior.bands)
