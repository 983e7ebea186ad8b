"""mlx_mla.prefill_gemm: dequantize + float GEMM gives the quantized kernel's results.

Reference: the same modules' stock quantized path (``mx.quantized_matmul`` /
``mx.gather_qmm``, what mlx-lm runs); the two differ only in float rounding (same dequantized
values, another summation order), so the tolerance is relative to the outputs' scale.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

import mlx_mla
from mlx_mla import Model, ModelArgs, prefill_gemm
from mlx_mla.prefill_gemm import GemmQuantizedLinear, GemmQuantizedSwitchLinear


def close(a, b, rel=1e-5):
    return mx.abs(a - b).max().item() <= rel * mx.abs(b).max().item()


@pytest.fixture
def dequantized(monkeypatch):
    """Counts the weights (per expert) the GEMM path dequantizes."""
    calls = []
    real = prefill_gemm._dequantized

    def spy(module, e=None):
        calls.append(e)
        return real(module, e)

    monkeypatch.setattr(prefill_gemm, "_dequantized", spy)
    return calls


def test_linear_dequantized_from_min_rows_on(dequantized):
    mx.random.seed(0)
    lin = nn.Linear(256, 384, bias=True)
    lin.bias = mx.random.normal((384,))
    ql = nn.QuantizedLinear.from_linear(lin, 64, 4)
    x = mx.random.normal((2, 20, 256))
    ref_many, ref_one = ql(x), ql(x[:1, :3])
    assert prefill_gemm.apply(ql, 8) == 1 and type(ql) is GemmQuantizedLinear
    assert close(ql(x), ref_many) and dequantized == [None]  # 40 rows: dequantized GEMM
    assert mx.array_equal(ql(x[:1, :3]), ref_one).item()  # 3 rows: the quantized kernel itself
    assert dequantized == [None]
    assert ql.parameters().keys() == {"weight", "scales", "biases", "bias"}


def test_experts_one_gemm_per_expert_block(dequantized):
    mx.random.seed(1)
    glu = SwitchGLU(128, 192, 8)
    nn.quantize(glu, 64, 4)
    x = mx.random.normal((1, 48, 128))
    # skewed routing: experts 0-2 get ~32 rows each (GEMM), 3-7 get 9-10 (quantized matmul)
    inds = mx.concatenate([mx.random.randint(0, 3, (1, 48, 2)),
                           (mx.arange(48) % 5 + 3).reshape(1, 48, 1)], axis=-1).astype(mx.uint32)
    ref, ref_small = glu(x, inds), glu(x[:, :5], inds[:, :5])  # 15 pairs: unsorted path
    ref_few = glu(x[:, :30], inds[:, :30])  # 90 pairs: sorted, < 12 per expert on average
    assert prefill_gemm.apply(glu, 12) == 3  # 144 pairs ≥ 12 · 8 experts
    assert type(glu.up_proj) is GemmQuantizedSwitchLinear
    assert close(glu(x, inds), ref)
    assert sorted(set(dequantized)) == [0, 1, 2] and len(dequantized) == 9  # 3 experts x 3 projs
    assert mx.array_equal(glu(x[:, :5], inds[:, :5]), ref_small).item()
    assert mx.array_equal(glu(x[:, :30], inds[:, :30]), ref_few).item()
    assert len(dequantized) == 9


def test_apply_none_or_float_leaves_modules_alone():
    lin = nn.Linear(128, 128)
    ql = nn.QuantizedLinear.from_linear(nn.Linear(128, 128), 64, 4)
    assert prefill_gemm.apply(ql, None) == 0 and type(ql) is nn.QuantizedLinear
    assert prefill_gemm.apply(lin, 4) == 0 and type(lin) is nn.Linear


TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=2, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=32,
            qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=1, moe_layer_freq=1,
            max_position_embeddings=512, rope_scaling=None)


@pytest.mark.parametrize("strategy", ["auto", "absorb"])
def test_quantized_model_prefill_matches(strategy):
    """A 4-bit mlx_mla model: a 40-token prefill (every Linear and expert on the GEMM path)
    and the decode step after it give the stock quantized path's logits."""
    mx.random.seed(2)
    model = Model(ModelArgs.from_dict({"model_type": "deepseek_v2", **TINY}))
    for layer in model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.weight = mx.random.normal(layer.mlp.gate.weight.shape)
    nn.quantize(model, 64, 4, class_predicate=lambda p, m: isinstance(m, nn.Linear)
                or isinstance(m, nn.Embedding) or hasattr(m, "to_quantized") and "switch" in p)
    model.set_mla_strategy(strategy)
    tokens = mx.random.randint(0, 256, (1, 41))

    def run():
        cache = model.make_cache()
        return model(tokens[:, :40], cache), model(tokens[:, 40:], cache)

    ref_prefill, ref_step = run()
    n = prefill_gemm.apply(model, 2)  # 80 token-expert pairs ≥ 2 · 4 experts: GEMM path
    assert n == sum(isinstance(m, (nn.QuantizedLinear, QuantizedSwitchLinear))
                    for _, m in model.named_modules()) > 10
    prefill, step = run()
    assert close(prefill, ref_prefill) and close(step, ref_step)


def test_loader_applies_the_table_on_the_cpu(tmp_path):
    from mlx_lm.utils import save_config, save_model

    from mlx_mla import blas

    model = Model(ModelArgs.from_dict({"model_type": "deepseek_v2", **TINY}))
    nn.quantize(model, 64, 4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    save_model(tmp_path, model)
    save_config({"model_type": "deepseek_v2", **TINY, "quantization": {"group_size": 64, "bits": 4}},
                config_path=tmp_path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((mlx_mla.DEMO_MODEL / name).read_bytes())
    loaded, _ = mlx_mla.load(tmp_path)
    o_proj = loaded.layers[0].self_attn.o_proj
    min_rows = prefill_gemm.MIN_ROWS.get(blas.kind())
    if min_rows is None:
        assert type(o_proj) is nn.QuantizedLinear
    else:
        assert type(o_proj) is GemmQuantizedLinear and o_proj.min_rows == min_rows
