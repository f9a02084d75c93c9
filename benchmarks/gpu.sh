#!/usr/bin/env bash
# One prepared accelerator run: the RL update step and the sampler of a ~0.5B MoE in
# bfloat16 (tokens/s, MFU, decode HBM bandwidth). Needs only JAX (with CUDA), flax and
# optax: policyopt is used from this checkout, not installed. Finishes in < 5 minutes.
#
#   bash benchmarks/gpu.sh [OUT_DIR]        # writes OUT_DIR/gpu_bench.json (default: $OUT or .)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
timeout 280 python3 benchmarks/gpu_bench.py --out "$out/gpu_bench.json" "${@:2}"
