"""The main window with a scripted engine (``ScriptedBackend``: no engine host; the test writes the
answers and says which models fail to load): Enter sends, drafts survive edits and chat switches,
the chat's keys act only on its tab, a model that cannot load is said in the chat with a way back,
Restart always answers, a long answer streams at the cost of its tail, the window comes back as it
was left, a theme switch recolours what is shown, and the controls carry accessible names."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from hearth.app.gui import answers as answers_module
from hearth.app.gui.answers import FLUSH_MS
from hearth.app.gui.backend import DEMO_LABEL, ModelChoice
from hearth.app.gui.engine_worker import EngineWorker
from hearth.app.gui.main_window import MainWindow
from hearth.app.gui.message_widget import GENERATING
from hearth.app.gui.qt import (
    QAbstractButton,
    QAbstractItemView,
    QAbstractSpinBox,
    QAccessible,
    QApplication,
    QComboBox,
    QHeaderView,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    Qt,
    QWidget,
)
from hearth.app.store.chats import MessageStats
from hearth.app.store.settings import load_settings
from tests.app.test_gui_helpers import SCRIPTED_TIMEOUT_MS as TIMEOUT_MS
from tests.app.test_gui_helpers import ScriptedBackend, finish, send

CTRL, SHIFT = Qt.KeyboardModifier.ControlModifier, Qt.KeyboardModifier.ShiftModifier
BROKEN = "broken/llama-model"
WHY = "broken/llama-model is a llama model, an architecture Hearth cannot run"


class FlakyHostBackend(ScriptedBackend):
    """Like an engine host: loading another model stops the one serving, so while a model loads,
    and after it failed to, no host is alive (a stats poll finds none). ``gate``: loads wait for it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.host_alive = False
        self.gate = threading.Event()
        self.gate.set()

    def _load(self, choice: ModelChoice):
        self.host_alive = False
        self.gate.wait(TIMEOUT_MS / 1000)
        connected = super()._load(choice)
        self.host_alive = True
        return connected

    def is_alive(self) -> bool:
        return self.host_alive


@pytest.fixture
def open_window(open_scripted_window):
    return open_scripted_window


def broken_choice(tmp_path: Path) -> ModelChoice:
    return ModelChoice(BROKEN, str(tmp_path), False, 4096)


# ---- the message box ---------------------------------------------------------------------------

def test_enter_sends_and_shift_enter_starts_a_new_line(qtbot, open_window):
    window = open_window()
    composer = window.chat.composer
    assert "Enter to send" in composer.placeholderText() and "Shift+Enter" in composer.placeholderText()
    qtbot.keyClicks(composer, "first line")
    qtbot.keyClick(composer, Qt.Key.Key_Return, SHIFT)
    qtbot.keyClicks(composer, "second line")
    assert composer.toPlainText() == "first line\nsecond line" and not window.chat.is_busy
    qtbot.keyClick(composer, Qt.Key.Key_Return)
    assert window.chat.is_busy and composer.toPlainText() == ""
    assert window.chat.view.widgets[0].text == "first line\nsecond line"
    finish(qtbot, window)
    for key, modifiers in ((Qt.Key.Key_Return, CTRL), (Qt.Key.Key_Enter, Qt.KeyboardModifier.KeypadModifier)):
        qtbot.keyClicks(composer, "again")
        qtbot.keyClick(composer, key, modifiers)
        assert window.chat.is_busy and composer.toPlainText() == ""
        finish(qtbot, window)
    assert [m.content for m in window.store.thread(window.chat.conversation_id)][::2] == [
        "first line\nsecond line", "again", "again"]


def test_editing_a_message_keeps_the_draft(qtbot, open_window):
    window = open_window()
    chat, composer = window.chat, window.chat.composer
    send(qtbot, window, "First question")
    finish(qtbot, window)
    composer.setPlainText("a long draft I typed")
    qtbot.mouseClick(chat.view.widgets[0].action_button, Qt.MouseButton.LeftButton)
    assert composer.toPlainText() == "First question" and chat.edit_banner.isVisible()
    qtbot.keyClick(composer, Qt.Key.Key_Escape)  # cancel: the draft comes back, nothing is cleared
    assert composer.toPlainText() == "a long draft I typed" and not chat.edit_banner.isVisible()
    assert chat.editing_id is None

    qtbot.mouseClick(chat.view.widgets[0].action_button, Qt.MouseButton.LeftButton)
    composer.setPlainText("Better question")
    qtbot.keyClick(composer, Qt.Key.Key_Return)  # the edit is sent: the draft comes back too
    assert chat.is_busy and composer.toPlainText() == "a long draft I typed"
    finish(qtbot, window)
    assert chat.view.widgets[0].text == "Better question" and chat.view.widgets[0].version_label.text() == "2/2"
    qtbot.keyClick(composer, Qt.Key.Key_Escape)  # Esc with no edit and no answer: the draft stays
    assert composer.toPlainText() == "a long draft I typed"


