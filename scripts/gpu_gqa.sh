#!/usr/bin/env bash
# On the H200: the GQA families' fast path (paged GQA decode kernel, CUDA graphs, gpt-oss's experts through
# the fused MoE kernel) against the plain path and transformers, on CUDA. Logs go to $OUT.
#   usage: bash scripts/gpu_gqa.sh            (then, for speed: bash scripts/gpu_e2e.sh e2e -- --family glm4_moe ...)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export HEARTH_TEST_DEVICE=cuda
timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider \
    tests/kernels/test_gqa_attention.py tests/kernels/test_moe.py tests/engine/test_gqa_kernels_engine.py \
    tests/engine/test_fused_experts.py tests/engine/test_runner.py tests/engine/test_gpt_oss.py \
    tests/engine/test_conformance_glm4_moe.py \
    "tests/engine/test_conformance.py::test_prefill_logits_match_transformers" \
    "tests/engine/test_conformance.py::test_greedy_decode_matches_transformers" \
    2>&1 | tee "$OUT/gqa_tests.log" | tail -30
