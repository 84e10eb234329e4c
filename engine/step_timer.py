"""Where a decode step's time goes: the engine step on the host versus the model's GPU work.

``StepTimer`` records, for steps where every request decodes one token, the wall time of the whole
engine step (scheduling, the runner, sampling, detokenising, events) and the GPU time between CUDA
events recorded around ``ModelRunner.run`` (read one step later, so timing adds no synchronisation).
The difference is what the engine adds around the model; the server's HTTP/SSE work shows up as the
client's time per token minus the engine step.

With overlapped decode (``EngineConfig.overlap_decode``) a decode step call launches step N+1 and then
lands step N, so its wall time includes waiting for step N's tokens and, in steady decoding, is the
time per token; the GPU time is still that of ``ModelRunner.run`` alone (step N+1's). Host work hidden
behind the GPU no longer shows in the difference: what remains there is the host work the GPU waits
for (launching the step, staging its inputs) and the sampling kernels. The step that starts a run of
overlapped steps reads nothing back and is short; the numbers are medians of the last 256 steps.

Beside the medians, running totals let a client average any window it chooses (the change between
two ``/hearth/stats`` snapshots): decode steps, their wall time, the GPU time of those read, and the
gap between consecutive decode steps (the engine thread's time outside ``Engine.step``: handing the
events to the server, stats snapshots, waiting for the GIL).

Steps that read prompt tokens (prefill chunks, alone or with decodes) count in ``prompt_*`` totals:
their number and wall time, so that a client can tell a slow first token's prefill from the rest.

The runahead decoder's micro-steps (one layer's attention or experts for the requests at that layer)
are not decode steps of the kind above: their own totals count them, their wall time and the tokens
they finished (``runahead_*``), so a window's time per token under runahead is its wall time over
its tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

_WINDOW = 256  # recent decode steps averaged
_TOTALS = ("decode_steps", "decode_step_ms_sum", "decode_gaps", "decode_gap_ms_sum", "decode_run_gpu_steps",
           "decode_run_gpu_ms_sum", "runahead_steps", "runahead_step_ms_sum", "runahead_tokens",
           "prompt_steps", "prompt_step_ms_sum")


@dataclass
class StepTimer:
    enabled: bool
    _pending: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    _start: float = 0.0
    _decode: bool = False
    _prompt: bool = False
    step_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    run_gpu_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    # Two event pairs used in turn: a step records one while the other (the step before's) is read.
    _pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    _turn: int = 0
    _last_end: float | None = None  # when the last decode step ended (None: the step after was not one)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_TOTALS, 0.0))

    def begin(self, decode: bool, prompt: bool = False) -> None:
        """A step starts: one where every request decodes a token (``decode``), or one that reads
        prompt tokens (``prompt``: its wall time goes to the ``prompt_*`` totals)."""
        self._decode = decode
        self._prompt = prompt and not decode
        self._start = time.perf_counter()
        if decode and self._last_end is not None:
            self.totals["decode_gaps"] += 1
            self.totals["decode_gap_ms_sum"] += 1e3 * (self._start - self._last_end)
        self._last_end = None

    def around_run(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """Two events to record before and after the runner (None off CUDA or outside decode)."""
        if not (self.enabled and self._decode):
            return None
        if not self._pairs:
            self._pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(2)]
        self._turn ^= 1
        return self._pairs[self._turn]

    def end(self, events: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> None:
        if self._prompt:
            self.totals["prompt_steps"] += 1
            self.totals["prompt_step_ms_sum"] += 1e3 * (time.perf_counter() - self._start)
        if not self._decode:
            return
        self._last_end = time.perf_counter()
        self.step_s.append(self._last_end - self._start)
        self.totals["decode_steps"] += 1
        self.totals["decode_step_ms_sum"] += 1e3 * self.step_s[-1]
        if self._pending is not None and self._pending[1].query():
            self.run_gpu_s.append(self._pending[0].elapsed_time(self._pending[1]) / 1e3)
            self.totals["decode_run_gpu_steps"] += 1
            self.totals["decode_run_gpu_ms_sum"] += 1e3 * self.run_gpu_s[-1]
        self._pending = events

    def runahead(self, seconds: float, tokens: int) -> None:
        """One call of the runahead decoder: its wall time and the tokens it finished."""
        self.totals["runahead_steps"] += 1
        self.totals["runahead_step_ms_sum"] += 1e3 * seconds
        self.totals["runahead_tokens"] += tokens

    def summary(self) -> dict[str, float]:
        out = dict(self.totals)
        if self.step_s:
            out["decode_step_ms"] = 1e3 * sorted(self.step_s)[len(self.step_s) // 2]
        if self.run_gpu_s:
            out["decode_run_gpu_ms"] = 1e3 * sorted(self.run_gpu_s)[len(self.run_gpu_s) // 2]
        return out
