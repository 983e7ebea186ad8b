"""A second trained DeepSeek-V2 checkpoint, of another shape and text domain than the fixture.

The `mla` quantization recipe's prior was measured on the shared fixture (Shakespeare,
hidden 256, plain q_proj, greedy routing, 4 layers). This benchmark builds the checkpoint
the recipe is checked on out of sample: a small *code* model, like DeepSeek-Coder-V2, with
the features the fixture lacks:

- ``q_lora_rank`` set (q_a_proj -> q_a_layernorm -> q_b_proj, as DeepSeek-V2 / V2.5),
- ``topk_method`` group_limited_greedy (8 routed experts in 4 groups, top 2 groups),
- ``hidden_size`` 192 (a multiple of 64, not of 128) and ``intermediate_size`` 448
  (the same for the dense MLP's down_proj input), 5 layers, its own tokenizer.

Text: the Python standard library of the interpreter running this (its ``*.py`` files,
tests and site-packages excluded; no internet needed). Every 20th file, in sorted order, is
held out (never trained on) for the KL measurements; a slice of the training files is
written as a calibration text for ``python -m convert --calibration-file``.

Training: transformers' DeepseekV2ForCausalLM on the CPU, float32, AdamW (cosine to 10%),
next-token loss plus DeepSeek's expert-level balance loss (alpha 0.01, so routing does not
collapse onto a few experts), saved in bfloat16 in the Hub layout. Short 128-token
sequences and a 1024-token vocabulary buy more updates and sharper predictions within the
~15 minutes two shared cores allow. Seeded: the same interpreter, torch
version and thread count rebuild the same weights (their sha256 is in the results).

    python -m benchmarks.train_code_checkpoint          # ~15 minutes on 2 cores
Writes benchmarks/checkpoints/ (git-ignored): tiny-dsv2-coder-python/ (the checkpoint),
python-heldout.txt, python-calibration.txt; and benchmarks/results/train_code_checkpoint.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import sysconfig
import time
from pathlib import Path

import torch

from .common import RESULTS, ROOT, machine_info, summary

CHECKPOINTS = ROOT / "benchmarks" / "checkpoints"
MODEL_DIR = CHECKPOINTS / "tiny-dsv2-coder-python"
HELDOUT = CHECKPOINTS / "python-heldout.txt"
CALIBRATION = CHECKPOINTS / "python-calibration.txt"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SEQ = 128
HELDOUT_EVERY = 20  # every 20th stdlib file (sorted) is held out
CALIBRATION_CHARS = 64_000
AUX_ALPHA = 0.01

# Not the fixture's shape (see the module docstring); dims that mlx_lm.convert -q (group 64)
# quantizes entirely, so its figure is a fair baseline.
CONFIG = dict(
    vocab_size=1024, hidden_size=192, intermediate_size=448, moe_intermediate_size=192,
    num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=6,
    q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    topk_method="group_limited_greedy", n_group=4, topk_group=2,
    routed_scaling_factor=1.0, norm_topk_prob=False, first_k_dense_replace=1,
    max_position_embeddings=2048, initializer_range=0.02, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False,
)
ROPE_SCALING = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def stdlib_files() -> tuple:
    """(training files, held-out files): the stdlib's ``*.py`` in sorted order, tests and
    site-packages excluded; every HELDOUT_EVERY-th file is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = [f for f in sorted(root.rglob("*.py")) if not skip & set(f.relative_to(root).parts)]
    held = files[::HELDOUT_EVERY]
    return [f for f in files if f not in set(held)], held


def read_all(files) -> str:
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def train_tokenizer(text: str, folder: Path):
    """A byte-level BPE of CONFIG's vocabulary on ``text``, saved to ``folder`` with
    DeepSeek's special tokens (BOS prepended when encoding, as DeepSeek's tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator([text], trainer)
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=EOS)
    tok.save_pretrained(folder)
    return tok


def balance_loss(router_logits, topk_idx, n_experts: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V2's expert-level balance loss for one layer (paper, eq. 12-14):
    E * sum_i f_i * P_i / top_k, f_i the fraction of token slots routed to expert i, P_i
    its mean router probability. router_logits: (tokens, E); topk_idx: (tokens, K)."""
    probs = router_logits.softmax(-1)
    counts = torch.zeros(n_experts).scatter_add_(0, topk_idx.reshape(-1),
                                                 torch.ones(topk_idx.numel()))
    f = counts / topk_idx.shape[0]
    return n_experts * (f * probs.mean(0)).sum() / top_k