def test_each_chat_keeps_its_draft_and_a_new_chat_its_system_prompt(qtbot, open_window):
    window = open_window()
    chat = window.chat
    send(qtbot, window, "Chat one")
    finish(qtbot, window)
    first = chat.conversation_id
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)
    chat.system_panel.editor.setPlainText("You are a pirate.")
    chat.composer.setPlainText("words for the new chat")
    window.open_conversation(first)
    assert chat.composer.toPlainText() == "" and chat.system_panel.text() == ""
    chat.composer.setPlainText("a reply to chat one, unsent")
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)
    assert chat.system_panel.text() == "You are a pirate." and chat.composer.toPlainText() == "words for the new chat"
    window.open_conversation(first)
    assert chat.composer.toPlainText() == "a reply to chat one, unsent"
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)
    qtbot.keyClick(chat.composer, Qt.Key.Key_Return)
    finish(qtbot, window)
    second = chat.conversation_id
    assert second != first and window.store.conversation(second).system_prompt == "You are a pirate."
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)  # that draft became the chat: the next new one is empty
    assert chat.system_panel.text() == "" and chat.composer.toPlainText() == ""


def test_send_and_stop_keys_act_only_on_the_chat_tab(qtbot, open_window):
    window = open_window()
    window.chat.composer.setPlainText("not yet")
    window.show_view("models")
    qtbot.keyClick(window.models_tab.results, Qt.Key.Key_Return, CTRL)
    assert not window.chat.is_busy and window.chat.composer.toPlainText() == "not yet"
    window.show_view("chat")
    qtbot.keyClick(window.chat.composer, Qt.Key.Key_Return, CTRL)
    assert window.chat.is_busy
    window.show_view("models")
    qtbot.keyClick(window.models_tab.results, Qt.Key.Key_Escape)
    window.backend.answers.put("still coming")
    qtbot.waitUntil(lambda: window.chat.view.widgets[-1].text == "still coming", timeout=TIMEOUT_MS)
    assert window.chat.is_busy  # Esc on the Models tab did not stop the answer
    window.show_view("chat")
    qtbot.keyClick(window.chat.composer, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not window.chat.is_busy, timeout=TIMEOUT_MS)
    assert window.store.thread(window.chat.conversation_id)[-1].finish_reason == "abort"


# ---- models that do not load, and Restart --------------------------------------------------------

def test_a_model_that_cannot_load_is_said_in_the_chat_with_a_way_back(qtbot, open_window, tmp_path: Path):
    backend = FlakyHostBackend(broken={BROKEN: WHY})
    window = open_window(backend)
    assert window.connected.choice.label == DEMO_LABEL
    backend.gate.clear()
    window.choose_model(broken_choice(tmp_path))
    qtbot.waitUntil(lambda: not backend.host_alive, timeout=TIMEOUT_MS)  # the old host is gone, the new one loads
    window.poller.poll()
    qtbot.waitUntil(lambda: not window.poller._in_flight, timeout=TIMEOUT_MS)
    assert not window.crash_banner.isVisible()  # loading a model is no crash
    assert window.status.engine_label.text() == f"Engine: loading {BROKEN}…"
    backend.gate.set()
    banner = window.load_banner
    qtbot.waitUntil(banner.isVisible, timeout=TIMEOUT_MS)
    assert WHY in banner.label.text()  # the real reason, in the chat area, for as long as it holds
    assert not window.crash_banner.isVisible() and "stopped" not in window.status.engine_label.text()
    assert window.chat.connected is None and not window.chat.send_button.isEnabled()
    window.poller.poll()  # no host runs now: that is no crash either
    qtbot.waitUntil(lambda: not window.poller._in_flight, timeout=TIMEOUT_MS)
    assert not window.crash_banner.isVisible() and banner.isVisible()
    assert load_settings().default_model == DEMO_LABEL  # the next start loads the model that loads

    assert banner.fallback_button.text() == f"Use {DEMO_LABEL}"
    qtbot.mouseClick(banner.fallback_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=TIMEOUT_MS)
    assert window.connected.choice.label == DEMO_LABEL and not banner.isVisible()
    assert window.chat.model_picker.currentText() == DEMO_LABEL
    assert backend.loads == [DEMO_LABEL, BROKEN, DEMO_LABEL]


