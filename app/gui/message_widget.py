"""One message bubble: role, a thinking model's reasoning (a foldable "Thinking" block), Markdown
body (highlighted code, copy link per code block), stats line, copy / edit / regenerate buttons and
the version switcher (< 2/3 >)."""

from __future__ import annotations

from dataclasses import dataclass

from hearth.app.gui.markdown import COPY_SCHEME, FEATURES, CodeHighlighter, code_blocks, stable_end, with_copy_links
from hearth.app.gui.qt import (
    QFrame,
    QGuiApplication,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    Qt,
    QTextBrowser,
    QTextCursor,
    QToolButton,
    QUrl,
    QVBoxLayout,
    QWidget,
    Signal,
)
from hearth.app.gui.resources import icon
from hearth.app.store.chats import Message, thinking_title

THINKING_LIVE = "Thinking…"
GENERATING = "generating…"
_MERGED_AWAY = "\u200b"  # zero-width space (see MarkdownBrowser._append)


@dataclass(frozen=True)
class MessageView:
    """A message as shown: its version number among ``sibling_ids`` (1-based)."""

    message: Message
    sibling_ids: tuple[int, ...]

    @property
    def version(self) -> int:
        return self.sibling_ids.index(self.message.id) + 1


class MarkdownBrowser(QTextBrowser):
    """A QTextBrowser as tall as its content (the chat view scrolls, not each message).

    ``stream_markdown`` renders a growing answer at a cost set by its tail, not its length: the
    complete blocks before ``stable_end`` are parsed once and appended, and only the text after
    them is parsed again on each call. ``show_markdown`` renders a text from scratch (the answer
    once it has ended: exactly what a whole-text render gives). ``rendered_chars`` counts the
    Markdown characters parsed so far.
    """

    def __init__(self, parent: QWidget | None = None, dark: bool = False) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.document().setUndoRedoEnabled(False)  # read-only: an undo stack would keep every streamed tail
        self.highlighter = CodeHighlighter(self.document(), dark)
        self.document().contentsChanged.connect(self._fit_height)
        self.rendered_chars = 0
        self._frozen = 0  # streaming: characters of the text rendered for good (complete blocks)
        self._tail_at = 0  # streaming: the document position where the re-rendered tail starts
        self._frozen_code_blocks = 0  # streaming: code blocks in the frozen part (copy links count on)
        self._mark_tail(0)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's virtual
        super().resizeEvent(event)
        self._fit_height()

    def _fit_height(self) -> None:
        width = max(self.viewport().width(), 50)
        if self.document().textWidth() != width:  # NOTE: setting it, even unchanged, lays out the whole text again
            self.document().setTextWidth(width)
        self.setFixedHeight(int(self.document().size().height()) + 6)

    def show_markdown(self, text: str) -> None:
        """Render ``text`` (Markdown, no raw HTML) from scratch."""
        self._frozen = self._tail_at = self._frozen_code_blocks = 0
        self._parse_into_document(with_copy_links(text))

    def show_plain(self, text: str) -> None:
        self._frozen = self._tail_at = self._frozen_code_blocks = 0
        self.setPlainText(text)

    def stream_markdown(self, text: str) -> None:
        """Render ``text``, which extends the text of the previous call (or of ``show_markdown``):
        complete blocks are parsed once, only the tail after them again."""
        if len(text) < self._frozen:  # not an extension after all
            self.show_markdown(text)
            return
        cut = stable_end(text, self._frozen)
        if self._frozen == 0:
            if cut == 0:
                self._parse_into_document(with_copy_links(text))  # no complete block yet
                return
            head = text[:cut]
            self._parse_into_document(with_copy_links(head))
            self._frozen, self._frozen_code_blocks = cut, len(code_blocks(head))
            self._mark_tail(self.document().characterCount() - 1)
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()  # one contentsChanged (one height fit) per call
        cursor.setPosition(self._tail_at)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        # NOTE: removing the tail can leave its first block's format on the block it merged into
        # (the empty one after a table becomes a heading): that block gets its own back.
        cursor.setBlockFormat(self._tail_block_format)
        cursor.setBlockCharFormat(self._tail_char_format)
        if cut > self._frozen:
            chunk = text[self._frozen:cut]
            self._append(cursor, with_copy_links(chunk, self._frozen_code_blocks))
            self._frozen, self._frozen_code_blocks = cut, self._frozen_code_blocks + len(code_blocks(chunk))
            self._mark_tail(cursor.position())
        tail = text[self._frozen:]
        if tail.strip():
            self._append(cursor, with_copy_links(tail, self._frozen_code_blocks))
        cursor.endEditBlock()

    def _mark_tail(self, position: int) -> None:
        """The tail starts at ``position``, the end of the frozen blocks' last block."""
        self._tail_at = position
        block = self.document().findBlock(position)
        self._tail_block_format, self._tail_char_format = block.blockFormat(), block.charFormat()

    def _parse_into_document(self, markdown: str) -> None:
        self.rendered_chars += len(markdown)
        self.document().setMarkdown(markdown, FEATURES)

    def _append(self, cursor: QTextCursor, markdown: str) -> None:
        """Parse ``markdown`` as blocks of their own at the end of the document.

        NOTE: an inserted fragment's first block merges into the block at the cursor and takes its
        format (a heading would become the paragraph before it), so the fragment starts with an
        invisible zero-width space paragraph: that one merges into the last block, and the real
        blocks follow with their own formats.
        """
        self.rendered_chars += len(markdown)
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertMarkdown(f"{_MERGED_AWAY}\n\n{markdown}", FEATURES)

    def set_dark(self, dark: bool) -> None:
        """Code colours for a dark (or light) background (the caller renders the text again, as
        Markdown's link colour is taken from the palette when it is parsed)."""
        self.highlighter.set_dark(dark, rehighlight=False)


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
        if text == self.text:
            return
        if self.text and text.startswith(self.text):  # streaming: only the new part goes in
            cursor = QTextCursor(self.body.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            cursor.insertText(text[len(self.text):])
        else:
            self.body.show_plain(text)
        self.text = text

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
        self.live = False  # the answer is streaming into this bubble
        self.waiting: str | None = None  # why the answer has not begun (another chat's is being written)
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

    @property
    def is_markdown(self) -> bool:
        """Answers are Markdown; the user's own words are shown as typed (a "# note" stays a note)."""
        return self.view.message.role != "user"

    def set_text(self, text: str) -> None:
        """Render the whole body from scratch."""
        self.text = text
        if not self.is_markdown:
            self.body.show_plain(text)
        else:
            self.body.show_markdown(text or "…")
        self._fold_for_answer()

    def stream_text(self, text: str) -> None:
        """Show a streaming answer that has grown to ``text`` (called per coalesced batch): only its
        tail is rendered again, so a long answer costs no more per batch than a short one."""
        if not text or not self.is_markdown:
            self.set_text(text)
            return
        self.text = text
        self.body.stream_markdown(text)
        self._fold_for_answer()

    def _fold_for_answer(self) -> None:
        if self.text and not self._folded:
            self._folded = True
            self.thinking.set_expanded(False)

    def set_live(self, live: bool) -> None:
        """Mark the bubble as the answer being written (its stats line says so) or not."""
        self.live = live
        self._show_stats()

    def set_waiting(self, why: str | None) -> None:
        """Say in the stats line why the answer has not begun (None: it has, or has ended)."""
        self.waiting = why
        self._show_stats()

    def set_dark(self, dark: bool) -> None:
        """Render again in a new theme's colours (links and code take them when parsed)."""
        self.body.set_dark(dark)
        self.thinking.body.set_dark(dark)
        self.set_text(self.text)
        self.thinking.body.highlighter.rehighlight()

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
        self._show_stats()

    def _show_stats(self) -> None:
        live = self.live and self.view.message.role == "assistant"
        self.stats_label.setText(self.waiting if live and self.waiting else stats_line(self.view.message, live=live))
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


def stats_line(message: Message, *, live: bool = False) -> str:
    """"12.3 tok/s · first token 0.21 s · 40 tokens", plus "generating…" while the answer streams
    (``live``) and "stopped" for a partial one."""
    parts = []
    stats = message.stats
    if stats is not None:
        if stats.tokens_per_s is not None:
            parts.append(f"{stats.tokens_per_s:.1f} tok/s")
        if stats.time_to_first_token_s is not None:
            parts.append(f"first token {stats.time_to_first_token_s:.2f} s")
        if stats.completion_tokens:
            parts.append(f"{stats.completion_tokens} tokens")
    if message.role == "assistant" and live:
        parts.append(GENERATING)
    elif message.role == "assistant" and not message.is_complete:
        parts.append("stopped" if message.finish_reason in (None, "abort") else f"ended: {message.finish_reason}")
    return " · ".join(parts)


def copy_text(text: str) -> None:
    QGuiApplication.clipboard().setText(text)
