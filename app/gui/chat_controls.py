"""The chat panel's controls: model picker, system prompt with presets, sampling settings and the
context-usage meter. Widgets only; the chat panel wires them to the store and the engine."""

from __future__ import annotations

from typing import Any

from hearth.app.gui.backend import ModelChoice
from hearth.app.gui.qt import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
    Signal,
)
from hearth.app.store.chats import Preset

DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "max_tokens": 512, "seed": None}


class ModelPicker(QComboBox):
    """Installed models plus the demo; ``chosen`` fires when the user picks one."""

    chosen = Signal(object)  # ModelChoice

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setMinimumContentsLength(22)
        self.setToolTip("Model")
        self.setAccessibleName("Model")
        self.activated.connect(lambda index: self.chosen.emit(self.itemData(index)))

    def set_choices(self, choices: list[ModelChoice], current_label: str | None = None) -> None:
        self.blockSignals(True)
        self.clear()
        for choice in choices:
            self.addItem(choice.label, choice)
        labels = [c.label for c in choices]
        if current_label in labels:
            self.setCurrentIndex(labels.index(current_label))
        self.blockSignals(False)

    def current_choice(self) -> ModelChoice | None:
        return self.currentData()


class SamplingPanel(QGroupBox):
    """Temperature, top-p, top-k, max tokens and seed; ``changed`` on every edit."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Sampling (saved per model)", parent)
        form = QFormLayout(self)
        self.temperature = _double(0.0, 2.0, 0.05, "0 = greedy")
        self.top_p = _double(0.01, 1.0, 0.01, "nucleus sampling; 1 = off")
        self.top_k = _int(0, 1000, "0 = off")
        self.max_tokens = _int(1, 131072, "longest answer")
        self.seed = _int(-1, 2**31 - 1, "same seed, same answer")
        self.seed.setSpecialValueText("random")
        for label, widget in (("Temperature", self.temperature), ("Top-p", self.top_p), ("Top-k", self.top_k),
                              ("Max tokens", self.max_tokens), ("Seed", self.seed)):
            form.addRow(label, widget)
            widget.valueChanged.connect(self.changed)
        self.set_values({})

    def values(self) -> dict[str, Any]:
        seed = self.seed.value()
        return {"temperature": round(self.temperature.value(), 3), "top_p": round(self.top_p.value(), 3),
                "top_k": self.top_k.value(), "max_tokens": self.max_tokens.value(),
                "seed": None if seed < 0 else seed}

    def set_values(self, values: dict[str, Any]) -> None:
        merged = {**DEFAULT_SAMPLING, **{k: v for k, v in values.items() if k in DEFAULT_SAMPLING}}
        self.blockSignals(True)
        self.temperature.setValue(float(merged["temperature"]))
        self.top_p.setValue(float(merged["top_p"]))
        self.top_k.setValue(int(merged["top_k"]))
        self.max_tokens.setValue(int(merged["max_tokens"]))
        self.seed.setValue(-1 if merged["seed"] is None else int(merged["seed"]))
        self.blockSignals(False)


class SystemPromptPanel(QGroupBox):
    """The conversation's system prompt and the saved presets."""

    save_preset_requested = Signal(str)
    delete_preset_requested = Signal(str)
    preset_chosen = Signal(object)  # Preset

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("System prompt", parent)
        layout = QVBoxLayout(self)
        self.editor = QPlainTextEdit(self)
        self.editor.setPlaceholderText("How the assistant should behave in this conversation")
        self.editor.setAccessibleName("System prompt")
        self.editor.setMaximumHeight(90)
        layout.addWidget(self.editor)
        row = QHBoxLayout()
        self.presets = QComboBox(self)
        self.presets.setPlaceholderText("Presets")
        self.presets.setAccessibleName("Preset")
        self.presets.activated.connect(lambda i: self.preset_chosen.emit(self.presets.itemData(i)))
        self.name_edit = _line_edit("Preset name")
        save, delete = QPushButton("Save preset", self), QPushButton("Delete preset", self)
        save.clicked.connect(lambda: self.save_preset_requested.emit(self.name_edit.text().strip()))
        delete.clicked.connect(lambda: self.delete_preset_requested.emit(self.presets.currentText()))
        for widget in (QLabel("Preset:"), self.presets, self.name_edit, save, delete):
            row.addWidget(widget)
        layout.addLayout(row)

    def set_presets(self, presets: list[Preset]) -> None:
        self.presets.clear()
        for preset in presets:
            self.presets.addItem(preset.name, preset)
        self.presets.setCurrentIndex(-1)

    def text(self) -> str:
        return self.editor.toPlainText().strip()


class ContextMeter(QWidget):
    """Tokens in the model's context out of the context length: a thin bar with the numbers beside
    it (not drawn on the fill, where they are hard to read)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        self.bar = QProgressBar(self)
        self.bar.setObjectName("contextBar")
        self.bar.setTextVisible(False)
        self.bar.setFixedWidth(110)
        self.bar.setAccessibleName("Context used")
        self.label = QLabel(self)
        self.label.setObjectName("hintLabel")
        row.addWidget(self.bar)
        row.addWidget(self.label)
        self.setToolTip("Tokens in the model's context (prompt + answer, counted by the engine) / context length; "
                        "~ marks an estimate")
        self.setAccessibleName("Context used")
        self.set_usage(0, 0)

    def set_usage(self, used: int, limit: int, *, estimated: bool = False) -> None:
        self.bar.setRange(0, max(limit, 1))
        self.bar.setValue(min(used, max(limit, 1)))
        prefix = "~" if estimated else ""
        self.label.setText(f"context {prefix}{used:,} / {limit:,}" if limit else "context: no model")

    def text(self) -> str:
        return self.label.text()


def _double(low: float, high: float, step: float, tip: str) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setDecimals(2)
    box.setToolTip(tip)
    return box


def _int(low: int, high: int, tip: str) -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setToolTip(tip)
    return box


def _line_edit(placeholder: str):
    from hearth.app.gui.qt import QLineEdit

    edit = QLineEdit()
    edit.setPlaceholderText(placeholder)
    edit.setAccessibleName(placeholder)
    edit.setMaximumWidth(160)
    return edit
