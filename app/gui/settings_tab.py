"""The Settings tab: local engine or remote backend (``BackendFields``: its URL, API key and a Test
that lists its models, also run on save), the engine options, the models folder,
parallel downloads and offline mode, Hugging Face token and mirror, the chat's send key and
overflow policy, theme. Everything but the token is saved with ``save_settings``, under the keys
``hearth --cli config`` reads and writes, so the GUI and the CLI agree.

A value that cannot be saved is said under its field, in red, and nothing is saved until it is
fixed: a number box whose typed text is out of range (Qt would quietly put the old number back),
a models folder Hearth cannot write to, a URL that is not http(s). The models folder, parallel
downloads and offline mode take effect when saved, without a restart (the Models tab and the chat's
model list read the new folder at once); engine options restart the local engine.

The engine rows are generated from ``EngineConfig``'s field metadata (``engine_options()``): each
field gets an editor chosen by its type, its one-line help under it and as tooltip, in the
"Engine" group or the collapsed "Advanced engine options" one. A new field thus gets a row without
code here.

The token goes to huggingface_hub's own login store (``login(token=...)``), never into Hearth's
settings file, and is never shown again: the field is cleared after saving and the tab only says
whether a token is stored.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import get_token
from huggingface_hub import login as hf_login
from huggingface_hub import logout as hf_logout

from hearth.app.gui.backend_fields import BackendFields
from hearth.app.gui.composer import send_hint
from hearth.app.gui.option_row import (
    INT_MAX,
    OptionRow,
    error_label,
    field_column,
    field_row,
    setting_problem,
    show_error,
)
from hearth.app.gui.qt import (
    QCheckBox,
    QComboBox,
    QFileDialog,
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
from hearth.app.hub.context import env_offline, hub_cache_dir
from hearth.app.store.settings import SEND_KEYS, Settings, folder_problem, save_settings
from hearth.engine.api import ADVANCED, BASIC, EngineConfig, engine_options

THEMES = ("system", "light", "dark")
NO_CUDA_TIP = "This machine has no CUDA GPU, so every decode step runs eagerly; the option does nothing here."
OVERFLOW_CHOICES = (("Drop the oldest messages (the system prompt stays)", "truncate"),
                    ("Stop and say so", "stop"))
FOLDER_HINT = ("Where downloads go and where installed models are listed from; empty: the Hugging Face cache. "
               "Takes effect when saved, no restart (a download under way is paused; resumed, it goes to the "
               "new folder). Models already in the old folder stay there.")
OFFLINE_HINT = ("No search, model details or downloads; installed models still load and chat. HF_HUB_OFFLINE=1 "
                "in the environment turns it on as well.")


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
        layout.addWidget(self._models_box())
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
        self.backend_fields = fields = BackendFields(form, box)
        self.backend_kind, self.backend_url, self.backend_url_error = fields.kind, fields.url, fields.url_error
        self.backend_api_key = fields.api_key
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
        row.editor.setMaximum(limit or INT_MAX)
        row.set_value(self.settings.engine.max_model_len)  # shown capped when the model holds less
        cap = f" At most {limit:,} tokens for {model or 'this model'}." if limit else ""
        row.set_tooltip(row.option.text.help + cap)
        row.hint.setText(row.option.text.help + cap)

    def _models_box(self) -> QGroupBox:
        box = QGroupBox("Models and downloads", self)
        form = _form(box)
        self.models_folder = QLineEdit(box)
        self.models_folder_error = error_label(box)
        self.models_folder.setAccessibleName("Models folder")
        self.models_folder.setPlaceholderText(f"empty: {hub_cache_dir(Settings())}")
        self.models_folder.textEdited.connect(lambda _text: show_error(self.models_folder_error, None))
        self.models_folder.editingFinished.connect(self._check_models_folder)
        choose = self.models_folder_button = QPushButton("Choose…", box)
        choose.setToolTip("Pick the folder in a file dialog")
        choose.clicked.connect(self.choose_models_folder)
        form.addRow("Models folder", field_column(box, field_row(box, self.models_folder, choose),
                                                  self.models_folder_error, _hint(FOLDER_HINT, box)))
        self.download_parallelism = QSpinBox(box)
        self.download_parallelism.setRange(1, 64)
        self.download_parallelism.setSuffix(" files")
        self.download_parallelism.setAccessibleName("Parallel downloads")
        form.addRow("Parallel downloads", field_column(box, self.download_parallelism, _hint(
            "Files of a model fetched at the same time; fewer suit a slow or shared connection.", box)))
        self.offline = QCheckBox("Offline: never contact the Hugging Face Hub", box)
        forced = " It is on now: HF_HUB_OFFLINE is set in the environment." if env_offline() else ""
        self.offline_hint = _hint(OFFLINE_HINT + forced, box)
        form.addRow("", field_column(box, self.offline, self.offline_hint))
        return box

    def choose_models_folder(self) -> None:
        start = self.models_folder.text().strip() or str(hub_cache_dir(self.settings))
        folder = QFileDialog.getExistingDirectory(self, "Models folder", start)
        if folder:
            self.models_folder.setText(folder)
            self._check_models_folder()

    def _check_models_folder(self) -> str | None:
        folder = self.models_folder.text().strip()
        problem = folder_problem(folder) if folder else None
        show_error(self.models_folder_error, problem)
        return problem

    def _hub_box(self) -> QGroupBox:
        box = QGroupBox("Hugging Face", self)
        form = _form(box)
        self.endpoint = QLineEdit(box)
        self.endpoint.setPlaceholderText("empty: HF_ENDPOINT or https://huggingface.co; or a mirror such as "
                                         "https://hf-mirror.com")
        self.endpoint_error = error_label(box)
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
        form.addRow("Mirror endpoint", field_column(box, self.endpoint, self.endpoint_error))
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
        self.send_key = QComboBox(box)
        for value in SEND_KEYS:
            self.send_key.addItem(send_hint(value), value)
        self.send_key.setToolTip("Which key sends a message from the message box (Ctrl+Enter always sends)")
        self.send_key.setAccessibleName("Send with")
        form.addRow("Send with", self.send_key)
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
        self.backend_fields.show_settings(settings)
        self.endpoint.setText(settings.hf_endpoint or "")
        self.theme.setCurrentText(settings.theme)
        for name, row in self.rows.items():
            row.set_value(getattr(settings.engine, name))
        self.context_overflow.setCurrentIndex(max(self.context_overflow.findData(settings.context_overflow), 0))
        self.show_thinking.setChecked(settings.show_thinking)
        self.send_key.setCurrentIndex(max(self.send_key.findData(settings.send_key), 0))
        self.models_folder.setText(settings.hf_cache_dir or "")
        self.download_parallelism.setValue(settings.download_parallelism)
        self.offline.setChecked(settings.offline)
        for label in (self.models_folder_error, self.endpoint_error):
            show_error(label, None)

    def edited(self) -> Settings:
        """The settings as the form shows them (raises HearthError for bad values)."""
        backend_url, backend_api_key = self.backend_fields.values()
        values = {name: row.value() for name, row in self.rows.items()}
        stored_context = self.settings.engine.max_model_len
        if self._context_cap is not None and values["max_model_len"] == self._context_cap and (
                stored_context is not None and stored_context > self._context_cap):
            # NOTE: the box shows the setting capped by the selected model; the larger setting
            # still holds for bigger models, so an unchanged box keeps it.
            values["max_model_len"] = stored_context
        engine = EngineConfig(**values)
        return self.settings.replace(
            backend_url=backend_url, backend_api_key=backend_api_key,
            hf_endpoint=self.endpoint.text().strip() or None, theme=self.theme.currentText(),
            context_overflow=self.context_overflow.currentData(), show_thinking=self.show_thinking.isChecked(),
            send_key=self.send_key.currentData(), hf_cache_dir=self.models_folder.text().strip() or None,
            download_parallelism=self.download_parallelism.value(), offline=self.offline.isChecked(),
            engine=engine)

    def problems(self) -> list[str]:
        """Why the form cannot be saved, one line per field (each also shown under its field)."""
        found = []
        for row in self.rows.values():
            problem = row.problem()
            show_error(row.error, problem)
            row.clear_reverted()
            if problem:
                found.append(problem)
        problem = setting_problem(hf_endpoint=self.endpoint.text().strip() or None)
        show_error(self.endpoint_error, problem)
        found += [problem] if problem else []
        found += self.backend_fields.problems()
        problem = self._check_models_folder()
        return [*found, problem] if problem else found

    def save(self) -> None:
        problems = self.problems()
        if problems:
            self.status_label.setText(f"Not saved: {problems[0]}" + (f" (and {len(problems) - 1} more, marked above)"
                                                                       if len(problems) > 1 else ""))
            return
        try:
            settings = self.edited()
            if settings.hf_cache_dir:  # checked above: created now, so downloads and the disk check find it
                Path(settings.hf_cache_dir).expanduser().mkdir(parents=True, exist_ok=True)
            save_settings(settings)
        except Exception as exc:
            self.status_label.setText(f"Not saved: {exc}")
            return
        self.settings = settings
        self.status_label.setText("Saved.")
        self.settings_saved.emit(settings)
        if settings.backend_url:
            self.backend_fields.test()  # what the saved backend serves, said under its fields

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


def _hint(text: str, parent: QWidget) -> QLabel:
    label = QLabel(text, parent)
    label.setObjectName("hintLabel")
    label.setWordWrap(True)
    return label




def _form(box: QGroupBox) -> QFormLayout:
    form = QFormLayout(box)
    form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)  # editors span the window
    return form
