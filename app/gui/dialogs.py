"""Small modal questions: ``confirm`` asks before something that cannot be undone (deleting a
model's files or a chat, cancelling a download and its partial files), with No as the default answer."""

from __future__ import annotations

from hearth.app.gui.qt import QMessageBox, QWidget


def confirm(parent: QWidget | None, title: str, text: str, *, action: str = "Delete") -> bool:
    """Ask ``text``; True only when the user answers with ``action`` (Enter and Esc answer No)."""
    box = QMessageBox(QMessageBox.Icon.Warning, title, text, QMessageBox.StandardButton.Yes
                      | QMessageBox.StandardButton.No, parent)
    box.button(QMessageBox.StandardButton.Yes).setText(action)
    box.setDefaultButton(QMessageBox.StandardButton.No)
    box.setEscapeButton(QMessageBox.StandardButton.No)
    return box.exec() == QMessageBox.StandardButton.Yes
