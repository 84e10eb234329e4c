#!/usr/bin/env bash
# Installs Hearth into .venv and starts it (the desktop app; pass --cli ... for the terminal).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0" -e .
exec hearth "$@"
