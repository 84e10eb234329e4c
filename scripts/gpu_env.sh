# Sourced by the GPU scripts (run from the repository root on the device machine): makes the work
# tree importable as hearth.* without installing it, and sets OUT (default /tmp/hearth-out).
# shellcheck shell=bash
OUT="${OUT:-/tmp/hearth-out}"; mkdir -p "$OUT"
mkdir -p /tmp/hp/hearth
for d in app engine kernels offload resources; do ln -sfn "$PWD/$d" "/tmp/hp/hearth/$d"; done
export OUT PYTHONPATH="/tmp/hp:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
