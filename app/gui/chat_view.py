"""The scrolling list of message bubbles of one conversation thread."""

from __future__ import annotations

from hearth.app.gui.composer import NEW_LINE_KEY_NAMES, SEND_KEY_NAMES
from hearth.app.gui.message_widget import MessageView, MessageWidget
from hearth.app.gui.qt import QFrame, QLabel, QScrollArea, Qt, QVBoxLayout, QWidget, Signal
from hearth.app.store.chats import Message
from hearth.app.store.settings import SendKey


def start_hint(send_key: SendKey) -> str:
    """The empty chat's line, naming the keys of the ``send_key`` setting."""
    return (f"Start the conversation: type below and press {SEND_KEY_NAMES[send_key]} "
            f"({NEW_LINE_KEY_NAMES[send_key]} starts a new line).")


START_HINT = start_hint("enter")
DEMO_HINT = ("This is Hearth's tiny demo model, trained on Python's docs: it only imitates English. For real "
             "answers open Models, search DeepSeek-V3.2 or GLM-5 and pick one marked \"runs on the GPU\" or "
             "\"runs with experts in RAM\" for this machine.")


class ChatView(QScrollArea):
    """Shows a thread; the last bubble can be updated in place while an answer streams."""

    edit_requested = Signal(int)
    regenerate_requested = Signal(int)
    version_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.dark = False
        self.show_thinking = True  # Settings > Chat > Show thinking
        self._start_hint = START_HINT
        self._is_demo = False
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        container = QWidget(self)
        self._layout = QVBoxLayout(container)
        self._layout.setContentsMargins(16, 12, 16, 12)
        self._layout.setSpacing(10)
        self._placeholder = QLabel(START_HINT, container)
        self._placeholder.setObjectName("hintLabel")
        self._placeholder.setWordWrap(True)
        self._placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._layout.addWidget(self._placeholder)
        self.context_marker = QLabel("", container)
        self.context_marker.setObjectName("contextMarker")
        self.context_marker.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.context_marker.hide()
        self.notice = QLabel("", container)
        self.notice.setObjectName("chatNotice")
        self.notice.setWordWrap(True)
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.notice.hide()
        self._layout.addWidget(self.notice)
        self._layout.addStretch(1)
        self.setWidget(container)
        self.widgets: list[MessageWidget] = []
        self.verticalScrollBar().rangeChanged.connect(self._follow)
        self.verticalScrollBar().valueChanged.connect(self._user_scrolled)
        self._stick_to_bottom = True

    def set_demo_hint(self, is_demo: bool) -> None:
        """Explain, on an empty chat with the demo model, what to download for real answers."""
        self._is_demo = is_demo
        self._placeholder.setText(f"{self._start_hint}\n\n{DEMO_HINT}" if is_demo else self._start_hint)

    def set_send_key(self, send_key: SendKey) -> None:
        self._start_hint = start_hint(send_key)
        self.set_demo_hint(self._is_demo)

    def set_thread(self, views: list[MessageView]) -> None:
        for widget in self.widgets:
            self._layout.removeWidget(widget)
            widget.deleteLater()
        self.widgets = [self._add(view) for view in views]
        self._placeholder.setVisible(not views)
        self.set_context_marker(None)
        self._stick_to_bottom = True

    def append(self, view: MessageView) -> MessageWidget:
        widget = self._add(view)
        self.widgets.append(widget)
        self._placeholder.hide()
        self._stick_to_bottom = True
        return widget

    def _add(self, view: MessageView) -> MessageWidget:
        widget = MessageWidget(view, self.widget(), self.dark, self.show_thinking)
        widget.edit_requested.connect(self.edit_requested)
        widget.regenerate_requested.connect(self.regenerate_requested)
        widget.version_requested.connect(self.version_requested)
        self._layout.insertWidget(self._layout.indexOf(self.notice), widget)
        return widget

    def set_context_marker(self, first_kept_id: int | None) -> None:
        """A line above message ``first_kept_id`` saying how many earlier messages the model no
        longer sees (None: hide it)."""
        self._layout.removeWidget(self.context_marker)
        index = next((i for i, w in enumerate(self.widgets) if w.view.message.id == first_kept_id), None)
        if not index:  # None, or the very first message: nothing is left out
            self.context_marker.hide()
            return
        noun = "message is" if index == 1 else "messages are"
        self.context_marker.setText(f"⤒ {index} earlier {noun} not in the model's context")
        self.context_marker.setToolTip("The conversation outgrew the context, so the oldest messages were left "
                                       "out (the system prompt stays). Settings > Chat chooses this behaviour.")
        self._layout.insertWidget(self._layout.indexOf(self.widgets[index]), self.context_marker)
        self.context_marker.show()

    def scroll_to_context_marker(self) -> None:
        """Show the marker at the top of the view (and stop following the end of the thread)."""
        if not self.context_marker.isHidden():
            self._stick_to_bottom = False
            self.verticalScrollBar().setValue(max(self.context_marker.y() - 60, 0))

    def show_notice(self, text: str) -> None:
        """A message from Hearth at the end of the thread (why an answer failed or was not sent)."""
        self.notice.setText(text)
        self.notice.show()
        self._placeholder.hide()
        self._stick_to_bottom = True

    def clear_notice(self) -> None:
        self.notice.hide()

    def widget_for(self, message_id: int) -> MessageWidget | None:
        return next((w for w in self.widgets if w.view.message.id == message_id), None)

    def update_message(self, message: Message) -> None:
        """Show a message that has ended (rendered whole, no longer marked as being written)."""
        widget = self.widget_for(message.id)
        if widget is not None:
            widget.set_text(message.content)
            widget.set_message(message)
            widget.set_live(False)

    def set_dark(self, dark: bool) -> None:
        """Render the bubbles again in a new theme's colours (and new ones in them too)."""
        if dark == self.dark:
            return
        self.dark = dark
        for widget in self.widgets:
            widget.set_dark(dark)

    def set_show_thinking(self, show: bool) -> None:
        self.show_thinking = show
        for widget in self.widgets:
            widget.set_show_thinking(show)

    def set_busy(self, busy: bool) -> None:
        for widget in self.widgets:
            widget.set_busy(busy)

    def _user_scrolled(self, value: int) -> None:
        """Reading back up stops following the stream; scrolling to the bottom resumes it."""
        self._stick_to_bottom = value >= self.verticalScrollBar().maximum() - 80

    def _follow(self, _minimum: int, maximum: int) -> None:
        bar = self.verticalScrollBar()
        if self._stick_to_bottom or maximum - bar.value() < 80:
            bar.setValue(maximum)
