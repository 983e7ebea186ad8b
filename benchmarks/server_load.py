"""Serving under load: ``python -m mlx_mla.server`` against ``mlx_lm.server`` on one 4-bit folder.

One random DeepSeek-V2-Lite-shaped folder (``benchmarks.engines.write_random_folder``: V2-Lite's
dimensions and 102,400-token vocabulary, 4-bit group 64, float32 norms and scales, so both
servers run float32 activations; one MoE layer by default, as benchmarks.e2e_decode), served
in turn by each server, each in its own process with its default flags (continuous batching,
LRU prompt cache of 10). The folder's tokenizer is a word-level one whose words are the token
ids ("t0" … "t102399"), so a prompt of N words is exactly N tokens and any id the random model
generates decodes.

For 1, 4 and 16 concurrent clients (threads of this process, streamed text completions over
HTTP on 127.0.0.1), each sending a distinct random prompt of ``--prompt-tokens`` (2,048)
tokens and asking for ``--max-tokens`` greedy tokens:

- aggregate generated tok/s: completion tokens of all clients / wall time from the first
  request sent to the last answer complete;
- time to first token (request sent → first streamed token) and per-token latency (the gaps
  between a client's successive streamed tokens), p50 / p95 over the clients' values;
- the server's memory, measured inside the server process: **weights** (bytes of the
  model's parameters, plus any derived weights of its MLA strategy), **caches** (peak
  over the phase of the bytes allocated to every KV/latent cache the server holds: live
  sequences in mlx-lm's ``BatchGenerator`` plus the LRU prompt cache, read after each
  ``BatchGenerator.next`` via mlx-lm's ``prompt_cache_nbytes`` / ``LRUPromptCache.nbytes``),
  MLX's peak allocated memory in the phase (``mx.get_peak_memory``: weights, caches and
  transients), and the process's peak RSS (``VmHWM``, lifetime). The watching is done by
  subclassing mlx-lm's ``BatchGenerator`` and wrapping ``ResponseGenerator.__init__`` in the
  server process (``--serve``); neither server's code is otherwise changed.

Prompt reuse: a request with a fresh ``--prompt-tokens`` prefix + 16 tokens, then one with
the same prefix + 16 other tokens; time to first token of each and the cached-token count the
second reports. With one layer, prefill computes only what the single layer caches
(mlx-lm's prefill evaluates the cache state), so the same pair is also measured on a
``--reuse-layers`` (2) folder, where the first layer's attention and MoE run over the prompt.

    python -m benchmarks.server_load          # 14-18 minutes on a 2-core CPU
Writes benchmarks/results/server_load_BLAS.{csv,json,png}, BLAS being the one both server
processes multiplied with (``mlx_mla.blas``: "openblas" where ``mlx-mla[openblas]`` is
installed, "reference" with ``MLX_MLA_BLAS=reference`` or without it; "gpu" on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from .common import RESULTS, V2_LITE, machine_info, with_layers, write_csv, summary

ENGINES = ("mlx_mla", "mlx-lm")
SUFFIX_TOKENS = 16


# ---------------------------------------------------------------- the model folder

def write_word_tokenizer(folder: Path, config: Dict) -> None:
    """A word-level tokenizer whose words are the token ids ("t0" … "t{vocab_size-1}"), the
    BOS and EOS ids named "<bos>" / "<eos>" (a special token named like a word would also
    match inside longer words), no BOS added: prompts of exact lengths, every id decodable."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {config["bos_token_id"]: "<bos>", config["eos_token_id"]: "<eos>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<bos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "add_bos_token": False}))


def write_folder(config: Dict, folder: Path) -> Path:
    """``config``'s random 4-bit folder (``engines.write_random_folder``) with the word
    tokenizer."""
    from .engines import write_random_folder

    write_random_folder(config, folder)
    write_word_tokenizer(folder, config)
    return folder


def one_moe_layer(config: Dict, layers: int) -> Dict:
    """``config`` with ``layers`` decoder layers, all MoE (as 26 of V2-Lite's 27)."""
    return {**with_layers(config, layers), "first_k_dense_replace": 0}


# ---------------------------------------------------------------- inside the server process

