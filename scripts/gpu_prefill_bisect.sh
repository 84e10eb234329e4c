#!/usr/bin/env bash
# Issue O2 item 4: find what slowed streamed prefill with offloaded experts (88% / 94% of the link floor at
# 4K / 16K tokens on 2026-11-29 with the tree just before 34f5080; 67% / 58% on 2026-12-01). Each tree's
# own bench/bench_offload.py --parts prefill runs on the GPU machine, which has no git history, so the
# trees are exported here first and carried along:
#   bash scripts/gpu_prefill_bisect.sh prepare 873be03 34f5080     # on the dev machine: writes .bisect/<rev>/
#   (device tool, carry [".bisect", ".whl"]): bash scripts/gpu_prefill_bisect.sh run
# `run` times every tree under .bisect/ and the working tree ("head"); logs go to $OUT/prefill-<rev>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
prepare)
    shift
    for rev in "$@"; do
        rm -rf ".bisect/$rev" && mkdir -p ".bisect/$rev"
        git archive "$rev" engine kernels offload bench | tar -x -C ".bisect/$rev"
    done ;;
run)
    source scripts/gpu_env.sh
    time_tree() {  # folder label
        local dir=$1 links=/tmp/hp-bisect-$2
        mkdir -p "$links/hearth"
        for pkg in engine kernels offload; do ln -sfn "$dir/$pkg" "$links/hearth/$pkg"; done
        (cd "$dir" && PYTHONPATH="$links:$dir" timeout 150 python3 bench/bench_offload.py --parts prefill \
            --layers 2 > "$OUT/prefill-$2.log" 2>&1)
        echo "== $2"; grep -i -A6 "prefill" "$OUT/prefill-$2.log" | tail -8
    }
    for dir in .bisect/*/; do time_tree "$PWD/$dir" "$(basename "$dir")"; done
    time_tree "$PWD" head ;;
*) echo "usage: $0 prepare REV... | run" >&2; exit 2 ;;
esac
