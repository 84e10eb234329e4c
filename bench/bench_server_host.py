"""What the server and the engine loop add to a decode step, through the real server process (CPU).

The engine alone (``Engine.step`` in a loop, no server) and then ``python -m hearth.engine.server``
in its own process on the same tiny DeepSeek-V3.2 checkpoint, driven by ``--concurrency`` streaming
clients (``/v1/completions`` with token-id prompts, greedy, ``ignore_eos``, ``include_usage``) on their
own threads in this process. The server runs with probes installed (``--probe``: this script starts the server's
``main`` after wrapping a few functions; the server's code is unchanged) that time, for every
engine step: its wall time and the gap before the next one, the events it produced, the host's
hand-over of those events to the HTTP loop (``EngineHost._dispatch``, the sinks'
``call_soon_threadsafe``), stats snapshots, detokenising (``IncrementalDetokenizer.push``), and on the
HTTP loop the SSE encoding and each body ``send``. The engine thread's and the loop thread's CPU
time over the window come from ``/proc``. ``/hearth/stats`` gives the decode steps by how they ran
(overlapped, or synchronous and why).

Everything is taken over the window in which every stream decodes (after the last first token,
before the first stream ends). The headline: the server's time per decode step (the client's
time per token) against the engine alone, and what the difference is made of.

    python bench/bench_server_host.py [--concurrency 8] [--prompt-len 256] [--decode-tokens 96]
        [--no-overlap] [--json FILE]

CPU only and noisy on a shared machine (its numbers say where host time goes, not what a GPU
would see); the GPU measurement of the same path is ``bench/bench_e2e.py``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---- the probes, inside the server process -----------------------------------------------------


@dataclass
class Probe:
    """Timings the wrapped functions append to (the server process's side)."""

    steps: list[tuple[float, float, int, int]] = field(default_factory=list)  # start, end, deltas, finished
    calls: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # name -> (start, seconds)
    bytes_sent: list[tuple[float, int]] = field(default_factory=list)
    engine_tid: int = 0

    def timed(self, name: str, fn: Callable) -> Callable:
        log = self.calls.setdefault(name, [])

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                log.append((start, time.perf_counter() - start))

        return wrapper

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({"steps": self.steps, "calls": self.calls, "bytes_sent": self.bytes_sent,
                                    "engine_tid": self.engine_tid, "clock": time.perf_counter(),
                                    "epoch": time.time()}))


def serve_with_probes(out: Path, argv: list[str]) -> int:
    from hearth.engine.api import Finished, TokenDelta
    from hearth.engine.engine import Engine
    from hearth.engine.runner import ModelRunner
    from hearth.engine.server import app, host, main
    from hearth.engine.text.detokenizer import IncrementalDetokenizer

    probe = Probe()
    step = Engine.step

    def timed_step(self: Engine, *args: Any, **kwargs: Any) -> list:
        start = time.perf_counter()
        events = step(self, *args, **kwargs)
        end = time.perf_counter()
        probe.steps.append((start, end, sum(isinstance(e, TokenDelta) for e in events),
                            sum(isinstance(e, Finished) for e in events)))
        return events

    Engine.step = timed_step
    ModelRunner.run = probe.timed("run", ModelRunner.run)
    IncrementalDetokenizer.push = probe.timed("detokenize", IncrementalDetokenizer.push)
    host.EngineHost._dispatch = probe.timed("dispatch", host.EngineHost._dispatch)
    host.EngineHost._take_snapshot = probe.timed("snapshot", host.EngineHost._take_snapshot)
    run = host.EngineHost._run

    def run_noting_thread(self: host.EngineHost) -> None:
        probe.engine_tid = threading.get_native_id()
        out.with_suffix(".tid").write_text(str(probe.engine_tid))
        run(self)

    host.EngineHost._run = run_noting_thread
    _probe_server_side(probe, app)
    try:
        return main.main(argv)
    finally:
        probe.dump(out)


def _probe_server_side(probe: Probe, app: Any) -> None:
    """Wrap what the HTTP side does per event: the sink's hop onto the loop, SSE encoding, sends."""
    if hasattr(app, "EventRelay"):  # the hand-over of queued events to the loop (after the relay came)
        app.EventRelay.flush = probe.timed("sink", app.EventRelay.flush)
    else:  # before: one call_soon_threadsafe per event
        app.RequestStream.sink = probe.timed("sink", app.RequestStream.sink)
    app.sse = probe.timed("sse_encode", app.sse)
    respond = app.StreamWithCleanup.__call__
    sends = probe.calls.setdefault("send", [])

    async def timed_call(self: Any, scope: Any, receive: Any, send: Any) -> None:
        async def timed_send(message: dict) -> None:
            start = time.perf_counter()
            await send(message)
            sends.append((start, time.perf_counter() - start))
            probe.bytes_sent.append((start, len(message.get("body", b""))))

        await respond(self, scope, receive, timed_send)

    app.StreamWithCleanup.__call__ = timed_call


