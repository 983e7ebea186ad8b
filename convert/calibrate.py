"""`--calibration-file`: the `mla` figures measured on the model being converted.

The model runs in mlx-lm's own deepseek_v2 (the source weights, float) over windows of the
user's text; the reference is its unquantized next-token distribution. Each measurement
quantizes some modules (`mx.quantize`, then `mx.dequantize`, as a loaded folder computes
them) and records the mean KL(reference || quantized) in nats per position, as
benchmarks/quant_recipe.py does on the fixture:
- per class: every layer of the class at its anchor option (--q-bits at the --q-group-size
  its input dim allows), which sets that class's level;
- per band: for a class spread over several bands, the layers of one band at a time,
  which sets how its KL splits over its layers.
The shape of each class's curve over options comes from the prior (`Sensitivity.rescaled`):
measuring every option on a large model would take hours.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from .errors import ConvertError
from .plan import model_layers, units_of
from .recipes import QuantSpec, fit_group, layer_of
from .sensitivity import Sensitivity, band_of, option_key

WINDOW = 256  # tokens per calibration window
BATCH = 4  # windows per forward pass


def read_tokens(tokenizer_dir: Path, text_file: Path, max_tokens: int) -> mx.array:
    """(windows, L) token ids of the first `max_tokens` tokens of `text_file`, in windows of
    WINDOW tokens (one shorter window when the text is shorter than that).

    Raises:
        ConvertError: unreadable file, or fewer than 16 tokens.
    """
    from mlx_lm.utils import load_tokenizer

    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"--calibration-file {text_file}: cannot read it as UTF-8 text ({e})") from e
    ids = load_tokenizer(Path(tokenizer_dir)).encode(text)[:max_tokens]
    if len(ids) < 16:
        raise ConvertError(f"--calibration-file {text_file} has {len(ids)} tokens; give at least 16 "
                           "(a few hundred tokens of text like the model's use give steadier figures)")
    length = min(WINDOW, len(ids))
    n = len(ids) // length
    return mx.array(ids[: n * length]).reshape(n, length)


def load_float_model(src, dtype: mx.Dtype):
    """mlx-lm's deepseek_v2 Model holding the source's float weights cast to `dtype`
    (`mlx_lm.utils.load_model`, lazily, so the cast happens as each tensor is read; its
    `sanitize` stacks the routed experts)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(src.path), lazy=True)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


class _KL:
    """KL(reference || model) of next-token distributions over fixed token windows.

    The reference pass keeps the hidden state entering each layer in `starts` (and the
    final norm's input), so a measurement that quantizes only later layers (or lm_head)
    reruns the model from there: the band measurements of the last layers cost little.
    """

    def __init__(self, model, tokens: mx.array, starts):
        from mlx_lm.models.base import create_attention_mask

        self.model = model
        inner = model.model
        self.n_layers = len(inner.layers)
        self.starts = sorted(set(starts) | {0, self.n_layers})
        self.batches = []  # per batch of windows: (tokens, {start layer: hidden}, mask, reference log p)
        for i in range(0, len(tokens), BATCH):
            x = tokens[i : i + BATCH]
            h = inner.embed_tokens(x)
            mask = create_attention_mask(h, None)
            saved = {}
            for l, layer in enumerate(inner.layers):
                if l in self.starts:
                    saved[l] = h
                h = layer(h, mask, None)
            saved[self.n_layers] = h
            ref = self._head(h)
            mx.eval(saved, ref)
            self.batches.append((x, saved, mask, ref))

    def _head(self, h):
        logits = self.model.lm_head(self.model.model.norm(h)).astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _start(self, modules) -> int:
        """The latest cached layer input at or before the first layer `modules` change."""
        first = min((layer_of(m) for m in modules if layer_of(m) is not None), default=self.n_layers)
        return max(s for s in self.starts if s <= first)

    def with_quantized(self, modules: dict) -> float:
        """Mean KL per position with `modules` ({module path: QuantSpec}) quantized."""
        from mlx.utils import tree_flatten

        flat = dict(tree_flatten(self.model.parameters()))
        saved = [(f"{m}.weight", flat[f"{m}.weight"]) for m in modules]
        fake = []
        for name, w in saved:
            spec = modules[name.rpartition(".")[0]]
            q = mx.quantize(w, group_size=spec.group_size, bits=spec.bits)
            fake.append((name, mx.dequantize(*q, group_size=spec.group_size, bits=spec.bits).astype(w.dtype)))
        self.model.load_weights(fake, strict=False)
        embed = "model.embed_tokens" in modules
        start = 0 if embed else self._start(modules)
        total, count = 0.0, 0
        for x, hidden, mask, ref in self.batches:
            h = self.model.model.embed_tokens(x) if embed else hidden[start]
            for layer in self.model.model.layers[start:]:
                h = layer(h, mask, None)
            q = self._head(h)
            kl = (mx.exp(ref) * (ref - q)).sum(-1)
            total += kl.sum().item()
            count += kl.size
        self.model.load_weights(saved, strict=False)
        return total / count


