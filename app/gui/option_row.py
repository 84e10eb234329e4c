"""The Settings tab's row of one ``EngineConfig`` field (``OptionRow``): an editor chosen by the
field's kind, its one-line help under it and as tooltip, and a red line under the editor saying why
a value cannot be saved (``error_label`` and ``field_column``, also used by the tab's other fields).

A number box keeps Qt's own range checks, which quietly put the old number back when the typed
text is out of range; the row says so instead, in words, and the tab does not save until it has.
"""

from __future__ import annotations

from typing import Any

from hearth.app.gui.qt import (
    QAbstractSpinBox,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QSpinBox,
    QValidator,
    QVBoxLayout,
    QWidget,
)
from hearth.app.store.settings import Settings, SettingsError
from hearth.engine.api import EngineOption

INT_MAX = 2**31 - 1  # QSpinBox holds a C int
_TRI_STATE = {"auto": None, "on": True, "off": False}


def error_label(parent: QWidget) -> QLabel:
    """A field's red line saying why its value cannot be saved (hidden while it can)."""
    label = QLabel(parent)
    label.setObjectName("errorLabel")  # red in both themes' stylesheets
    label.setWordWrap(True)
    label.hide()
    return label


def field_column(parent: QWidget, *widgets: QWidget) -> QWidget:
    """``widgets`` stacked as one form field (an editor, its error line, a hint or what a test said)."""
    field = QWidget(parent)
    column = QVBoxLayout(field)
    column.setContentsMargins(0, 0, 0, 0)
    column.setSpacing(2)
    for widget in widgets:
        column.addWidget(widget)
    return field


def field_row(parent: QWidget, *widgets: QWidget) -> QWidget:
    """``widgets`` side by side as one form field, the first stretching (an editor and its buttons)."""
    line = QWidget(parent)
    row = QHBoxLayout(line)
    row.setContentsMargins(0, 0, 0, 0)
    row.addWidget(widgets[0], 1)
    for widget in widgets[1:]:
        row.addWidget(widget)
    return line


def setting_problem(**change: Any) -> str | None:
    """Why the settings would refuse ``change`` (``Settings.replace``'s error), or None."""
    try:
        Settings().replace(**change)
    except SettingsError as exc:
        return str(exc)
    return None


def show_error(label: QLabel, problem: str | None) -> None:
    label.setText(problem or "")
    label.setVisible(bool(problem))


