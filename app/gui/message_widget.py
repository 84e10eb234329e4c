"""One message bubble: role, a thinking model's reasoning (a foldable "Thinking" block), Markdown
body (highlighted code, copy link per code block), stats line, copy / edit / regenerate buttons and
the version switcher (< 2/3 >)."""

from __future__ import annotations

from dataclasses import dataclass

from hearth.app.gui.markdown import COPY_SCHEME, CodeHighlighter, code_blocks, with_copy_links
from hearth.app.gui.qt import (
    QFrame,
    QGuiApplication,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    Qt,
    QTextBrowser,
    QToolButton,
    QUrl,
    QVBoxLayout,
    QWidget,
    Signal,
)
from hearth.app.gui.resources import icon
from hearth.app.store.chats import Message, thinking_title

THINKING_LIVE = "Thinking…"


@dataclass(frozen=True)
class MessageView:
    """A message as shown: its version number among ``sibling_ids`` (1-based)."""

    message: Message
    sibling_ids: tuple[int, ...]

    @property
    def version(self) -> int:
        return self.sibling_ids.index(self.message.id) + 1


class MarkdownBrowser(QTextBrowser):
    """A QTextBrowser as tall as its content (the chat view scrolls, not each message)."""

    def __init__(self, parent: QWidget | None = None, dark: bool = False) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.highlighter = CodeHighlighter(self.document(), dark)
        self.document().contentsChanged.connect(self._fit_height)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's virtual
        super().resizeEvent(event)
        self._fit_height()

    def _fit_height(self) -> None:
        self.document().setTextWidth(max(self.viewport().width(), 50))
        self.setFixedHeight(int(self.document().size().height()) + 6)


