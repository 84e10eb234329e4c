"""A thinking model in the chat window: a tiny DeepSeek-V3.2 rewired to write fixed reasoning, then
an answer, served by a real engine host the app reaches as its backend URL. The Thinking block opens
while reasoning streams, folds once the answer starts ("Thought for N s"), is stored with the
message and shown again after a reopen, is exported, is never sent back to the model, and the
Settings' "Show thinking" hides it. The Think switch sets the template's thinking flag."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hearth.app.gui.main_window import MainWindow
from hearth.app.gui.message_widget import THINKING_LIVE, MessageView, MessageWidget
from hearth.app.gui.qt import Qt
from hearth.app.store.settings import load_settings
from hearth.engine.testing.tiny import write_tiny_model
from hearth.engine.text.tokenizer import Tokenizer
from tests.app.test_gui_helpers import FAST_DOWNLOADS, isolated_settings
from tests.engine.scripted_model import rewire
from tests.engine.test_server_support import start_server

TIMEOUT_MS = 30_000
THOUGHT, ANSWER = " the kettle sang", " Mira smiled."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("gui-thinking")
    tiny = write_tiny_model(root / "tiny", "deepseek_v32", seed=7)
    tokenizer = Tokenizer.from_pretrained(tiny, "deepseek_v32")
    script = [tokenizer.token_to_id("<think>"), *tokenizer.encode(THOUGHT), tokenizer.token_to_id("</think>"),
              *tokenizer.encode(ANSWER), tokenizer.eos_token_ids[0]]
    running = start_server(rewire(tiny, root / "tiny-thinking", script), root / "run", max_model_len=256)
    yield running
    running.stop()


@pytest.fixture
def open_window(qtbot, server, tmp_path: Path, windows):
    def open_(**changes: object) -> MainWindow:
        settings = isolated_settings(tmp_path, backend_url=server.base_url, **changes)
        window = MainWindow(settings, download_options=FAST_DOWNLOADS)
        windows.track(window)
        qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=TIMEOUT_MS)
        return window

    return open_


def _record_requests(window: MainWindow) -> list[tuple[list[dict], dict]]:
    """What the chat sends to the backend, request by request."""
    sent: list[tuple[list[dict], dict]] = []
    backend = window.engine.worker.backend
    real = backend.stream

    def stream(messages, sampling, *rest):
        sent.append((messages, dict(sampling)))
        return real(messages, sampling, *rest)

    backend.stream = stream
    return sent


def _ask(qtbot, window: MainWindow, text: str) -> None:
    window.chat.sampling_panel.max_tokens.setValue(30)
    window.chat.sampling_panel.temperature.setValue(0.0)
    window.chat.composer.setPlainText(text)
    qtbot.keyClick(window.chat.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: not window.chat.is_busy, timeout=TIMEOUT_MS)


def test_thinking_block_folds_is_stored_and_is_not_sent_back(qtbot, open_window, windows):
    window = open_window(think=True)
    assert window.chat.think_button.isChecked()
    sent = _record_requests(window)
    reasoning_chunks: list[str] = []
    window.engine.worker.reasoning_chunk.connect(lambda _rid, text: reasoning_chunks.append(text))
    _ask(qtbot, window, "Hello")
    assert "".join(reasoning_chunks) == THOUGHT.strip()
    answer = window.chat.view.widgets[-1]
    assert answer.text == ANSWER.strip()
    assert not answer.thinking.isHidden() and answer.thinking.text == THOUGHT.strip()
    assert not answer.thinking.expanded  # folded once the answer started
    title = answer.thinking.toggle.text()
    assert title.startswith("Thought for ") and title.endswith(" s")
    stored = window.store.thread(window.chat.conversation_id)[-1]
    assert (stored.reasoning, stored.content) == (THOUGHT.strip(), ANSWER.strip())
    assert stored.stats is not None and stored.stats.thinking_s is not None

    qtbot.mouseClick(answer.thinking.toggle, Qt.MouseButton.LeftButton)
    assert answer.thinking.expanded and answer.thinking.body.isVisible()

    _ask(qtbot, window, "And then?")
    (first, options), (second, _) = sent
    assert options["chat_template_kwargs"] == {"thinking": True, "enable_thinking": True}
    assert {"role": "assistant", "content": ANSWER.strip()} in second
    assert THOUGHT.strip() not in json.dumps(second)

    conversation_id = window.chat.conversation_id
    markdown = window.store.export_markdown(conversation_id)
    assert f"<details><summary>{title}</summary>" in markdown and THOUGHT.strip() in markdown
    exported = window.store.export_json(conversation_id)
    assert THOUGHT.strip() in [m["reasoning"] for m in exported["messages"]]

    windows.close(window)
    reopened = open_window(think=True)
    reopened.open_conversation(conversation_id)
    again = reopened.chat.view.widgets[1]
    assert again.thinking.text == THOUGHT.strip() and again.thinking.toggle.text() == title
    assert not again.thinking.isHidden() and not again.thinking.expanded


def test_think_off_and_show_thinking_off(qtbot, open_window):
    window = open_window(think=False)
    sent = _record_requests(window)
    _ask(qtbot, window, "Hello")
    assert "chat_template_kwargs" not in sent[0][1]
    answer = window.chat.view.widgets[-1]
    # Thinking off: V3.2's prompt closes the block, so the model answers at once.
    assert answer.text == ANSWER and answer.thinking.isHidden()

    window.chat.think_button.setChecked(True)
    assert window.settings.think and load_settings().think  # the switch is a saved setting
    window.apply_settings(window.settings.replace(show_thinking=False))
    _ask(qtbot, window, "Hello again")
    answer = window.chat.view.widgets[-1]
    assert window.store.thread(window.chat.conversation_id)[-1].reasoning == THOUGHT.strip()
    assert answer.thinking.isHidden()  # kept, not shown
    window.apply_settings(window.settings.replace(show_thinking=True))
    assert not answer.thinking.isHidden()


def test_the_block_is_open_while_reasoning_streams(qtbot, open_window):
    window = open_window()
    window.chat.composer.setPlainText("x")
    window.chat.send()
    qtbot.waitUntil(lambda: not window.chat.is_busy, timeout=TIMEOUT_MS)
    message = window.store.thread(window.chat.conversation_id)[-1]
    widget = MessageWidget(MessageView(dataclasses.replace(message, content="", reasoning=""), (message.id,)))
    qtbot.addWidget(widget)
    widget.set_reasoning("first thoughts", live=True)
    assert widget.thinking.expanded and widget.thinking.toggle.text() == THINKING_LIVE
    widget.set_reasoning("first thoughts, more", live=True)
    widget.set_text("The answer")
    assert not widget.thinking.expanded
    widget.set_reasoning("first thoughts, more", live=True)
    assert not widget.thinking.expanded  # stays folded once the answer has begun
