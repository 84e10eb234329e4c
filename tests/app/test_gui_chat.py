"""The chat window against the real demo model in a real engine host (one host per module):
streaming, stop, regenerate with the version switcher, edit-and-resend, persistence across a
restart, search, export, quitting mid-answer, the screenshot entry point, and an engine crash
with its Restart button (last: it replaces the shared host)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hearth.app.gui.backend import DEMO_LABEL
from hearth.app.gui.main import run
from hearth.app.gui.main_window import MainWindow
from hearth.app.gui.qt import Qt
from hearth.app.store.chats import ChatStore
from hearth.app.store.settings import Settings, save_settings
from tests.app.test_gui_helpers import (
    link_demo_model,
)

TIMEOUT_MS = 30_000
pytestmark = pytest.mark.slow  # a real engine host process for the module, answers from the demo model


def ask(qtbot, window: MainWindow, text: str, max_tokens: int = 24) -> None:
    window.chat.sampling_panel.max_tokens.setValue(max_tokens)
    window.chat.composer.setPlainText(text)
    qtbot.keyClick(window.chat.composer, Qt.Key.Key_Return)  # Enter sends (Shift+Enter: a new line)
    assert window.chat.is_busy


def wait_idle(qtbot, window: MainWindow) -> None:
    qtbot.waitUntil(lambda: not window.chat.is_busy, timeout=TIMEOUT_MS)


def test_send_streams_the_answer_into_the_view(qtbot, open_window):
    window = open_window()
    chunks: list[str] = []
    window.engine.worker.chunk.connect(lambda _rid, text: chunks.append(text))
    # greedy: a sampled answer of the demo model can end after its first token (one chunk), as it did in CI once
    window.chat.sampling_panel.temperature.setValue(0.0)
    ask(qtbot, window, "Hello there", max_tokens=32)
    wait_idle(qtbot, window)
    user, answer = window.chat.view.widgets
    assert user.text == "Hello there"
    stored = window.store.thread(window.chat.conversation_id)[-1]
    assert len(chunks) > 1 and stored.content == "".join(chunks) == answer.text
    assert stored.is_complete and stored.model == DEMO_LABEL
    assert "tok/s" in answer.stats_label.text() and "first token" in answer.stats_label.text()
    assert "/ 2,048" in window.chat.context_meter.text()
    assert window.sidebar.list.count() == 1


def test_stop_keeps_the_partial_answer(qtbot, open_window):
    window = open_window()
    # Greedy, so the (deterministic) answer cannot end on an early end-of-sentence token by chance.
    window.chat.sampling_panel.temperature.setValue(0.0)
    ask(qtbot, window, "Tell me a very long story", max_tokens=1800)
    qtbot.waitUntil(lambda: len(window.chat.view.widgets) == 2 and bool(window.chat.view.widgets[1].text),
                    timeout=TIMEOUT_MS)
    assert window.chat.is_busy  # text is on screen while the answer is still streaming
    assert "generating" in window.chat.view.widgets[1].stats_label.text()  # not "stopped" while it runs
    qtbot.keyClick(window.chat.composer, Qt.Key.Key_Escape)
    wait_idle(qtbot, window)
    stored = window.store.thread(window.chat.conversation_id)[-1]
    assert stored.content and not stored.is_complete and stored.finish_reason == "abort"
    assert (stored.stats.completion_tokens or 0) < 1800
    assert window.chat.view.widgets[1].text == stored.content
    assert "stopped" in window.chat.view.widgets[1].stats_label.text()


def test_regenerate_keeps_both_versions_and_the_switcher_moves(qtbot, open_window):
    window = open_window(default_model=None)
    window.chat.sampling_panel.temperature.setValue(1.0)
    ask(qtbot, window, "Pick a word")
    wait_idle(qtbot, window)
    first = window.chat.view.widgets[1].text
    qtbot.mouseClick(window.chat.view.widgets[1].action_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, window)
    answer = window.chat.view.widgets[1]
    assert answer.version_label.text() == "2/2" and answer.version_label.isVisible()
    second = answer.text
    qtbot.mouseClick(answer.prev_button, Qt.MouseButton.LeftButton)
    answer = window.chat.view.widgets[1]
    assert answer.version_label.text() == "1/2" and answer.text == first
    qtbot.mouseClick(answer.next_button, Qt.MouseButton.LeftButton)
    assert window.chat.view.widgets[1].version_label.text() == "2/2"
    assert window.chat.view.widgets[1].text == second
    assert len(window.store.all_messages(window.chat.conversation_id)) == 3


def test_edit_and_resend_adds_a_user_version(qtbot, open_window):
    window = open_window()
    ask(qtbot, window, "First question")
    wait_idle(qtbot, window)
    qtbot.mouseClick(window.chat.view.widgets[0].action_button, Qt.MouseButton.LeftButton)
    assert window.chat.composer.toPlainText() == "First question"
    ask(qtbot, window, "Better question")
    wait_idle(qtbot, window)
    user = window.chat.view.widgets[0]
    assert user.text == "Better question" and user.version_label.text() == "2/2"
    qtbot.mouseClick(user.prev_button, Qt.MouseButton.LeftButton)
    assert window.chat.view.widgets[0].text == "First question"
    assert len(window.chat.view.widgets) == 2  # the first question keeps its own answer


def test_conversation_survives_a_restart_and_search_finds_it(qtbot, open_window, windows):
    window = open_window()
    window.chat.system_panel.editor.setPlainText("You are terse.")
    ask(qtbot, window, "What do aardvarks eat?")
    wait_idle(qtbot, window)
    conv_id = window.chat.conversation_id
    thread = [m.content for m in window.store.thread(conv_id)]
    windows.close(window)

    again = open_window()
    assert again.sidebar.list.count() == 1
    qtbot.keyClick(again, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert again.sidebar.search_edit.hasFocus()
    qtbot.keyClicks(again.sidebar.search_edit, "aardvark")
    assert again.sidebar.list.count() == 1
    qtbot.keyClicks(again.sidebar.search_edit, "zzz")
    assert again.sidebar.list.count() == 0
    again.sidebar.search_edit.clear()
    item = again.sidebar.list.item(0)
    again.sidebar.list.setCurrentItem(item)
    again.sidebar.list.itemClicked.emit(item)
    assert [w.text for w in again.chat.view.widgets] == thread
    assert again.chat.system_panel.text() == "You are terse."


def test_export_markdown_and_json(qtbot, open_window, tmp_path: Path):
    window = open_window()
    ask(qtbot, window, "Export me")
    wait_idle(qtbot, window)
    answer = window.chat.view.widgets[1].text
    # read bytes: read_text would turn a "\r" the tiny test model emitted into "\n"
    markdown = window.sidebar.export_current(str(tmp_path / "chat.md")).read_bytes().decode("utf-8")
    assert markdown.startswith("# Export me\n") and "**User**\n\nExport me" in markdown
    assert f"**Assistant**\n\n{answer}" in markdown and "tok/s" in markdown
    data = json.loads(window.sidebar.export_current(str(tmp_path / "chat.json")).read_text(encoding="utf-8"))
    assert [m["content"] for m in data["messages"]] == ["Export me", answer]


def test_new_chat_and_rename_and_delete(qtbot, open_window):
    window = open_window()
    ask(qtbot, window, "One")
    wait_idle(qtbot, window)
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert window.chat.conversation_id is None and window.chat.view.widgets == []
    window.sidebar.select_id(window.store.conversations()[0].id)
    window.sidebar.rename_current("Renamed")
    assert window.sidebar.list.item(0).text() == "Renamed"
    window.sidebar.delete_current(confirm=False)
    assert window.sidebar.list.count() == 0 and window.store.conversations() == []


def test_chats_send_their_id_and_deleting_a_chat_drops_its_engine_cache(qtbot, open_window, backend):
    window = open_window()
    ask(qtbot, window, "Remember this chat for the next turn, please. " * 12)  # more than one 64-token page
    wait_idle(qtbot, window)
    conversation = window.chat.conversation_id
    cached = backend.stats()["prefix_cache_conversations"]
    assert cached >= 1  # the engine host keeps this chat's pages under its id
    window.status.show_stats(backend.stats())
    assert window.status.chat_cache_label.text().startswith(f"Cached chats {int(cached)}")
    assert window.sidebar.current_id() == conversation  # the open chat is the one deleted
    window.sidebar.delete_current(confirm=False)
    assert window.chat.conversation_id is None
    qtbot.waitUntil(lambda: backend.stats()["prefix_cache_conversations"] == cached - 1, timeout=TIMEOUT_MS)


def test_deleting_the_chat_being_answered_stops_and_forgets_it(qtbot, open_window):
    window = open_window()
    ask(qtbot, window, "A long story, please", max_tokens=1800)
    qtbot.waitUntil(lambda: len(window.chat.view.widgets) == 2 and bool(window.chat.view.widgets[1].text),
                    timeout=TIMEOUT_MS)
    window.sidebar.delete_current(confirm=False)
    assert window.chat.conversation_id is None and not window.chat.is_busy
    assert window.store.conversations() == [] and window.chat.view.widgets == []
    ask(qtbot, window, "Hello again")  # the panel works on: a new chat answers
    wait_idle(qtbot, window)
    assert len(window.store.conversations()) == 1


def test_quitting_mid_answer_keeps_the_partial_answer(qtbot, open_window, windows, tmp_path: Path):
    window = open_window()
    window.chat.sampling_panel.temperature.setValue(0.0)
    ask(qtbot, window, "Another long story please", max_tokens=1800)
    qtbot.waitUntil(lambda: len(window.chat.view.widgets) == 2 and bool(window.chat.view.widgets[1].text),
                    timeout=TIMEOUT_MS)
    shown = window.chat.view.widgets[1].text
    conv_id = window.chat.conversation_id
    windows.close(window)
    store = ChatStore()
    try:
        answer = store.thread(conv_id)[-1]
        assert answer.role == "assistant" and not answer.is_complete
        assert answer.content.startswith(shown)
    finally:
        store.close()


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (symlinks as their target)."""
    return {str(p.relative_to(folder)): (str(p.readlink()).encode() if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_symlink() or p.is_file()}


def test_screenshot_leaves_the_users_data_untouched(qtbot, engine_home: Path, tmp_path: Path, windows,
                                                    isolated_home: Path):
    link_demo_model(engine_home)
    save_settings(Settings(theme="dark").replace(max_model_len=4096))
    store = ChatStore()
    conversation = store.create_conversation("My own chat")
    store.add_message(conversation.id, "user", "Keep me", parent_id=None)
    store.close()
    before = _tree(isolated_home)
    out = tmp_path / "shot.png"
    assert run(["--screenshot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _tree(isolated_home) == before  # no chat, no sampling, no settings, no engine record written
    assert os.environ["HEARTH_HOME"] == str(isolated_home)


def test_engine_crash_shows_restart_and_restart_recovers(qtbot, open_window, backend):
    window = open_window()
    os.kill(backend.engine_pid(), signal.SIGKILL)
    qtbot.waitUntil(lambda: window.crash_banner.isVisible(), timeout=TIMEOUT_MS)
    assert window.status.restart_button.isVisible()
    assert window.chat.connected is None and not window.chat.send_button.isEnabled()
    qtbot.mouseClick(window.crash_banner.restart_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=60_000)
    assert not window.crash_banner.isVisible() and not window.status.restart_button.isVisible()
    ask(qtbot, window, "Still there?")
    wait_idle(qtbot, window)
    assert window.store.thread(window.chat.conversation_id)[-1].is_complete


def test_a_stats_poll_failing_while_the_window_closes_is_no_crash(qtbot, open_window, monkeypatch):
    """A poll still in flight when the window closes fails once the engine is gone and the chat store
    closed (seen in CI as 'Cannot operate on a closed database'): it is ignored, not shown as a crash."""
    window = open_window()
    window.close()
    monkeypatch.setattr(window.backend, "is_alive", lambda: False)
    window.poller.failed.emit("the engine process exited")
    qtbot.wait(50)
    assert window.connected is not None and not window.crash_banner.isVisible()


def test_demo_model_shows_what_to_download(qtbot, open_window):
    window = open_window()
    qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=TIMEOUT_MS)
    hint = window.chat.view._placeholder.text()
    assert "demo model" in hint and "runs with experts in RAM" in hint



def test_changing_an_engine_option_in_settings_restarts_the_engine(qtbot, open_window, backend):
    """Any option the engine reads at load time (here the parallel requests, which used to be left
    out) restarts the engine host with it; a theme change does not. Last: it replaces the shared host."""
    window = open_window()
    tab = window.settings_tab
    assert tab.row("max_model_len").editor.maximum() == window.connected.choice.context_length
    first_pid = backend.engine_pid()
    tab.theme.setCurrentText("light")
    tab.save()
    assert backend.engine_pid() == first_pid and window.chat.connected is not None
    tab.row("max_num_seqs").editor.setValue(3)
    tab.save()
    qtbot.waitUntil(lambda: window.chat.connected is not None and backend.engine_pid() != first_pid,
                    timeout=60_000)
    assert backend._engine.options["max_num_seqs"] == 3
    ask(qtbot, window, "Restarted?")
    wait_idle(qtbot, window)
    assert window.store.thread(window.chat.conversation_id)[-1].is_complete
