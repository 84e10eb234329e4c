#!/usr/bin/env bash
# Long context on the H200: the tier / MLI tests on CUDA, then bench/bench_longctx.py (tests <= 150 s,
# bench <= 250 s). Run there as: bash scripts/gpu_longctx.sh   (logs and bench_longctx.json go to $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
# No network on the device image: expose the repo's folders as the hearth.* namespace via symlinks.
source scripts/gpu_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
HEARTH_TEST_DEVICE=cuda timeout 150 python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider \
    tests/offload/test_tiered_keys.py tests/offload/test_tiered_latents.py \
    tests/engine/test_tiers_engine.py tests/engine/test_mli.py \
    2>&1 | tee "$OUT/longctx_tests.log" | tail -12
# --time-limit skips the configurations that would start after 185 s; timeout is the hard stop.
timeout 250 python3 bench/bench_longctx.py --out "$OUT" --time-limit 185 "$@" 2>&1 | tee "$OUT/longctx_bench.log"