def test_restart_after_a_failed_load_always_answers(qtbot, open_window, tmp_path: Path):
    backend = FlakyHostBackend(broken={BROKEN: WHY})
    window = open_window(backend)
    window.choose_model(broken_choice(tmp_path))
    qtbot.waitUntil(window.load_banner.isVisible, timeout=TIMEOUT_MS)
    assert window.status.restart_button.isVisible()
    qtbot.mouseClick(window.status.restart_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "restarting" not in window.status.engine_label.text(), timeout=TIMEOUT_MS)
    assert window.status.engine_label.text() == "Engine: failed to load" and not window._restarting
    assert window.load_banner.isVisible() and WHY in window.load_banner.label.text()
    assert backend.loads == [DEMO_LABEL, BROKEN, BROKEN]  # restart tried the chosen model again

    backend.broken.clear()  # (say the user fixed the model's folder)
    qtbot.mouseClick(window.load_banner.retry_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=TIMEOUT_MS)
    assert window.connected.choice.label == BROKEN and not window.load_banner.isVisible()


class NothingToRestart(ScriptedBackend):
    def restart(self):  # a backend that has nothing to restart (and does not raise)
        return None


def test_restart_with_no_model_chosen_says_so(qtbot):
    for backend, why in ((ScriptedBackend(), "no model has been chosen"), (NothingToRestart(), "no model is chosen")):
        worker = EngineWorker(backend)
        with qtbot.waitSignal(worker.connect_failed, timeout=TIMEOUT_MS) as failed:
            worker.restart()
        assert why in failed.args[0]


# ---- streaming -----------------------------------------------------------------------------------

def test_a_long_answer_streams_at_the_cost_of_its_tail(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "A long story, please")
    answer = window.chat.view.widgets[-1]
    assert GENERATING in answer.stats_label.text() and "stopped" not in answer.stats_label.text()
    parsed: list[int] = []
    for n in range(40):
        piece = f"Paragraph {n}: " + "the fire crackled and the kettle sang, " * 15 + "\n\n"
        before = answer.body.rendered_chars
        window.backend.answers.put(piece)
        qtbot.waitUntil(lambda p=piece: answer.text.endswith(p), timeout=TIMEOUT_MS)
        parsed.append(answer.body.rendered_chars - before)
        assert GENERATING in answer.stats_label.text()
    assert len(answer.text) > 20_000
    assert max(parsed) < 2 * len(piece) + 100, parsed  # what one flush parses does not grow with the answer
    finish(qtbot, window, "The end.")
    stats = window.chat.view.widgets[-1].stats_label.text()
    assert GENERATING not in stats and "stopped" not in stats and "tok/s" in stats


