#!/usr/bin/env bash
# On the H200 (<= 7 min): the runahead CPU-contract tests on CUDA, then the runahead benchmark for
# uniform and synthetic skewed routing at 25% cache (50% if the time budget allows).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
HEARTH_TEST_DEVICE=cuda timeout 90 python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider \
    tests/engine/test_runahead.py tests/engine/test_offload_engine.py \
    2>&1 | tee "$OUT/runahead_tests.log" | tail -8
# --budget-s: no configuration starts after 230 s; the JSON is rewritten after each one.
timeout 320 python3 bench/bench_runahead.py --moe-layers 3 --concurrency 8 32 1 --tokens 6 \
    --cache-fraction 0.25 0.5 --routing uniform skewed --budget-s 230 \
    --json "$OUT/runahead.json" 2>&1 | tee "$OUT/runahead.log"
