# Sourced by every GPU script (run from the repository root on the device machine): makes the work
# tree importable as hearth.* without installing it, and sets OUT (default /tmp/hearth-out).
#
# NOTE: /tmp/hp/hearth is a folder of links, one per package folder. It must never be a link to the
# repository root itself (an older script did that): links made through it would then land inside
# the checkout (engine/engine -> engine) and imports would recurse. A leftover link is removed.
# shellcheck shell=bash
OUT="${OUT:-/tmp/hearth-out}"; mkdir -p "$OUT"
[ -L /tmp/hp/hearth ] && rm /tmp/hp/hearth
mkdir -p /tmp/hp/hearth
for d in app engine kernels offload resources; do ln -sfn "$PWD/$d" "/tmp/hp/hearth/$d"; done
export OUT PYTHONPATH="/tmp/hp:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
