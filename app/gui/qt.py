"""The one place Hearth imports Qt from: every GUI module takes its Qt names from here.

Keeping the binding behind one module makes a later switch (or a version shim) a one-file change
and lets import-linter see at a glance that Qt stays inside ``hearth.app.gui``.
"""

from __future__ import annotations

from PySide6.QtCore import (
    QEvent,
    QEventLoop,
    QObject,
    QRunnable,
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
    QAction,
    QCloseEvent,
    QColor,
    QDesktopServices,
    QFont,
    QFontDatabase,
    QGuiApplication,
    QIcon,
    QKeySequence,
    QPalette,
    QShortcut,
    QSyntaxHighlighter,
    QTextCharFormat,
    QTextDocument,
    QTextFormat,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
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

__all__ = [
    "QAbstractItemView", "QAction", "QApplication", "QCheckBox", "QCloseEvent", "QColor", "QComboBox",
    "QDesktopServices", "QDialog", "QDialogButtonBox", "QDoubleSpinBox", "QEvent", "QEventLoop", "QFileDialog", "QFont",
    "QFontDatabase", "QFormLayout", "QFrame", "QGroupBox", "QGuiApplication", "QHBoxLayout", "QHeaderView",
    "QIcon", "QInputDialog", "QKeySequence", "QLabel", "QLineEdit", "QListWidget", "QListWidgetItem",
    "QMainWindow", "QMessageBox", "QObject", "QPalette", "QPlainTextEdit", "QProgressBar", "QPushButton",
    "QRunnable", "QScrollArea", "QShortcut", "QSize", "QSizePolicy", "QSpinBox", "QSplitter", "QStatusBar",
    "QSyntaxHighlighter", "QTabWidget", "QTableWidget", "QTableWidgetItem", "QTextBrowser", "QTextCharFormat",
    "QTextDocument", "QTextFormat", "QThread", "QThreadPool", "QTimer", "QToolButton", "QUrl", "QVBoxLayout",
    "QWidget", "Qt", "Signal", "Slot",
]
