"""A model, an engine option or the backend changed while an answer is being written, with a scripted
engine (``ScriptedBackend``): nothing reloads under the answer, the status bar says what will happen
"when the answer ends", the answer is written whole by the engine it began on, and then the reload
happens: the same model with the new options, the model chosen, or the new backend's models. With
answers in several chats it waits for all of them; Stop ends the wait like an answer's end."""

from __future__ import annotations

from hearth.app.gui.backend import DEMO_LABEL, ModelChoice
from hearth.app.gui.qt import Qt
from tests.app.fake_backend import FakeBackend
from tests.app.test_gui_helpers import SCRIPTED_TIMEOUT_MS as TIMEOUT_MS
from tests.app.test_gui_helpers import finish, send

CTRL = Qt.KeyboardModifier.ControlModifier
LEFT = Qt.MouseButton.LeftButton


def _begin(qtbot, window, question: str, first_words: str) -> None:
    send(qtbot, window, question)
    window.backend.answers.put(first_words)
    qtbot.waitUntil(lambda: window.chat.view.widgets[-1].text == first_words, timeout=TIMEOUT_MS)


def _pending(window) -> str:
    label = window.status.pending_label
    return "" if label.isHidden() else label.text()


def _loaded(window, label: str) -> bool:
    connected = window.chat.connected
    return connected is not None and connected.choice.label == label


def test_an_engine_option_saved_during_an_answer_reloads_the_engine_once_it_ends(qtbot, open_scripted_window):
    window = open_scripted_window()
    backend, tab = window.backend, window.settings_tab
    _begin(qtbot, window, "Tell me a story", "Once ")
    tab.row("gpu_memory_gib").editor.setValue(12.0)
    qtbot.mouseClick(tab.save_button, LEFT)
    assert tab.status_label.text() == "Saved." and window.settings.engine.gpu_memory_gib == 12.0
    assert _pending(window) == f"Engine options changed: {DEMO_LABEL} will reload when the answer ends"
    assert backend.loads == [DEMO_LABEL] and backend.settings.engine.gpu_memory_gib is None  # the answer's engine
    assert window.chat.is_busy and backend.aborted == []

    finish(qtbot, window, "upon a time.")
    qtbot.waitUntil(lambda: backend.loads == [DEMO_LABEL, DEMO_LABEL] and _loaded(window, DEMO_LABEL),
                    timeout=TIMEOUT_MS)
    assert backend.settings.engine.gpu_memory_gib == 12.0 and _pending(window) == ""
    assert [m.content for m in window.store.thread(window.chat.conversation_id)] == [
        "Tell me a story", "Once upon a time."]  # written whole by the engine it began on
    assert window.status.engine_label.text() == f"Engine: {DEMO_LABEL} ready (local engine)"


def test_a_model_chosen_during_answers_loads_once_every_answer_has_ended_or_stopped(qtbot, open_scripted_window):
    window = open_scripted_window()
    backend, chat = window.backend, window.chat
    other = ModelChoice("Other model", None, False, 4096)
    window.choices = [*window.choices, other]  # as if it were installed
    _begin(qtbot, window, "First question", "Working")
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)
    send(qtbot, window, "Second question")  # waits for the first chat's answer
    window.models_tab.use_model_requested.emit("Other model")  # the Models tab's "Use this model"
    assert _pending(window) == "Other model will load when the answers end"
    assert backend.loads == [DEMO_LABEL] and chat.model_picker.currentText() == "Other model"

    backend.answers.put(None)  # the first answer ends; the second one's turn comes
    qtbot.waitUntil(lambda: len(backend.streamed) == 2 and chat.answers.count == 1, timeout=TIMEOUT_MS)
    assert backend.loads == [DEMO_LABEL] and _pending(window) == "Other model will load when the answers end"
    assert _loaded(window, DEMO_LABEL)
    chat.stop()  # Stop ends the second answer: nothing is written any more
    qtbot.waitUntil(lambda: _loaded(window, "Other model"), timeout=TIMEOUT_MS)
    assert backend.loads == [DEMO_LABEL, "Other model"] and backend.aborted == [chat.conversation_id]
    assert _pending(window) == "" and window.load_banner.isHidden()


def test_a_backend_saved_during_an_answer_is_switched_to_once_it_ends(qtbot, open_scripted_window):
    window = open_scripted_window()
    backend, tab, fields = window.backend, window.settings_tab, window.settings_tab.backend_fields
    _begin(qtbot, window, "Summarise this", "The text ")
    with FakeBackend(models=("remote-model",)) as server:
        fields.kind.setCurrentIndex(1)
        fields.url.setText(server.url)
        qtbot.mouseClick(tab.save_button, LEFT)
        assert _pending(window) == f"Will switch to {server.url} when the answer ends"
        qtbot.waitUntil(lambda: not fields.is_testing, timeout=TIMEOUT_MS)  # saving tested it meanwhile
        assert fields.result.text() == f"Connected: {server.url} serves 1 model: remote-model"
        assert window.choices[0].label == DEMO_LABEL and backend.loads == [DEMO_LABEL]  # nothing switched yet
        assert backend.settings.backend_url is None and window.chat.is_busy

        finish(qtbot, window, "says hello.")
        qtbot.waitUntil(lambda: _loaded(window, "remote-model"), timeout=TIMEOUT_MS)
    assert backend.loads == [DEMO_LABEL, "remote-model"] and backend.settings.backend_url == server.url
    assert [c.label for c in window.choices] == ["remote-model"] and _pending(window) == ""
    answer = window.store.thread(window.chat.conversation_id)[-1]
    assert (answer.content, answer.model) == ("The text says hello.", DEMO_LABEL)
