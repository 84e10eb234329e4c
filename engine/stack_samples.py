"""Where threads' time goes, sampled: a developer's diagnostic, off unless asked for.

``StackSampler`` wakes every ``interval`` seconds, takes the innermost frames of some threads
(``sys._current_frames``) with the wall-clock time, and appends them to a JSON-lines file about twice
a second, so that a client can read the samples of a window it timed itself (a slow first token)
while the process runs. ``hearth --cli serve`` samples its engine thread and its HTTP loop's (the
main thread) when the environment names a file (``HEARTH_STACK_SAMPLES``); ``bench/bench_e2e.py
--stack-samples`` sets it and prints the commonest stacks of each slow follow-up. The sampler takes
the GIL at each sample (every 5 ms by default), so the sampled process runs a little slower.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ENV", "StackSampler", "read_samples", "top_stacks"]

ENV = "HEARTH_STACK_SAMPLES"
_DEPTH = 12  # innermost frames kept per sample
_FLUSH_S = 0.5


class StackSampler:
    """Sample the stacks of ``threads`` every ``interval`` seconds into ``path`` (JSON lines ``{"t":
    wall clock, "thread": name, "stack": ["file:function:line", ... innermost first]}``) until ``stop``."""

    def __init__(self, threads: list[threading.Thread], path: str | Path, interval: float = 0.005) -> None:
        self.targets = threads
        self.path = Path(path)
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hearth-stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        pending: list[str] = []
        flushed = time.monotonic()
        with open(self.path, "a", encoding="utf-8") as out:
            while not self._stop.wait(self.interval):
                frames, now = sys._current_frames(), time.time()
                for target in self.targets:
                    frame = frames.get(target.ident or -1)
                    stack: list[str] = []
                    while frame is not None and len(stack) < _DEPTH:
                        code = frame.f_code
                        stack.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
                        frame = frame.f_back
                    if stack:
                        pending.append(json.dumps({"t": now, "thread": target.name, "stack": stack}))
                del frames
                if pending and time.monotonic() - flushed >= _FLUSH_S:
                    out.write("\n".join(pending) + "\n")
                    out.flush()
                    pending, flushed = [], time.monotonic()
            if pending:
                out.write("\n".join(pending) + "\n")


def read_samples(path: str | Path, start: float, end: float, thread: str) -> list[list[str]]:
    """The stacks of ``thread`` sampled in [start, end] (wall clock); a line cut short by a writer is skipped."""
    stacks = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            sample = json.loads(line)
        except ValueError:
            continue
        if start <= sample["t"] <= end and sample.get("thread") == thread:
            stacks.append(sample["stack"])
    return stacks


def top_stacks(stacks: Iterable[list[str]], frames: int = 4, top: int = 6) -> list[tuple[int, str]]:
    """The commonest ``frames`` innermost frames of ``stacks``: (samples, "a <- b <- c"), most first."""
    counts = Counter(" <- ".join(stack[:frames]) for stack in stacks)
    return [(n, stack) for stack, n in counts.most_common(top)]