class _Watch:
    """Peaks of cache bytes, written to a JSON file for the harness (``serve``)."""

    def __init__(self, path: Path):
        self.path, self.generators, self.lock = path, [], threading.Lock()
        self.weights = 0
        self.reset()

    def reset(self, *_):
        import mlx.core as mx

        with self.lock:
            self.live_peak = self.lru_peak = self.cache_peak = 0
        mx.reset_peak_memory()

    def record(self, live: int) -> None:
        lru = sum(g.prompt_cache.nbytes for g in self.generators if hasattr(g, "prompt_cache"))
        with self.lock:
            self.live_peak = max(self.live_peak, live)
            self.lru_peak = max(self.lru_peak, lru)
            self.cache_peak = max(self.cache_peak, live + lru)

    def dump_forever(self, period: float = 0.2) -> None:
        import mlx.core as mx

        from mlx_mla import blas

        kind = blas.describe()["kind"] if mx.default_device() == mx.cpu else "gpu"
        while True:
            with self.lock:
                stats = {"blas": kind, "weight_bytes": self.weights,
                         "live_cache_peak_bytes": self.live_peak,
                         "lru_cache_peak_bytes": self.lru_peak,
                         "cache_peak_bytes": self.cache_peak}
            stats["mlx_peak_bytes"] = mx.get_peak_memory()
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stats))
            tmp.replace(self.path)
            time.sleep(period)


def serve(engine: str, stats_path: Path, server_args: List[str]) -> None:
    """Run ``engine``'s server (its own main, its own flags) with the cache watch installed;
    SIGUSR1 resets the peaks. Never returns normally (exits the process)."""
    import mlx_lm.server as mls

    from .engines import weight_bytes

    watch = _Watch(stats_path)

    class WatchedBatchGenerator(mls.BatchGenerator):
        def __init__(self, model, *a, **k):
            super().__init__(model, *a, **k)
            watch.weights = weight_bytes(model)

        def next(self):
            out = super().next()
            watch.record(self.prompt_cache_nbytes)
            return out

    init = mls.ResponseGenerator.__init__

    def registering_init(self, *a, **k):
        watch.generators.append(self)
        init(self, *a, **k)

    mls.BatchGenerator = WatchedBatchGenerator
    mls.ResponseGenerator.__init__ = registering_init
    signal.signal(signal.SIGUSR1, watch.reset)
    threading.Thread(target=watch.dump_forever, daemon=True).start()
    if engine == "mlx_mla":
        from mlx_mla.server import main

        status = main(server_args)
    else:
        sys.argv = ["mlx_lm.server", *server_args]
        status = mls.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)  # as mlx_mla.server.cli: no interpreter shutdown racing MLX threads


