#!/usr/bin/env bash
# The user's-path benchmark on the GPU machine (run from the repository root through the device tool):
# GPU tests of the FP8 linear kernels and the engine paths they feed, the FP8 linear microbenchmark, then
# bench/bench_e2e.py. Results and logs go to $OUT. Needs the server's and the OpenAI client's wheels
# (fastapi, uvicorn, openai, ...) on PYTHONPATH when the machine lacks them.
#   usage: bash scripts/gpu_e2e.sh [tests] [micro] [sweep] [e2e -- bench_e2e args...]
#   e2e families: --family deepseek_v32 (default), glm_moe_dsa (GLM-5), glm4_moe (GLM-4.5-Air, bf16),
#   gpt_oss (gpt-oss-120b, MXFP4 experts); see bench/bench_e2e.py and docs/benchmarks.md.
#   chat cache (issue 16, C2: a 64K chat's follow-up TTFT on the GPU, after a chat switch, after a restart,
#   against a full re-prefill): bash scripts/gpu_e2e.sh e2e -- --configs chat-cache --chat-context 65536 --reps 2
set -o pipefail
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
steps=()
while [[ $# -gt 0 && $1 != -- ]]; do steps+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
for step in "${steps[@]}"; do
    case $step in
    tests)
        export HEARTH_TEST_DEVICE=cuda
        timeout 300 python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider -x tests/kernels/test_fp8_linear.py \
            tests/engine/test_dsa_kernels_engine.py tests/engine/test_cuda_graphs.py tests/engine/test_fused_experts.py \
            tests/engine/test_runner.py tests/engine/test_mli.py tests/engine/test_loader_errors.py 2>&1 | tee "$OUT/tests.log" | tail -25 || rc=1 ;;
    micro) timeout 200 python3 bench/bench_fp8_linear.py --json "$OUT/fp8_linear.json" 2>&1 | tee "$OUT/fp8_linear.log" || rc=1 ;;
    sweep) timeout 170 python3 bench/bench_fp8_linear.py --rows 1 --sweep --json "$OUT/fp8_sweep.json" \
            2>&1 | grep -E "best|Error|error" | tee "$OUT/fp8_sweep.log" || rc=1 ;;
    e2e) python3 bench/bench_e2e.py --dir /tmp/hearth-ckpt --logs "$OUT" --json "$OUT/e2e.json" "$@" 2>&1 \
            | tee "$OUT/e2e.log" || rc=1 ;;
    esac
done
exit $rc
