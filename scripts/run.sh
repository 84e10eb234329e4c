#!/usr/bin/env bash
# Starts Hearth (the desktop app; pass --cli ... for the terminal), installing it into .venv first
# when needed: on the first run and after pyproject.toml changes (see scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/install.sh
hearth_ensure_installed .venv "$PWD" ""
exec .venv/bin/hearth "$@"
