#!/usr/bin/env bash
# The strategy and end-to-end benchmarks on MLX's CUDA backend (Linux, an NVIDIA GPU).
#
#   bash benchmarks/gpu_check.sh            # from the repository root; ~8 minutes
#
# Makes a virtual environment .venv-cuda beside the checkout's own, installs mlx-mla with
# mlx[cuda] into it, checks that MLX's default device is a CUDA GPU, then runs
#   python -m benchmarks.mla_strategies   (one MLA layer at DeepSeek-V2-Lite's shape)
#   python -m benchmarks.e2e_decode       (a 2-layer V2-Lite-shaped 4-bit model, mlx_mla vs mlx-lm)
# each under `timeout`, writing benchmarks/results/cuda/{mla_strategies,e2e_decode}.* beside
# the CPU results. On a machine without internet, download the wheels elsewhere first (same
# OS, CPU architecture and Python version) and point WHEELS at them:
#   pip download -d wheels "mlx[cuda]>=0.30" "mlx-lm>=0.30" numpy safetensors \
#       huggingface-hub tqdm matplotlib setuptools
#   WHEELS=$PWD/wheels bash benchmarks/gpu_check.sh
# Budgets (seconds) per step: INSTALL_S (default 180), STRATEGIES_S (120), E2E_S (180).
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/cuda
mkdir -p "$out"
t0=$(date +%s)

python3 -m venv .venv-cuda
. .venv-cuda/bin/activate
pip_opts=(-q)
if [[ -n "${WHEELS:-}" ]]; then pip_opts+=(--no-index --find-links "$WHEELS"); fi
timeout "${INSTALL_S:-180}" pip install "${pip_opts[@]}" -e ".[cuda,bench]"

python - <<'PY'
import mlx.core as mx
if mx.default_device() != mx.gpu or mx.metal.is_available():
    raise SystemExit("error: MLX's default device is not a CUDA GPU here "
                     f"({mx.default_device()}); is mlx[cuda] installed and a GPU visible?")
print("MLX", mx.__version__, "on", mx.default_device(), mx.device_info() if hasattr(mx, "device_info") else "")
PY

# A GPU runs each benchmark once, in this process's backend ("--blas current").
timeout "${STRATEGIES_S:-120}" python -m benchmarks.mla_strategies --blas current \
    --repeats 5 --out "$out" 2>&1 | tee "$out/mla_strategies.log"
timeout "${E2E_S:-180}" python -m benchmarks.e2e_decode --blas current --prefill-v3 \
    --out "$out" 2>&1 | tee "$out/e2e_decode.log"
echo "gpu_check: done in $(( $(date +%s) - t0 )) s; results in $out"
