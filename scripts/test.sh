#!/usr/bin/env bash
# Installs Hearth with its test extras into .venv and runs the whole test suite (ruff, mypy and
# import contracts included). torch==2.13.0 is pinned first so a CPU-only machine takes the local
# CPU wheel instead of downloading a multi-GB CUDA build.
#
#   bash scripts/test.sh                 # everything (what CI runs)
#   bash scripts/test.sh --fast          # leaves out the tests marked slow (whole-model runs, subprocesses)
#   bash scripts/test.sh tests/app -x    # other arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0" -e ".[test]"
export QT_QPA_PLATFORM=offscreen TRITON_INTERPRET=1 HF_HUB_OFFLINE=0 HF_HUB_DISABLE_TELEMETRY=1
if [ "${1:-}" = "--fast" ]; then
    shift
    set -- -m "not slow" "$@"
fi
exec python -m pytest -q "$@"
