"""The engine worker: a QObject on its own QThread that owns all blocking engine calls.

The GUI talks to it only through queued signals (``request_connect``, ``request_generate``,
``request_restart``) and the thread-safe ``stop()``; it answers with signals. Each streamed chunk
is emitted as it arrives; the chat panel coalesces them on a timer before re-rendering.
Exceptions never escape the worker: they become ``connect_failed`` / ``generation_done`` with an
error, and a dead engine host becomes ``engine_died``.

It writes one answer at a time: a request sent while another streams (from another chat) waits in
the thread's queue and begins (``generation_started``) when that one is done. ``stop(request_id)``
ends the answer it names, running or still waiting (a waiting one ends as "abort" when its turn
comes, without reaching the engine).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from hearth.app.client.context_window import ContextFullError
from hearth.app.gui.backend import Backend, ModelChoice
from hearth.app.gui.qt import QObject, QThread, Signal, Slot
from hearth.app.store.chats import MessageStats
from hearth.engine.api import HearthError, decode_rate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    """How one answer ended. ``finish_reason`` is "stop", "length", "abort", "error", or
    "context_full" (nothing was sent: the chat outgrew the context and the policy is "stop")."""

    request_id: int
    text: str
    finish_reason: str
    stats: MessageStats
    error: str | None = None
    engine_died: bool = False
    reasoning: str = ""  # what a thinking model wrote before its answer


class EngineWorker(QObject):
    """Lives on the engine thread; its slots run there, one at a time."""

    connected = Signal(object)  # backend.Connected
    connect_failed = Signal(str)
    generation_started = Signal(int)  # request id: its turn came (requests from other chats wait theirs)
    context_fitted = Signal(int, object)  # request id, ContextFit: what is sent, before the first chunk
    chunk = Signal(int, str)  # request id, new text
    reasoning_chunk = Signal(int, str)  # request id, new reasoning (a thinking model's, before the answer)
    generation_done = Signal(object)  # GenerationResult
    engine_died = Signal(str)

    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self._lock = threading.Lock()
        self._running: int | None = None  # the request being answered
        self._stopped: set[int] = set()  # requests to end: running (at its next chunk) or not begun

    def stop(self, request_id: int | None = None) -> None:
        """Thread-safe: end answer ``request_id`` (None: the running one): a running answer at its
        next chunk (the request is aborted), a waiting one as soon as its turn comes."""
        with self._lock:
            request_id = self._running if request_id is None else request_id
            if request_id is not None:
                self._stopped.add(request_id)

    def _is_stopped(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self._stopped

    @Slot(object)
    def connect_model(self, choice: ModelChoice) -> None:
        try:
            self.connected.emit(self.backend.connect(choice))
        except Exception as exc:
            logger.warning("Could not load %s", choice.label, exc_info=exc)
            self.connect_failed.emit(f"Could not load {choice.label}: {exc}")

    @Slot()
    def restart(self) -> None:
        """Restart the engine host; always answers, with ``connected`` or ``connect_failed``."""
        try:
            result = self.backend.restart()
        except Exception as exc:
            logger.warning("Engine restart failed", exc_info=exc)
            self.connect_failed.emit(f"Could not restart the engine: {exc}")
            return
        if result is None:  # a backend with nothing to restart
            self.connect_failed.emit("Could not restart the engine: no model is chosen; pick one in the chat")
        else:
            self.connected.emit(result)

    @Slot(int, object, object, str, object)
    def generate(self, request_id: int, messages: list[dict[str, str]], sampling: dict[str, Any],
                 context_policy: str, conversation_id: int | None = None) -> None:
        with self._lock:
            if request_id in self._stopped:  # stopped while it waited for its turn
                self._stopped.discard(request_id)
                self.generation_done.emit(GenerationResult(request_id, "", "abort", MessageStats()))
                return
            self._running = request_id
        self.generation_started.emit(request_id)
        try:
            result = self._answer(request_id, messages, sampling, context_policy, conversation_id)
        finally:
            with self._lock:
                self._running = None
                self._stopped.discard(request_id)
        self.generation_done.emit(result)

    def _answer(self, request_id: int, messages: list[dict[str, str]], sampling: dict[str, Any],
                context_policy: str, conversation_id: int | None) -> GenerationResult:
        started = time.monotonic()
        state = _Progress()
        try:
            fit = self.backend.fit_context(messages, sampling.get("max_tokens"), context_policy)
            self.context_fitted.emit(request_id, fit)
            self._stream(request_id, fit.messages, sampling, state, conversation_id)
            reason = "abort" if self._is_stopped(request_id) else (state.finish_reason or "stop")
            result = GenerationResult(request_id, state.text, reason, state.stats(started), reasoning=state.reasoning)
        except ContextFullError as exc:
            result = GenerationResult(request_id, "", "context_full", state.stats(started), str(exc))
        except Exception as exc:
            died = _is_engine_death(exc) or not self._alive()
            # A refused request (HearthError: the server's one-line reason) needs no traceback.
            logger.warning("Generation failed: %s", exc, exc_info=None if isinstance(exc, HearthError) else exc)
            result = GenerationResult(request_id, state.text, "error", state.stats(started),
                                      str(exc) or type(exc).__name__, engine_died=died, reasoning=state.reasoning)
            if died:
                self.engine_died.emit(str(exc) or "The engine stopped")
        return result

    def _stream(self, request_id: int, messages: list[dict[str, str]], sampling: dict[str, Any],
                state: _Progress, conversation_id: int | None) -> None:
        chunks = self.backend.stream(messages, sampling, conversation_id)
        try:
            for chunk in chunks:
                if self._is_stopped(request_id):
                    break
                state.add(chunk)
                if getattr(chunk, "reasoning", ""):
                    self.reasoning_chunk.emit(request_id, chunk.reasoning)
                if getattr(chunk, "text", ""):
                    self.chunk.emit(request_id, chunk.text)
        finally:
            closer = getattr(chunks, "close", None)
            if closer is not None:
                closer()  # aborts the request server-side when we stopped early

    def _alive(self) -> bool:
        try:
            return self.backend.is_alive()
        except Exception:
            return False


class _Progress:
    """What has arrived of one answer so far."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.first_token_at: float | None = None
        self.first_answer_at: float | None = None
        self.num_chunks = 0
        self.finish_reason: str | None = None
        self.usage: Any = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    def add(self, chunk: Any) -> None:
        text = getattr(chunk, "text", "") or ""
        reasoning = getattr(chunk, "reasoning", "") or ""
        if text or reasoning:
            self.num_chunks += 1
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
        if reasoning:
            self.reasoning_parts.append(reasoning)
        if text:
            self.parts.append(text)
            if self.first_answer_at is None:
                self.first_answer_at = time.monotonic()
        self.finish_reason = getattr(chunk, "finish_reason", None) or self.finish_reason
        self.usage = getattr(chunk, "usage", None) or self.usage

    def stats(self, started: float) -> MessageStats:
        end = time.monotonic()
        completion = _usage_value(self.usage, "completion_tokens") or self.num_chunks or None
        prompt = _usage_value(self.usage, "prompt_tokens")
        ttft = self.first_token_at - started if self.first_token_at is not None else None
        speed = decode_rate(completion or 0, ttft, end - started)
        thinking = None
        if self.reasoning_parts and self.first_token_at is not None:
            thinking = (self.first_answer_at or end) - self.first_token_at
        return MessageStats(speed, ttft, completion, prompt, thinking_s=thinking)