# ---------------------------------------------------------------- the harness

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (``python -m benchmarks.server_load --serve ENGINE ...``)."""

    def __init__(self, engine: str, folder: Path, workdir: Path, log):
        self.engine, self.port = engine, free_port()
        self.stats_path = workdir / f"stats-{engine}.json"
        self.log_file = open(workdir / f"server-{engine}.log", "w")
        cmd = [sys.executable, "-m", "benchmarks.server_load", "--serve", engine,
               "--stats", str(self.stats_path), "--", "--model", str(folder),
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[1])
        t0 = time.perf_counter()
        while True:  # the first answered request means the model is loaded
            if self.proc.poll() is not None:
                raise RuntimeError(f"{engine} server exited: see {self.log_file.name}")
            try:
                stream_completion(self.port, "t2 t3 t4", 2)
                break
            except OSError:
                time.sleep(1.0)
        self.blas = self.stats()["blas"]
        log(f"{engine}: server up in {time.perf_counter() - t0:.1f} s (port {self.port}, "
            f"BLAS {self.blas})")

    def reset_peaks(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)

    def stats(self) -> Dict:
        time.sleep(0.5)  # one dump period after the phase
        stats = json.loads(self.stats_path.read_text())
        status = Path(f"/proc/{self.proc.pid}/status")
        if status.exists():  # Linux: the process's lifetime peak resident set
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    stats["rss_peak_bytes"] = int(line.split()[1]) * 1024
        return stats

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


def stream_completion(port: int, prompt: str, max_tokens: int, timeout: float = 1800) -> Dict:
    """One streamed greedy text completion: send time, token arrival times, usage.

    Raises:
        OSError: no connection; RuntimeError: a non-200 answer.
    """
    import http.client

    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    arrivals, usage = [], None
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        elif event["choices"] and event["choices"][0].get("text"):
            arrivals.append(time.perf_counter())
    conn.close()
    return {"sent": sent, "arrivals": arrivals, "done": time.perf_counter(), "usage": usage}


def random_prompt(rng: random.Random, n: int, config: Dict) -> List[str]:
    """``n`` random words of the word tokenizer, never the BOS or EOS id."""
    special = {config["bos_token_id"], config["eos_token_id"]}
    words = []
    while len(words) < n:
        i = rng.randrange(config["vocab_size"])
        if i not in special:
            words.append(f"t{i}")
    return words


def load_phase(server: Server, clients: int, prompt_tokens: int, max_tokens: int,
               config: Dict, rng: random.Random) -> Dict:
    """``clients`` concurrent streamed requests with distinct random prompts; one row."""
    prompts = [" ".join(random_prompt(rng, prompt_tokens, config)) for _ in range(clients)]
    results: List[Optional[Dict]] = [None] * clients
    barrier = threading.Barrier(clients)

    def client(i):
        barrier.wait()
        results[i] = stream_completion(server.port, prompts[i], max_tokens)

    server.reset_peaks()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = min(r["sent"] for r in results)
    wall = max(r["done"] for r in results) - start
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    ttft = [r["arrivals"][0] - r["sent"] for r in results]
    gaps = np.concatenate([np.diff(r["arrivals"]) for r in results])
    stats = server.stats()
    return {
        "engine": server.engine, "phase": "load", "layers": config["num_hidden_layers"],
        "clients": clients,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_reported": sum(r["usage"]["prompt_tokens"] for r in results) / clients,
        "completion_tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p95_s": float(np.percentile(ttft, 95)),
        "token_latency_p50_s": float(np.percentile(gaps, 50)),
        "token_latency_p95_s": float(np.percentile(gaps, 95)), **stats,
    }


def reuse_phase(server: Server, prompt_tokens: int, config: Dict, rng: random.Random) -> Dict:
    """The prefix pair: time to first token of each and what the second reports cached."""
    prefix = random_prompt(rng, prompt_tokens, config)
    out = []
    for _ in range(2):
        prompt = " ".join(prefix + random_prompt(rng, SUFFIX_TOKENS, config))
        out.append(stream_completion(server.port, prompt, 4))
    first, second = (r["arrivals"][0] - r["sent"] for r in out)
    details = out[1]["usage"].get("prompt_tokens_details") or {}
    return {"engine": server.engine, "blas": server.blas, "phase": "reuse",
            "layers": config["num_hidden_layers"],
            "clients": 1,
            "prompt_tokens": prompt_tokens + SUFFIX_TOKENS, "ttft_first_s": first,
            "ttft_second_s": second, "ttft_speedup": first / second,
            "cached_tokens_second": details.get("cached_tokens")}


def ratios(rows: List[Dict]) -> Dict[str, float]:
    """The targets, as mlx_mla / mlx-lm ratios in this run."""
    def get(engine, phase, **kv):
        return next(r for r in rows if r["engine"] == engine and r["phase"] == phase
                    and all(r.get(k) == v for k, v in kv.items()))

    out = {}
    for c in sorted({r["clients"] for r in rows if r["phase"] == "load"}):
        ours, theirs = get("mlx_mla", "load", clients=c), get("mlx-lm", "load", clients=c)
        out[f"cache_bytes_{c}_clients"] = ours["cache_peak_bytes"] / theirs["cache_peak_bytes"]
        out[f"aggregate_tok_s_{c}_clients"] = ours["aggregate_tok_s"] / theirs["aggregate_tok_s"]
        out[f"ttft_p50_{c}_clients"] = ours["ttft_p50_s"] / theirs["ttft_p50_s"]
        out[f"token_latency_p50_{c}_clients"] = (ours["token_latency_p50_s"]
                                                 / theirs["token_latency_p50_s"])
    for r in rows:
        if r["phase"] == "reuse":
            out[f"reuse_ttft_speedup_{r['engine']}_{r['layers']}_layers"] = r["ttft_speedup"]
    return out


def plot(rows: List[Dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = [r for r in rows if r["phase"] == "load"]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    panels = [("aggregate_tok_s", "aggregate generated tok/s", 1),
              ("ttft_p50_s", "time to first token p50 (s)", 1),
              ("token_latency_p50_s", "per-token latency p50 (s)", 1),
              ("cache_peak_bytes", "peak cache memory (MiB)", 2**20)]
    for ax, (key, title, scale) in zip(axes, panels):
        for engine, style in zip(ENGINES, ("-o", "--s")):
            sel = sorted((r for r in load if r["engine"] == engine), key=lambda r: r["clients"])
            ax.plot([r["clients"] for r in sel], [r[key] / scale for r in sel], style, label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"servers on one 4-bit DeepSeek-V2-Lite-shaped folder, "
                 f"{load[0]['prompt_tokens']}-token prompts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(config: Dict, workdir: Path, clients=(1, 4, 16), prompt_tokens: int = 2048,
        max_tokens: int = 32, reuse_config: Optional[Dict] = None, log=print) -> List[Dict]:
    """Every measurement, both engines; rows as in the CSV."""
    folder = write_folder(config, workdir / "model")
    rows = []
    for engine in ENGINES:
        rng = random.Random(0)  # the same prompts for both engines
        server = Server(engine, folder, workdir, log)
        try:
            for c in clients:
                rows.append(load_phase(server, c, prompt_tokens, max_tokens, config, rng))
                log(json.dumps(rows[-1]))
            rows.append(reuse_phase(server, prompt_tokens, config, rng))
            log(json.dumps(rows[-1]))
        finally:
            server.stop()
    if reuse_config is not None:
        folder = write_folder(reuse_config, workdir / "model-reuse")
        for engine in ENGINES:
            server = Server(engine, folder, workdir, log)
            try:
                rows.append(reuse_phase(server, prompt_tokens, reuse_config, random.Random(1)))
                log(json.dumps(rows[-1]))
            finally:
                server.stop()
    return rows


FIELDS = ["engine", "blas", "phase", "layers", "clients", "prompt_tokens", "prompt_tokens_reported",
          "completion_tokens", "wall_s", "aggregate_tok_s", "ttft_p50_s", "ttft_p95_s",
          "token_latency_p50_s", "token_latency_p95_s", "weight_bytes", "cache_peak_bytes",
          "live_cache_peak_bytes", "lru_cache_peak_bytes", "mlx_peak_bytes", "rss_peak_bytes",
          "ttft_first_s", "ttft_second_s", "ttft_speedup", "cached_tokens_second"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the load run")
    p.add_argument("--reuse-layers", type=int, default=2,
                   help="decoder layers of the extra prompt-reuse run (0: skip it)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--serve", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    p.add_argument("server_args", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.stats, args.server_args)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        reuse = one_moe_layer(V2_LITE, args.reuse_layers) if args.reuse_layers else None
        rows = run(one_moe_layer(V2_LITE, args.layers), Path(tmp), tuple(args.clients),
                   args.prompt_tokens, args.max_tokens, reuse,
                   log=lambda m: print(m, flush=True))
    kinds = {r["blas"] for r in rows if "blas" in r}
    if len(kinds) != 1:
        raise SystemExit(f"error: the servers ran on different BLAS ({sorted(kinds)}): "
                         "the ratios would not compare like with like")
    stem = f"server_load_{kinds.pop()}"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / f"{stem}.csv", FIELDS)
    result = {"machine": machine_info(), "load": load_average(), "rows": rows,
              "ratios": ratios(rows), "seconds": time.perf_counter() - t0}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out / f"{stem}.png")
    print(json.dumps(result["ratios"], indent=2))
    return 0


def load_average() -> Optional[List[float]]:
    """The machine's 1/5/15-minute load averages at the end (others share the CPU)."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
