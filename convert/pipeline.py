"""The conversion itself: source shards in, one tensor at a time, mlx-lm folder out."""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from mlx_mla.config import quantization_of
from mlx_mla.dtypes import DTYPES

from . import card, layout, plan, recipes, sensitivity, source, writer
from .errors import ConvertError
from .upload import upload

# Copied verbatim from the source: tokenizer files, generation config, remote code.
COPY_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "*.tiktoken",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "*.py",
]


@dataclass
class ConvertOptions:
    """What `python -m convert` was asked to do (field names follow the CLI flags)."""

    hf_path: str
    mlx_path: str = "mlx_model"
    quantize: bool = False
    q_bits: int | None = None  # None: the mode's (affine: 4)
    q_group_size: int | None = None  # None: the mode's (affine: 64)
    quant_recipe: str | None = None  # None: `mla` for affine, `uniform` for the other modes
    q_mode: str = "affine"
    dtype: str | None = None
    upload_repo: str | None = None
    dequantize: bool = False
    force: bool = False
    max_shard_bytes: int = writer.MAX_SHARD_BYTES
    progress: bool = True
    bits_per_weight: float | None = None  # mla budget; None: plan.default_bits_per_weight
    calibration_file: str | None = None
    calibration_tokens: int | None = None  # None: 2048
    min_bits: int | None = None  # mla: fewest bits of any module; None: plan.default_min_bits

    def check(self) -> None:
        """Raises ConvertError for contradictory or unsupported options."""
        if self.quantize and self.dequantize:
            raise ConvertError("choose either -q/--quantize or -d/--dequantize, not both")
        name = self._recipe_name()
        base_bits = self.q_bits or recipes.FIXED_MODES.get(self.q_mode, (4, 64))[0]
        mla_only = {"--bits-per-weight": self.bits_per_weight is not None,
                    "--calibration-file": self.calibration_file is not None,
                    "--min-bits": self.min_bits is not None}
        for flag, given in mla_only.items():
            if given and not (self.quantize and name == "mla"):
                raise ConvertError(f"{flag} applies to -q with the mla recipe (--quant-recipe mla)")
        if self.calibration_tokens is not None and self.calibration_file is None:
            raise ConvertError("--calibration-tokens applies with --calibration-file")
        if self.bits_per_weight is not None and not 0 < self.bits_per_weight < math.inf:
            raise ConvertError(f"--bits-per-weight {self.bits_per_weight} must be a positive number")
        if self.calibration_file is not None and not Path(self.calibration_file).is_file():
            raise ConvertError(f"--calibration-file {self.calibration_file} is not a file")
        if self.min_bits is not None and not (self.min_bits in recipes.SUPPORTED_BITS
                                              and self.min_bits <= base_bits):
            raise ConvertError(f"--min-bits {self.min_bits}: choose one of "
                               f"{', '.join(str(b) for b in recipes.SUPPORTED_BITS if b <= base_bits)}"
                               " (at most --q-bits)")
        if self.calibration_tokens is not None and self.calibration_tokens < 16:
            raise ConvertError(f"--calibration-tokens {self.calibration_tokens}: give at least 16")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConvertError(f"--dtype {self.dtype} is not supported; choose one of {', '.join(DTYPES)}")
        try:
            base = self.recipe().base
        except ValueError as e:
            raise ConvertError(str(e)) from e
        if self.quantize:  # a mode this MLX build lacks fails here, not mid-conversion
            try:
                mx.quantize(mx.zeros((32, 128)), group_size=base.group_size,
                            bits=base.bits, mode=base.mode)
            except (ValueError, RuntimeError) as e:
                raise ConvertError(f"this MLX ({mx.__version__}) cannot quantize with --q-mode "
                                   f"{base.mode} ({e}): upgrade mlx, or choose another mode") from e

    def _recipe_name(self) -> str:
        """--quant-recipe, else the mode's default (`mla` for affine, `uniform` otherwise)."""
        return self.quant_recipe or (recipes.DEFAULT_RECIPE if self.q_mode == "affine" else "uniform")

    def recipe(self) -> recipes.Recipe:
        """The recipe the options name, with each unset option at its mode's default.

        Raises:
            ValueError: see ``recipes.make_recipe``.
        """
        bits, group = recipes.FIXED_MODES.get(self.q_mode, (4, 64))
        return recipes.make_recipe(self._recipe_name(), bits if self.q_bits is None else self.q_bits,
                                   group if self.q_group_size is None else self.q_group_size,
                                   mode=self.q_mode)


