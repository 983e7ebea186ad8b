"""The engines the benchmarks compare, all reading one random model folder through their own
loaders: ``mlx_mla <strategy>`` (``mlx_mla.load``), ``mlx-lm v2`` (stock ``mlx_lm.load``,
``deepseek_v2``: decompressed K/V cache) and ``mlx-lm v3`` (stock ``mlx_lm.load`` of the same
weights as a ``deepseek_v3`` folder: absorbed attention over a latent cache, V3's router).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_mla import DEMO_MODEL
from mlx_mla.dtypes import cast_floating

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_random_folder(config: dict, folder: Path, bits: int = 4, group_size: int = 64,
                        seed: int = 0) -> Path:
    """An mlx-lm folder of random weights at ``config``'s shape, quantized as
    ``mlx_lm.convert -q`` does (mlx-lm's ``quantize_model`` / ``save_model``), so every
    engine reads it through its own loader, as users would. The router gets random weights
    (MLX initialises it to zeros) so routing spreads over the experts. Tokenizer files are
    the demo checkpoint's (the loaders need one; the benchmark feeds token ids)."""
    from mlx_lm.models import deepseek_v2 as v2
    from mlx_lm.utils import quantize_model, save_config, save_model

    mx.random.seed(seed)
    model = v2.Model(v2.ModelArgs.from_dict(config))
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.weight = mx.random.normal(layer.mlp.gate.weight.shape) * 0.02
    model, out_config = quantize_model(model, dict(config), group_size, bits)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(out_config, config_path=folder / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO_MODEL / name, folder / name)
    return folder


def v3_overrides(config: dict) -> dict:
    """The same dimensions as a ``deepseek_v3`` config (V3 router: sigmoid + noaux_tc)."""
    return {"model_type": "deepseek_v3", "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "n_group": 1, "topk_group": 1}


def v3_folder(v2_folder: Path, folder: Path, config: dict) -> Path:
    """``v2_folder``'s weights (linked, not copied) as a ``deepseek_v3`` folder: its config
    with ``v3_overrides`` and zero e_score_correction_bias tensors for the V3 router."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in v2_folder.iterdir():
        if f.name.endswith(".safetensors") or f.name in TOKENIZER_FILES:
            (folder / f.name).symlink_to(f.resolve())
    v2_config = json.loads((v2_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**v2_config, **v3_overrides(config)}))
    bias = {f"model.layers.{i}.mlp.gate.e_score_correction_bias": mx.zeros((config["n_routed_experts"],))
            for i in range(config["num_hidden_layers"])
            if i >= config["first_k_dense_replace"]}
    if bias:
        mx.save_safetensors(str(folder / "model-v3-router.safetensors"), bias)
    return folder


def load_engine(engine: str, folders: Dict[str, Path], dtype: mx.Dtype):
    """An engine by name from its folder, through its own loader: ``mlx_mla.load`` for
    "mlx_mla <strategy>", stock ``mlx_lm.load`` for "mlx-lm v2" / "mlx-lm v3" (float
    parameters then cast to ``dtype``, as ``mlx_mla.load`` casts its own)."""
    if engine.startswith("mlx_mla"):
        import mlx_mla

        model, _ = mlx_mla.load(folders["v2"], mla_strategy=engine.split(" ", 1)[1], dtype=dtype)
        return model
    import mlx_lm

    model, _ = mlx_lm.load(str(folders["v2" if engine == "mlx-lm v2" else "v3"]))
    return cast_floating(model, dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters plus any weights its MLA strategy derives and keeps
    outside them (absorb-materialized's precomputed matrices)."""
    return (sum(v.nbytes for _, v in tree_flatten(model.parameters()))
            + getattr(model, "derived_nbytes", 0))


def lazy_weight_bytes(engine: str, config: dict, dtype: mx.Dtype, bits: int = 4,
                      group_size: int = 64) -> int:
    """Weight bytes of ``engine`` at ``config``'s shape from shapes alone (``lazy_model``)."""
    return weight_bytes(lazy_model(engine, config, dtype, bits, group_size))


def lazy_model(engine: str, config: dict, dtype: mx.Dtype, bits: Optional[int] = 4,
               group_size: int = 64) -> nn.Module:
    """``engine``'s model at ``config``'s shape from shapes alone (lazy arrays, no weights
    read or allocated): the model class quantized as its loader would quantize a
    ``write_random_folder`` folder (``bits`` None: left float), float parameters in ``dtype``."""
    if engine.startswith("mlx_mla"):
        from mlx_mla import Model, ModelArgs

        model = Model(ModelArgs.from_dict(config))
    else:
        from mlx_lm.models import deepseek_v2, deepseek_v3

        mod = deepseek_v2 if engine == "mlx-lm v2" else deepseek_v3
        cfg = config if engine == "mlx-lm v2" else {**config, **v3_overrides(config)}
        model = mod.Model(mod.ModelArgs.from_dict(cfg))
    if bits is not None:
        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=lambda _, m: (
            hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0))
    cast_floating(model, dtype, evaluate=False)
    return model


def write_folders(config: dict, workdir: Path) -> Dict[str, Path]:
    """The random 4-bit folder every engine loads ("v2"), and its deepseek_v3 twin ("v3")."""
    v2 = write_random_folder(config, workdir / "v2")
    return {"v2": v2, "v3": v3_folder(v2, workdir / "v3", config)}
