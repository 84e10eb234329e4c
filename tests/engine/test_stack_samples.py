"""The developers' stack sampler (hearth.engine.stack_samples): a thread's samples land in the file
within a second, carry the sampled function, and read back by time window and thread."""

from __future__ import annotations

import threading
import time

from hearth.engine.stack_samples import StackSampler, read_samples, top_stacks


def _busy_wait_here(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.001)


def test_samples_name_the_function_a_thread_is_in(tmp_path):
    stop = threading.Event()
    worker = threading.Thread(target=_busy_wait_here, args=(stop,), name="worker")
    worker.start()
    path = tmp_path / "stacks.jsonl"
    start = time.time()
    sampler = StackSampler([worker], path, interval=0.002).start()
    time.sleep(1.2)  # (two flushes)
    end = time.time()
    seen = read_samples(path, start, end, "worker")
    stop.set()
    worker.join()
    sampler.stop()
    assert len(seen) >= 20
    top = top_stacks(seen, frames=2, top=1)[0][1]
    assert "_busy_wait_here" in top
    assert read_samples(path, start, end, "another") == [] and read_samples(path, end + 60, end + 61, "worker") == []