class ThinkingBlock(QWidget):
    """The reasoning above an answer: a toggle line ("Thinking…" while it streams, "Thought for
    3.2 s" after) over the reasoning text, shown dimmed."""

    def __init__(self, parent: QWidget | None = None, dark: bool = False) -> None:
        super().__init__(parent)
        self.text = ""
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.toggle = QToolButton(self)
        self.toggle.setObjectName("thinkingToggle")
        self.toggle.setCheckable(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.toggle.setToolTip("Show or hide what the model thought before answering")
        self.toggle.toggled.connect(self._expand)
        layout.addWidget(self.toggle, 0, Qt.AlignmentFlag.AlignLeft)
        self.body = MarkdownBrowser(self, dark)
        self.body.setObjectName("thinkingBody")
        self.body.hide()
        layout.addWidget(self.body)

    @property
    def expanded(self) -> bool:
        return self.toggle.isChecked()

    def set_expanded(self, expanded: bool) -> None:
        self.toggle.setChecked(expanded)

    def set_text(self, text: str) -> None:
        if text != self.text:
            self.text = text
            self.body.setPlainText(text)

    def _expand(self, expanded: bool) -> None:
        self.body.setVisible(expanded)
        self.toggle.setArrowType(Qt.ArrowType.DownArrow if expanded else Qt.ArrowType.RightArrow)


class MessageWidget(QFrame):
    """A bubble; emits requests, never touches the store itself. While an answer streams, its
    Thinking block is open; it folds when the answer starts (a click opens it again)."""

    edit_requested = Signal(int)
    regenerate_requested = Signal(int)
    version_requested = Signal(int)  # the message id to show instead

    def __init__(self, view: MessageView, parent: QWidget | None = None, dark: bool = False,
                 show_thinking: bool = True) -> None:
        super().__init__(parent)
        self.view = view
        self.text = view.message.content
        self.show_thinking = show_thinking
        self._folded = bool(self.text)  # the Thinking block was folded for the answer (or never opened)
        self.setObjectName(f"bubble_{view.message.role}")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 6)
        layout.addLayout(self._header())
        self.thinking = ThinkingBlock(self, dark)
        layout.addWidget(self.thinking)
        self.body = MarkdownBrowser(self, dark)
        self.body.anchorClicked.connect(self._on_link)
        layout.addWidget(self.body)
        self.stats_label = QLabel(self)
        self.stats_label.setObjectName("statsLabel")
        layout.addWidget(self.stats_label)
        self.set_text(self.text)
        self.set_message(view.message)

    def _header(self) -> QHBoxLayout:
        row = QHBoxLayout()
        message = self.view.message
        self.role_label = QLabel(message.role.capitalize(), self)
        self.role_label.setObjectName("roleLabel")
        row.addWidget(self.role_label)
        row.addStretch(1)
        self.prev_button = self._tool("prev", "Previous version")
        self.version_label = QLabel(self)
        self.next_button = self._tool("next", "Next version")
        self.prev_button.clicked.connect(lambda: self._switch(-1))
        self.next_button.clicked.connect(lambda: self._switch(+1))
        for widget in (self.prev_button, self.version_label, self.next_button):
            row.addWidget(widget)
        self._update_switcher()
        self.copy_button = self._tool("copy", "Copy message")
        self.copy_button.clicked.connect(lambda: copy_text(self.text))
        row.addWidget(self.copy_button)
        if message.role == "user":
            self.action_button = self._tool("edit", "Edit and resend")
            self.action_button.clicked.connect(lambda: self.edit_requested.emit(message.id))
            row.addWidget(self.action_button)
        elif message.role == "assistant":
            self.action_button = self._tool("regenerate", "Regenerate")
            self.action_button.clicked.connect(lambda: self.regenerate_requested.emit(message.id))
            row.addWidget(self.action_button)
        return row

    def _tool(self, icon_name: str, tip: str) -> QToolButton:
        button = QToolButton(self)
        button.setIcon(icon(icon_name))
        button.setToolTip(tip)
        button.setAccessibleName(tip)
        return button

    def _update_switcher(self) -> None:
        count = len(self.view.sibling_ids)
        self.version_label.setText(f"{self.view.version}/{count}")
        for widget in (self.prev_button, self.version_label, self.next_button):
            widget.setVisible(count > 1)
        self.prev_button.setEnabled(self.view.version > 1)
        self.next_button.setEnabled(self.view.version < count)

    def _switch(self, step: int) -> None:
        index = self.view.version - 1 + step
        if 0 <= index < len(self.view.sibling_ids):
            self.version_requested.emit(self.view.sibling_ids[index])

    def set_text(self, text: str) -> None:
        """Re-render the body (called per coalesced batch while streaming)."""
        self.text = text
        self.body.setMarkdown(with_copy_links(text) if text else "…")
        if text and not self._folded:
            self._folded = True
            self.thinking.set_expanded(False)

    def set_reasoning(self, text: str, live: bool = False) -> None:
        """Show the reasoning; ``live``: it is streaming (open, titled "Thinking…", until the answer starts)."""
        self.thinking.set_text(text)
        self.thinking.setVisible(bool(text) and self.show_thinking)
        if live:
            self.thinking.toggle.setText(THINKING_LIVE)
            if not self._folded and not self.thinking.expanded:
                self.thinking.set_expanded(True)

    def set_show_thinking(self, show: bool) -> None:
        self.show_thinking = show
        self.thinking.setVisible(bool(self.thinking.text) and show)

    def set_message(self, message: Message) -> None:
        """Refresh the stats line once an answer has finished."""
        self.view = MessageView(message, self.view.sibling_ids)
        self.set_reasoning(message.reasoning)
        self.thinking.toggle.setText(thinking_title(message))
        if message.role == "assistant" and message.model:
            self.role_label.setText(f"Assistant · {message.model}")
        self.stats_label.setText(stats_line(message))
        self.stats_label.setVisible(bool(self.stats_label.text()))

    def set_busy(self, busy: bool) -> None:
        for button in (getattr(self, "action_button", None), self.prev_button, self.next_button):
            if button is not None:
                button.setEnabled(not busy)
        if not busy:
            self._update_switcher()

    def _on_link(self, url: QUrl) -> None:
        if url.scheme() == COPY_SCHEME:
            blocks = code_blocks(self.text)
            index = int(url.path() or 0)
            if 0 <= index < len(blocks):
                copy_text(blocks[index])
            return
        from hearth.app.gui.qt import QDesktopServices

        QDesktopServices.openUrl(url)


def stats_line(message: Message) -> str:
    """"12.3 tok/s · first token 0.21 s · 40 tokens", plus "stopped" for a partial answer."""
    parts = []
    stats = message.stats
    if stats is not None:
        if stats.tokens_per_s is not None:
            parts.append(f"{stats.tokens_per_s:.1f} tok/s")
        if stats.time_to_first_token_s is not None:
            parts.append(f"first token {stats.time_to_first_token_s:.2f} s")
        if stats.completion_tokens:
            parts.append(f"{stats.completion_tokens} tokens")
    if message.role == "assistant" and not message.is_complete:
        parts.append("stopped" if message.finish_reason in (None, "abort") else f"ended: {message.finish_reason}")
    return " · ".join(parts)


def copy_text(text: str) -> None:
    QGuiApplication.clipboard().setText(text)
