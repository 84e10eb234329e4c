"""Icons and stylesheets, read from the ``hearth.resources`` package through importlib.resources,
and the theme switch (light, dark, or whatever the system uses)."""

from __future__ import annotations

from functools import cache
from importlib import resources

from hearth.app.gui.qt import QApplication, QColor, QGuiApplication, QIcon, QPalette, Qt

_PACKAGE = "hearth.resources"


def _read_text(*parts: str) -> str:
    return resources.files(_PACKAGE).joinpath(*parts).read_text(encoding="utf-8")


@cache
def icon(name: str) -> QIcon:
    """The SVG icon ``resources/icons/<name>.svg`` (an empty icon if it is missing)."""
    path = resources.files(_PACKAGE).joinpath("icons", f"{name}.svg")
    return QIcon(str(path)) if path.is_file() else QIcon()


def stylesheet(theme: str) -> str:
    """The base rules plus the colours of ``theme`` ("light" or "dark")."""
    return _read_text("styles", "base.qss") + "\n" + _read_text("styles", f"{theme}.qss")


def resolve_theme(theme: str) -> str:
    """"system" becomes light or dark from the platform's colour scheme."""
    if theme in ("light", "dark"):
        return theme
    hints = QGuiApplication.styleHints()
    return "dark" if hints.colorScheme() == Qt.ColorScheme.Dark else "light"


def apply_theme(app: QApplication, theme: str) -> str:
    """Set the palette and stylesheet for ``theme``; returns the theme actually used."""
    used = resolve_theme(theme)
    app.setStyle("Fusion")
    app.setPalette(_dark_palette() if used == "dark" else app.style().standardPalette())
    app.setStyleSheet(stylesheet(used))
    return used


def _dark_palette() -> QPalette:
    palette = QPalette()
    colours = {
        QPalette.ColorRole.Window: "#17191d", QPalette.ColorRole.WindowText: "#e6e8eb",
        QPalette.ColorRole.Base: "#1f2227", QPalette.ColorRole.AlternateBase: "#24272d",
        QPalette.ColorRole.Text: "#e6e8eb", QPalette.ColorRole.Button: "#2a2e35",
        QPalette.ColorRole.ButtonText: "#e6e8eb", QPalette.ColorRole.Highlight: "#e0662b",
        QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.ToolTipBase: "#2a2e35",
        QPalette.ColorRole.ToolTipText: "#e6e8eb", QPalette.ColorRole.PlaceholderText: "#8b949e",
        QPalette.ColorRole.Link: "#79b8ff",
    }
    for role, colour in colours.items():
        palette.setColor(role, QColor(colour))
    return palette
