"""Chats switched while an answer is being written, with a scripted engine (``ScriptedBackend``): the
answer goes on into its own chat and is stored when it ends, the chat shown instead is left alone,
opening the answer's chat again shows it as far as it has come (or why it failed), Stop and Esc
follow the chat shown; a message sent in a second chat waits for the first chat's answer (one answer
at a time) and Stop cancels only it; deleting a chat whose answer is being written asks, then stops
the answer first; quitting keeps every answer as far as it came."""

from __future__ import annotations

from hearth.app.gui.message_widget import GENERATING
from hearth.app.gui.qt import QMessageBox, Qt
from hearth.app.gui.sidebar import ID_ROLE
from hearth.app.store.chats import ChatStore
from tests.app.test_gui_helpers import SCRIPTED_TIMEOUT_MS as TIMEOUT_MS
from tests.app.test_gui_helpers import answer_next_question, finish, send

CTRL = Qt.KeyboardModifier.ControlModifier
LEFT = Qt.MouseButton.LeftButton
WAITING = "waiting: Hearth writes one answer at a time, now in “{}”"  # (a chat's title)


def click_chat(qtbot, window, conversation_id: int) -> None:
    """Click the chat's row in the sidebar, as the user does."""
    chats = window.sidebar.list
    item = next(chats.item(r) for r in range(chats.count()) if chats.item(r).data(ID_ROLE) == conversation_id)
    qtbot.mouseClick(chats.viewport(), LEFT, pos=chats.visualItemRect(item).center())
    assert window.chat.conversation_id == conversation_id


def texts(window) -> list[str]:
    return [w.text for w in window.chat.view.widgets]


def start_answer(qtbot, window, question: str, first_words: str) -> int:
    """Send ``question`` in a new chat and let its answer begin with ``first_words``; the chat's id."""
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)
    send(qtbot, window, question)
    window.backend.answers.put(first_words)
    qtbot.waitUntil(lambda: window.chat.view.widgets[-1].text == first_words, timeout=TIMEOUT_MS)
    return window.chat.conversation_id


def test_an_answer_goes_on_in_its_own_chat_while_another_is_open(qtbot, open_scripted_window):
    window = open_scripted_window()
    chat, backend = window.chat, window.backend
    send(qtbot, window, "An old question")
    finish(qtbot, window, "An old answer.")
    old = chat.conversation_id
    story = start_answer(qtbot, window, "Tell me a long story", "Once upon ")

    click_chat(qtbot, window, old)
    assert texts(window) == ["An old question", "An old answer."] and window.sidebar.current_id() == old
    assert not chat.is_busy and chat.send_button.isVisible() and not chat.stop_button.isVisible()
    assert chat.is_generating and not chat.model_picker.isEnabled()  # the model cannot change under the story
    with qtbot.waitSignal(window.engine.worker.chunk, timeout=TIMEOUT_MS):
        backend.answers.put("a time")
    with qtbot.waitSignal(chat.answers.flush_timer.timeout, timeout=TIMEOUT_MS):
        pass
    assert texts(window) == ["An old question", "An old answer."]  # the story's words did not land here
    qtbot.keyClick(chat.composer, Qt.Key.Key_Escape)  # Esc here has no answer to stop
    assert chat.is_generating

    click_chat(qtbot, window, story)  # as far as it has come, still being written
    assert texts(window) == ["Tell me a long story", "Once upon a time"]
    assert chat.is_busy and chat.stop_button.isVisible() and not chat.send_button.isVisible()
    assert GENERATING in chat.view.widgets[-1].stats_label.text()
    backend.answers.put(", and on")
    qtbot.waitUntil(lambda: texts(window)[-1] == "Once upon a time, and on", timeout=TIMEOUT_MS)

    click_chat(qtbot, window, old)
    backend.answers.put(".")
    backend.answers.put(None)
    qtbot.waitUntil(lambda: not chat.is_generating, timeout=TIMEOUT_MS)
    answer = window.store.thread(story)[-1]
    assert answer.content == "Once upon a time, and on." and answer.is_complete and answer.finish_reason == "stop"
    assert chat.conversation_id == old and window.sidebar.current_id() == old  # the list did not jump to it
    assert texts(window) == ["An old question", "An old answer."] and chat.model_picker.isEnabled()

    click_chat(qtbot, window, story)
    assert texts(window) == ["Tell me a long story", "Once upon a time, and on."] and not chat.is_busy
    assert GENERATING not in chat.view.widgets[-1].stats_label.text()