def train(out: Path, steps: int, batch: int, lr: float, seed: int = 0) -> dict:
    """Build, train and save the checkpoint at ``out``; returns what the results record."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    train_files, held_files = stdlib_files()
    train_text, held_text = read_all(train_files), read_all(held_files)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = train_tokenizer(train_text, tmp)
    ids = torch.tensor(tok(train_text)["input_ids"])
    held = torch.tensor(tok(held_text)["input_ids"])

    torch.manual_seed(seed)
    config = DeepseekV2Config(rope_scaling=dict(ROPE_SCALING), **CONFIG)
    model = DeepseekV2ForCausalLM(config).float().train()
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    captured = []
    for r in routers:
        r.register_forward_hook(lambda m, i, o: captured.append((o[0], o[2])))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    gen = torch.Generator().manual_seed(seed)
    log, t0 = [], time.time()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - SEQ - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + SEQ] for s in starts])
        captured.clear()
        loss = model(x, labels=x).loss
        aux = sum(balance_loss(lg, ix, CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"])
                  for lg, ix in captured) / len(captured)
        opt.zero_grad()
        (loss + AUX_ALPHA * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == steps - 1:
            log.append({"step": step, "loss": loss.item(), "balance": aux.item(), "s": time.time() - t0})
            print(f"  step {step:4d} loss {loss.item():.3f} balance {aux.item():.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        n = min(32, len(held) // SEQ)
        held_loss = model(held[: n * SEQ].reshape(n, SEQ), labels=held[: n * SEQ].reshape(n, SEQ)).loss.item()
    model.to(torch.bfloat16).save_pretrained(tmp)
    _hub_style_config(tmp / "config.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    (out.parent / HELDOUT.name).write_text(held_text)
    (out.parent / CALIBRATION.name).write_text(train_text[:CALIBRATION_CHARS])
    return {
        "config": CONFIG, "rope_scaling": ROPE_SCALING, "steps": steps, "batch": batch, "seq": SEQ,
        "lr": lr, "seed": seed, "train_tokens_seen": steps * batch * SEQ,
        "train_corpus_tokens": len(ids), "heldout_tokens": len(held),
        "train_files": len(train_files), "heldout_files": len(held_files),
        "final_train_loss": log[-1]["loss"], "heldout_loss": held_loss,
        "heldout_perplexity": math.exp(held_loss), "log": log, "seconds": time.time() - t0,
        "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "weights_sha256": weights_digest(out),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
    }


def _hub_style_config(path: Path) -> None:
    """config.json with the Hub's ``rope_scaling`` key, as DeepSeek's own configs have it
    (transformers 5 writes ``rope_parameters``)."""
    data = json.loads(path.read_text())
    rope = data.pop("rope_parameters", None) or {}
    data["rope_scaling"] = dict(ROPE_SCALING)
    data["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    path.write_text(json.dumps(data, indent=2))


def weights_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def ensure_checkpoint() -> Path:
    """MODEL_DIR, or SystemExit naming the command that builds it."""
    if not (MODEL_DIR / "config.json").is_file() or not HELDOUT.is_file():
        raise SystemExit(f"error: {MODEL_DIR} is absent; build it first with "
                         "`python -m benchmarks.train_code_checkpoint` (~15 minutes)")
    return MODEL_DIR


def main() -> None:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", type=Path, default=MODEL_DIR,
                    help="folder to write the checkpoint to (default: benchmarks/checkpoints/tiny-dsv2-coder-python, git-ignored)")
    args = ap.parse_args()
    meta = train(args.out, args.steps, args.batch, args.lr)
    meta["machine"] = machine_info()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "train_code_checkpoint.json").write_text(json.dumps(meta, indent=2))
    print(f"[train_code_checkpoint] {args.out}: held-out loss {meta['heldout_loss']:.3f} "
          f"(perplexity {meta['heldout_perplexity']:.1f}) after {meta['seconds']:.0f} s")


if __name__ == "__main__":
    main()
