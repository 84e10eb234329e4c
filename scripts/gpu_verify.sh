#!/usr/bin/env bash
# First GPU call of a session (run from the repository root through the device tool, carry [".whl"]):
# the GPU tests of code merged since the last GPU run, then the user's-path rows that code changes.
# Results under $OUT: tests.txt (pass/fail lines), e2e-*.log/json, all.tgz (full logs, server logs).
#   usage: bash scripts/gpu_verify.sh tests   (one call, ~5-6 min on a fresh machine), then bash scripts/gpu_verify.sh e2e (~6 min),
#   then `kernels` (~9 min: the A/B rows of kernel variants merged untimed, the sparse MLA sweep) and `c2` (~7 min: tiered decode
#   through the server, the chat cache across a restart, plain and tiered, planned tiers by kernel), one call each; `defaults`
#   (~6 min: the GPU tests and rows of defaults flipped on CPU evidence, the tiered 61-layer stack, the user's path resident;
#   `dtests`: its tests only); `c2k` (~6.5 min: the C2 kernels' tests and rows), `chat-tiers` (~4 min: a tiered chat's
#   follow-ups across restarts), `c2close` (~9 min: C2's open rows, then its tests),
#   `c2stack` (~5 min: the planned read and the tiered stack by candidate select, the tier tests), `one-launch` (~2 min),
#   `o2r` (~6 min: runahead / sync / prefetch on the kernel path, runahead tests), `o2e` (~7 min: the same through the server),
#   `o2g` (~2.5 min: auto's runahead gate on skewed small-cache rows), `k2t` (~8 min: the one-launch top-k's scan and
#   histogram variants, the decode indexer + top-k rows), `k2m` (~7 min: the warm-up tests, sparse MLA's deeper
#   prefetch swept at decode batch 64 and in prefill), `k2s` (~9 min: the one-launch top-k's 1-in-8 first histogram,
#   its tests and rows beside the exact one), `k2z` (~9 min: fine_bin's zero bins, the ReLU rows, narrower sampled bands), `k2b` (~5 min: the
#   indexer + top-k rows by the sampled band's width), `k2p` (~3 min: Nsight Compute on the one-launch select),
#   `k2q` (~3 min: the select's packed sums and scans, tests and rows), `k2d` (~7 min: programmatic dependent launch
#   between the decode indexer and the top-k, tests and rows; the select by programs per row), `k2e` (~6 min: the same
#   tests, the select's timeline, the indexer + top-k and the select's rows at the new defaults), `k2f` (~4 min: the
#   finish's first loaded block by size, on the indexer's logits), `k2c` (~5 min: the cooperative few-row top-k, its tests
#   and the decode rows at 1-4 requests beside the one-launch path), `ttft` (~4.5 min: a 2K prompt's first token with
#   experts in RAM, the server's stack samples over it), `first` (~7 min: the warm-up's tests, then on an empty Triton
#   cache the first 2K prompt after start, resident and with experts in RAM: what a first long prompt compiles), `k2n`
#   (~3 min: Nsight Compute on the persistent decode indexer at 1 and 8 x 128K), `k2i` (~5 min: the decode indexer and
#   the cooperative top-k in one launch, its tests and the decode rows at 1-4 requests beside the two launches),
#   `gluon` (~5 min: the Gluon sparse MLA kernels' GPU tests, then their decode and prefill rows, bf16 and FP8 caches).
#   E2E_DS_ONLY=1 leaves gpt-oss out of `e2e`.
# The wheels of the server and the OpenAI client (fastapi, uvicorn, openai, ...) come from .whl/ when
# the machine lacks them; checkpoints are written once per machine (bench_e2e reuses them).
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
source scripts/gpu_env.sh
steps=("$@"); [[ ${#steps[@]} -eq 0 ]] && steps=(tests)
mkdir -p "$OUT/l"
fams=(); [[ " ${steps[*]} " == *" e2e "* ]] && fams=(deepseek_v32) && [[ -z ${E2E_DS_ONLY:-} ]] && fams+=(gpt_oss)
[[ " ${steps[*]} " == *" c2 "* ]] && fams+=(deepseek_v32)
[[ " ${steps[*]} " == *" defaults "* || " ${steps[*]} " == *" o2e "* ]] && fams+=(deepseek_v32)
[[ " ${steps[*]} " == *" chat-tiers "* || " ${steps[*]} " == *" c2close "* || " ${steps[*]} " == *" ttft "* \
    || " ${steps[*]} " == *" first "* ]] \
    && fams+=(deepseek_v32)
(( ${#fams[@]} )) && ( for fam in $(printf '%s\n' "${fams[@]}" | sort -u); do python3 -c "
import sys, torch; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_e2e import write_checkpoint
write_checkpoint(Path('/tmp/ckpt-$fam'), '$fam', 2, torch.device('cuda'))"; done > "$OUT/l/ckpt.log" 2>&1 ) &
# The tests compare against the machine's transformers, which refuses huggingface_hub 2.x (Hearth's, from
# .whl): they see every brought wheel but that one.
tests_path=$PYTHONPATH
if [[ :$PYTHONPATH: == *:/tmp/site:* ]]; then
    tests_path=${PYTHONPATH/:\/tmp\/site/:\/tmp\/site-tests}
    mkdir -p /tmp/site-tests
    for f in /tmp/site/*; do [[ $(basename "$f") == huggingface_hub* ]] || ln -sfn "$f" /tmp/site-tests/; done
fi
gpu_tests() {  # gpu_tests LIMIT_S FILE...: the files' tests on the GPU (8 workers, + $EXTRA_TESTS) -> $OUT/tests.txt
    local limit=$1; shift
    PYTHONPATH=$tests_path HEARTH_TEST_DEVICE=cuda timeout "$limit" python3 -m pytest -c scripts/gpu_pytest.ini --rootdir . -q -rf \
        -p no:cacheprovider -n 8 "$@" ${EXTRA_TESTS:-} > "$OUT/l/tests.log" 2>&1
    echo "rc $?" >> "$OUT/l/tests.log"
    grep -E "^FAILED|^ERROR|passed|failed|^rc " "$OUT/l/tests.log" | tee "$OUT/tests.txt" | tail -25
}
chat_tiers() {  # a tiered 64K chat's follow-ups across chat switches and restarts, with the tier cache's host times
    wait  # the checkpoint
    timeout 300 python3 bench/bench_e2e.py --dir /tmp/ckpt-deepseek_v32 --logs "$OUT/l" --reps 2 --configs chat-cache-tiers \
        --chat-context 65536 ${CHAT_ARGS:-} > "$OUT/e2e-chat-tiers.log" 2>&1
    grep -E "TTFT|target|tier" "$OUT/e2e-chat-tiers.log" | tail -14
}
for step in "${steps[@]}"; do
    case $step in
    tests)
        gpu_tests 500 tests/kernels tests/offload tests/engine/test_gpt_oss.py tests/engine/test_fused_experts.py \
            tests/engine/test_offload_engine.py tests/engine/test_piecewise.py tests/engine/test_runahead.py \
            tests/engine/test_cuda_graphs.py tests/engine/test_tiers_engine.py \
            tests/engine/test_tiers_graph_step.py tests/engine/test_prefix_store.py tests/engine/test_runner.py \
            tests/engine/test_dsa_kernels_engine.py tests/engine/test_conformance.py tests/engine/test_warm_up.py \
            tests/engine/test_tiers_pieces.py tests/engine/test_mli.py tests/engine/test_tier_cache.py \
            tests/engine/test_tiers_kernels_engine.py tests/engine/test_sampling.py \
            tests/engine/test_structured_engine.py tests/engine/test_structured_masks.py ;;
    e2e)
        wait  # the checkpoints
        E=(python3 bench/bench_e2e.py --logs "$OUT/l" --reps 2 --decode-tokens 128)  # TTFT: the median of 2
        # three configs load in ~4 min on a slow machine (2026-12-04: 65 s resident, 126 s experts in RAM): the
        # DeepSeek rows alone get the call's time
        timeout "$([[ -n ${E2E_DS_ONLY:-} ]] && echo 450 || echo 280)" "${E[@]}" --dir /tmp/ckpt-deepseek_v32 --json "$OUT/e2e-ds.json" \
            --configs resident offload-sync offload-runahead --concurrency 1 8 --ttft 2048 > "$OUT/e2e-ds.log" 2>&1
        grep -vE "server flags|this window" "$OUT/e2e-ds.log" | tail -12
        [[ -n ${E2E_DS_ONLY:-} ]] && continue
        timeout 170 "${E[@]}" --dir /tmp/ckpt-gpt_oss --family gpt_oss --json "$OUT/e2e-gpt_oss.json" \
            --configs resident offload-sync --concurrency 1 8 --ttft 2048 > "$OUT/e2e-gpt_oss.log" 2>&1
        grep -vE "server flags|this window" "$OUT/e2e-gpt_oss.log" | tail -8 ;;
    k2m)  # the warm-up tests, then sparse MLA's deeper-prefetch configs at decode batch 64 and in prefill
        gpu_tests 200 tests/engine/test_warm_up.py tests/kernels/test_sparse_mla.py
        timeout 330 python3 bench/bench_dsa.py --only decode_mla,prefill_mla --sweep --mla-batches 64 --out "$OUT/l" \
            > "$OUT/dsa-mla.log" 2>&1
        grep -E "sweep|TFLOP|best|FP8 tile|prefill sparse" "$OUT/dsa-mla.log" | tail -40 ;;
    k2s)  # the one-launch top-k with a 1-in-8 first histogram: its tests, then beside the exact one
        gpu_tests 240 tests/kernels/test_topk_one_launch.py tests/kernels/test_lightning_indexer.py
        timeout 150 python3 bench/bench_one_launch.py --rows 1 8 64 --programs 0 --warps 0 --scans 1 --samples 1 8 \
            --hist-blocks 0 --kinds randn relu --out "$OUT/l" > "$OUT/one-launch-sample.log" 2>&1
        grep -E "hist|sample" "$OUT/one-launch-sample.log" | tail -20
        timeout 200 python3 bench/bench_dsa.py --only decode_indexer --out "$OUT/l" > "$OUT/dsa-indexer.log" 2>&1
        grep -A12 "decode top-k |" "$OUT/dsa-indexer.log" | tail -12 ;;
    k2z)  # fine_bin's bins of zeros alone: the top-k and indexer tests, the ReLU rows, narrower sampled bands, the indexer rows
        gpu_tests 240 tests/kernels/test_topk_one_launch.py tests/kernels/test_topk.py tests/kernels/test_lightning_indexer.py
        timeout 240 python3 bench/bench_one_launch.py --rows 1 8 64 --programs 0 --warps 0 --scans 1 --samples 1 2 4 8 \
            --sigmas 6 4 3 --hist-blocks 0 --kinds randn relu --out "$OUT/l" > "$OUT/one-launch-band.log" 2>&1
        tail -45 "$OUT/one-launch-band.log"
        timeout 200 python3 bench/bench_dsa.py --only decode_indexer --out "$OUT/l" > "$OUT/dsa-indexer.log" 2>&1
        grep -A12 "decode top-k |" "$OUT/dsa-indexer.log" | tail -12 ;;
    k2b)  # the decode indexer + top-k rows with the 1-in-8 histogram's band at 6, 4 and 3 sigmas (paths per row)
        timeout 420 python3 bench/bench_dsa.py --only decode_indexer --hist-sigmas 6 4 3 --out "$OUT/l" \
            > "$OUT/dsa-indexer.log" 2>&1
        grep -E "1-in-8 histogram, band" "$OUT/dsa-indexer.log" | tail -30
        grep -A12 "decode top-k |" "$OUT/dsa-indexer.log" | tail -12 ;;
    k2q)  # the select's packed sums and scans: the one-launch tests, then the histogram + select rows (every one checked)
        gpu_tests 150 tests/kernels/test_topk_one_launch.py
        timeout 100 python3 bench/bench_one_launch.py --rows 1 8 64 --programs 0 --warps 0 --scans 1 --samples 1 8 \
            --sigmas 4 --kinds randn relu --out "$OUT/l" > "$OUT/one-launch-packed.log" 2>&1
        grep -E "^(randn|relu) .*sample" "$OUT/one-launch-packed.log" | tail -12 ;;
    k2d)  # programmatic dependent launch between the indexer, the histogram and the select: their tests (graphs
        # included), the engine's decode indexer + top-k with it on / off, then the select by programs per row
        gpu_tests 300 tests/kernels/test_topk_one_launch.py tests/kernels/test_indexer_decode_persistent.py \
            tests/kernels/test_lightning_indexer.py tests/engine/test_dsa_kernels_engine.py tests/engine/test_cuda_graphs.py
        timeout 150 python3 bench/bench_decode_topk.py --out "$OUT/l" > "$OUT/decode-topk.log" 2>&1
        grep -E "^B" "$OUT/decode-topk.log" | tail -18
        timeout 150 python3 bench/bench_one_launch.py --rows 64 8 --programs 0 2 3 4 6 8 12 16 --warps 4 8 --scans 1 \
            --samples 8 --sigmas 4 --kinds randn --pdl 1 --out "$OUT/l" > "$OUT/one-launch-programs.log" 2>&1
        grep -E "^randn" "$OUT/one-launch-programs.log" | tail -40 ;;
    k2e)  # two programs per SM rounded down, 8 warps, PDL at <= 4 rows: the tests, the select's timeline, the
        # engine's decode indexer + top-k (PDL on / off), then histogram + select by rows at the defaults
        gpu_tests 200 tests/kernels/test_topk_one_launch.py tests/kernels/test_indexer_decode_persistent.py \
            tests/kernels/test_lightning_indexer.py
        timeout 60 python3 bench/bench_one_launch.py --trace --rows 1 8 64 --out "$OUT/l" > "$OUT/one-launch-trace.log" 2>&1
        grep -E "^trace|Error" "$OUT/one-launch-trace.log" | tail -4
        timeout 150 python3 bench/bench_decode_topk.py --out "$OUT/l" > "$OUT/decode-topk.log" 2>&1
        grep -E "^B|^trace|Error" "$OUT/decode-topk.log" | tail -27
        timeout 120 python3 bench/bench_one_launch.py --rows 1 8 64 --programs 0 --warps 0 --scans 1 \
            --samples 1 8 --sigmas 4 --kinds randn relu --out "$OUT/l" > "$OUT/one-launch-defaults.log" 2>&1
        grep -E "^(randn|relu) .*sample|Error" "$OUT/one-launch-defaults.log" | tail -20 ;;
    k2f)  # the finish's first loaded block (1024 survivors, the default) against 4096 and 16 (a loop of 1024-key
        # blocks, as before), with PDL on / off, on the decode indexer's logits, one run
        timeout 400 python3 bench/bench_decode_topk.py --contexts 32768 131072 --finish-blocks 1024 4096 16 --out "$OUT/l" \
            > "$OUT/decode-topk-finish.log" 2>&1
        grep -E "^B|Error" "$OUT/decode-topk-finish.log" | tail -36 ;;
    ttft)  # where a 2K prompt's first token goes with experts in RAM (sync): the server's commonest stacks over the
           # timed runs (~4.5 min on a fresh machine: the checkpoint, then a 2-minute load)
        wait
        timeout 240 python3 bench/bench_e2e.py --dir /tmp/ckpt-deepseek_v32 --logs "$OUT/l" --reps 2 --decode-tokens 8 \
            --configs offload-sync --concurrency 1 --ttft 2048 --stack-samples > "$OUT/e2e-ttft.log" 2>&1
        grep -vE "server flags|this window" "$OUT/e2e-ttft.log" | tail -32 ;;
    first)  # a first long prompt after start, every kernel compiled anew (an empty Triton cache, as on a new install):
            # "the untimed first" TTFT beside the timed ones, resident (whose warm-up reads prompts up to a whole chunk) and experts in RAM
        # FIRST_TESTS=0: the rows only; FIRST_CONFIGS: which configs (default both)
        [[ ${FIRST_TESTS:-1} == 0 ]] || gpu_tests 240 tests/engine/test_warm_up.py tests/engine/test_decode_tables.py
        wait
        for config in ${FIRST_CONFIGS:-resident offload-sync}; do  # each on its own empty cache
            TRITON_CACHE_DIR=$(mktemp -d) timeout 200 python3 bench/bench_e2e.py --dir /tmp/ckpt-deepseek_v32 --logs "$OUT/l" \
                --reps 2 --decode-tokens 32 --configs $config --concurrency 1 --ttft 2048 > "$OUT/e2e-first-$config.log" 2>&1
            grep -E "==|load|TTFT|c=1|kernels the" "$OUT/e2e-first-$config.log" | tail -8
        done ;;
    gluon)  # the Gluon sparse MLA kernels (kernels/sparse_mla/gluon_kernels.py): their GPU tests (the FP8 seesaw's among
            # them), then decode b1 / 8 / 64 and prefill rows beside the Triton kernel, bf16 and FP8 caches (~5 min)
        gpu_tests 150 tests/kernels/test_sparse_mla_gluon.py
        timeout 200 python3 bench/bench_gluon_mla.py --fp8 --batches 1,8,64 --prefill 4096 --timeout 90 \
            > "$OUT/gluon.log" 2>&1
        tail -30 "$OUT/gluon.log" ;;
    k2c)  # the cooperative few-row top-k (histogram, select and finish in one launch with grid barriers): its tests and
          # the indexer's and the DSA engine's, then the decode rows at 1-4 requests beside the one-launch path (~5 min)
        gpu_tests 300 tests/kernels/test_topk_cooperative.py tests/kernels/test_lightning_indexer.py \
            tests/engine/test_dsa_kernels_engine.py
        # K2C_ARGS: more of bench_decode_topk's flags (--coop-programs 32 64: fewer programs a row beside the default)
        timeout 260 python3 bench/bench_decode_topk.py --batches 1 2 4 --contexts ${K2C_CONTEXTS:-8192 32768 131072} \
            ${K2C_ARGS:-} --out "$OUT" > "$OUT/decode-topk.log" 2>&1
        grep -E "^B|trace|Error|error" "$OUT/decode-topk.log" | tail -40 ;;
    k2i)  # the decode indexer and the cooperative top-k in one launch (kernels/indexer/decode_cooperative.py): its
          # tests, the cooperative and indexer tests, then the decode rows at 1-4 requests beside the two launches
        gpu_tests 300 tests/kernels/test_indexer_cooperative.py tests/kernels/test_topk_cooperative.py \
            tests/kernels/test_lightning_indexer.py
        # K2I_TABLES: table widths to run the rows at (0: as wide as the context; 163840: the engine's decode tables at
        # DeepSeek's max_model_len); K2I_ARGS: more flags (--fused-programs 256, --fused-stages 9 13 17, --coop-spread,
        # --indexer-stages 9 13)
        for tokens in ${K2I_TABLES:-0}; do
            timeout 270 python3 bench/bench_decode_topk.py --batches 1 2 4 --contexts ${K2C_CONTEXTS:-8192 32768 131072} \
                --table-tokens $tokens ${K2I_ARGS:-} --out "$OUT" > "$OUT/decode-topk-$tokens.log" 2>&1
            grep -E "^B|Error|error" "$OUT/decode-topk-$tokens.log" | grep -v "pdl 0" | tail -30
        done ;;
    k2p)  # Nsight Compute on the one-launch select (its last programs finish the rows) at 64 and 1 x 128K randn
        for rows in 64 1; do
            timeout 150 /usr/local/cuda/bin/ncu --kernel-name regex:_topk_one_launch_kernel --launch-skip 4 --launch-count 1 \
                --set full python3 -c "
import torch
from hearth.kernels.topk import topk_indices_one_launch
from hearth.kernels.topk.one_launch import new_one_launch_workspace, one_launch_plan
rows, n, k = $rows, 131072, 2048
s = torch.randn(rows, n, device='cuda')
lengths = torch.full((rows,), n, dtype=torch.int32, device='cuda')
ws = new_one_launch_workspace(rows, one_launch_plan(k), s.device)
out = torch.empty(rows, k, dtype=torch.int32, device='cuda')
for _ in range(6):
    topk_indices_one_launch(s, lengths, k, out=out, workspace=ws)
torch.cuda.synchronize()" > "$OUT/ncu-select-$rows.txt" 2>&1
            grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Eligible|Issued Warp|No Eligible|Stall|Compute \(SM\) Throughput|Memory Throughput|Block Size|Grid Size|Executed Ipc" \
                "$OUT/ncu-select-$rows.txt" | head -30
        done ;;
    k2n)  # Nsight Compute on the persistent decode indexer at 1 and 8 x 128K: what its 8.7 us at batch 1 (46% of HBM)
          # waits on, against batch 8 (64%)
        for batch in 1 8; do
            timeout 150 /usr/local/cuda/bin/ncu --kernel-name regex:_indexer_decode_persistent_kernel --launch-skip 4 \
                --launch-count 1 --set full python3 -c "
import sys, torch; sys.path.insert(0, 'bench')
from bench_dsa import BS, random_indexer_cache
from hearth.kernels._utils import FP8_E4M3
from hearth.kernels.indexer import lightning_indexer_decode
batch, n = $batch, 131072
cache = random_indexer_cache(batch * n // BS)
table = torch.randperm(batch * n // BS, device='cuda').int().view(batch, n // BS)
ctx = torch.full((batch,), n, dtype=torch.int32, device='cuda')
q = (torch.randn(batch, 1, 64, 128, device='cuda') * 2).to(FP8_E4M3)
w = torch.randn(batch, 1, 64, device='cuda') * 0.05
for _ in range(6):
    lightning_indexer_decode(q, w, cache, table, ctx, BS)
torch.cuda.synchronize()" > "$OUT/ncu-indexer-$batch.txt" 2>&1
            grep -E "Duration|Registers|Achieved Occupancy|Eligible|Issued Warp|No Eligible|Stall|Memory Throughput|DRAM Throughput|L2 Hit|Block Size|Grid Size|Executed Ipc|Waves" \
                "$OUT/ncu-indexer-$batch.txt" | head -30
        done ;;
    kernels)  # variants merged without a GPU, each beside the path it may replace, in one run
        timeout 300 python3 bench/bench_dsa.py --only decode_indexer --out "$OUT/l" > "$OUT/dsa-indexer.log" 2>&1
        grep -A12 "decode top-k |" "$OUT/dsa-indexer.log" | tail -12
        timeout 250 python3 bench/bench_dsa.py --only decode_mla --sweep --out "$OUT/l" > "$OUT/dsa-mla.log" 2>&1
        grep -E "TFLOP|FP8 tile|BEST|best" "$OUT/dsa-mla.log" | tail -15 ;;
    c2)
        wait  # the checkpoint
        E=(python3 bench/bench_e2e.py --dir /tmp/ckpt-deepseek_v32 --logs "$OUT/l" --reps 1)
        timeout 100 "${E[@]}" --configs tiers64k --concurrency 1 --ttft --prompt 65536 --decode-tokens 64 \
            > "$OUT/e2e-tiers.log" 2>&1
        grep -v "server flags" "$OUT/e2e-tiers.log" | tail -4
        timeout 160 "${E[@]}" --configs chat-cache --chat-context 65536 --reps 2 > "$OUT/e2e-chat.log" 2>&1
        grep -E "TTFT|target" "$OUT/e2e-chat.log" | tail -12
        timeout 160 "${E[@]}" --configs chat-cache-tiers --chat-context 65536 --reps 2 > "$OUT/e2e-chat-tiers.log" 2>&1
        grep -E "TTFT|target" "$OUT/e2e-chat-tiers.log" | tail -12
        timeout 80 python3 bench/bench_longctx.py --planned --contexts 131072 --skip-stack --budgets 256:4096:256 \
            --time-limit 60 --profile --candidate-topk sort select single_pass --out "$OUT/l" > "$OUT/longctx.log" 2>&1
        grep -A16 "kernels of\|planned:" "$OUT/longctx.log" | tail -40 ;;
    c2k)  # the C2 kernels and rows changed on CPU evidence (~6.5 min): their GPU tests, the planned read by kernel
          # (candidate select: bisection vs histograms), the tiered 61-layer stack, prefill's bounded indexer logits
        gpu_tests ${TESTS_TIMEOUT:-200} tests/kernels/test_topk_short.py tests/kernels/test_tiered_residency.py \
            tests/kernels/test_topk_one_launch.py tests/kernels/test_tiered_write_through.py \
            tests/kernels/test_lightning_indexer.py tests/offload/test_planned_tiers.py \
            tests/offload/test_planned_tiers_launches.py tests/engine/test_tiers_kernels_engine.py \
            tests/engine/test_tiers_graph_step.py tests/engine/test_mla_select.py \
            tests/engine/test_prefill_histories.py tests/engine/test_runner.py
        timeout 120 python3 bench/bench_longctx.py --planned --contexts 131072 --stack-contexts 131072 \
            --stack-modes tiered --budgets 256:4096:256 --time-limit 95 --profile --candidate-topk select hist \
            --out "$OUT/l" > "$OUT/longctx.log" 2>&1
        grep -E -A12 "^\(p\)|planned:|stack with tiered|kernels of planned|graph:" "$OUT/longctx.log" | tail -40
        timeout 60 python3 bench/bench_longctx.py --prefill-buffers --prefill-contexts 32768,131072 --prefill-chunk 2048 \
            --prefill-layers 4 --time-limit 50 --out "$OUT/l" > "$OUT/prefill-buffers.log" 2>&1
        grep -E "^\(5\)|prefill [0-9]+K" "$OUT/prefill-buffers.log" | tail -8 ;;
    c2close)  # C2's open rows in one call (~9 min): the planned read by candidate select (bisection vs its narrowed,
              # early-stopping form), the tiered chat's follow-ups, then the GPU tests of what changed since
        timeout 80 python3 bench/bench_longctx.py --planned --contexts 131072 --skip-stack --budgets 256:4096:256 \
            --time-limit 65 --profile --candidate-topk select narrow --out "$OUT/l" > "$OUT/longctx.log" 2>&1
        grep -E -A12 "^\(p\)|planned:|kernels of planned|graph:" "$OUT/longctx.log" | tail -30
        chat_tiers
        gpu_tests ${TESTS_TIMEOUT:-130} tests/kernels/test_topk_short.py \
            tests/offload/test_planned_tiers_launches.py tests/engine/test_tier_store.py \
            tests/engine/test_tier_cache.py tests/engine/test_warm_start.py \
            tests/engine/test_tiers_kernels_engine.py tests/engine/test_sampling.py ;;
    c2stack)  # the planned read and the tiered 61-layer stack with the default candidate select (narrow) beside the
              # bisection, then the GPU tests of the tier cache, the tiered pieces and graph steps (~5 min)
        timeout 120 python3 bench/bench_longctx.py --planned --contexts 131072 --stack-contexts 131072 \
            --stack-modes tiered --budgets 256:4096:256 --time-limit 95 --profile --candidate-topk narrow select \
            --out "$OUT/l" > "$OUT/longctx.log" 2>&1
        grep -E -A12 "^\(p\)|planned:|stack with tiered|kernels of planned|graph:" "$OUT/longctx.log" | tail -40
        gpu_tests ${TESTS_TIMEOUT:-200} tests/engine/test_tier_cache.py tests/engine/test_tiers_pieces.py \
            tests/engine/test_tiers_graph_step.py tests/engine/test_tiers_kernels_engine.py \
            tests/offload/test_planned_tiers.py tests/offload/test_planned_tiers_launches.py \
            tests/kernels/test_topk_short.py tests/engine/test_server_support.py ;;
    o2e)  # O2's scheduler rows on the user's path: sync, prediction prefetch and runahead through the server, one run
        wait  # the checkpoint
        timeout 400 python3 bench/bench_e2e.py --logs "$OUT/l" --reps 1 --decode-tokens 96 --dir /tmp/ckpt-deepseek_v32 \
            --json "$OUT/e2e-o2.json" --configs offload-sync offload-prefetch offload-runahead --concurrency 8 32 \
            > "$OUT/e2e-o2.log" 2>&1
        grep -vE "server flags|this window" "$OUT/e2e-o2.log" | tail -14 ;;
    one-launch)  # the one-launch top-k by programs per row (~2 min)
        timeout 150 python3 bench/bench_one_launch.py --programs 0 8 16 32 64 128 256 --out "$OUT/l" \
            > "$OUT/one-launch.log" 2>&1
        tail -30 "$OUT/one-launch.log" ;;
    k2t)  # K2 item 1 (~8 min): the one-launch select's slice streaming (SCAN 0/1/2) x block x warps and its first
          # histogram alone (prefetch, warps), then the decode indexer rows incl. one launch after a separate histogram
        timeout 200 python3 bench/bench_one_launch.py --rows 1 8 64 --kinds randn --programs 0 --warps 4 8 \
            --scans 0 1 2 --blocks 1024 4096 --hist-blocks 1024 4096 --out "$OUT/l" > "$OUT/one-launch.log" 2>&1
        grep -E "best:|^hist" "$OUT/one-launch.log" | tail -30
        timeout 280 python3 bench/bench_dsa.py --only decode_indexer --out "$OUT/l" > "$OUT/dsa-indexer.log" 2>&1
        grep -A13 "decode top-k |" "$OUT/dsa-indexer.log" ;;
    o2r|o2t|o2b)  # o2t: the top-k and runahead GPU tests (~2.5 min); o2b: runahead beside sync and prefetch on the
          # user's attention path (kernels, graphs) with the decoder's time split (~4 min); o2r: both
        [[ $step != o2b ]] && gpu_tests ${TESTS_TIMEOUT:-150} tests/engine/test_tiers_pieces.py \
            tests/engine/test_offload_engine.py tests/engine/test_piecewise.py tests/engine/test_runahead.py \
            tests/engine/test_link_gate.py tests/engine/test_cuda_graphs.py tests/offload/test_gpu_offload.py \
            tests/kernels/test_topk_one_launch.py tests/kernels/test_topk_short.py tests/kernels/test_topk.py
        [[ $step == o2t ]] && continue
        timeout ${RUNAHEAD_TIMEOUT:-230} python3 bench/bench_runahead.py --moe-layers 3 --concurrency 8 32 --tokens 12 --cache-fraction 0.25 \
            --routing uniform --budget-s 200 --json "$OUT/runahead.json" ${RUNAHEAD_ARGS:-} > "$OUT/runahead.log" 2>&1
        grep -v "^store" "$OUT/runahead.log" | tail -30 ;;
    o2g)  # auto's runahead gate where sync leaves the link partly idle (skewed routing, small caches), ~2.5 min
        timeout 200 python3 bench/bench_runahead.py --moe-layers 3 --concurrency 8 32 --tokens 16 \
            --cache-fraction 0.05 0.1 --routing skewed --budget-s 150 --json "$OUT/runahead-gate.json" \
            > "$OUT/runahead-gate.log" 2>&1
        grep -v "^store" "$OUT/runahead-gate.log" | grep -E "tok/s|gate:|never slower" | tail -40 ;;
    chat-tiers)  # a tiered 64K chat's follow-ups across chat switches and restarts, with the tier cache's host times
        chat_tiers ;;
    defaults|dtests)  # the defaults flipped on CPU evidence after the last GPU run: their GPU tests, then their rows, most needed first
        gpu_tests ${TESTS_TIMEOUT:-200} tests/offload/test_planned_tiers.py \
            tests/offload/test_planned_tiers_launches.py tests/kernels/test_lightning_indexer.py \
            tests/kernels/test_topk_one_launch.py tests/kernels/test_sparse_mla.py \
            tests/engine/test_dsa_kernels_engine.py tests/engine/test_cuda_graphs.py \
            tests/engine/test_tiers_graph_step.py tests/engine/test_mli.py tests/offload/test_gpu_offload.py \
            tests/offload/test_experts.py
        [[ $step == dtests ]] && continue
        timeout 80 python3 bench/bench_offload.py --parts prefill --layers 2 --prefill-variants halves ring ring4 ring16 \
            --json "$OUT/l/prefill_ab.json" > "$OUT/prefill-ab.log" 2>&1
        grep -E "^prefill|streamed" "$OUT/prefill-ab.log" | tail -10
        timeout 110 python3 bench/bench_longctx.py --planned --contexts 131072 --stack-contexts 131072 \
            --stack-modes tiered --budgets 256:4096:256 --fine-topk one_launch radix --time-limit 85 --profile \
            --out "$OUT/l" > "$OUT/longctx.log" 2>&1
        grep -E "^\(p\)|planned:|tiered keys\+latents r=1|IndexCache r=1 \(all|stack with tiered|kernels of|graph:" \
            "$OUT/longctx.log" | tail -16
        wait  # the checkpoint
        timeout 150 python3 bench/bench_e2e.py --dir /tmp/ckpt-deepseek_v32 --logs "$OUT/l" --reps 1 --decode-tokens 128 \
            --configs resident --concurrency 1 8 --ttft 2048 --json "$OUT/e2e-resident.json" > "$OUT/e2e-resident.log" 2>&1
        grep -vE "server flags|this window" "$OUT/e2e-resident.log" | tail -5
        timeout 60 python3 bench/bench_dsa.py --only decode_mla --out "$OUT/l" > "$OUT/dsa-mla.log" 2>&1
        grep -E "^decode sparse MLA \((bf16|fp8 tile path)\)" "$OUT/dsa-mla.log" | tail -6 ;;
    esac
done
wait
tar czf "$OUT/all.tgz" -C "$OUT" l && rm -rf "$OUT/l"
