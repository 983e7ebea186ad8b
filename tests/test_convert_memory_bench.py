"""benchmarks/convert_memory.py at a tiny size: its generator and measurement work."""

from __future__ import annotations

import json


import benchmarks.convert_memory as bench

TINY = {**bench.V2_LITE, "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
        "num_key_value_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}


def test_generated_checkpoint_converts_and_is_measured(tmp_path):
    rows = bench.run(TINY, shard_bytes=200_000, workdir=tmp_path)
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # multi-shard source
    assert [r["converter"] for r in rows] == ["mlx-mla convert -q", "mlx_lm.convert -q"]
    for r in rows:
        assert r["peak_rss_bytes"] > 0 and 0 < r["output_bytes"] < r["source_bytes"]
    assert rows[0]["output_bytes"] >= rows[1]["output_bytes"] * 0.9
