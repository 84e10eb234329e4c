"""EngineHost: the one ``Engine`` of the engine host process and the thread that steps it.

HTTP handlers run on the asyncio loop; the engine runs on its own thread, ``hearth-engine``, which
alone calls ``Engine.step()``. A handler ``submit``s a request with a *sink* (a callable the engine
thread calls with each of that request's events) and may ``abort`` it. The server's sinks come from
the host's ``EventRelay``: they only queue, and the engine thread hands a step's events for all
requests to the loop in one hop, once the next step is launched and it is about to wait for the
device (see ``EventRelay``). Loading and unloading swap the engine under a lock;
requests still in flight on the old engine get ``Finished(reason="abort")``. Whatever must run
between steps (dropping a conversation's cache, saving the cache when the engine goes) takes the
step lock, which the engine thread holds while it steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from hearth.engine.api import (
    CheckpointError,
    EngineConfig,
    EngineStats,
    Event,
    Finished,
    HearthError,
    RequestStats,
    TokenDelta,
)
from hearth.engine.config import ModelConfig
from hearth.engine.engine import Engine, check_conversation_id
from hearth.engine.loader import CheckpointFiles
from hearth.engine.prefix_store import drop_from_folder
from hearth.engine.text.reasoning import PROMPT_TAIL_TOKENS
from hearth.engine.tier_store import drop_tiers_from_folder

logger = logging.getLogger("hearth.engine.server")

Sink = Callable[[Event], None]
_IDLE_WAIT_S = 0.25
_SNAPSHOT_EVERY_S = 0.1  # how stale /hearth/stats may be while the engine is busy


class NoModelError(HearthError):
    """No model is loaded (or one is still loading), so requests cannot run."""


class StillLoadingError(NoModelError):
    """A model is loading; requests can run once it is ready."""


class BusyError(HearthError):
    """Another load is already in progress."""


class EventRelay:
    """Carries the engine thread's events onto asyncio loops, one hop per step rather than one per
    token. A sink made by ``sink`` only queues its event; ``flush`` passes everything queued to each
    loop with one ``call_soon_threadsafe``, in order. Each such hop writes to the loop's wake-up
    pipe: a system call that releases the GIL, which the HTTP loop then takes and the engine thread
    has to wait to get back. The host flushes when the engine calls back from ``Engine.step`` (the
    next step is launched and the engine is about to wait for it), so the loop encodes and sends a
    step's chunks while the engine thread sleeps on the device instead of while it launches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: dict[asyncio.AbstractEventLoop, list[tuple[Sink, Event]]] = {}

    def sink(self, loop: asyncio.AbstractEventLoop, deliver: Sink) -> Sink:
        """A sink whose events reach ``deliver``, called on ``loop``, at the next ``flush``."""
        def post(event: Event) -> None:
            with self._lock:
                self._queued.setdefault(loop, []).append((deliver, event))

        return post

    def flush(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, {}
        for loop, batch in queued.items():
            # RuntimeError: the loop is closed because the server is shutting down.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[Sink, Event]]) -> None:
    for deliver, event in batch:
        deliver(event)


@dataclass(frozen=True)
class Submission:
    request_id: str
    prompt_tokens: int
    prompt_tail: str = ""  # the prompt's last tokens as text, markers kept (does it open a <think>?)


@dataclass(frozen=True)
class LoadedModel:
    name: str
    path: Path
    max_model_len: int
    model_type: str = ""  # picks the tool-call format


class EngineHost:
    """Owns the engine; thread-safe ``submit`` / ``abort`` / ``load`` / ``unload`` / ``stats``."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._engine: Engine | None = None
        self._model: LoadedModel | None = None
        self._loading: str | None = None
        self._sinks: dict[str, Sink] = {}
        # requests whose first token has not been dispatched: a step that gives one its first token
        # flushes the relay at once instead of at the next step's launch, which may capture a CUDA
        # graph first (tens of ms on the first token of a chat whose tiers were just resumed)
        self._awaiting_first: set[str] = set()
        self._snapshot_at = 0.0
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()  # held by the engine thread while it steps
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hearth-engine", daemon=True)
        self._snapshot: EngineStats | None = None
        self.relay = EventRelay()
        self._counts = {"requests_total": 0, "requests_finished": 0, "requests_aborted": 0, "requests_failed": 0}
        self._retired_tokens = 0  # generated by models unloaded since: the counters cover the host's life
        self._started = time.time()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The engine thread (every ``Engine`` call but loading runs on it)."""
        return self._thread

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.unload()

    @property
    def model(self) -> LoadedModel | None:
        return self._model

    @property
    def state(self) -> str:
        """"ready", "loading" or "no_model"."""
        if self._loading is not None:
            return "loading"
        return "ready" if self._model is not None else "no_model"

    def load(self, path: str | Path, served_name: str | None = None, max_model_len: int | None = None) -> LoadedModel:
        """Replace the current model with the one in ``path`` (blocking; minutes for big models), ready
        once its warm-up (``EngineConfig.warm_up``) ran."""
        folder = Path(path).expanduser()
        with self._lock:
            if self._loading is not None:
                raise BusyError(f"already loading {self._loading}; wait for it to finish")
            self._loading = str(folder)
        try:
            _preflight(folder)
            self.unload()
            config = self.config
            if max_model_len is not None:
                config = EngineConfig(**{**asdict(config), "max_model_len": max_model_len})
            engine = _start_engine(folder, config)
            model = LoadedModel(served_name or folder.resolve().name, folder.resolve(), engine.max_model_len,
                                engine.model_config.model_type)
            with self._lock:
                self._engine, self._model = engine, model
            logger.info("loaded %s from %s (context %d tokens)", model.name, folder, model.max_model_len)
            return model
        finally:
            self._loading = None
            self._wake.set()

    def unload(self) -> str | None:
        """Drop the model (in-flight requests end with reason "abort"); returns its name."""
        with self._lock:
            engine, model, self._engine, self._model = self._engine, self._model, None, None
            sinks, self._sinks = self._sinks, {}
            self._awaiting_first.clear()
        if engine is not None:
            with self._step_lock:
                saved = engine.close()  # the cached pages and long chats, for the next engine on this model
            if saved:
                logger.info("saved %d prefix cache pages and long chats", saved)
        for request_id, sink in sinks.items():
            sink(_failed(request_id, "abort", "the model was unloaded"))
        self.relay.flush()
        if model is not None:
            snapshot, self._snapshot = self._snapshot, None
            self._retired_tokens += snapshot.generated_tokens if snapshot is not None else 0
            _free_memory()
            logger.info("unloaded %s", model.name)
        return model.name if model else None

    # ---- requests --------------------------------------------------------------------------

    def submit(self, sink: Sink, *, sampling: dict[str, Any], messages: Sequence[dict[str, Any]] | None = None,
               prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
               chat_options: dict[str, Any] | None = None, conversation_id: str | None = None) -> Submission:
        """Tokenize and queue a request whose events go to ``sink``. ``sampling`` holds what the
        client gave (``Engine.add_request`` fills the rest and checks it); ``conversation_id``
        tags its cache pages (``drop_conversation``)."""
        request_id = uuid.uuid4().hex
        check_conversation_id(conversation_id)
        with self._lock:
            engine = self._require_engine()
        # Tokenising happens outside the lock, so a long prompt holds up neither other requests
        # nor the engine thread.
        ids = engine.encode(messages, prompt, prompt_token_ids, max_tokens=engine.max_model_len - 1,
                            conversation_id=conversation_id, **(chat_options or {}))
        with self._lock:
            if engine is not self._engine:  # unloaded or replaced while the prompt was tokenised
                if self._engine is None:
                    raise self._not_ready()
                raise NoModelError("the model was replaced while this request was prepared; send it again")
            self._sinks[request_id] = sink
            self._awaiting_first.add(request_id)
            try:
                engine.add_request(prompt_token_ids=ids, sampling=sampling, request_id=request_id,
                                   conversation_id=conversation_id)
            except BaseException:
                self._sinks.pop(request_id, None)
                self._awaiting_first.discard(request_id)
                raise
            self._counts["requests_total"] += 1
        self._wake.set()
        return Submission(request_id, len(ids), engine.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))

    def count_prompt_tokens(self, messages: Sequence[dict[str, Any]] | None = None, prompt: str | None = None,
                            chat_options: dict[str, Any] | None = None) -> int:
        """The prompt's length in tokens, through the same tokenizer and chat template as ``submit``."""
        with self._lock:
            return len(self._require_engine().encode(messages, prompt, None, **(chat_options or {})))

    def abort(self, request_id: str) -> None:
        """Stop a request if it is still running (a no-op otherwise)."""
        with self._lock:
            if request_id in self._sinks and self._engine is not None:
                self._engine.abort(request_id)
        self._wake.set()

    def drop_conversation(self, conversation_id: str) -> int:
        """Delete a conversation's cached pages (GPU, RAM, disk); returns how many. With no model
        loaded, its files in the cache folder are deleted."""
        check_conversation_id(conversation_id)
        with self._lock:
            engine = self._engine
        if engine is not None:
            with self._step_lock:
                dropped = engine.drop_conversation(conversation_id)
                self._take_snapshot(engine)  # stats show the chat gone at once
            return dropped
        folder = self.config.prefix_cache_dir
        if not folder:
            return 0
        return drop_from_folder(folder, conversation_id) + drop_tiers_from_folder(folder, conversation_id)

    def require_model(self) -> LoadedModel:
        """The loaded model; raises StillLoadingError or NoModelError when there is none."""
        model = self._model
        if model is None:
            raise self._not_ready()
        return model

    def _require_engine(self) -> Engine:
        if self._engine is None:
            raise self._not_ready()
        return self._engine

    def _not_ready(self) -> NoModelError:
        if self._loading is not None:
            return StillLoadingError("the model is still loading; try again shortly")
        return NoModelError("no model is loaded; load one with POST /hearth/load")

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            engine = self._engine
            self._wake.clear()
            if engine is None or not engine.has_unfinished():
                self.relay.flush()
                self._take_snapshot(engine)
                self._wake.wait(_IDLE_WAIT_S)
                continue
            try:
                with self._step_lock:
                    # The last step's events go to the loop once this one is launched (EventRelay).
                    events = engine.step(launched=self.relay.flush)
            except Exception:  # an engine bug must not kill the host: fail the requests, keep serving
                logger.exception("engine step failed")
                events = self._fail_running(engine)
            self.relay.flush()  # (a step that launched nothing did not flush)
            now = time.monotonic()
            if now - self._snapshot_at >= _SNAPSHOT_EVERY_S or any(isinstance(e, Finished) for e in events):
                self._take_snapshot(engine)  # not every step: stats cost host time a decode step cannot spare
                self._snapshot_at = now
            if self._dispatch(events):
                self.relay.flush()  # a first token: to its client now (see _awaiting_first)

    def _dispatch(self, events: list[Event]) -> bool:
        """Pass events to their requests' sinks; whether one was a request's first token."""
        first = False
        for event in events:
            with self._lock:
                if event.request_id in self._awaiting_first and isinstance(event, (TokenDelta, Finished)):
                    self._awaiting_first.discard(event.request_id)
                    first = True
                if isinstance(event, Finished):
                    sink = self._sinks.pop(event.request_id, None)
                    if sink is not None:
                        self._count(event)
                else:
                    sink = self._sinks.get(event.request_id)
            if sink is not None:
                sink(event)
        return first

    def _count(self, finished: Finished) -> None:
        key = {"abort": "requests_aborted", "error": "requests_failed"}.get(finished.reason, "requests_finished")
        self._counts[key] += 1

    def _fail_running(self, engine: Engine) -> list[Event]:
        with self._lock:
            ids = list(self._sinks) if engine is self._engine else []
        for request_id in ids:
            engine.abort(request_id)  # the next step frees their cache pages
        return [_failed(r, "error", "the engine hit an internal error (details are in the engine host's log)")
                for r in ids]

    def _take_snapshot(self, engine: Engine | None) -> None:
        # NOTE: Engine.stats() reads scheduler state, so it is called here on the engine thread
        # (after every step, and while idle) and handlers read the snapshot.
        if engine is not None and engine is self._engine:  # not a model unloaded during the step
            self._snapshot = engine.stats()

    # ---- stats -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine counters (as of the last step), request counts, memory and uptime. Request and
        generated-token counts cover the host's whole life, across unload and load."""
        model, snapshot = self._model, self._snapshot
        # NOTE: no model path: it names folders on this machine, and status bars need only the name.
        out: dict[str, Any] = {"state": self.state, "model": model.name if model else None,
                               "max_model_len": model.max_model_len if model else None,
                               "uptime_s": round(time.time() - self._started, 3), **self._counts}
        if snapshot is not None and model is not None:
            out.update(asdict(snapshot))
            out.update(snapshot.extra)  # expert_cache_hit_rate etc. at the top level for status bars
        current = snapshot.generated_tokens if snapshot is not None and model is not None else 0
        out["generated_tokens"] = self._retired_tokens + current
        out["memory"] = memory_usage()
        return out