def _usage_value(usage: Any, key: str) -> int | None:
    if usage is None:
        return None
    value = usage.get(key) if isinstance(usage, dict) else getattr(usage, key, None)
    return int(value) if value is not None else None


def _is_engine_death(exc: BaseException) -> bool:
    try:
        from hearth.app.client.openai_client import EngineDiedError
    except ImportError:
        return False
    return isinstance(exc, EngineDiedError)


class EngineThread(QObject):
    """Owns the worker's QThread and the queued signals that drive it from the GUI thread."""

    request_connect = Signal(object)
    # request id, messages, sampling, context policy, conversation id (the engine keeps its cache)
    request_generate = Signal(int, object, object, str, object)
    request_restart = Signal()

    def __init__(self, backend: Backend, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("hearth-engine")
        self.worker = EngineWorker(backend)
        self.worker.moveToThread(self.thread)
        self.request_connect.connect(self.worker.connect_model)
        self.request_generate.connect(self.worker.generate)
        self.request_restart.connect(self.worker.restart)
        self.thread.start()

    def shutdown(self, timeout_ms: int = 10_000) -> None:
        self.worker.stop()
        self.thread.quit()
        if not self.thread.wait(timeout_ms):
            logger.warning("The engine thread did not stop within %d ms", timeout_ms)