@dataclass
class ConvertReport:
    """What was written: folder, shard names, sizes in bytes and bits per weight."""

    path: Path
    shards: list
    source_bytes: int
    output_bytes: int
    bits_per_weight: float
    quantization: dict | None
    url: str | None = None
    notes: list = field(default_factory=list)  # one-line remarks on the plan
    precisions: list = field(default_factory=list)  # one line per precision written
    calibration: list = field(default_factory=list)  # --calibration-file's table (Markdown rows)


def _target_dtype(opts: ConvertOptions, config: dict):
    """--dtype, else config's torch_dtype/dtype (as mlx-lm does), else keep each tensor's."""
    name = opts.dtype or config.get("torch_dtype") or config.get("dtype")
    return DTYPES.get(name)


def _float_bits(dtype, src):
    """name -> bits of one float parameter of that output tensor: `dtype`'s, or when None
    (each tensor keeps its own) the source tensor's."""
    if dtype is not None:
        return lambda name: dtype.size * 8
    sizes = {"F64": 64, "F32": 32, "BF16": 16, "F16": 16}
    bits = {layout.target_name(n): sizes.get(i.dtype, 16) for s in src.shards for n, i in s.tensors.items()}
    return lambda name: bits.get(name, 16)


def make_plan(opts: ConvertOptions, src, mlx_layout):
    """The quantization plan for this source: `uniform`, or `mla` solved on its shapes
    under --bits-per-weight (default: `plan.default_bits_per_weight` for the output's float
    dtype), with figures measured on --calibration-file when given.

    Returns:
        (plan.Plan, calibration table lines or []).
    Raises:
        ConvertError: an unusable calibration file.
    """
    recipe = opts.recipe()
    base = recipe.base
    dtype = _target_dtype(opts, src.config)
    float_bits = _float_bits(dtype, src)
    if recipe.name == "uniform":
        return plan.plan_uniform(mlx_layout, base, float_bits), []
    figures, table = sensitivity.load_prior(), []
    if opts.calibration_file:
        from .calibrate import calibrate

        figures, table = calibrate(src, mlx_layout, base, figures, Path(opts.calibration_file),
                                   opts.calibration_tokens or 2048, opts.progress)
    budget = opts.bits_per_weight
    if budget is None:
        budget = plan.default_bits_per_weight(base, dtype.size * 8 if dtype else 16)
    return plan.plan_mla(mlx_layout, base, budget, figures, float_bits, opts.min_bits), table


