#!/usr/bin/env bash
# Issue O1 on the H200: GPU tests of the fused MoE kernel and the expert offload, then the benchmark.
# Usage (device machine, repository root): bash bench/gpu_o1.sh   (writes logs to $OUT when set)
set -uo pipefail
OUT=${OUT:-/tmp/o1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=/tmp/hearth_pp
if [ -n "${PYTHONPATH:-}" ]; then  # no editable install: expose the folders as hearth.*
  mkdir -p /tmp/hearth_pp/hearth && for d in kernels offload engine app resources; do ln -sfn "$PWD/$d" /tmp/hearth_pp/hearth/$d; done
  export PYTHONPATH=/tmp/hearth_pp:$PWD
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -z "${O1_SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py tests/offload 2>&1 | tee "$OUT/gpu_tests.log"
fi
python3 bench/bench_offload.py --layers "${O1_LAYERS:-4}" --steps "${O1_STEPS:-12}" --json "$OUT/bench_offload.json" \
  2>&1 | tee "$OUT/bench_offload.log"
