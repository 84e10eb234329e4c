#!/usr/bin/env bash
# On the GPU machine: the engine conformance suite on CUDA in fp32 and bf16.
# Run there as: bash scripts/gpu_conformance.sh   (writes logs to $OUT when set)
set -uo pipefail
cd "$(dirname "$0")/.."
# The device image has torch/triton/transformers but no network: expose the repo's folders as the
# hearth.* namespace through a symlink farm instead of pip-installing.
source scripts/gpu_env.sh
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
HEARTH_TEST_DEVICE=cuda python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -p no:cacheprovider tests/engine/test_conformance.py tests/engine/test_engine.py \
    2>&1 | tee "$OUT/conformance_cuda.log" | tail -15
