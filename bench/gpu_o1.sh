#!/usr/bin/env bash
# Issue O1 on the H200: GPU tests of the fused MoE kernel and the expert offload, then the benchmark in
# three processes (per-layer decode + prefill; Hearth model decode; transformers + accelerate baseline).
# Every part runs under `timeout` against one deadline, so the whole script ends within O1_BUDGET_S
# (default 470 s) even when a part hangs. Logs and JSON go to $OUT.
# Usage (device machine, repository root): bash bench/gpu_o1.sh
#   O1_SKIP_TESTS=1  skip pytest;  O1_LAYERS / O1_STEPS  decode store layers / timed steps;
#   O1_CONTEXT  model/hf context (4096);  O1_HF_TOKENS  timed transformers tokens (2).
set -uo pipefail
OUT=${OUT:-/tmp/o1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
END=$((SECONDS + ${O1_BUDGET_S:-470}))
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=/tmp/hearth_pp
if [ -n "${PYTHONPATH:-}" ]; then  # no editable install: expose the folders as hearth.*
  mkdir -p /tmp/hearth_pp/hearth && for d in kernels offload engine app resources; do ln -sfn "$PWD/$d" /tmp/hearth_pp/hearth/$d; done
  export PYTHONPATH=/tmp/hearth_pp:$PWD
fi
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

if [ -z "${O1_SKIP_TESTS:-}" ]; then
  run_part gpu_tests 120 250 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py tests/offload
fi
run_part bench_layers 200 150 python3 bench/bench_offload.py --parts decode,prefill --layers "${O1_LAYERS:-4}" \
  --steps "${O1_STEPS:-12}" --json "$OUT/bench_layers.json"
run_part bench_model 100 100 python3 bench/bench_offload.py --parts model --context "${O1_CONTEXT:-4096}" \
  --json "$OUT/bench_model.json"
run_part bench_hf 200 0 python3 bench/bench_offload.py --parts hf --context "${O1_CONTEXT:-4096}" \
  --hf-tokens "${O1_HF_TOKENS:-2}" --hearth-json "$OUT/bench_model.json" --json "$OUT/bench_hf.json"

echo "== summary (${SECONDS}s)"
grep -h -E "passed|failed|check |host-expert|auto decision|T=[18] |prefill .*tokens/layer|hearth model:|hf baseline:|hearth vs|^== " \
  "$OUT"/gpu_tests.log "$OUT"/bench_*.log 2>/dev/null
