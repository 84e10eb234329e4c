"""The conversation list: new, rename, delete, export, and full-text search (Ctrl+F).

Long histories page in: the list starts with the ``PAGE_SIZE`` most recent conversations and reads
the next page when it is scrolled to the bottom (``load_more``); a search looks through all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hearth.app.gui import dialogs
from hearth.app.gui.qt import (
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    Qt,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
)
from hearth.app.gui.resources import icon
from hearth.app.store.chats import ChatStore

ID_ROLE = Qt.ItemDataRole.UserRole
PAGE_SIZE = 200


class Sidebar(QWidget):
    """Lists conversations (or search hits); ``selected`` carries the conversation id.

    ``is_generating(id)`` (set by the window) says whether an answer is being written in a chat: the
    question before deleting it says that the answer is stopped, and ``deleting`` lets the window
    stop it before the chat leaves the store (``deleted``)."""

    selected = Signal(object)  # int, or None for a new chat
    deleting = Signal(int)  # about to be deleted from the store
    deleted = Signal(int)

    def __init__(self, store: ChatStore, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.is_generating: Callable[[int], bool] = lambda _conversation_id: False
        self.setObjectName("sidebar")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        self.search_edit = QLineEdit(self)
        self.search_edit.setPlaceholderText("Search chats (Ctrl+F)")
        search_icon = self.search_edit.addAction(icon("search"), QLineEdit.ActionPosition.LeadingPosition)
        search_icon.setText("Search chats")  # (its button's accessible name)
        self.search_edit.setClearButtonEnabled(True)
        self.search_edit.setAccessibleName("Search chats")
        self.search_edit.textChanged.connect(self.refresh)
        layout.addWidget(self.search_edit)
        self.list = QListWidget(self)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setAccessibleName("Chats")
        self.list.itemClicked.connect(self._on_click)
        self.list.itemActivated.connect(self._on_click)
        self.list.verticalScrollBar().valueChanged.connect(self._on_scroll)
        layout.addWidget(self.list, 1)
        layout.addLayout(self._buttons())
        self._listed: set[int] = set()  # conversation ids in the list
        self._loaded = 0  # conversations read from the store (without a search)
        self._has_more = False
        self.refresh()

    def _buttons(self) -> QHBoxLayout:
        row = QHBoxLayout()
        actions = (("new", "New chat (Ctrl+N)", lambda: self.selected.emit(None)),
                   ("edit", "Rename", self.rename_current), ("delete", "Delete", self.delete_current),
                   ("export", "Export Markdown / JSON", self.export_current))
        for name, tip, slot in actions:
            button = QToolButton(self)
            button.setIcon(icon(name))
            button.setToolTip(tip)
            button.setAccessibleName(tip)
            if name == "new":  # the one action a first-time user looks for gets words, not just an icon
                button.setText("New chat")
                button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
            button.clicked.connect(slot)
            row.addWidget(button)
        row.addStretch(1)
        return row

    def refresh(self) -> None:
        """Re-read the list: the hits of the search text, or the most recent conversations (as many
        as were listed before, at least a page)."""
        current = self.current_id()
        self.list.clear()
        self._listed.clear()
        query = self.search_edit.text().strip()
        if query:
            self._has_more = False
            self._add([(hit.conversation_id, hit.title, hit.snippet) for hit in self.store.search(query)], current)
            return
        self._read_page(max(self._loaded, PAGE_SIZE), 0, current)

    def has_more(self) -> bool:
        """Whether older conversations are still to be read (never while searching)."""
        return self._has_more

    def load_more(self) -> int:
        """List the next page of older conversations; returns how many were added."""
        if not self._has_more:
            return 0
        before = self.list.count()
        self._read_page(PAGE_SIZE, self._loaded, self.current_id())
        return self.list.count() - before

    def _read_page(self, limit: int, offset: int, current: int | None) -> None:
        page = self.store.conversations(limit=limit, offset=offset)
        self._loaded = offset + len(page)
        self._has_more = len(page) == limit
        self._add([(c.id, c.title, None) for c in page], current)

    def _add(self, entries: list[tuple[int, str, str | None]], current: int | None) -> None:
        for conv_id, title, snippet in entries:
            if conv_id in self._listed:  # moved up between two pages (it was changed meanwhile)
                continue
            self._listed.add(conv_id)
            item = QListWidgetItem(title if not snippet or snippet == title else f"{title}\n  {snippet}")
            item.setData(ID_ROLE, conv_id)
            item.setToolTip(title)
            self.list.addItem(item)
            if conv_id == current:
                item.setSelected(True)
                self.list.setCurrentItem(item)

    def _on_scroll(self, value: int) -> None:
        if self._has_more and value >= self.list.verticalScrollBar().maximum():
            self.load_more()

    def select_id(self, conversation_id: int | None) -> None:
        for row in range(self.list.count()):
            item = self.list.item(row)
            if item.data(ID_ROLE) == conversation_id:
                self.list.setCurrentItem(item)
                return
        self.list.clearSelection()
        self.list.setCurrentItem(None)

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item is not None and item.isSelected() else None

    def focus_search(self) -> None:
        self.search_edit.setFocus()
        self.search_edit.selectAll()

    def _on_click(self, item: QListWidgetItem) -> None:
        self.selected.emit(item.data(ID_ROLE))

    def rename_current(self, title: str | None = None) -> None:
        conv_id = self.current_id()
        if conv_id is None:
            return
        if title is None:
            old = self.store.conversation(conv_id).title
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=old)
            if not ok:
                return
        self.store.rename(conv_id, title)
        self.refresh()

    def delete_current(self, confirm: bool = True) -> None:
        conv_id = self.current_id()
        if conv_id is None:
            return
        if confirm:
            title = self.store.conversation(conv_id).title
            stopped = " The answer being written in it is stopped." if self.is_generating(conv_id) else ""
            if not dialogs.confirm(self, "Delete chat", f"Delete “{title}” and all its messages?{stopped}"):
                return
        self.deleting.emit(conv_id)  # an answer being written to it stops before its messages go
        self.store.delete_conversation(conv_id)
        self.deleted.emit(conv_id)  # first: the open chat lets go of it before the list moves its selection
        self.refresh()

    def export_current(self, path: str | None = None) -> Path | None:
        """Write the chat as Markdown (.md) or JSON (.json), chosen by the file name."""
        conv_id = self.current_id()
        if conv_id is None:
            return None
        if path is None:
            title = self.store.conversation(conv_id).title
            path, _ = QFileDialog.getSaveFileName(self, "Export chat", f"{_safe_name(title)}.md",
                                                  "Markdown (*.md);;JSON (*.json)")
            if not path:
                return None
        target = Path(path)
        if target.suffix.lower() == ".json":
            text = json.dumps(self.store.export_json(conv_id), indent=2, ensure_ascii=False)
        else:
            text = self.store.export_markdown(conv_id)
        target.write_text(text, encoding="utf-8")
        return target


def _safe_name(title: str) -> str:
    keep = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip()
    return keep[:60] or "chat"
