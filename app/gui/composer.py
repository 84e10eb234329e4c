"""The message box: Enter sends, Shift+Enter starts a new line (LM Studio's, Ollama's and Jan's
convention), Ctrl+Enter sends too; and ``Draft``, what was typed in a chat and not sent."""

from __future__ import annotations

from dataclasses import dataclass

from hearth.app.gui.qt import QKeyEvent, QPlainTextEdit, Qt, QWidget, Signal

_ENTER_KEYS = (Qt.Key.Key_Return, Qt.Key.Key_Enter)


class Composer(QPlainTextEdit):
    """The message box. Enter sends (``submitted``), Shift+Enter starts a new line, as in LM Studio,
    Ollama and Jan; Ctrl+Enter sends too."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        self.setPlaceholderText("Message the model (Enter to send, Shift+Enter for a new line, Esc to stop)")
        self.setToolTip("Enter sends; Shift+Enter starts a new line; Esc stops an answer or cancels an edit")
        self.setAccessibleName("Message")
        self.setMaximumHeight(110)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt's virtual
        if event.key() in _ENTER_KEYS:
            modifiers = event.modifiers() & ~Qt.KeyboardModifier.KeypadModifier
            if modifiers & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")  # a new paragraph (Qt's own Shift+Enter is a soft line break)
                return
            if modifiers in (Qt.KeyboardModifier.NoModifier, Qt.KeyboardModifier.ControlModifier):
                self.submitted.emit()
                return
        super().keyPressEvent(event)


@dataclass
class Draft:
    """What was typed in a chat and not sent: the message box, and for a chat not yet saved its
    system prompt (a saved chat keeps that in the store)."""

    text: str = ""
    system_prompt: str = ""