# ---- the clients, in this process -------------------------------------------------------------


@dataclass
class Stream:
    start: float
    first: float = 0.0
    end: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each content chunk
    completion_tokens: int = 0


def stream_one(port: int, prompt: list[int], max_tokens: int, out: Stream) -> None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        now = time.perf_counter()
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            out.completion_tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"] and chunk["choices"][0]["text"]:
            if not out.arrivals:
                out.first = now
            out.arrivals.append(now)
    out.end = time.perf_counter()
    conn.close()


def run_streams(port: int, prompts: list[list[int]], max_tokens: int) -> list[Stream]:
    streams = [Stream(time.perf_counter()) for _ in prompts]
    threads = [threading.Thread(target=stream_one, args=(port, p, max_tokens, s))
               for p, s in zip(prompts, streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return streams


def decode_window(streams: list[Stream]) -> tuple[float, float]:
    return max(s.first for s in streams), min(s.arrivals[-1] for s in streams)


def thread_cpu_s(pid: int, tid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the engine alone ------------------------------------------------------------------------


def engine_alone(model: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    """The engine stepped in a loop, no server: each decode step's wall time and its time outside
    ``ModelRunner.run``."""
    from hearth.engine import Engine, Finished, SamplingParams

    engine = Engine.load(str(model), _config(args))
    run_s = [0.0]
    run = engine.runner.run

    def timed_run(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return run(*a, **k)
        finally:
            run_s[0] += time.perf_counter() - start

    engine.runner.run = timed_run
    sampling = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(prompt_token_ids=p, sampling=sampling)
    walls, outside = [], []
    while engine.has_unfinished():
        decoding = all(not s.in_prefill for s in engine.scheduler.running) and not engine.scheduler.waiting
        run_s[0] = 0.0
        start = time.perf_counter()
        events = engine.step()
        if decoding and len(events) == len(prompts) and not any(isinstance(e, Finished) for e in events):
            walls.append(time.perf_counter() - start)
            outside.append(walls[-1] - run_s[0])
    return {"step_ms": 1e3 * statistics.median(walls[2:]), "outside_run_ms": 1e3 * statistics.median(outside[2:]),
            "steps": len(walls)}


def _config(args: argparse.Namespace) -> Any:
    from hearth.engine import EngineConfig

    return EngineConfig(device="cpu", dtype="float32", max_num_seqs=args.concurrency,
                        max_model_len=args.prompt_len + args.decode_tokens + 64, overlap_decode=not args.no_overlap)


# ---- through the server ----------------------------------------------------------------------


def through_server(model: Path, args: argparse.Namespace, prompts: list[list[int]], folder: Path) -> dict[str, Any]:
    import httpx

    port_file, probe_file = folder / "port", folder / "probe.json"
    cmd = [sys.executable, __file__, "--probe", str(probe_file), "--", "--model", str(model),
           "--served-name", "tiny", "--port", "0", "--port-file", str(port_file), "--device", "cpu",
           "--dtype", "float32", "--max-num-seqs", str(args.concurrency),
           "--max-model-len", str(args.prompt_len + args.decode_tokens + 64), "--log-level", "warning"]
    if args.no_overlap:
        cmd += ["--overlap-decode", "false"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    try:
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            time.sleep(0.1)
        port = int(port_file.read_text())
        url = f"http://127.0.0.1:{port}"
        run_streams(port, prompts[:1], 8)  # warm up
        cpu_before: dict[str, float] = {}
        stats_before: dict[str, Any] = {}

        def at_window_start() -> None:  # once every stream has its first token
            while not all(s.arrivals for s in streams):
                time.sleep(0.002)
            cpu_before.update(_cpu(proc.pid, probe_file))
            stats_before.update(httpx.get(url + "/hearth/stats", timeout=30).json())

        streams = [Stream(time.perf_counter()) for _ in prompts]
        threads = [threading.Thread(target=stream_one, args=(port, p, args.decode_tokens, s))
                   for p, s in zip(prompts, streams)]
        watcher = threading.Thread(target=at_window_start)
        for t in [*threads, watcher]:
            t.start()
        for t in [*threads, watcher]:
            t.join()
        cpu_after = _cpu(proc.pid, probe_file)
        stats_after = httpx.get(url + "/hearth/stats", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(60)
    probe = json.loads(probe_file.read_text())
    return summarize(streams, probe, cpu_before, cpu_after, stats_before, stats_after)


def _cpu(pid: int, probe_file: Path) -> dict[str, float]:
    """CPU seconds of the server's engine thread and of its main (HTTP loop) thread so far."""
    engine_tid = int(probe_file.with_suffix(".tid").read_text())
    return {"loop": thread_cpu_s(pid, pid), "engine": thread_cpu_s(pid, engine_tid)}


def summarize(streams: list[Stream], probe: dict, cpu_before: dict, cpu_after: dict, before: dict,
              after: dict) -> dict[str, Any]:
    lo, hi = decode_window(streams)
    # Client clock -> server clock: both are perf_counter on one machine (CLOCK_MONOTONIC).
    steps = [s for s in probe["steps"] if lo <= s[0] and s[1] <= hi]
    if len(steps) < 3:
        raise RuntimeError("too few decode steps in the window; raise --decode-tokens")
    tokens = sum(sum(lo < t <= hi for t in s.arrivals) for s in streams)  # chunks; see the chunk check below
    span = steps[-1][1] - steps[0][0]
    walls = [e - b for b, e, _, _ in steps]
    gaps = [b2 - e1 for (_, e1, _, _), (b2, _, _, _) in zip(steps, steps[1:])]
    deltas = sum(n for _, _, n, _ in steps)

    def per_step(name: str) -> tuple[float, int]:
        calls = [d for t, d in probe["calls"].get(name, []) if lo <= t <= hi]
        return 1e3 * sum(calls) / len(steps), len(calls)

    row: dict[str, Any] = {
        "window_s": hi - lo, "steps": len(steps),
        "client_ms_per_token": 1e3 * (hi - lo) / (tokens / len(streams)),
        "step_period_ms": 1e3 * span / (len(steps) - 1) if len(steps) > 1 else float("nan"),
        "step_wall_ms": 1e3 * statistics.median(walls), "gap_ms": 1e3 * statistics.median(gaps),
        "gap_mean_ms": 1e3 * statistics.mean(gaps), "token_events_per_step": deltas / len(steps),
        "chunks_per_step": tokens / len(steps),
        "engine_cpu_ms_per_step": 1e3 * (cpu_after["engine"] - cpu_before["engine"]) / len(steps),
        "loop_cpu_ms_per_step": 1e3 * (cpu_after["loop"] - cpu_before["loop"]) / len(steps),
    }
    for name in ("run", "dispatch", "sink", "snapshot", "detokenize", "sse_encode", "send"):
        row[f"{name}_ms_per_step"], row[f"{name}_calls"] = per_step(name)
    row["outside_run_ms"] = row["step_period_ms"] - row["run_ms_per_step"]
    sent = [n for t, n in probe["bytes_sent"] if lo <= t <= hi]
    row["bytes_sent_per_step"] = sum(sent) / len(steps)
    keys = {k for k in after if k.startswith("decode_steps_")}
    row["decode_steps_by_kind"] = {k.removeprefix("decode_steps_"): after[k] - before.get(k, 0.0) for k in sorted(keys)}
    return row


def main() -> None:
    if "--probe" in sys.argv:
        at = sys.argv.index("--probe")
        raise SystemExit(serve_with_probes(Path(sys.argv[at + 1]), sys.argv[at + 3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the engine (both runs)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)

    from hearth.engine.testing.tiny import write_tiny_model

    torch.manual_seed(0)
    prompts = [[(31 * i + 7 * j) % 400 + 20 for j in range(args.prompt_len)] for i in range(args.concurrency)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = write_tiny_model(folder / "tiny", "deepseek_v32", seed=1)
        alone = engine_alone(model, args, prompts)
        print(f"engine alone: {alone['step_ms']:.3f} ms per decode step, {alone['outside_run_ms']:.3f} ms of it "
              f"outside ModelRunner.run ({alone['steps']} steps)", flush=True)
        server = through_server(model, args, prompts, folder)
    server["engine_alone_step_ms"] = alone["step_ms"]
    server["engine_alone_outside_run_ms"] = alone["outside_run_ms"]
    report(server, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **server}, indent=2))


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"server, {args.concurrency} streams, overlap {'off' if args.no_overlap else 'on'}: "
          f"{r['client_ms_per_token']:.3f} ms per token per stream at the clients; engine step period "
          f"{r['step_period_ms']:.3f} ms of which ModelRunner.run {r['run_ms_per_step']:.3f} ms: outside the run "
          f"{r['outside_run_ms']:.3f} ms per step (engine alone: {r['engine_alone_outside_run_ms']:.3f} ms)")
    print(f"  engine steps in the window {r['steps']}: period {r['step_period_ms']:.3f} ms, step wall "
          f"{r['step_wall_ms']:.3f} ms (median), gap between steps {r['gap_ms']:.3f} ms (median; mean "
          f"{r['gap_mean_ms']:.3f})")
    print(f"  per step: {r['token_events_per_step']:.2f} token events, {r['chunks_per_step']:.2f} chunks at the "
          f"clients, {r['bytes_sent_per_step']:.0f} SSE bytes")
    print(f"  CPU per step: engine thread {r['engine_cpu_ms_per_step']:.3f} ms, HTTP loop thread "
          f"{r['loop_cpu_ms_per_step']:.3f} ms")
    for name in ("run", "dispatch", "sink", "snapshot", "detokenize", "sse_encode", "send"):
        print(f"  {name:<11} {r[f'{name}_ms_per_step']:.3f} ms per step ({r[f'{name}_calls']} calls)")
    print(f"  decode steps by kind: {r['decode_steps_by_kind']}")


if __name__ == "__main__":
    main()
