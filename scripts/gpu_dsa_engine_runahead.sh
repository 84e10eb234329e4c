#!/usr/bin/env bash
# On the H200: engine conformance with the Triton DSA kernels on, then the runahead benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
HEARTH_TEST_DEVICE=cuda timeout 150 python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider \
    tests/engine/test_dsa_kernels_engine.py tests/engine/test_offload_engine.py \
    2>&1 | tee "$OUT/dsa_engine_tests.log" | tail -8
timeout 330 python3 bench/bench_runahead.py --moe-layers 3 --concurrency 1 8 32 --tokens 6 \
    --json "$OUT/runahead.json" 2>&1 | tee "$OUT/runahead.log"
