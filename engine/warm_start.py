"""The warm starts' background reads: a daemon thread reads planned items (cache files) into host
RAM one after another while the engine loads and serves, and hands each over through a ``Future``.

``prefix_store.Preload`` (page segments) and ``tier_store.TierPreload`` (parked long chats) share
this machinery; what they plan, how they read an item and what the engine thread makes of an
outcome are theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from typing import Generic, TypeVar

__all__ = ["BackgroundReads"]

Item = TypeVar("Item")
Outcome = TypeVar("Outcome")


class BackgroundReads(Generic[Item, Outcome]):
    """Read ``plan``'s items in order with ``read`` in a daemon thread named ``name`` (``start``
    starts it, once ``read`` may be called); each item's ``Future`` (its key ``key(item)``) ends with
    ``read``'s outcome or exception. ``plan`` is the items, planned on the calling thread, or a
    callable the thread calls first (``plan_known`` says when the engine thread may see its items).

    Threads. The thread touches only its items, what ``read`` reads into and the futures. The
    engine thread (one: nothing here is locked) takes finished outcomes over (``claim``), and
    ``withdraw``s items it needs now: one the thread has not begun leaves the plan (``Future.cancel``:
    the engine reads it itself and the thread skips it), one whose read has begun is waited for, so
    no item is read twice at once. ``cancel`` sets ``stopping`` (``read`` may watch it to stop in the
    middle of an item), skips the items not begun, drops every outcome not claimed and joins the
    thread, at most ``timeout`` seconds.

    Yielding to requests. While the engine serves requests (``set_busy``) the thread holds before
    its next item and, where ``read`` calls ``pause`` between the parts of one, before its next
    part: a warm start reading gigabytes from disk, checksumming them and pinning host memory (a
    call that holds the CUDA driver) would otherwise share the host with the request path it is meant
    to shorten (on the H200 the prompt step of a restarted server's first 64K follow-up took 119 ms
    while the reads ran, 22 ms after them). An item the engine waits for (``withdraw``) is never held.
    """

    def __init__(self, name: str, read: Callable[[Item], Outcome], key: Callable[[Item], str],
                 plan: list[Item] | Callable[[], list[Item]]) -> None:
        self.stopping = threading.Event()
        self._read = read
        self._key = key
        self._planned = threading.Event()
        self._plan: dict[str, tuple[Item, Future[Outcome]]] = {}  # set before _planned (by the thread, or here)
        self._pending: dict[str, tuple[Item, Future[Outcome]]] | None = None  # engine thread: not yet claimed
        self._planner = plan if callable(plan) else None
        if not callable(plan):
            self._plan = self._entries(plan)
            self._planned.set()
            self._pending = dict(self._plan)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._gate = threading.Condition()
        self._busy = False  # the engine serves requests: hold (under _gate)
        self._urgent: set[str] = set()  # items the engine waits for: never held (under _gate)

    def start(self) -> None:
        self.thread.start()

    @property
    def outstanding(self) -> bool:
        """(Engine thread.) Whether outcomes may still be claimed: the plan is not known here yet, or
        items of it are neither claimed nor withdrawn."""
        return self._pending is None or bool(self._pending)

    def plan_known(self, wait: bool) -> bool:
        """(Engine thread.) Whether the plan is known here, after waiting for the thread to make it
        with ``wait``; its items then wait to be claimed."""
        if self._pending is None:
            if not wait and not self._planned.is_set():
                return False
            self._planned.wait()
            self._pending = dict(self._plan)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every planned item was read or skipped; False on timeout."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def set_busy(self, busy: bool) -> None:
        """(Engine thread.) Whether the engine is serving requests now: the thread holds meanwhile."""
        if busy != self._busy:
            with self._gate:
                self._busy = busy
                self._gate.notify_all()

    def pause(self, key: str) -> None:
        """(The thread, between two parts of item ``key``.) Wait while the engine serves requests,
        unless it waits for this item or the reads stop."""
        with self._gate:
            self._gate.wait_for(lambda: not self._busy or key in self._urgent or self.stopping.is_set())

    def cancel(self, timeout: float | None = None) -> bool:
        """Stop, dropping every outcome not claimed; whether the thread ended within ``timeout``."""
        self.stopping.set()
        with self._gate:
            self._gate.notify_all()
        for _, result in self._plan.values() if self._planned.is_set() else ():
            result.cancel()
        self._pending = {}
        return self.wait(timeout)

    def withdraw(self, keys: Iterable[str]) -> None:
        """(Engine thread, the plan known.) Items the engine needs now: those not begun leave the
        plan; then those whose read has begun (or ended) are waited for, their outcomes left to
        ``claim``."""
        begun = []
        for key in keys:
            entry = self._plan.get(key)
            if entry is None:
                continue
            if entry[1].cancel():  # (True too when it was cancelled before)
                if self._pending is not None:
                    self._pending.pop(key, None)
            else:
                begun.append(entry[1])
                with self._gate:
                    self._urgent.add(key)
                    self._gate.notify_all()
        wait_all(begun)

    def claim(self, key: str | None = None) -> list[tuple[Item, Future[Outcome]]]:
        """(Engine thread.) The finished items not claimed yet (only ``key``'s, with ``key``), in
        plan order, with their futures; they are claimed now."""
        pending = self._pending or {}
        done = [k for k, (_, result) in pending.items() if result.done() and (key is None or k == key)]
        return [pending.pop(k) for k in done]

    def _entries(self, items: list[Item]) -> dict[str, tuple[Item, Future[Outcome]]]:
        return {self._key(item): (item, Future[Outcome]()) for item in items}

    def _run(self) -> None:
        try:
            if self._planner is not None:
                self._plan = self._entries(self._planner())
        finally:
            self._planned.set()
        for key, (item, result) in self._plan.items():
            self.pause(key)
            if self.stopping.is_set():
                result.cancel()
            elif result.set_running_or_notify_cancel():  # (False: the engine withdrew it)
                try:
                    result.set_result(self._read(item))
                except BaseException as err:  # (every read ends its Future, so nothing waits forever)
                    result.set_exception(err)
