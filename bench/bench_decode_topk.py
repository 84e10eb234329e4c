"""K2 item 1 on the path the engine runs: the decode indexer + top-k (`indexer_decode_topk` with its defaults),
with programmatic dependent launch on and off (`hearth.kernels._utils.PDL`), beside the indexer's logits alone
and the top-k alone on them (a workspace kept across calls, as the engine keeps one), and the select's timeline
and finishing paths on those logits (`bench_one_launch.timeline_of`). Where the cooperative top-k
(`hearth.kernels.topk.cooperative`, at most four rows) is the default, the one-launch path is timed beside it
(topk="one_launch") with its own timeline (`coop_timeline_of`), and the indexer and the cooperative top-k in one
launch (topk="fused_cooperative", `hearth.kernels.indexer.decode_cooperative`) with its timeline.

Each row is a CUDA-graph replay median (the engine replays its decode step from a graph), after a check of the
selection against torch on the same logits. The issue's targets: b1 x 128K indexer + top-k <= 15 us, 64 x 128K
top-k <= 100 us.

    python bench/bench_decode_topk.py [--batches 1 8 64] [--contexts 8192 32768 131072] [--finish-blocks 1024 16]
        [--coop-programs 32 64] [--coop-polls acquire hist hist+acquire] [--fused-programs 256]
        [--fused-stages 9 13 17] [--coop-spread] [--indexer-stages 9 13]
        [--table-tokens 163840] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dsa import BS, random_indexer_cache  # noqa: E402
from bench_one_launch import timeline_of  # noqa: E402

from hearth.kernels import _utils  # noqa: E402
from hearth.kernels._utils import FP8_E4M3  # noqa: E402
from hearth.kernels.indexer import (  # noqa: E402
    decode_cooperative,
    indexer_decode_topk,
    lightning_indexer_decode,
)
from hearth.kernels.indexer.decode_cooperative import (  # noqa: E402
    fused_plan,
    indexer_cooperative_launch,
    use_fused_cooperative,
)
from hearth.kernels.topk import cooperative, one_launch, topk_indices_one_launch  # noqa: E402
from hearth.kernels.topk.cooperative import (  # noqa: E402
    cooperative_block,
    cooperative_topk_launch,
    topk_indices_cooperative,
    use_cooperative,
)
from hearth.kernels.topk.one_launch import HEADER, PATH, new_one_launch_workspace, one_launch_plan  # noqa: E402
from hearth.kernels.topk.reference import check_topk  # noqa: E402

K = 2048
FINISH_BLOCKS = [one_launch.FINISH_BLOCK]  # --finish-blocks: survivors the finish loads beside its header
COOP_PROGRAMS: list[int] = []  # --coop-programs: cooperative.MAX_PROGRAMS values to time beside the default
COOP_POLLS: list[str] = []  # --coop-polls: how the barriers poll (POLLS), timed beside the default
FUSED_PROGRAMS: list[int] = []  # --fused-programs: decode_cooperative.MAX_PROGRAMS values beside the default
INDEXER_STAGES: list[int] = []  # --indexer-stages: the persistent indexer's num_stages beside its default
COOP_SPREAD = [False]  # --coop-spread: cooperative.SPREAD on, timed beside the default
FUSED_STAGES: list[int] = []  # --fused-stages: decode_cooperative.NUM_STAGES values beside the default
TABLE_TOKENS = [0]  # --table-tokens: block tables at least this wide (the engine's are max_model_len wide)
# --coop-polls values: (cooperative.POLL_ACQUIRE, cooperative.POLL_HIST)
POLLS = {"volatile": (False, False), "acquire": (True, False), "hist": (False, True), "hist+acquire": (True, True)}


def median_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def coop_timeline_of(scores: torch.Tensor, lengths: torch.Tensor, fused=None) -> dict:
    """Where the cooperative top-k's time goes: each program's global-timer stamps (start, past the first barrier
    with its band, its slice split, past the second barrier, its keys placed and arrived; the last program done),
    in us from the first start, medians over programs; the last of 5 eager calls. fused: the fused indexer +
    top-k's launch instead (`fused(out, workspace, plan, trace)`, returning its logits), its first barrier
    passed once every program has scored its keys."""
    rows, n = scores.shape
    out = torch.empty(rows, K, dtype=torch.int32, device="cuda")
    plan = one_launch_plan(K)
    ws = new_one_launch_workspace(rows, plan, scores.device)
    programs = fused_plan(rows, n, scores.device)[0] if fused else -(-n // cooperative_block(rows, n, scores.device))
    trace = torch.zeros(rows, programs, 8, dtype=torch.int64, device="cuda")
    for _ in range(5):
        trace.zero_()
        if fused is None:
            cooperative_topk_launch(scores, lengths, out, ws, plan, trace=trace)
        else:
            scores = fused(out, ws, plan, trace)
    torch.cuda.synchronize()
    check_topk(out, scores, lengths, K)
    paths = ws[:, HEADER + PATH].tolist()
    active = trace[..., 0] > 0
    t0 = trace[..., 0][active].min().double()
    t = (trace[..., :4].double() - t0) / 1e3
    live = t[active]  # programs that held keys (every one stamps its start)
    end = float((trace[..., 4].max().double() - t0) / 1e3)
    arrived = float(((trace[..., 7][active].double() - t0) / 1e3).median())
    res = dict(rows=rows, n=n, programs_per_row=programs, paths={p: paths.count(p) for p in sorted(set(paths))},
               start_spread_us=float(live[:, 0].max()), first_barrier_us=float(live[:, 1].median()),
               split_us=float((live[:, 2] - live[:, 1]).median()), second_barrier_us=float(live[:, 3].median()),
               arrived_us=arrived, end_us=end)
    print(f"{'fused' if fused else 'coop'} trace {rows} x {n}: {programs} programs/row, paths {res['paths']}: "
          f"starts spread over "
          f"{res['start_spread_us']:.2f} us, past the first barrier (band) at {res['first_barrier_us']:.2f}, split "
          f"{res['split_us']:.2f}, past the second barrier at {res['second_barrier_us']:.2f}, placed and arrived at "
          f"{arrived:.2f}, done at {end:.2f} us",
          flush=True)
    return res


def rows_for(batch: int, ctx_len: int, heads: int = 64) -> list[dict]:
    max_blocks = max(ctx_len, TABLE_TOKENS[0]) // BS  # (the engine's decode tables: max_model_len wide)
    cache = random_indexer_cache(batch * max_blocks)
    table = torch.randperm(batch * max_blocks, device="cuda").int().view(batch, max_blocks)
    ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device="cuda")
    q = (torch.randn(batch, 1, heads, 128, device="cuda") * 2).to(FP8_E4M3)
    w = torch.randn(batch, 1, heads, device="cuda") * 0.05
    logits, lengths = lightning_indexer_decode(q, w, cache, table, ctx, BS)
    out = torch.empty(batch, K, dtype=torch.int32, device="cuda")
    ws = new_one_launch_workspace(batch, one_launch_plan(K), q.device)  # kept across calls, as the engine's
    t_logits = median_us(lambda: lightning_indexer_decode(q, w, cache, table, ctx, BS))
    for stages in INDEXER_STAGES:  # the persistent indexer's key chunks in flight (its default 7 stages: three)
        deeper, _ = lightning_indexer_decode(q, w, cache, table, ctx, BS, config={"num_stages": stages})
        valid = torch.arange(logits.shape[1], device="cuda")[None, :] < lengths[:, None]
        assert torch.equal(deeper[valid], logits[valid]), "the same sums in the same order"
        t_deeper = median_us(lambda st=stages: lightning_indexer_decode(q, w, cache, table, ctx, BS,
                                                                         config={"num_stages": st}))
        print(f"B{batch:<3d} {ctx_len // 1024:4d}K  indexer logits alone, {stages} pipeline stages: "
              f"{t_deeper:6.1f} us (default {t_logits:6.1f} us)", flush=True)
    has_fused = use_fused_cooperative(batch, 1, logits.shape[1], q.device)
    # the default's selection is checked on the logits its own path computes (the fused launch sums the heads in
    # another order, so a tie at the k-th largest may fall either way against the indexer's)
    default_fused = has_fused and decode_cooperative.FUSED_COOPERATIVE and batch <= decode_cooperative.AUTO_ROWS
    rows = []
    for fblock, pdl in ((fb, pd) for fb in FINISH_BLOCKS for pd in (True, False)):
        _utils.PDL = pdl
        one_launch.FINISH_BLOCK = fblock
        if has_fused:  # the indexer and the cooperative top-k in one launch
            fused_logits = indexer_cooperative_launch(q, w, cache, table, ctx, BS, out, ws, one_launch_plan(K))
            check_topk(out, fused_logits, lengths, K)
        check_topk(indexer_decode_topk(q, w, cache, table, ctx, BS, K)[:, 0],
                   fused_logits if default_fused else logits, lengths, K)
        t_full = median_us(lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, K))
        check_topk(topk_indices_one_launch(logits, lengths, K, out=out, workspace=ws), logits, lengths, K)
        t_topk = median_us(lambda: topk_indices_one_launch(logits, lengths, K, out=out, workspace=ws))
        row = dict(batch=batch, context=ctx_len, table_tokens=logits.shape[1], pdl=pdl, finish_block=fblock,
                   indexer_logits_us=t_logits, indexer_topk_us=t_full, topk_only_us=t_topk)
        coop = use_cooperative(batch, logits.shape[1], q.device)
        if coop:  # the cooperative top-k after the indexer (the default without the fused launch), the one-launch
            # path beside it
            row["indexer_topk_one_launch_us"] = t_one = median_us(
                lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, K, topk="one_launch"))
            row["indexer_topk_cooperative_us"] = t_two = median_us(
                lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, K, topk="cooperative"))
            check_topk(topk_indices_cooperative(logits, lengths, K, out=out, workspace=ws), logits, lengths, K)
            row["topk_only_cooperative_us"] = t_coop = median_us(
                lambda: topk_indices_cooperative(logits, lengths, K, out=out, workspace=ws))
        if has_fused:
            row["indexer_topk_fused_us"] = t_fused = median_us(
                lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, K, topk="fused_cooperative"))
        rows.append(row)
        default = "fused" if default_fused else "cooperative" if coop else "one-launch"
        print(f"B{batch:<3d} {ctx_len // 1024:4d}K  pdl {int(pdl)} finish block {fblock:4d}: indexer + top-k "
              f"{t_full:7.1f} us (the default, {default}), one-launch top-k alone {t_topk:7.1f} us (indexer logits "
              f"alone {t_logits:6.1f} us)"
              + (f"; indexer + one-launch top-k {t_one:7.1f} us, indexer + cooperative top-k {t_two:7.1f} us, "
                 f"cooperative top-k alone {t_coop:7.1f} us" if coop else "")
              + (f"; fused indexer + cooperative top-k {t_fused:7.1f} us" if has_fused else ""), flush=True)
    _utils.PDL, one_launch.FINISH_BLOCK = True, FINISH_BLOCKS[0]
    defaults = cooperative.MAX_PROGRAMS, cooperative.POLL_ACQUIRE, cooperative.POLL_HIST, cooperative.SPREAD
    variants = [("programs", p) for p in COOP_PROGRAMS] + [("poll", p) for p in COOP_POLLS]
    variants += [("spread", True)] if COOP_SPREAD[0] else []
    for kind, value in variants if use_cooperative(batch, logits.shape[1], q.device) else ():
        cooperative.MAX_PROGRAMS, cooperative.POLL_ACQUIRE, cooperative.POLL_HIST, cooperative.SPREAD = defaults
        if kind == "programs":
            cooperative.MAX_PROGRAMS = value  # fewer programs a row: wider slices, fewer arrivals at each barrier
        elif kind == "poll":
            cooperative.POLL_ACQUIRE, cooperative.POLL_HIST = POLLS[value]
        else:
            cooperative.SPREAD = value
        block = cooperative_block(batch, logits.shape[1], q.device)
        label = {"programs": f"at most {value} programs a row", "poll": f"barriers polling {value}",
                 "spread": "slices spread by the row's length"}[kind]
        if block is None:  # too few programs for this row: its slices would exceed MAX_BLOCK
            print(f"B{batch:<3d} {ctx_len // 1024:4d}K  cooperative, {label}: does not fit (slices over "
                  f"{cooperative.MAX_BLOCK} keys)", flush=True)
            continue
        check_topk(topk_indices_cooperative(logits, lengths, K, out=out, workspace=ws), logits, lengths, K)
        t_pair = median_us(lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, K, topk="cooperative"))
        t_alone = median_us(lambda: topk_indices_cooperative(logits, lengths, K, out=out, workspace=ws))
        rows[0].setdefault(f"by_coop_{kind}", {})[value] = dict(block=block, indexer_topk_us=t_pair,
                                                                 topk_only_us=t_alone)
        print(f"B{batch:<3d} {ctx_len // 1024:4d}K  cooperative, {label} ({block}-key slices): indexer + top-k "
              f"{t_pair:7.1f} us, top-k alone {t_alone:7.1f} us", flush=True)
    cooperative.MAX_PROGRAMS, cooperative.POLL_ACQUIRE, cooperative.POLL_HIST, cooperative.SPREAD = defaults
    fused_defaults = decode_cooperative.MAX_PROGRAMS, decode_cooperative.NUM_STAGES
    fused_variants = [("programs", v) for v in FUSED_PROGRAMS] + [("stages", v) for v in FUSED_STAGES]
    for kind, value in fused_variants if use_fused_cooperative(batch, 1, logits.shape[1], q.device) else ():
        decode_cooperative.MAX_PROGRAMS, decode_cooperative.NUM_STAGES = fused_defaults
        if kind == "programs":
            decode_cooperative.MAX_PROGRAMS = value
        else:  # key chunks in flight: two stages a chunk (its page ids, its keys)
            decode_cooperative.NUM_STAGES = value
        label = f"at most {value} programs a row" if kind == "programs" else f"{value} pipeline stages"
        plan = fused_plan(batch, logits.shape[1], q.device)
        try:
            if plan is None:
                raise ValueError("no plan")
            fused_logits = indexer_cooperative_launch(q, w, cache, table, ctx, BS, out, ws, one_launch_plan(K))
        except ValueError as err:  # no plan, or a build whose programs cannot all be resident at once
            print(f"B{batch:<3d} {ctx_len // 1024:4d}K  fused, {label}: does not fit ({err})", flush=True)
            continue
        check_topk(out, fused_logits, lengths, K)
        t_fused = median_us(lambda: indexer_decode_topk(q, w, cache, table, ctx, BS, K, topk="fused_cooperative"))
        rows[0].setdefault(f"by_fused_{kind}", {})[value] = dict(programs=plan[0], block=plan[1],
                                                                 indexer_topk_us=t_fused)
        print(f"B{batch:<3d} {ctx_len // 1024:4d}K  fused, {label} ({plan[0]} x {plan[1]}-key blocks): indexer + "
              f"top-k {t_fused:7.1f} us", flush=True)
    decode_cooperative.MAX_PROGRAMS, decode_cooperative.NUM_STAGES = fused_defaults
    rows[0]["trace"] = timeline_of(logits, lengths, "logits")
    if use_cooperative(batch, logits.shape[1], q.device):
        rows[0]["coop_trace"] = coop_timeline_of(logits, lengths)
    if use_fused_cooperative(batch, 1, logits.shape[1], q.device):
        def fused(out, ws, plan, trace):
            return indexer_cooperative_launch(q, w, cache, table, ctx, BS, out, ws, plan, trace=trace)

        rows[0]["fused_trace"] = coop_timeline_of(logits, lengths, fused)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--finish-blocks", type=int, nargs="+", default=FINISH_BLOCKS,
                    help="one_launch.FINISH_BLOCK values to time side by side (powers of two)")
    ap.add_argument("--coop-programs", type=int, nargs="*", default=[],
                    help="cooperative.MAX_PROGRAMS values to time beside the default (PDL on)")
    ap.add_argument("--coop-polls", nargs="*", default=[], choices=list(POLLS),
                    help="how the cooperative barriers poll, timed beside the default: volatile loads and one "
                         "acquire atomic, acquire loads, the first barrier by the histogram's sum (hist)")
    ap.add_argument("--fused-programs", type=int, nargs="*", default=[],
                    help="decode_cooperative.MAX_PROGRAMS values to time beside the default (the fused launch)")
    ap.add_argument("--indexer-stages", type=int, nargs="*", default=[],
                    help="the persistent decode indexer's pipeline stages to time beside its default (its logits "
                         "alone, checked equal)")
    ap.add_argument("--coop-spread", action="store_true",
                    help="the cooperative top-k with each row's keys spread over its programs by its length "
                         "(cooperative.SPREAD), timed beside the default; with --table-tokens")
    ap.add_argument("--fused-stages", type=int, nargs="*", default=[],
                    help="decode_cooperative.NUM_STAGES values to time beside the default (odd: key chunks in flight "
                         "= (stages - 1) / 2; 13 fits two programs an SM, 17 one)")
    ap.add_argument("--table-tokens", type=int, default=0,
                    help="block tables at least this many tokens wide, as the engine's (max_model_len), whatever "
                         "the context")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    FINISH_BLOCKS[:] = args.finish_blocks
    COOP_PROGRAMS[:] = args.coop_programs
    COOP_POLLS[:] = args.coop_polls
    FUSED_PROGRAMS[:] = args.fused_programs
    FUSED_STAGES[:] = args.fused_stages
    COOP_SPREAD[:] = [args.coop_spread]
    INDEXER_STAGES[:] = args.indexer_stages
    TABLE_TOKENS[:] = [args.table_tokens]
    rows = [r for b in args.batches for c in args.contexts for r in rows_for(b, c)]
    Path(args.out, "decode_topk.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
