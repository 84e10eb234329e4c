"""A chat that outgrows the model's context, against the real demo model in a real engine host:
the engine counts the prompt (``/hearth/tokenize``) exactly as the answer's prompt, "truncate" drops
the oldest turns with a marker in the chat, "stop" says so in the chat and sends nothing."""

from __future__ import annotations

from hearth.app.gui.main_window import MainWindow

TIMEOUT_MS = 60_000
CONTEXT = 2048  # the shared demo host's context


def long_message(backend, tokens: int, topic: str) -> str:
    """A user message of about ``tokens`` tokens as the engine counts them (with the template)."""
    words = [f"{topic} stone{i % 10}" for i in range(tokens)]
    low, high = 1, len(words)
    while low < high:  # the most words that stay within ``tokens``
        mid = (low + high + 1) // 2
        count, exact = backend.count_tokens([{"role": "user", "content": " ".join(words[:mid])}])
        assert exact
        low, high = (mid, high) if count <= tokens else (low, mid - 1)
    return " ".join(words[:low])


def ask(qtbot, window: MainWindow, text: str, max_tokens: int = 16) -> None:
    window.chat.sampling_panel.max_tokens.setValue(max_tokens)
    window.chat.sampling_panel.temperature.setValue(0.0)
    window.chat.composer.setPlainText(text)
    window.chat.send()
    qtbot.waitUntil(lambda: not window.chat.is_busy, timeout=TIMEOUT_MS)


def test_truncate_drops_the_oldest_turn_and_marks_it(qtbot, open_window, backend):
    window = open_window(context_overflow="truncate")
    fits = []
    window.engine.worker.context_fitted.connect(lambda _rid, fit: fits.append(fit))
    ask(qtbot, window, long_message(backend, 1200, "hearth"))
    assert fits[-1].dropped == 0 and window.chat.view.context_marker.isHidden()
    ask(qtbot, window, long_message(backend, 1200, "chimney"))

    assert fits[-1].dropped == 2 and fits[-1].exact
    thread = window.store.thread(window.chat.conversation_id)
    answer = thread[-1]
    assert len(thread) == 4 and answer.role == "assistant" and answer.is_complete and answer.content
    assert answer.finish_reason in ("stop", "length")
    marker = window.chat.view.context_marker
    assert marker.isVisible() and "2 earlier messages are not in the model's context" in marker.text()
    # the marker sits right above the first message the model saw
    layout = window.chat.view.widget().layout()
    assert layout.indexOf(marker) == layout.indexOf(window.chat.view.widgets[2]) - 1
    # the meter counted the prompt exactly as the server did for the answer
    assert answer.stats.prompt_tokens == fits[-1].prompt_tokens <= CONTEXT
    used = answer.stats.prompt_tokens + answer.stats.completion_tokens
    assert window.chat.context_meter.text() == f"context {used:,} / {CONTEXT:,}"
    assert window.chat.view.notice.isHidden()


def test_marker_comes_back_with_the_conversation(qtbot, open_window, backend):
    window = open_window()
    ask(qtbot, window, long_message(backend, 1200, "ember"))
    ask(qtbot, window, long_message(backend, 1200, "flame"))
    conversation = window.chat.conversation_id
    window.new_chat()
    assert window.chat.view.context_marker.isHidden()
    window.open_conversation(conversation)
    assert "2 earlier messages" in window.chat.view.context_marker.text()
    assert window.chat.view.context_marker.isVisible()


def test_stop_says_so_in_the_chat_and_sends_nothing(qtbot, open_window, backend):
    window = open_window(context_overflow="stop")
    ask(qtbot, window, long_message(backend, 1200, "hearth"))
    first = window.store.thread(window.chat.conversation_id)
    second = long_message(backend, 1200, "chimney")
    ask(qtbot, window, second)

    thread = window.store.thread(window.chat.conversation_id)
    assert [m.id for m in thread[:2]] == [m.id for m in first] and thread[-1].content == second
    assert len(thread) == 3  # the user's message is kept; no empty answer is left behind
    notice = window.chat.view.notice
    assert notice.isVisible() and "outgrown the model's context" in notice.text()
    assert "Drop the oldest messages" in notice.text()
    assert window.chat.view.context_marker.isHidden()
    assert window.status.currentMessage() == ""  # said in the chat, not only the status bar


def test_meter_counts_with_the_engine_before_any_answer(qtbot, open_window, backend):
    window = open_window(default_model=None)
    ask(qtbot, window, "Hello there")
    conversation = window.chat.conversation_id
    window.new_chat()
    window.open_conversation(conversation)
    thread = window.store.thread(conversation)
    expected, exact = backend.count_tokens([{"role": m.role, "content": m.content} for m in thread])
    assert exact
    qtbot.waitUntil(lambda: window.chat.context_meter.text() == f"context {expected:,} / {CONTEXT:,}",
                    timeout=TIMEOUT_MS)
