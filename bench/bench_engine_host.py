"""Host time an engine decode step adds around the model, on a tiny model (CPU by default).

Two measurements:

- engine: a tiny DeepSeek-V3.2 checkpoint (hidden 64, 3 layers) served by ``Engine`` with
  ``--concurrency`` requests of ``--prompt-len`` tokens, greedy. For every decode step (all requests
  past their prompt, none finished yet) it takes the wall time of ``Engine.step()`` and the time
  inside the model's ``forward``; the difference is the engine's host work per step (scheduling,
  inputs, sampling, read-back, detokenising, stop checks, events). On the CPU every kernel runs
  synchronously, so this is the host work a GPU would wait for without overlapped decode, minus
  the sampling kernels' own time. Medians, with ``overlap_decode`` off and on.
- staging: host microseconds of ``DecodeInputs.stage`` (what a CUDA-graph decode step uploads)
  per step of steady decoding at each batch size with tables of ``--prompt-len`` tokens, beside the
  per-row staging it replaced (kept here as the baseline: a pinned row per request filled element by
  element and a ``torch.tensor`` per block table). Off CUDA nothing is pinned.

- schedulers: what the runahead scheduler adds over sync per token with offloaded experts
  (``--expert-slots`` of the tiny model's 8 experts per MoE layer cached, the rest copied from host
  RAM; the host-experts policy off). One engine per scheduler serves a warm round of 8 requests (as
  the engine's warm-up does), then each ``--concurrency`` in turn, greedy, ``--steps`` tokens each.
  Per token of steady decoding: model calls (``ModelRunner.run`` plus the runahead decoder's
  micro-steps), requests per call, expert bytes copied, and host CPU ms (this process's CPU time
  with one torch thread: on the tiny model nearly all of it is Python and kernel launch work, and
  unlike wall time it does not count other processes on a shared machine). On the CPU copies land
  at once, so this measures the scheduler's own work, not the link schedule.

    python bench/bench_engine_host.py [--device cpu] [--concurrency 1 8] [--prompt-len 1500]
        [--steps 40] [--expert-slots 4] [--parts engine staging schedulers] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hearth.engine import Engine, EngineConfig, Finished, SamplingParams, TokenDelta
from hearth.engine.cuda_graphs import DecodeInputs
from hearth.engine.testing.tiny import write_tiny_model

_BLOCK = 64


def engine_host_ms(model: Path, device: str, concurrency: int, prompt_len: int, steps: int,
                   overlap: bool) -> dict[str, float]:
    engine = Engine.load(str(model), EngineConfig(device=device, dtype="float32", max_num_seqs=max(concurrency, 1),
                                                  max_model_len=prompt_len + steps + 64, overlap_decode=overlap))
    model_s = [0.0]
    forward = engine.runner.model.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            model_s[0] += time.perf_counter() - start

    engine.runner.model.forward = timed_forward
    sampling = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(prompt_token_ids=[(31 * i + 7 * j) % 400 + 20 for j in range(prompt_len)],
                           sampling=sampling)
    step_ms, outside_ms = [], []
    while engine.has_unfinished():
        decoding = all(not s.in_prefill for s in engine.scheduler.running) and not engine.scheduler.waiting
        model_s[0] = 0.0
        start = time.perf_counter()
        events = engine.step()
        wall = time.perf_counter() - start
        if decoding and not any(isinstance(e, Finished) for e in events):
            step_ms.append(1e3 * wall)
            outside_ms.append(1e3 * (wall - model_s[0]))
    return {"step_ms": statistics.median(step_ms[2:]), "host_ms": statistics.median(outside_ms[2:]),
            "steps": len(step_ms)}


def _stage_per_row(host: torch.Tensor, tables: list[list[int]], positions: list[int], ids: list[int], b: int,
                   scratch: int) -> torch.Tensor:
    """The staging DecodeGraphs did before DecodeInputs (baseline): a row per request, element by
    element, and the whole table of every row each step."""
    rows = host[:b]
    rows[:, 0] = 0
    rows[:, 1] = 0
    rows[:, 2] = scratch * _BLOCK
    rows[:, 3] = 1
    rows[:, 4:] = scratch
    for i, (table, pos, tok) in enumerate(zip(tables, positions, ids)):
        row = rows[i]
        row[0], row[1], row[2], row[3] = tok, pos, table[pos // _BLOCK] * _BLOCK + pos % _BLOCK, pos + 1
        row[4:4 + len(table)] = torch.tensor(table, dtype=torch.long)
    return rows


def staging_us(batch: int, context: int, steps: int) -> dict[str, float]:
    pages = -(-(context + steps) // _BLOCK)
    max_blocks = pages + 1
    scratch = batch * pages
    tables = [list(range(i * pages, i * pages + -(-context // _BLOCK))) for i in range(batch)]
    positions = [context - 1] * batch
    inputs = DecodeInputs(batch, max_blocks, _BLOCK, scratch, torch.device("cpu"))
    host = torch.zeros(batch, 4 + max_blocks, dtype=torch.long)
    new_us, old_us = [], []
    for step in range(steps):
        positions = [p + 1 for p in positions]
        for table, pos in zip(tables, positions):
            if pos // _BLOCK >= len(table):
                table.append(table[-1] + 1)  # grows in place, as the block manager's tables do
        ids = [step % 100 + i for i in range(batch)]
        start = time.perf_counter()
        inputs.stage(tables, positions, ids, batch)
        new_us.append(1e6 * (time.perf_counter() - start))
        start = time.perf_counter()
        _stage_per_row(host, tables, positions, ids, batch, scratch)
        old_us.append(1e6 * (time.perf_counter() - start))
    return {"stage_us": statistics.median(new_us[1:]), "per_row_us": statistics.median(old_us[1:])}


def scheduler_costs(model: Path, device: str, scheduler: str, concurrencies: list[int], prompt_len: int, steps: int,
                    slots: int) -> list[dict[str, float]]:
    """Per token of steady decoding at each concurrency (see the module doc), for one scheduler."""
    engine = Engine.load(str(model), EngineConfig(
        device=device, dtype="float32", scheduler=scheduler, offload="always", expert_cache_slots=slots,
        host_experts="off", max_num_seqs=max(8, *concurrencies), max_model_len=prompt_len + steps + 64))
    runs = [0, 0]  # model calls, requests in them
    run = engine.runner.run

    def counting_run(inputs, *args, **kwargs):
        runs[0] += 1
        runs[1] += len(inputs)
        return run(inputs, *args, **kwargs)

    engine.runner.run = counting_run
    _decode(engine, 8, 32, 8, runs)  # warm: several requests, as the engine's warm-up runs them
    return [_decode(engine, concurrency, prompt_len, steps, runs) for concurrency in concurrencies]


def _decode(engine: Engine, concurrency: int, prompt_len: int, steps: int, runs: list[int]) -> dict[str, float]:
    sampling = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(prompt_token_ids=[(31 * i + 7 * j) % 400 + 20 for j in range(prompt_len)],
                           sampling=sampling)
    scheduler = engine.scheduler
    while engine.has_unfinished() and (scheduler.waiting or not scheduler.running
                                       or any(s.in_prefill for s in scheduler.running)):
        engine.step()  # the prompts (and each request's first token)
    decoder, cache = engine.decoder, engine.runner.expert_cache

    def counts() -> tuple[float, ...]:
        # (the decoder's sync steps are ModelRunner.run calls: counted there, not twice)
        micro = (decoder.micro_steps - decoder.sync_steps, decoder.rows - decoder.sync_rows) \
            if decoder is not None else (0, 0)
        return (*runs, *micro, cache.stats()["total"]["bytes_fetched"], time.process_time())

    before, tokens = counts(), 0
    while engine.has_unfinished():
        tokens += sum(len(e.token_ids) for e in engine.step() if isinstance(e, TokenDelta))
    calls, rows, micro, micro_rows, fetched, cpu_s = (a - b for a, b in zip(counts(), before))
    return {"concurrency": concurrency, "tokens": tokens, "calls_per_token": (calls + micro) / tokens,
            "rows_per_call": (rows + micro_rows) / max(calls + micro, 1), "bytes_per_token": fetched / tokens,
            "host_ms_per_token": 1e3 * cpu_s / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--staging-batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--expert-slots", type=int, default=4, help="of the tiny model's 8 experts per MoE layer")
    parser.add_argument("--parts", nargs="+", choices=("engine", "staging", "schedulers"),
                        default=["engine", "staging", "schedulers"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = write_tiny_model(Path(folder) / "tiny", "deepseek_v32", seed=1)
        for concurrency in args.concurrency if "engine" in args.parts else []:
            for overlap in (False, True):
                row = {"what": "engine", "concurrency": concurrency, "overlap": overlap,
                       **engine_host_ms(model, args.device, concurrency, args.prompt_len, args.steps, overlap)}
                rows.append(row)
                print(f"engine  c={concurrency:<3} overlap={'on ' if overlap else 'off'} step {row['step_ms']:.3f} ms"
                      f"  outside the model {row['host_ms']:.3f} ms  ({row['steps']} decode steps)")
        if "schedulers" in args.parts:
            torch.set_num_threads(1)  # (host CPU time of one thread: see the module doc)
            for scheduler in ("sync", "runahead"):
                for row in scheduler_costs(model, args.device, scheduler, args.concurrency, args.prompt_len,
                                           args.steps, args.expert_slots):
                    rows.append({"what": "scheduler", "scheduler": scheduler, **row})
                    print(f"{scheduler:<8} c={row['concurrency']:<3} {row['calls_per_token']:.3f} model calls / token, "
                          f"{row['rows_per_call']:.2f} requests / call, {row['bytes_per_token'] / 1e3:.1f} KB "
                          f"copied / token, host {row['host_ms_per_token']:.3f} ms / token ({row['tokens']} tokens)")
    for batch in args.staging_batch if "staging" in args.parts else []:
        row = {"what": "staging", "batch": batch, **staging_us(batch, args.prompt_len, args.steps)}
        rows.append(row)
        print(f"staging b={batch:<3} DecodeInputs.stage {row['stage_us']:.1f} us   per-row (before) "
              f"{row['per_row_us']:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
