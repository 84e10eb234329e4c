#!/usr/bin/env bash
# On the H200: CUDA-graph decode and fused resident experts (GPU tests), then the whole-decode-step
# benchmark (bench/bench_decode_step.py). Logs go to $OUT. SKIP_TESTS=1 skips the tests;
# TEST_TIMEOUT / BENCH_TIMEOUT cap each part (180 s / 200 s).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  HEARTH_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider -x \
      tests/engine/test_cuda_graphs.py tests/engine/test_fused_experts.py tests/engine/test_dsa_kernels_engine.py \
      2>&1 | tee "$OUT/decode_step_tests.log" | tail -25
fi
timeout "${BENCH_TIMEOUT:-200}" python3 bench/bench_decode_step.py --context 4096 --batch 1 8 --steps 30 \
    --json "$OUT/decode_step.json" 2>&1 | tee "$OUT/decode_step.log"