class OptionRow:
    """The Settings row of one ``EngineConfig`` field: an editor chosen by the field's kind, its
    one-line explanation under it, and the same text as tooltip. 0 in a number box, "auto" in a
    list or an empty text stands for ``None``."""

    def __init__(self, option: EngineOption, parent: QWidget) -> None:
        self.option = option
        self.editor = _editor(option, parent)
        self.editor.setAccessibleName(option.text.label)  # the row's label sits apart, in the form
        self.hint = QLabel(option.text.help, parent)
        self.hint.setObjectName("hintLabel")
        self.hint.setWordWrap(True)
        self.error = error_label(parent)
        self.field = field_column(parent, self.editor, self.error, self.hint)
        self.set_tooltip(option.text.help)
        self._reverted: str | None = None  # typed text Qt replaced by the old number when the box lost focus
        if isinstance(self.editor, QAbstractSpinBox):
            self.editor.lineEdit().textEdited.connect(lambda _text: self._check_typed())
            self.editor.editingFinished.connect(self._typing_done)

    def set_tooltip(self, text: str) -> None:
        for widget in (self.editor, self.hint):
            widget.setToolTip(text)

    def problem(self) -> str | None:
        """Why the value shown cannot be saved (None: it can): typed text out of the box's range,
        typed text Qt threw away when the box lost focus (said once, at the next save), or a value
        the engine refuses (a size of 0)."""
        editor = self.editor
        if isinstance(editor, (QSpinBox, QDoubleSpinBox)):
            text = editor.lineEdit().text()
            # NOTE: QSpinBox.validate does not know the special value's text; the box's own validator does.
            at_special = bool(editor.specialValueText()) and text == editor.specialValueText()
            if not at_special and editor.validate(text, 0)[0] != QValidator.State.Acceptable:
                return self._range_problem(editor.cleanText())
            if self._reverted:
                return self._reverted
        why = self.option.check(self.value())
        return f"{self.option.text.label}: {why}." if why else None

    def _range_problem(self, typed: str) -> str:
        editor, text = self.editor, self.option.text
        assert isinstance(editor, (QSpinBox, QDoubleSpinBox))
        low, high = editor.minimum(), editor.maximum()
        at_none = f", or {text.none_text}" if self.option.optional else ""
        if self.option.optional:
            low = low + 1 if isinstance(editor, QSpinBox) else 10 ** -editor.decimals()
        kind = "a whole number" if isinstance(editor, QSpinBox) else "a number"
        span = f"{_number(low)} or more" if high >= INT_MAX else f"from {_number(low)} to {_number(high)}"
        shown = f"“{typed.strip()}”" if typed.strip() else "Nothing"
        return f"{shown} is not allowed: {text.label} takes {kind} {span}{text.unit}{at_none}."

    def _check_typed(self) -> None:
        self._reverted = None
        show_error(self.error, self.problem())

    def _typing_done(self) -> None:
        """The box lost focus (or Enter was pressed): Qt has put the old number back if the text was not one."""
        if not self.error.isHidden() and self._reverted is None:
            self._reverted = f"{self.error.text()} It was set back to {self.editor.text().strip()}."
            show_error(self.error, self._reverted)

    def clear_reverted(self) -> None:
        """A save said it: the next one saves the number the box shows."""
        self._reverted = None

    def value(self) -> Any:
        editor, option = self.editor, self.option
        if isinstance(editor, QCheckBox):
            return editor.isChecked()
        if isinstance(editor, QComboBox):
            text = editor.currentText()
            return _TRI_STATE[text] if option.kind == "bool" else text
        if isinstance(editor, (QSpinBox, QDoubleSpinBox)):
            at_none = option.optional and editor.value() == editor.minimum()
            return None if at_none else editor.value()
        assert isinstance(editor, QLineEdit)
        text = editor.text().strip()
        return text or (None if option.optional else option.default)

    def set_value(self, value: Any) -> None:
        editor = self.editor
        if isinstance(editor, QCheckBox):
            editor.setChecked(bool(value))
        elif isinstance(editor, QComboBox):
            shown = {v: k for k, v in _TRI_STATE.items()}[value] if self.option.kind == "bool" else value
            editor.setCurrentText(shown)
        elif isinstance(editor, (QSpinBox, QDoubleSpinBox)):
            editor.setValue(editor.minimum() if value is None else value)
        else:
            editor.setText("" if value is None else str(value))
        self._reverted = None
        show_error(self.error, None)


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _editor(option: EngineOption, parent: QWidget) -> QWidget:
    text = option.text
    if option.kind == "bool" and not option.optional:
        return QCheckBox(parent)
    if option.kind in ("bool", "choice"):
        combo = QComboBox(parent)
        combo.addItems(list(_TRI_STATE) if option.kind == "bool" else list(option.choices))
        return combo
    if option.kind == "int":
        box = QSpinBox(parent)
        low = text.minimum or 0
        # NOTE: an optional number keeps the value below its minimum for None, shown as its none_text.
        box.setRange(low - 1 if option.optional else low, INT_MAX)
        box.setStepType(QSpinBox.StepType.AdaptiveDecimalStepType)
    elif option.kind == "float":
        box = QDoubleSpinBox(parent)
        box.setRange(0.0, 4096.0)
        box.setDecimals(1)
        box.setSingleStep(1.0)
    else:
        edit = QLineEdit(parent)
        edit.setPlaceholderText(text.none_text if option.optional else str(option.default))
        return edit
    box.setSuffix(text.unit)
    if option.optional:
        box.setSpecialValueText(text.none_text)
    return box