class _Converter:
    """Turns complete source units into output tensors and records the quantization config."""

    def __init__(self, opts, src, mlx_layout, out, recipe=None):
        self.opts, self.mlx_layout, self.out = opts, mlx_layout, out
        self.recipe = recipe
        self.dtype = _target_dtype(opts, src.config)
        self.src_quant = src.config.get("quantization") if src.is_quantized else None
        base = self.recipe.base.as_config() if self.recipe else None
        self.quantization = dict(base) if base else None
        self.written = {}  # module -> (QuantSpec or None, parameters, input dim)

    def _cast(self, a):
        if self.dtype is not None and mx.issubdtype(a.dtype, mx.floating):
            return a.astype(self.dtype)
        return a

    def convert_tensor(self, name, array):
        """Cast a float source tensor and, under a recipe, quantize it; add it to the output."""
        array = self._cast(array)
        module = layout.quantizable_param(self.mlx_layout, name) if self.recipe else None
        if module is None:
            self.out.add(name, array)
            return
        spec = self.recipe.spec_for(module, array.shape[-1])
        self.written[module] = (spec, array.size, array.shape[-1])
        if spec is None:
            self.quantization[module] = False
            self.out.add(name, array)
            return
        if spec != self.recipe.base:
            self.quantization[module] = spec.as_config()
        # (weight, scales, biases) for affine; the floating-point modes have no biases
        w, s, *b = mx.quantize(array, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
        self.out.add(f"{module}.weight", w, parameters=array.size)
        self.out.add(f"{module}.scales", s, parameters=0)
        for biases in b:
            self.out.add(f"{module}.biases", biases, parameters=0)

    def convert_quantized(self, module, parts):
        """A quantized source module's weight/scales (/biases: affine only): passed through,
        or with -d dequantized to float, with the bits, group size and mode the source's
        ``quantization`` config gives the module.

        Raises:
            ConvertError: the config says the module is float, or its parts or shapes
                disagree with the config's mode and group size.
        """
        spec = quantization_of(self.src_quant, module)
        if spec is None:
            raise ConvertError(f"{module} is stored quantized but config.json's quantization says "
                               "it is float: the folder is inconsistent; convert it again")
        want = {"weight", "scales"} | ({"biases"} if spec["mode"] == "affine" else set())
        if set(parts) != want:
            raise ConvertError(f"{module}: {spec['mode']} quantization stores {sorted(want)}, "
                               f"the checkpoint has {sorted(parts)}: the folder is incomplete")
        w, s, b = parts["weight"], parts["scales"], parts.get("biases")
        if w.shape[-1] * 32 // spec["bits"] != s.shape[-1] * spec["group_size"]:
            raise ConvertError(f"{module}: stored shapes disagree with config.json's quantization "
                               f"({spec['bits']} bits, group {spec['group_size']})")
        if not self.opts.dequantize:  # pass through as stored
            self.out.add(f"{module}.weight", w, parameters=w.size * 32 // spec["bits"])
            self.out.add(f"{module}.scales", self._cast(s), parameters=0)
            if b is not None:
                self.out.add(f"{module}.biases", self._cast(b), parameters=0)
            return
        # affine: in the scales' float dtype; fp modes: MLX's default (bfloat16, exact)
        self.out.add(f"{module}.weight", self._cast(mx.dequantize(w, s, b, **spec)))


def _quantized_modules(src) -> dict:
    """{module: the parts the source stores for it} for every module with ``.scales``:
    weight/scales/biases (affine) or weight/scales (the floating-point modes)."""
    modules = {}
    for name in src.tensor_names:
        module, _, part = layout.target_name(name).rpartition(".")
        modules.setdefault(module, set()).add(part)
    return {m: frozenset(p & {"weight", "scales", "biases"}) for m, p in modules.items()
            if "scales" in p}


def _output_config(src, quantization, dequantized: bool) -> dict:
    config = dict(src.config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization"] = quantization
    elif src.is_quantized and not dequantized:  # passed through unchanged
        config["quantization"] = src.config["quantization"]
    return config


def _copy_side_files(src_dir: Path, dst: Path) -> None:
    for pattern in COPY_PATTERNS:
        for f in sorted(src_dir.glob(pattern)):
            if f.is_file():
                shutil.copyfile(f, dst / f.name)  # data only: source files may be read-only


def describe(quantization: dict | None, recipe_name: str | None, bpw: float) -> str:
    """One line for the model card and the summary, e.g. '4-bit affine, group 64 (uniform
    recipe), 4.52 bits per weight'; for the `mla` recipe the modules' own precisions are in
    the card's Quantization section, so the line names none."""
    if not quantization:
        return f"unquantized, {bpw:.2f} bits per weight"
    if recipe_name == "mla":
        return (f"mla recipe, each module its own bits and group (see Quantization below), "
                f"{bpw:.2f} bits per weight")
    return (
        f"{quantization['bits']}-bit {quantization.get('mode', 'affine')}, group "
        f"{quantization['group_size']} ({recipe_name} recipe), {bpw:.2f} bits per weight"
    )


def _card_details(qplan, precisions: list, table: list) -> str:
    """The model card's quantization section: the plan, what was written, the figures."""
    lines = ["## Quantization", ""] + [f"- {n}" for n in qplan.notes()]
    lines += [f"- {p}" for p in precisions]
    if table:
        lines += ["", "Sensitivities measured with `--calibration-file` (KL of next-token "
                  "distributions, nats per position, only that class quantized):", "", *table]
    return "\n".join(lines) + "\n"


def convert(opts: ConvertOptions) -> ConvertReport:
    """Convert a DeepSeek-V2 checkpoint to an mlx-lm folder at `opts.mlx_path`.

    Reads one source shard at a time, lazily, and writes output shards as they fill, so
    peak memory is about one output shard plus the tensors in flight. Nothing is visible
    at `mlx_path` until the whole folder is complete; source files are only read.

    Raises:
        ConvertError: bad options, a bad or unsupported source, an existing target without
            `force`, or a failed upload (the local output then stays).
    """
    from mlx_lm.utils import save_config

    opts.check()
    target = Path(opts.mlx_path)
    writer.check_target(target, opts.force)
    src = source.open_source(opts.hf_path)
    writer.check_target(target, opts.force, source=src.path)
    if opts.quantize and src.is_quantized:
        raise ConvertError(f"{opts.hf_path} is already quantized; convert its float original, or pass -d")
    if opts.dequantize and not src.is_quantized:
        raise ConvertError(f"-d: {opts.hf_path} is not quantized (its config.json has no 'quantization')")
    mlx_layout = layout.Layout.for_config(src.config)
    layout.check_names(mlx_layout, {n: i for s in src.shards for n, i in s.tensors.items()})

    qplan, table = make_plan(opts, src, mlx_layout) if opts.quantize else (None, [])
    with writer.staged_output(target, opts.force) as tmp:
        out = writer.ShardedWriter(tmp, opts.max_shard_bytes)
        conv = _Converter(opts, src, mlx_layout, out, qplan.recipe if qplan else None)
        assembler = layout.Assembler(mlx_layout.n_experts, _quantized_modules(src))
        for shard in src.shards:
            arrays = shard.load()
            names = list(shard.tensors)
            bar = tqdm(names, desc=shard.path.name, unit="tensor", disable=not opts.progress, file=sys.stderr)
            for name in bar:
                # pop: a loaded array must not outlive its conversion (that would hold the shard)
                for kind, key, value in assembler.feed(name, arrays.pop(name)):
                    if kind == "tensor":
                        conv.convert_tensor(key, value)
                    else:
                        conv.convert_quantized(key, value)
            del arrays
            mx.clear_cache()
        assembler.finish()
        shards = out.finish()
        quant = conv.quantization if conv.recipe else None
        save_config(_output_config(src, quant, opts.dequantize), config_path=tmp / "config.json")
        _copy_side_files(src.path, tmp)
        kept = None if opts.dequantize else src.config.get("quantization")
        summary = describe(quant or kept, conv.recipe.name if quant else "source's",
                           out.bits_per_weight)
        precisions = plan.precision_lines(conv.written, mlx_layout) if qplan else []
        details = _card_details(qplan, precisions, table) if qplan else ""
        card.write_model_card(tmp, target.name, src.path, src.hub_id, opts.upload_repo, summary, details)

    report = ConvertReport(
        path=target,
        shards=shards,
        source_bytes=sum(s.nbytes for s in src.shards),
        output_bytes=out.total_bytes,
        bits_per_weight=out.bits_per_weight,
        quantization=quant,
        notes=qplan.notes() if qplan else [],
        precisions=precisions,
        calibration=table,
    )
    if opts.upload_repo:
        report.url = upload(target, opts.upload_repo)
    return report