def test_why_an_answer_failed_while_its_chat_was_not_shown_is_said_there(qtbot, open_scripted_window):
    window = open_scripted_window()
    chat, backend, notice = window.chat, window.backend, window.chat.view.notice
    send(qtbot, window, "Elsewhere")
    finish(qtbot, window, "Quiet here.")
    quiet = chat.conversation_id
    failing = start_answer(qtbot, window, "This one fails", "Half an ")
    click_chat(qtbot, window, quiet)
    backend.answers.put(RuntimeError("the engine host refused the request"))
    qtbot.waitUntil(lambda: not chat.is_generating, timeout=TIMEOUT_MS)
    assert notice.isHidden() and texts(window) == ["Elsewhere", "Quiet here."]
    stored = window.store.thread(failing)[-1]
    assert (stored.content, stored.finish_reason, stored.is_complete) == ("Half an ", "error", False)

    click_chat(qtbot, window, failing)
    assert not notice.isHidden() and notice.text() == "The answer failed: the engine host refused the request"
    click_chat(qtbot, window, quiet)
    assert notice.isHidden()  # each chat's own
    click_chat(qtbot, window, failing)
    assert not notice.isHidden()
    send(qtbot, window, "Try again")
    assert notice.isHidden()
    finish(qtbot, window, "Fine now.")
    click_chat(qtbot, window, quiet)
    click_chat(qtbot, window, failing)
    assert notice.isHidden() and texts(window)[-1] == "Fine now."


def test_a_message_sent_in_another_chat_waits_for_the_answer_being_written(qtbot, open_scripted_window):
    window = open_scripted_window()
    chat, backend = window.chat, window.backend
    first = start_answer(qtbot, window, "First chat", "Working on ")
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)  # a new chat while the first one's answer streams
    assert chat.conversation_id is None and texts(window) == [] and window.sidebar.current_id() is None
    assert chat.send_button.isVisible() and chat.send_button.isEnabled()
    assert chat.send_button.toolTip() == "Send (Enter): the answer starts once the one being written in “First chat” " \
                                         "is done"
    send(qtbot, window, "Second chat")
    second = chat.conversation_id
    assert second != first and window.sidebar.current_id() == second
    assert chat.view.widgets[-1].stats_label.text() == WAITING.format("First chat")
    assert chat.stop_button.isVisible() and chat.stop_button.toolTip() == "Cancel this waiting answer (Esc)"
    assert window.store.thread(second)[0].content == "Second chat"

    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)
    send(qtbot, window, "Third chat")  # a third waits its turn after the second
    third = chat.conversation_id
    assert chat.view.widgets[-1].stats_label.text() == WAITING.format("First chat")

    backend.answers.put("it.")
    backend.answers.put(None)  # the first chat's answer ends, and the second's begins
    qtbot.waitUntil(lambda: chat.view.widgets[-1].stats_label.text() == WAITING.format("Second chat"),
                    timeout=TIMEOUT_MS)
    assert backend.streamed == [first, second]
    assert window.store.thread(first)[-1].content == "Working on it." and window.store.thread(first)[-1].is_complete
    click_chat(qtbot, window, second)
    assert GENERATING in chat.view.widgets[-1].stats_label.text() and chat.stop_button.toolTip().startswith("Stop")
    finish(qtbot, window, "Second answer.")
    assert texts(window) == ["Second chat", "Second answer."] and window.sidebar.current_id() == second
    click_chat(qtbot, window, third)
    qtbot.waitUntil(lambda: GENERATING in chat.view.widgets[-1].stats_label.text(), timeout=TIMEOUT_MS)
    finish(qtbot, window, "Third answer.")
    assert texts(window) == ["Third chat", "Third answer."] and not chat.is_generating
    assert backend.streamed == [first, second, third]


