#!/usr/bin/env bash
# Installs Hearth with its test extras into .venv (on a clean clone, and again when pyproject.toml
# changes; see scripts/install.sh) and runs the whole test suite (ruff, mypy and import contracts
# included). torch==2.13.0 is pinned first so a CPU-only machine takes the local CPU wheel instead
# of downloading a multi-GB CUDA build.
#
#   bash scripts/test.sh                 # everything (what CI runs)
#   bash scripts/test.sh --fast          # leaves out the tests marked slow (whole-model runs, subprocesses)
#   bash scripts/test.sh tests/app -x    # other arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/install.sh
hearth_ensure_installed .venv "$PWD" "[test]"
. .venv/bin/activate
export QT_QPA_PLATFORM=offscreen TRITON_INTERPRET=1 HF_HUB_OFFLINE=0 HF_HUB_DISABLE_TELEMETRY=1
if [ "${1:-}" = "--fast" ]; then
    shift
    set -- -m "not slow" "$@"
fi
exec python -m pytest -q "$@"
