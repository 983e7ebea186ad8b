"""References computed in the tests: transformers' DeepseekV2ForCausalLM (PyTorch, CPU,
float32), on the fixture checkpoint or on random-initialised tiny configs saved as
Hub-layout checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

from mlx_mla import DEMO_MODEL
from testdata import CORPUS

YARN = {
    "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
}

TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=512,
    topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
    initializer_range=0.1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)


def fixture_tokens(n: int = 48) -> list[int]:
    """The first n tokens of the held-out text, as the fixture's tokenizer encodes it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    return tok(CORPUS.read_text()[: 8 * n])["input_ids"][:n]


def load_reference(folder: Path) -> DeepseekV2ForCausalLM:
    """transformers' model of a Hub-layout folder, in float32."""
    return DeepseekV2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def norm_topk_prob_router(model: DeepseekV2ForCausalLM) -> None:
    """transformers 5.24 ignores norm_topk_prob; patch its routers to DeepSeek-V2's own rule
    (modeling_deepseek.py MoEGate: renormalise the top-k weights to sum 1 when
    norm_topk_prob and top_k > 1, instead of multiplying by routed_scaling_factor)."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        original = gate.forward
        scale = gate.routed_scaling_factor

        def forward(hidden_states, original=original, scale=scale):
            logits, weights, indices = original(hidden_states)
            weights = weights / scale
            return logits, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), indices

        gate.forward = forward


def make_checkpoint(folder: Path, seed: int = 0, rope_key: str = "rope_scaling", **overrides):
    """Random-initialise a tiny DeepseekV2ForCausalLM, save it in the Hub layout.

    rope_key: "rope_scaling" (the Hub's key), "rope_parameters" (transformers 5's, written
    as the only RoPE key) or None (no RoPE scaling at all).
    Returns the float32 reference model.
    """
    torch.manual_seed(seed)
    cfg = dict(TINY, **overrides)
    config = DeepseekV2Config(rope_scaling=dict(YARN) if rope_key else None, **cfg)
    model = DeepseekV2ForCausalLM(config).to(torch.float32).eval()
    if cfg.get("norm_topk_prob"):
        norm_topk_prob_router(model)
    model.save_pretrained(folder)
    _copy_tokenizer(folder)
    config_file = folder / "config.json"
    data = json.loads(config_file.read_text())
    rope = data.pop("rope_parameters", None) or data.pop("rope_scaling", None)
    data.pop("rope_scaling", None)
    if rope_key == "rope_scaling":
        rope = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")}
        rope["type"] = "yarn"
        data["rope_scaling"] = rope
        data["rope_theta"] = 10000.0
    elif rope_key == "rope_parameters":
        data["rope_parameters"] = rope
    else:
        data["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config_file.write_text(json.dumps(data, indent=2))
    return model


def _copy_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((DEMO_MODEL / name).read_bytes())


def hf_logits(model: DeepseekV2ForCausalLM, tokens: list[int]) -> np.ndarray:
    """(L, vocab) float32 logits of one full forward pass, no cache."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False).logits
    return out[0].float().numpy()


def hf_greedy(model: DeepseekV2ForCausalLM, tokens: list[int], n: int) -> list[int]:
    """n greedy tokens after ``tokens``, with transformers' own generate and cache."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        # An explicit mask: the fixture's pad id equals BOS (0), which generate would mask.
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=1,
        )
    return out[0, len(tokens):].tolist()
