"""The Settings tab: local engine or remote backend, the engine options, Hugging Face token and
mirror, theme. Everything but the token is saved with ``save_settings``.

The engine rows are generated from ``EngineConfig``'s field metadata (``engine_options()``): each
field gets an editor chosen by its type, its one-line help under it and as tooltip, in the
"Engine" group or the collapsed "Advanced engine options" one. A new field thus gets a row without
code here.

The token goes to huggingface_hub's own login store (``login(token=...)``), never into Hearth's
settings file, and is never shown again: the field is cleared after saving and the tab only says
whether a token is stored.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub import get_token
from huggingface_hub import login as hf_login
from huggingface_hub import logout as hf_logout

from hearth.app.gui.qt import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    Qt,
    QToolButton,
    QVBoxLayout,
    QWidget,
    Signal,
)
from hearth.app.gui.tasks import run_task
from hearth.app.store.settings import Settings, save_settings
from hearth.engine.api import ADVANCED, BASIC, EngineConfig, EngineOption, engine_options

THEMES = ("system", "light", "dark")
_INT_MAX = 2**31 - 1  # QSpinBox holds a C int
_TRI_STATE = {"auto": None, "on": True, "off": False}
NO_CUDA_TIP = "This machine has no CUDA GPU, so every decode step runs eagerly; the option does nothing here."
OVERFLOW_CHOICES = (("Drop the oldest messages (the system prompt stays)", "truncate"),
                    ("Stop and say so", "stop"))


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
        self.field = QWidget(parent)
        column = QVBoxLayout(self.field)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(2)
        column.addWidget(self.editor)
        column.addWidget(self.hint)
        self.set_tooltip(option.text.help)

    def set_tooltip(self, text: str) -> None:
        for widget in (self.editor, self.hint):
            widget.setToolTip(text)

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
        box.setRange(low - 1 if option.optional else low, _INT_MAX)
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


class SettingsTab(QWidget):
    settings_saved = Signal(object)  # Settings
    message = Signal(str)

    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.rows: dict[str, OptionRow] = {}
        self._context_cap: int | None = None  # the selected model's context length
        page = QWidget(self)
        layout = QVBoxLayout(page)
        layout.addWidget(self._engine_box(page))
        layout.addWidget(self._advanced_toggle(page))
        layout.addWidget(self.advanced_box)
        layout.addWidget(self._hub_box())
        layout.addWidget(self._chat_box())
        layout.addWidget(self._look_box())
        layout.addStretch(1)
        scroll = QScrollArea(self)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(page)
        row = QHBoxLayout()
        self.save_button = QPushButton("Save settings", self)
        self.save_button.setObjectName("primary")
        self.save_button.clicked.connect(self.save)
        self.status_label = QLabel("", self)
        row.addWidget(self.save_button)
        row.addWidget(self.status_label, 1)
        outer = QVBoxLayout(self)
        outer.addWidget(scroll, 1)
        outer.addLayout(row)
        self.show_settings(settings)
        self._show_token_state()

    def row(self, name: str) -> OptionRow:
        """The row of the ``EngineConfig`` field ``name``."""
        return self.rows[name]

    def _engine_box(self, page: QWidget) -> QGroupBox:
        box = QGroupBox(BASIC, page)
        form = _form(box)
        self.backend_kind = QComboBox(box)
        self.backend_kind.addItems(["Local engine (this machine)", "Remote backend (OpenAI-compatible URL)"])
        self.backend_url = QLineEdit(box)
        self.backend_url.setPlaceholderText("http://host:8000/v1")
        self.backend_kind.currentIndexChanged.connect(lambda i: self.backend_url.setEnabled(i == 1))
        form.addRow("Backend", self.backend_kind)
        form.addRow("Backend URL", self.backend_url)
        self.advanced_box = QGroupBox(ADVANCED, page)
        advanced_form = _form(self.advanced_box)
        for option in engine_options():
            row = OptionRow(option, box)
            self.rows[option.name] = row
            target = form if option.text.section == BASIC else advanced_form
            target.addRow(option.text.label, row.field)
            target.labelForField(row.field).setToolTip(option.text.help)
        return box

    def _advanced_toggle(self, page: QWidget) -> QToolButton:
        toggle = QToolButton(page)
        toggle.setText(f"Show {ADVANCED.lower()}")
        toggle.setCheckable(True)
        toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)

        def show(checked: bool) -> None:
            self.advanced_box.setVisible(checked)
            toggle.setText(f"{'Hide' if checked else 'Show'} {ADVANCED.lower()}")

        toggle.toggled.connect(show)
        self.advanced_toggle = toggle
        self.advanced_box.setVisible(False)
        return toggle

    def set_cuda_available(self, available: bool) -> None:
        """Grey out what only a CUDA GPU can do (decode steps replayed from CUDA graphs)."""
        row = self.rows["cuda_graphs"]
        row.editor.setEnabled(available)
        row.set_tooltip(row.option.text.help if available else NO_CUDA_TIP)

    def set_model_context(self, limit: int | None, model: str = "") -> None:
        """Cap the context length at the selected model's own (``limit``; None: no known cap)."""
        row = self.rows["max_model_len"]
        assert isinstance(row.editor, QSpinBox)
        self._context_cap = limit
        row.editor.setMaximum(limit or _INT_MAX)
        row.set_value(self.settings.engine.max_model_len)  # shown capped when the model holds less
        cap = f" At most {limit:,} tokens for {model or 'this model'}." if limit else ""
        row.set_tooltip(row.option.text.help + cap)

    def _hub_box(self) -> QGroupBox:
        box = QGroupBox("Hugging Face", self)
        form = _form(box)
        self.endpoint = QLineEdit(box)
        self.endpoint.setPlaceholderText("empty: HF_ENDPOINT or https://huggingface.co; or a mirror such as "
                                         "https://hf-mirror.com")
        self.token_edit = QLineEdit(box)
        self.token_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.token_edit.setPlaceholderText("hf_… (stored in huggingface_hub's login store)")
        self.token_state = QLabel(box)
        row = QHBoxLayout()
        save_token, forget = QPushButton("Save token", box), QPushButton("Log out", box)
        save_token.clicked.connect(self.save_token)
        forget.clicked.connect(self.forget_token)
        for widget in (self.token_edit, save_token, forget):
            row.addWidget(widget)
        form.addRow("Mirror endpoint", self.endpoint)
        form.addRow("Access token", row)
        form.addRow("", self.token_state)
        return box

    def _chat_box(self) -> QGroupBox:
        box = QGroupBox("Chat", self)
        form = QFormLayout(box)
        self.context_overflow = QComboBox(box)
        for label, value in OVERFLOW_CHOICES:
            self.context_overflow.addItem(label, value)
        self.context_overflow.setToolTip("What happens when a conversation no longer fits the model's context: "
                                         "leave out its oldest messages (a marker shows where), or send nothing "
                                         "and say so in the chat")
        form.addRow("When a chat outgrows the context", self.context_overflow)
        self.show_thinking = QCheckBox("Show thinking", box)
        self.show_thinking.setToolTip("Show a thinking model's reasoning in a foldable block above its answer "
                                      "(it is kept with the chat either way)")
        form.addRow("", self.show_thinking)
        return box

    def _look_box(self) -> QGroupBox:
        box = QGroupBox("Appearance", self)
        form = _form(box)
        self.theme = QComboBox(box)
        self.theme.addItems(THEMES)
        form.addRow("Theme", self.theme)
        return box

    def show_settings(self, settings: Settings) -> None:
        self.settings = settings
        self.backend_kind.setCurrentIndex(1 if settings.backend_url else 0)
        self.backend_url.setText(settings.backend_url or "")
        self.backend_url.setEnabled(bool(settings.backend_url))
        self.endpoint.setText(settings.hf_endpoint or "")
        self.theme.setCurrentText(settings.theme)
        for name, row in self.rows.items():
            row.set_value(getattr(settings.engine, name))
        self.context_overflow.setCurrentIndex(max(self.context_overflow.findData(settings.context_overflow), 0))
        self.show_thinking.setChecked(settings.show_thinking)

    def edited(self) -> Settings:
        """The settings as the form shows them (raises HearthError for bad values)."""
        remote = self.backend_kind.currentIndex() == 1 and self.backend_url.text().strip()
        values = {name: row.value() for name, row in self.rows.items()}
        stored_context = self.settings.engine.max_model_len
        if self._context_cap is not None and values["max_model_len"] == self._context_cap and (
                stored_context is not None and stored_context > self._context_cap):
            # NOTE: the box shows the setting capped by the selected model; the larger setting
            # still holds for bigger models, so an unchanged box keeps it.
            values["max_model_len"] = stored_context
        engine = EngineConfig(**values)
        return self.settings.replace(
            backend_url=self.backend_url.text().strip() if remote else None,
            hf_endpoint=self.endpoint.text().strip() or None, theme=self.theme.currentText(),
            context_overflow=self.context_overflow.currentData(), show_thinking=self.show_thinking.isChecked(),
            engine=engine)

    def save(self) -> None:
        try:
            settings = self.edited()
            save_settings(settings)
        except Exception as exc:
            self.status_label.setText(f"Not saved: {exc}")
            return
        self.settings = settings
        self.status_label.setText("Saved.")
        self.settings_saved.emit(settings)

    # ---- token ------------------------------------------------------------------------------
    def save_token(self) -> None:
        token = self.token_edit.text().strip()
        self.token_edit.clear()  # never kept in a widget longer than needed
        if not token:
            return
        self.token_state.setText("Checking the token…")
        run_task(lambda: hf_login(token=token, add_to_git_credential=False),
                 lambda _: self._show_token_state("Token saved."), self._token_failed,
                 owner=self)

    def forget_token(self) -> None:
        run_task(lambda: hf_logout() if get_token() else None, lambda _: self._show_token_state("Logged out."),
                 self._token_failed, owner=self)

    def _token_failed(self, exc: BaseException) -> None:
        self._show_token_state(f"Token not saved: {exc}")

    def _show_token_state(self, prefix: str = "") -> None:
        stored = get_token() is not None
        state = "A token is stored (hidden)." if stored else "No token stored: public models only."
        self.token_state.setText(f"{prefix} {state}".strip())


def _form(box: QGroupBox) -> QFormLayout:
    form = QFormLayout(box)
    form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)  # editors span the window
    return form