def test_stop_in_a_waiting_chat_cancels_only_its_answer(qtbot, open_scripted_window):
    window = open_scripted_window()
    chat, backend = window.chat, window.backend
    first = start_answer(qtbot, window, "Keep going", "Still ")
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)
    send(qtbot, window, "Never mind")
    second = chat.conversation_id
    qtbot.mouseClick(chat.stop_button, LEFT)
    assert not chat.is_busy and chat.send_button.isVisible()  # at once: it never reached the engine
    cancelled = window.store.thread(second)[-1]
    assert (cancelled.role, cancelled.content, cancelled.finish_reason, cancelled.is_complete) == (
        "assistant", "", "abort", False)
    assert chat.view.widgets[-1].stats_label.text() == "stopped"
    assert chat.is_generating  # the first chat's answer goes on
    backend.answers.put("going.")
    backend.answers.put(None)
    qtbot.waitUntil(lambda: not chat.is_generating, timeout=TIMEOUT_MS)
    assert window.store.thread(first)[-1].content == "Still going." and backend.streamed == [first]
    assert backend.aborted == []


def test_deleting_a_chat_whose_answer_is_being_written_asks_then_stops_it_first(qtbot, open_scripted_window):
    window = open_scripted_window()
    chat, backend, sidebar = window.chat, window.backend, window.sidebar
    doomed = start_answer(qtbot, window, "Doomed chat", "Some ")
    asked: list[tuple[str, bool]] = []
    answer_next_question(QMessageBox.StandardButton.No, asked)
    sidebar.delete_current()
    assert asked == [("Delete “Doomed chat” and all its messages? The answer being written in it is stopped.", True)]
    assert chat.is_busy and [c.id for c in window.store.conversations()] == [doomed] and backend.aborted == []

    seen_at_deleting: list[tuple[bool, int]] = []  # (an answer is being written, chats in the store)
    sidebar.deleting.connect(lambda _id: seen_at_deleting.append((chat.is_generating,
                                                                  len(window.store.conversations()))))
    answer_next_question(QMessageBox.StandardButton.Yes, asked)
    sidebar.delete_current()
    assert seen_at_deleting == [(False, 1)]  # the answer was stopped before its chat left the store
    assert window.store.conversations() == [] and chat.conversation_id is None and texts(window) == []
    assert not chat.is_busy and not chat.is_generating and chat.send_button.isVisible()
    qtbot.waitUntil(lambda: backend.aborted == [doomed], timeout=TIMEOUT_MS)  # the engine's request was aborted

    send(qtbot, window, "A fresh start")  # the window works on
    finish(qtbot, window, "Hello.")
    assert texts(window) == ["A fresh start", "Hello."] and len(window.store.conversations()) == 1
    answer_next_question(QMessageBox.StandardButton.No, asked)
    sidebar.delete_current()
    assert asked[-1] == ("Delete “A fresh start” and all its messages?", True)  # nothing to stop: not said


def test_quitting_keeps_every_answer_as_far_as_it_came(qtbot, open_scripted_window, windows):
    window = open_scripted_window()
    running = start_answer(qtbot, window, "Long one", "Part of it")
    qtbot.keyClick(window, Qt.Key.Key_N, CTRL)
    send(qtbot, window, "Queued one")
    waiting = window.chat.conversation_id
    windows.close(window)
    store = ChatStore()  # the chat file as the next start reads it
    try:
        kept = [store.thread(conversation)[-1] for conversation in (running, waiting)]
    finally:
        store.close()
    assert [(m.content, m.finish_reason, m.is_complete) for m in kept] == [("Part of it", "abort", False),
                                                                             ("", "abort", False)]