def calibrate(src, lay, base: QuantSpec, prior: Sensitivity, text_file: Path,
              max_tokens: int = 2048, progress: bool = True) -> tuple:
    """Measure the `mla` figures on the source model with the user's text.

    Args:
        src: convert.source.Source (float weights).
        lay: its convert.layout.Layout.
        base: the --q-bits / --q-group-size base (the anchor of each class).
        prior: the figures whose curve shapes are kept (`Sensitivity.rescaled`).
    Returns:
        (Sensitivity, table lines): the calibrated figures and a Markdown table of them.
    Raises:
        ConvertError: an unusable text file.
    """
    from mlx_mla.loader import activation_dtype

    tokens = read_tokens(src.path, text_file, max_tokens)
    units, _ = units_of(lay)
    n_layers, first_moe = model_layers(lay)
    classes = {}
    for unit in units.values():
        if fit_group(base, unit.in_dim) is None:
            continue  # stays float whatever the figures say
        band = band_of(unit.layer, n_layers, first_moe) if unit.layer is not None else None
        classes.setdefault(unit.cls, {}).setdefault(band, []).append(unit)
    jobs = [(c, None) for c in classes]
    jobs += [(c, b) for c, bands in classes.items() if len(bands) > 1 for b in bands]
    model = load_float_model(src, activation_dtype(None, src.config))
    starts = {min(u.layer for us in bands.values() for u in us)
              for bands in classes.values() for b, us in bands.items() if b is not None}
    kl = _KL(model, tokens, starts)
    anchors, measured, band_kl = {}, {}, {}
    bar = tqdm(jobs, desc="calibrating", unit="measurement", disable=not progress, file=sys.stderr)
    for cls, band in bar:
        chosen = [u for b, us in classes[cls].items() if band in (None, b) for u in us]
        anchors[cls] = fit_group(base, chosen[0].in_dim)
        value = kl.with_quantized({m: anchors[cls] for u in chosen for m, _ in u.modules})
        if band is None:
            measured[cls] = value
        else:
            band_kl.setdefault(cls, {})[band] = (value, len(chosen))
    bands = {}
    for cls, per in band_kl.items():
        mean = sum(v for v, _ in per.values()) / sum(n for _, n in per.values())
        bands[cls] = {b: (v / n) / mean if mean > 0 else 1.0 for b, (v, n) in per.items()}
    del kl, model
    mx.clear_cache()  # hand the float model back before the conversion streams
    source = (f"measured on {Path(text_file).name} ({tokens.size} tokens, {len(jobs)} measurements), "
              "option curves from the built-in prior")
    sens = prior.rescaled(measured, anchors, bands, source)
    return sens, calibration_table(measured, anchors, bands, prior)


def calibration_table(measured: dict, anchors: dict, bands: dict, prior: Sensitivity) -> list:
    """Markdown rows: per class, the KL measured at its anchor option, the prior's figure
    there, and the per-layer band weights measured (mean 1 over the class's layers)."""
    rows = ["| class | option | KL measured | KL prior | measured / prior | band weights |",
            "|---|---|---|---|---|---|"]
    for cls, value in measured.items():
        p = prior.curve(cls).get(anchors[cls])
        weights = ", ".join(f"{b} {w:.2f}" for b, w in bands[cls].items()) if cls in bands else "-"
        ratio = f"{value / p:.2f}" if p else "-"
        prior_kl = f"{p:.4g}" if p else "-"
        rows.append(f"| {cls} | {option_key(anchors[cls])} | {value:.4g} | {prior_kl} | {ratio} | {weights} |")
    return rows
