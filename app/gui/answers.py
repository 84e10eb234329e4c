"""The answers being written, one per chat, whichever chat the chat view shows (``Answers``), and
what has streamed into each so far (``Generation``).

An answer belongs to its chat, not to the view: while it streams another chat can be opened or a
new one started; its chunks keep arriving into its ``Generation``, it is stored in its own chat when
it ends, and opening its chat again shows it as far as it has come (``show_live``).

Streamed chunks are coalesced on a timer (``FLUSH_MS``); each flush renders only the tail of the
answer of the chat shown (see ``MarkdownBrowser.stream_markdown``), and when even that grows slow
(one huge code block) the timer backs off so rendering keeps to about a ``1 / FLUSH_BACKOFF`` share of
the GUI thread. The answers of the other chats only collect their chunks.

The engine worker writes one answer at a time, so an answer begun while another chat's streams
waits for it ("waiting" in its bubble, then "generating…" when its turn comes), the first-come
order the engine host also gives requests beyond its parallel limit; stopping a waiting answer
ends it at once (it never reaches the engine).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hearth.app.client.context_window import ContextFit
from hearth.app.gui.chat_view import ChatView
from hearth.app.gui.engine_worker import EngineThread, GenerationResult
from hearth.app.gui.qt import QObject, QTimer, Signal
from hearth.app.store.chats import ChatStore, Message, MessageStats

FLUSH_MS = 30
MAX_FLUSH_MS = 1000
FLUSH_BACKOFF = 5  # the flush interval is at least this many times the last render's time
WAITING = "waiting: Hearth writes one answer at a time"


@dataclass
class Generation:
    """The answer ``answer`` (stored empty and incomplete when it began) of chat ``conversation_id``.

    sent_ids: the history messages the request sends (where the context starts is one of them).
    is_waiting: another chat's answer is being written; this one begins when the worker gets to it.
    """

    request_id: int
    conversation_id: int
    answer: Message
    sent_ids: list[int]
    is_waiting: bool = False
    text: str = ""
    reasoning: str = ""
    pending: list[str] = field(default_factory=list)
    pending_reasoning: list[str] = field(default_factory=list)
    context_start_id: int | None = None  # first message the request sends (None: all of them)
    prompt_tokens: int | None = None  # the request's prompt, counted by the server

    @property
    def has_pending(self) -> bool:
        return bool(self.pending or self.pending_reasoning)

    def take_pending(self) -> tuple[bool, bool]:
        """Move the chunks received since the last call into ``text`` / ``reasoning``; returns
        whether each grew."""
        grew_text, grew_reasoning = bool(self.pending), bool(self.pending_reasoning)
        if grew_reasoning:
            self.reasoning += "".join(self.pending_reasoning)
            self.pending_reasoning.clear()
        if grew_text:
            self.text += "".join(self.pending)
            self.pending.clear()
        return grew_text, grew_reasoning


def chat_title(store: ChatStore, conversation_id: int) -> str:
    try:
        return store.conversation(conversation_id).title
    except KeyError:
        return "another chat"


class Answers(QObject):
    """The answers being written or waiting, by request id in the order the worker takes them;
    ``shown_id()`` is the chat the view shows (None: a new, unsaved one)."""

    changed = Signal()  # an answer began, got its turn or ended: the chat's buttons follow
    progressed = Signal()  # the answer of the chat shown grew or was counted: the context meter follows
    ended = Signal(object, object, object)  # Generation, GenerationResult, the stored answer (None: discarded)

    def __init__(self, store: ChatStore, engine: EngineThread, view: ChatView,
                 shown_id: Callable[[], int | None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store, self.engine, self.view = store, engine, view
        self.shown_id = shown_id
        self._request_id = 0
        self._by_request: dict[int, Generation] = {}
        self.flush_timer = QTimer(self)
        self.flush_timer.setInterval(FLUSH_MS)
        self.flush_timer.timeout.connect(self._flush)
        worker = engine.worker
        worker.generation_started.connect(self._on_started)
        worker.context_fitted.connect(self._on_context_fitted)
        worker.chunk.connect(self._on_chunk)
        worker.reasoning_chunk.connect(self._on_reasoning_chunk)
        worker.generation_done.connect(self._on_done)

    # ---- questions --------------------------------------------------------------------------
    @property
    def is_any(self) -> bool:
        return bool(self._by_request)

    @property
    def count(self) -> int:
        """Answers being written or waiting, in all chats."""
        return len(self._by_request)

    def of(self, conversation_id: int | None) -> Generation | None:
        if conversation_id is None:
            return None
        return next((g for g in self._by_request.values() if g.conversation_id == conversation_id), None)

    @property
    def shown(self) -> Generation | None:
        """The answer being written (or waiting) in the chat shown."""
        return self.of(self.shown_id())

    def elsewhere(self) -> Generation | None:
        """The first answer being written (or waiting) in a chat not shown."""
        return next((g for g in self._by_request.values() if not self._is_shown(g)), None)

    def _is_shown(self, generation: Generation) -> bool:
        return generation.conversation_id == self.shown_id()

    # ---- actions ----------------------------------------------------------------------------
    def begin(self, conversation_id: int, answer: Message, sent: list[Message], messages: list[dict[str, str]],
              options: dict[str, Any], context_policy: str) -> Generation:
        """Ask the worker for ``answer`` (stored empty); it waits if another chat's answer is being written."""
        self._request_id += 1
        generation = Generation(self._request_id, conversation_id, answer, [m.id for m in sent],
                                is_waiting=self.is_any)
        self._by_request[generation.request_id] = generation
        self.engine.request_generate.emit(generation.request_id, messages, options, context_policy, conversation_id)
        if not self.flush_timer.isActive():
            self.flush_timer.start(FLUSH_MS)
        return generation

    def stop(self, conversation_id: int | None) -> None:
        """Stop the chat's answer: a running one ends at its next chunk (and is stored as it is then),
        a waiting one at once."""
        generation = self.of(conversation_id)
        if generation is None:
            return
        self.engine.worker.stop(generation.request_id)
        if generation.is_waiting:  # the worker will skip it: nothing more can come of it
            self._on_done(GenerationResult(generation.request_id, "", "abort", MessageStats()))

    def cancel(self, conversation_id: int) -> None:
        """Stop the chat's answer and forget it (its chat is being deleted): its late chunks and its
        end are ignored, nothing more of it is stored."""
        generation = self.of(conversation_id)
        if generation is None:
            return
        self.engine.worker.stop(generation.request_id)
        self._forget(generation)
        self.changed.emit()

    def save_partial(self) -> None:
        """Store every answer as far as it has come (one still waiting: empty) and stop them all."""
        for generation in list(self._by_request.values()):
            generation.take_pending()
            self.engine.worker.stop(generation.request_id)
            self.store.finish_message(generation.answer.id, generation.text, finish_reason="abort",
                                      is_complete=False, reasoning=generation.reasoning)
            self._forget(generation)

    def show_live(self) -> None:
        """After the view was rebuilt from the store: show the shown chat's answer as far as it has
        come (the store has its words only once it ends), and where its context starts."""
        generation = self.shown
        if generation is None:
            return
        generation.take_pending()
        self._show_bubble(generation)
        if generation.context_start_id is not None:
            self.view.set_context_marker(generation.context_start_id)

    def _show_bubble(self, generation: Generation) -> None:
        widget = self.view.widget_for(generation.answer.id)
        if widget is None:
            return
        if generation.reasoning:
            widget.set_reasoning(generation.reasoning, live=not generation.text)
        if generation.text:
            widget.stream_text(generation.text)
        widget.set_waiting(self._waiting_text() if generation.is_waiting else None)
        widget.set_live(True)

    def _waiting_text(self) -> str:
        """What a waiting answer waits for: the answer being written (none between two turns)."""
        ahead = next((g for g in self._by_request.values() if not g.is_waiting), None)
        return WAITING if ahead is None else f"{WAITING}, now in “{chat_title(self.store, ahead.conversation_id)}”"

    def _forget(self, generation: Generation) -> None:
        del self._by_request[generation.request_id]
        if not self._by_request:
            self.flush_timer.stop()

    # ---- the worker's signals -----------------------------------------------------------------
    def _on_started(self, request_id: int) -> None:
        """The worker took the request: an answer that waited for another chat's begins."""
        generation = self._by_request.get(request_id)
        if generation is None or not generation.is_waiting:
            return
        generation.is_waiting = False
        shown = self.shown
        if shown is not None:
            self._show_bubble(shown)  # the one that began, or one still waiting (now for this one)
        self.changed.emit()

    def _on_context_fitted(self, request_id: int, fit: ContextFit) -> None:
        """What the request sends: where the model's context starts, and its length."""
        generation = self._by_request.get(request_id)
        if generation is None:
            return
        generation.context_start_id = generation.sent_ids[fit.dropped] if fit.dropped else None
        generation.prompt_tokens = fit.prompt_tokens
        if self._is_shown(generation):
            self.view.set_context_marker(generation.context_start_id)
            self.progressed.emit()

    def _on_chunk(self, request_id: int, text: str) -> None:
        generation = self._by_request.get(request_id)
        if generation is not None:  # (one cancelled has gone: its late chunks are dropped)
            generation.pending.append(text)

    def _on_reasoning_chunk(self, request_id: int, text: str) -> None:
        generation = self._by_request.get(request_id)
        if generation is not None:
            generation.pending_reasoning.append(text)

    def _flush(self) -> None:
        """Render what streamed into the chat shown; the other chats' answers only collect theirs (taken
        when their chat is shown, or when they end)."""
        shown = self.shown
        if shown is None or not shown.has_pending:
            return
        grew_text, grew_reasoning = shown.take_pending()
        widget = self.view.widget_for(shown.answer.id)
        if widget is not None and grew_reasoning:
            widget.set_reasoning(shown.reasoning, live=True)
        if widget is not None and grew_text:
            started = time.perf_counter()
            widget.stream_text(shown.text)
            self._back_off(time.perf_counter() - started)
        self.progressed.emit()

    def _back_off(self, render_s: float) -> None:
        """Flush no more often than every ``FLUSH_BACKOFF`` render times (a tail that is slow to
        render, such as one huge code block, must not take the GUI thread over)."""
        interval = min(max(FLUSH_MS, int(render_s * 1000 * FLUSH_BACKOFF)), MAX_FLUSH_MS)
        if interval != self.flush_timer.interval():
            self.flush_timer.setInterval(interval)

    def _on_done(self, result: GenerationResult) -> None:
        """An answer ended (or a waiting one was stopped): store it in its chat, shown or not."""
        generation = self._by_request.get(result.request_id)
        if generation is None:
            return
        if self._is_shown(generation):
            self._flush()
        generation.take_pending()
        self._forget(generation)
        message = None
        if result.finish_reason == "context_full":
            self.store.discard_empty_answer(generation.answer.id)
        else:
            complete = result.finish_reason in ("stop", "length")
            stats = dataclasses.replace(result.stats, context_start_id=generation.context_start_id)
            message = self.store.finish_message(generation.answer.id, result.text or generation.text, stats=stats,
                                                finish_reason=result.finish_reason, is_complete=complete,
                                                reasoning=result.reasoning or generation.reasoning)
        waiting = self.shown
        if waiting is not None and waiting.is_waiting:
            self._show_bubble(waiting)  # it waits for another chat's answer now
        self.ended.emit(generation, result, message)
