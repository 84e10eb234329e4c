"""The message box, whose send key is a setting (``Settings.send_key``): Enter sends and
Shift+Enter starts a new line (LM Studio's, Ollama's and Jan's convention, the default), or Ctrl+Enter
sends and Enter starts a new line (for long, many-paragraph prompts); Ctrl+Enter sends in both. And
``Draft``, what was typed in a chat and not sent."""

from __future__ import annotations

from dataclasses import dataclass

from hearth.app.gui.qt import QKeyEvent, QPlainTextEdit, Qt, QWidget, Signal
from hearth.app.store.settings import SEND_KEYS, SendKey

_ENTER_KEYS = (Qt.Key.Key_Return, Qt.Key.Key_Enter)
SEND_KEY_NAMES: dict[str, str] = {"enter": "Enter", "ctrl+enter": "Ctrl+Enter"}  # as the user presses them
NEW_LINE_KEY_NAMES: dict[str, str] = {"enter": "Shift+Enter", "ctrl+enter": "Enter"}


def send_hint(send_key: SendKey) -> str:
    """"Enter to send, Shift+Enter for a new line" for ``send_key``."""
    return f"{SEND_KEY_NAMES[send_key]} to send, {NEW_LINE_KEY_NAMES[send_key]} for a new line"


class Composer(QPlainTextEdit):
    """The message box: its send key (``set_send_key``) emits ``submitted``, the other Enter starts
    a new line; its placeholder and tooltip say which is which."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        self.setAccessibleName("Message")
        self.setMaximumHeight(110)
        self.send_key: SendKey = "enter"
        self.set_send_key("enter")

    def set_send_key(self, send_key: SendKey) -> None:
        """Which Enter sends: "enter" (Shift+Enter: a new line) or "ctrl+enter" (Enter: a new line)."""
        if send_key not in SEND_KEYS:
            raise ValueError(f"send key must be one of {', '.join(SEND_KEYS)}, not {send_key!r}")
        self.send_key = send_key
        self.setPlaceholderText(f"Message the model ({send_hint(send_key)}, Esc to stop)")
        self.setToolTip(f"{SEND_KEY_NAMES[send_key]} sends; {NEW_LINE_KEY_NAMES[send_key]} starts a new line; "
                        "Esc stops an answer or cancels an edit (Settings > Chat chooses the send key)")

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt's virtual
        if event.key() in _ENTER_KEYS:
            modifiers = event.modifiers() & ~Qt.KeyboardModifier.KeypadModifier
            plain = modifiers == Qt.KeyboardModifier.NoModifier
            if modifiers & Qt.KeyboardModifier.ShiftModifier or (plain and self.send_key == "ctrl+enter"):
                self.insertPlainText("\n")  # a new paragraph (Qt's own Shift+Enter is a soft line break)
                return
            if plain or modifiers == Qt.KeyboardModifier.ControlModifier:
                self.submitted.emit()
                return
        super().keyPressEvent(event)


@dataclass
class Draft:
    """What was typed in a chat and not sent: the message box, and for a chat not yet saved its
    system prompt (a saved chat keeps that in the store)."""

    text: str = ""
    system_prompt: str = ""
