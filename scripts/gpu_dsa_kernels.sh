#!/usr/bin/env bash
# On the H200: GPU-side kernel tests (all of tests/kernels, the small odd-size cases on CUDA plus the
# `gpu`-marked real shapes), then the DSA benchmark. Logs and the result table go to $OUT.
# Usage: bash scripts/gpu_dsa_kernels.sh [tests|bench|all|topk] [bench args]
# (topk: only bench/bench_topk.py, the sampled and single-pass decode top-k against radix select and torch.topk)
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export TRITON_DEFAULT_FP_FUSION=1
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
    timeout 300 python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider -n 8 tests/kernels 2>&1 | tee "$OUT/tests.log" | tail -40
    rc=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
    python3 bench/bench_dsa.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
if [[ $what == topk ]]; then
    python3 bench/bench_topk.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_topk.log" || rc=1
fi
exit $rc