def _preflight(folder: Path) -> None:
    """Cheap checks (folder, config.json, shard headers) before the current model is dropped, so a
    mistyped path does not cost the user the model they had."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a model folder")
    ModelConfig.from_file(folder)
    CheckpointFiles(folder).close()


def _start_engine(folder: Path, config: EngineConfig) -> Engine:
    """The engine of the model in ``folder``, warmed up when its config asks (``Engine.warm_up``: the
    host says "loading" until then). A warm-up that fails fails the load in one line, its engine freed."""
    engine = Engine.load(str(folder), config)
    if not engine.wants_warm_up:
        return engine
    try:
        seconds = engine.warm_up()
    except HearthError as err:  # (a warm-up request failed: the GPU ran out of memory)
        problem = str(err)
    except Exception as err:  # a bug, or a kernel that cannot build for this model: the log has the traceback
        # (as text: a handler that keeps records would keep the engine alive through the traceback's frames)
        logger.error("the engine's warm-up failed:\n%s", "".join(traceback.format_exception(err)).rstrip())
        problem = f"the engine's warm-up failed: {type(err).__name__}: {' '.join(str(err).split()) or 'no details'}"
    else:
        logger.info("warmed up in %.2f s (kernels compiled, decode graphs captured)", seconds)
        return engine
    # NOTE: out of the except block, so the error raised here holds no frame that holds the engine.
    engine.discard()
    del engine
    _free_memory()
    raise HearthError(problem)


def _free_memory() -> None:
    """Give the memory of an engine that is gone back (Python's cycles, then PyTorch's cached GPU blocks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _failed(request_id: str, reason: str, message: str) -> Finished:
    return Finished(request_id, reason, "", RequestStats(0, 0, 0, None, 0.0), message)  # type: ignore[arg-type]


def memory_usage() -> dict[str, Any]:
    """Host memory of this process and the machine, and per-GPU memory when CUDA is in use."""
    vm = psutil.virtual_memory()
    memory: dict[str, Any] = {"process_rss_bytes": psutil.Process().memory_info().rss,
                              "host_total_bytes": vm.total, "host_available_bytes": vm.available, "gpus": []}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            memory["gpus"].append({
                "index": i, "name": torch.cuda.get_device_name(i),
                "allocated_bytes": torch.cuda.memory_allocated(i), "reserved_bytes": torch.cuda.memory_reserved(i),
                "total_bytes": torch.cuda.get_device_properties(i).total_memory,
            })
    return memory
