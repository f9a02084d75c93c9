#!/usr/bin/env bash
# One prepared accelerator run, in five stages, each under its own time limit so that one
# stage failing or running long still leaves the others' figures:
#
#   1. gpu_bench.py: the RL update step and the sampler of a ~0.5B MoE in bfloat16
#      (tokens/s, MFU, decode HBM bandwidth);
#   2. the numerical tests of the core, the models, the MoE and the sampler, run on the
#      accelerator with float32 matmuls at full precision (no TF32);
#   3. bench_moe: the MoE dispatches (ragged_dot, blocked with each weight gather) in
#      bfloat16 at the update's size;
#   4. bench_core: every policy loss and GAE variant against the elementwise pass, on the
#      accelerator (the issue-2 table, accelerator edition);
#   5. a profile of stage 1's programs: device time per HLO op (gpu_profile.json).
#
# Needs only JAX (with CUDA), flax, optax, chex and pytest (the tests of stage 2 also
# torch and transformers, for the HF reference model): policyopt is used from this
# checkout, not installed. Takes < 9 minutes (the first four stages < 6).
#
#   bash benchmarks/gpu.sh [OUT_DIR [gpu_bench.py options]]   # writes gpu.log and *.json
#                                        # under OUT_DIR ($OUT or .); exit 1 if a stage failed
#   SMOKE=1 bash benchmarks/gpu.sh /tmp/x  # tiny sizes, to check the script on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."
out="$(mkdir -p "${1:-${OUT:-.}}" && cd "${1:-${OUT:-.}}" && pwd)" || exit 1
log="$out/gpu.log"
: > "$log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
py=python3
[ -x .venv/bin/python ] && [ -n "${SMOKE:-}" ] && py=.venv/bin/python
smoke="${SMOKE:+--smoke}"

failed=()
stage() {  # stage NAME LIMIT_S COMMAND...: run with a time limit, log, report rc and seconds
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name (limit ${limit}s)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "=== $name rc=$rc in $(( $(date +%s) - start ))s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>/dev/null
    $py -c "import sys, jax, jaxlib, flax, optax, chex, numpy; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'chex', chex.__version__, 'numpy', numpy.__version__); print(jax.devices())"
} 2>&1 | tee -a "$log"

if [ -n "${SMOKE:-}" ]; then
    core_args=(--batch 8 --length 64 --repeats 2 --numpy_rows 4)
    moe_args=(--tokens 64 --hidden 32 --expert-width 32 --experts 4 8 --repeats 2)
    tests=(tests/test_losses.py)
else
    core_args=(--batch 256 --length 4096 --repeats 20 --numpy_rows 16)
    # moe_0p5b's MoE layer at the update's 32k tokens.
    moe_args=(--tokens 32768 --hidden 1024 --expert-width 352 --top-k 4 --experts 8 32 --repeats 10
              --dispatches ragged blocked:512:take blocked:512:onehot)
    # GPU_TESTS="tests/x.py ...": another selection (the default takes ~140 s on an H200).
    read -r -a tests <<< "${GPU_TESTS:-tests/test_losses.py tests/test_advantages.py tests/test_logprobs.py tests/models/test_moe.py tests/models/test_models.py tests/test_sampling.py}"
fi

# moe_0p5b trains and prefills with "blocked" and decodes with "ragged" (on a GPU a dense
# product over the experts, which reads each weight once: faster at a few tokens per expert).
stage gpu_bench 130 $py benchmarks/gpu_bench.py --out "$out/gpu_bench.json" $smoke "${@:2}"
JAX_PLATFORMS="${SMOKE:+cpu}" JAX_DEFAULT_MATMUL_PRECISION=highest \
    stage tests 150 $py -m pytest -q -rfE -p no:cacheprovider "${tests[@]}"
stage bench_moe 60 $py benchmarks/bench_moe.py --dtype bfloat16 --out "$out/bench_moe.json" "${moe_args[@]}"
stage bench_core 45 $py -m benchmarks.bench_core --out "$out/bench_core.json" "${core_args[@]}"
# The profile, in a process of its own: XLA:GPU runs most of a program as CUDA graphs
# ("command buffers"), which the profiler reports as one event each, so the per-op
# breakdown needs them off (which also makes these timings slower than stage 1's).
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
    stage profile 130 $py benchmarks/gpu_bench.py --out "$out/gpu_profile.json" \
    --profile "${TMPDIR:-/tmp}/policyopt_gpu_profile" $smoke "${@:2}"
date -u | tee -a "$log"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed stages: ${failed[*]}" | tee -a "$log"
    exit 1
fi
