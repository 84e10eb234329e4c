#!/usr/bin/env bash
# Expert offload on the H200: GPU tests of the fused MoE kernel and the expert offload, then the benchmark in
# three processes (per-layer decode + prefill; Hearth model decode; transformers + accelerate baseline).
# Every part runs under `timeout` against one deadline, so the whole script ends within BUDGET_S
# (default 470 s) even when a part hangs. Logs and JSON go to $OUT.
# Usage (device machine): bash scripts/gpu_offload.sh
#   SKIP_TESTS=1  skip pytest;  LAYERS / STEPS  decode store layers / timed steps;
#   CONTEXT  model/hf context (4096);  HF_TOKENS  timed transformers tokens (2).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
END=$((SECONDS + ${BUDGET_S:-470}))
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# run_part NAME CAP_S RESERVE_S CMD...: at most CAP_S, and leave RESERVE_S for the parts after it.
run_part() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local left=$((END - SECONDS - reserve))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 20 ]; then echo "== $name: skipped, ${left}s left" | tee "$OUT/$name.log"; return; fi
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc $rc in $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')" | tee -a "$OUT/$name.log"
}

if [ -z "${SKIP_TESTS:-}" ]; then
  run_part gpu_tests 120 250 python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider tests/kernels/test_moe.py tests/offload
fi
run_part bench_layers 200 150 python3 bench/bench_offload.py --parts decode,prefill --layers "${LAYERS:-4}" \
  --steps "${STEPS:-12}" --json "$OUT/bench_layers.json"
run_part bench_model 100 100 python3 bench/bench_offload.py --parts model --context "${CONTEXT:-4096}" \
  --json "$OUT/bench_model.json"
run_part bench_hf 200 0 python3 bench/bench_offload.py --parts hf --context "${CONTEXT:-4096}" \
  --hf-tokens "${HF_TOKENS:-2}" --hearth-json "$OUT/bench_model.json" --json "$OUT/bench_hf.json"

echo "== summary (${SECONDS}s)"
grep -h -E "passed|failed|check |host-expert|auto decision|T=[18] |prefill .*tokens/layer|hearth model:|hf baseline:|hearth vs|^== " \
  "$OUT"/gpu_tests.log "$OUT"/bench_*.log 2>/dev/null
