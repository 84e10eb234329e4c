"""The one place Hearth imports Qt from: every GUI module takes its Qt names from here.

Keeping the binding behind one module makes a later switch (or a version shim) a one-file change
and lets import-linter see at a glance that Qt stays inside ``hearth.app.gui``.

One such shim lives here: PySide6 6.12.0 on Python 3.11 returns ``None`` from every void method
(``setText``, ``setData``, ``addItem``...) and from null-pointer results without taking a reference
to it, so each call leaves None's reference count one lower. Python 3.12+ never frees ``None`` (it
is immortal there) and hides the bug; on 3.11 the count reaches zero after some ten thousand calls
and the process aborts with ``Fatal Python error: none_dealloc``, e.g. when the sidebar listed
~7,000 conversations. ``_keep_none_alive`` detects the leak at import and gives ``None`` the same
immortality 3.12 has.
"""

from __future__ import annotations

import ctypes
import logging
import sys

from PySide6.QtCore import (
    QByteArray,
    QEvent,
    QEventLoop,
    QObject,
    QRect,
    QRunnable,
    QSettings,
    QSize,
    Qt,
    QThread,
    QThreadPool,
    QTimer,
    QUrl,
    Signal,
    Slot,
)
from PySide6.QtGui import (
    QAccessible,
    QAction,
    QCloseEvent,
    QColor,
    QDesktopServices,
    QFont,
    QFontDatabase,
    QGuiApplication,
    QIcon,
    QKeyEvent,
    QKeySequence,
    QPalette,
    QShortcut,
    QSyntaxHighlighter,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
    QValidator,
)
from PySide6.QtWidgets import (
    QAbstractButton,
    QAbstractItemView,
    QAbstractSpinBox,
    QApplication,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QStatusBar,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)
from shiboken6 import isValid as is_alive  # False once a QObject's C++ side was deleted

__all__ = [
    "QAbstractButton", "QAbstractItemView", "QAbstractSpinBox", "QAccessible", "QAction", "QApplication",
    "QByteArray", "QCheckBox", "QCloseEvent", "QColor", "QComboBox", "QDesktopServices", "QDialog",
    "QDialogButtonBox", "QDoubleSpinBox", "QEvent", "QEventLoop", "QFileDialog", "QFont", "QFontDatabase",
    "QFormLayout", "QFrame", "QGroupBox", "QGuiApplication", "QHBoxLayout", "QHeaderView", "QIcon", "QInputDialog",
    "QKeyEvent", "QKeySequence", "QLabel", "QLineEdit", "QListWidget", "QListWidgetItem", "QMainWindow",
    "QMessageBox", "QObject", "QPalette", "QPlainTextEdit", "QProgressBar", "QPushButton", "QRect", "QRunnable",
    "QScrollArea", "QSettings", "QShortcut", "QSize", "QSizePolicy", "QSpinBox", "QSplitter", "QStatusBar",
    "QSyntaxHighlighter", "QTabWidget", "QTableWidget", "QTableWidgetItem", "QTextBrowser", "QTextCharFormat",
    "QTextCursor", "QTextDocument", "QTextFormat", "QThread", "QThreadPool", "QTimer", "QToolButton", "QUrl",
    "QValidator", "QVBoxLayout", "QWidget", "Qt", "Signal", "Slot", "is_alive",
]

logger = logging.getLogger(__name__)
# How far None's count is raised: more void calls than any session makes, far from overflow.
_NONE_HEADROOM = 1 << 40


def _keep_none_alive() -> None:
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return  # None is immortal there (or refcounts are not CPython's)
    probe = QObject()
    before = sys.getrefcount(None)
    for _ in range(100):
        probe.setObjectName("probe")
    if sys.getrefcount(None) > before - 50:
        return  # this binding counts None's references correctly
    # NOTE: ob_refcnt is the first field of every CPython object, and id() is the object's address.
    ctypes.c_ssize_t.from_address(id(None)).value += _NONE_HEADROOM
    logger.debug("This Qt binding drops a reference to None on every void call; None is kept alive")


_keep_none_alive()