class FakeClock:
    """perf_counter for the answers' flush: each call ``step`` seconds after the one before."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_the_flush_backs_off_when_rendering_is_slow(qtbot, open_window, monkeypatch):
    window = open_window()
    clock = FakeClock(0.08)  # every render "takes" 80 ms
    monkeypatch.setattr(answers_module, "time", clock)
    send(qtbot, window, "Go")
    timer = window.chat.answers.flush_timer
    assert timer.interval() == FLUSH_MS
    window.backend.answers.put("slow to render")
    qtbot.waitUntil(lambda: window.chat.view.widgets[-1].text == "slow to render", timeout=TIMEOUT_MS)
    assert timer.interval() >= 5 * 80  # rendering keeps to a fifth of the GUI thread
    clock.step = 0.001
    window.backend.answers.put(", and now fast")
    qtbot.waitUntil(lambda: window.chat.view.widgets[-1].text.endswith("fast"), timeout=TIMEOUT_MS)
    assert timer.interval() == FLUSH_MS
    finish(qtbot, window, "")


# ---- window state, theme, accessibility ----------------------------------------------------------

def test_the_window_comes_back_as_it_was_left(qtbot, open_window, windows):
    window = open_window()
    send(qtbot, window, "Remember this chat")
    finish(qtbot, window)
    conversation = window.chat.conversation_id
    window.resize(window.minimumSizeHint().width(), 640)
    window.show_view("models")
    QApplication.processEvents()  # (lays the tab out at the new size)
    models_split = window.models_tab.split
    models_split.setSizes([300, models_split.width() - 300])  # the default gives the results more room
    left, right = models_split.sizes()
    assert left < right
    windows.close(window)

    again = open_window()
    # Not the default 1280 x 820 (the width is as narrow as the window can be: the offscreen screen is
    # 800 wide, and a restored window is fitted into its screen, so the chat's splitter has no room to
    # move and only the Models tab's shows its restored sizes).
    assert again.height() == 640 and again.width() == again.minimumSizeHint().width()
    again.show_view("models")
    QApplication.processEvents()
    restored = again.models_tab.split.sizes()  # (scaled to this window's width, which may differ a little)
    assert abs(restored[0] / sum(restored) - left / (left + right)) < 0.02
    again.show_view("chat")
    assert again.chat.conversation_id == conversation and again.sidebar.current_id() == conversation
    assert [w.text for w in again.chat.view.widgets] == ["Remember this chat", "Fine."]

    qtbot.keyClick(again, Qt.Key.Key_N, CTRL)  # left on a new chat: the next start opens a new chat
    windows.close(again)
    third = open_window()
    assert third.chat.conversation_id is None and third.chat.view.widgets == []


def _link_and_keyword_colours(window: MainWindow) -> tuple[str, str]:
    body = window.chat.view.widgets[-1].body
    document = body.document()
    link = keyword = ""
    block = document.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().isAnchor() and fragment.charFormat().anchorHref().startswith("https:"):
                link = fragment.charFormat().foreground().color().name()
            it += 1
        for span in block.layout().formats():
            if block.text()[span.start:span.start + 6] == "return":
                keyword = span.format.foreground().color().name()
        block = block.next()
    return link, keyword


def test_a_theme_switch_recolours_the_messages_shown(qtbot, open_window):
    window = open_window(theme="light")
    store = window.store
    conversation = store.create_conversation("Colours", model="example")
    question = store.add_message(conversation.id, "user", "Show me", parent_id=None)
    store.add_message(conversation.id, "assistant", "See [the docs](https://example.org).\n\n```python\nreturn 1\n```",
                      parent_id=question.id, model="example", stats=MessageStats(), finish_reason="stop")
    window.open_conversation(conversation.id)
    app = QApplication.instance()
    saved = (app.styleSheet(), app.palette(), app.style().name())
    try:
        window.apply_settings(window.settings.replace(theme="light"))
        light = _link_and_keyword_colours(window)
        window.apply_settings(window.settings.replace(theme="dark"))
        assert _link_and_keyword_colours(window) == ("#79b8ff", "#ff7b72")  # the dark palette's, not the old ones
        window.apply_settings(window.settings.replace(theme="light"))
        assert _link_and_keyword_colours(window) == light == (app.palette().link().color().name(), "#cf222e")
    finally:
        app.setStyle(saved[2])
        app.setPalette(saved[1])
        app.setStyleSheet(saved[0])


def _unnamed(root: QWidget) -> list[str]:
    kinds = (QAbstractButton, QLineEdit, QComboBox, QAbstractSpinBox, QPlainTextEdit, QAbstractItemView,
             QProgressBar)
    missing = []
    for widget in root.findChildren(QWidget):
        if (not isinstance(widget, kinds) or isinstance(widget, QHeaderView) or not widget.isVisible()
                or widget.objectName().startswith("qt_")):
            continue
        interface = QAccessible.queryAccessibleInterface(widget)
        if not (interface and interface.text(QAccessible.Text.Name).strip()):
            missing.append(f"{type(widget).__name__} {widget.objectName()!r} {widget.toolTip()[:40]!r} in "
                           f"{type(widget.parent()).__name__} {widget.parent().objectName()!r}")
    return missing


def test_the_controls_have_accessible_names(qtbot, open_window):
    window = open_window()
    chat, models = window.chat, window.models_tab
    named = {chat.composer: "Message", window.sidebar.search_edit: "Search chats", window.sidebar.list: "Chats",
             chat.context_meter.bar: "Context used", chat.model_picker: "Model",
             models.query_edit: "Search the Hugging Face Hub", models.results: "Models",
             models.files_table: "Files to download", models.installed_table: "Installed models",
             models.downloads: "Downloads"}
    assert [w.accessibleName() for w in named] == list(named.values())
    chat.system_button.setChecked(True)
    chat.sampling_button.setChecked(True)
    for view in ("chat", "models"):
        window.show_view(view)
        assert _unnamed(window) == [], view
    assert re.search("Enter", chat.composer.toolTip())
