#!/usr/bin/env bash
# Train the bundled demo model on one GPU within a hard wall-clock budget (default 420 s, so the
# whole run fits one 600 s device call with room to spare).
#
# Run from the repo root on the GPU machine (torch with CUDA, tokenizers, safetensors, numpy; no
# network) with the corpus folder from scripts/fetch_corpus.sh carried along as .corpus/:
#
#   OUT=/some/dir bash scripts/train_demo_gpu.sh
#   OUT=/some/dir BUDGET=300 COMPILE=1 bash scripts/train_demo_gpu.sh    # shorter; torch.compile
#
# Writes $OUT/demo_model/: config.json, model.safetensors (bf16, ~24 MB), tokenizer files,
# generation_config.json, loss_log.csv, loss_curve.svg, samples.txt, training_summary.json and
# MODEL_CARD.md, plus $OUT/train.log. Copy the folder over resources/demo_model/ to ship it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
BUDGET="${BUDGET:-420}"
PRESET="${PRESET:-h200}"
EXTRA=()
[ "${COMPILE:-0}" = 1 ] && EXTRA+=(--compile)
for f in tokens.npy tokenizer.json tokenizer_config.json; do
    [ -f ".corpus/$f" ] || { echo "missing .corpus/$f: run scripts/fetch_corpus.sh and carry .corpus" >&2; exit 2; }
done
# hearth is importable as a namespace package from the work tree (no pip install needed).
source scripts/gpu_env.sh
mkdir -p "$OUT/demo_model"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
# The script stops training BUDGET - 40 s after it starts, then evaluates, saves and samples
# (sampling stops 3 s before BUDGET, keeping what it has);
# `timeout` is only a backstop should something hang.
timeout $((BUDGET + 30)) python -m train.train_demo --data .corpus --out "$OUT/demo_model" --preset "$PRESET" \
    --time-budget "$BUDGET" --reserve 40 --dense-frac 0.05 --log-every 50 --eval-every 5 --patience 4 \
    ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 \
    | tee "$OUT/train.log"
ls -la "$OUT/demo_model"
