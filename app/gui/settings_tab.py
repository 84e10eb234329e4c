"""The Settings tab: memory budgets, context length, local engine or remote backend, Hugging Face
token and mirror, theme. Everything but the token is saved with ``save_settings``.

The token goes to huggingface_hub's own login store (``login(token=...)``), never into Hearth's
settings file, and is never shown again: the field is cleared after saving and the tab only says
whether a token is stored.
"""

from __future__ import annotations

from huggingface_hub import get_token
from huggingface_hub import login as hf_login
from huggingface_hub import logout as hf_logout

from hearth.app.gui.qt import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
    Signal,
)
from hearth.app.gui.tasks import run_task
from hearth.app.store.settings import Settings, save_settings

THEMES = ("system", "light", "dark")
OVERFLOW_CHOICES = (("Drop the oldest messages (the system prompt stays)", "truncate"),
                    ("Stop and say so", "stop"))


def _count_box(parent: QWidget, tip: str) -> QSpinBox:
    box = QSpinBox(parent)
    box.setRange(0, 1_000_000)
    box.setSpecialValueText("off")
    box.setToolTip(tip)
    return box


def _gib_box(tip: str) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(0.0, 4096.0)
    box.setDecimals(1)
    box.setSingleStep(1.0)
    box.setSuffix(" GiB")
    box.setSpecialValueText("auto")
    box.setToolTip(tip)
    return box


class SettingsTab(QWidget):
    settings_saved = Signal(object)  # Settings
    message = Signal(str)

    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        layout = QVBoxLayout(self)
        layout.addWidget(self._engine_box())
        layout.addWidget(self._hub_box())
        layout.addWidget(self._chat_box())
        layout.addWidget(self._look_box())
        row = QHBoxLayout()
        self.save_button = QPushButton("Save settings", self)
        self.save_button.setObjectName("primary")
        self.save_button.clicked.connect(self.save)
        self.status_label = QLabel("", self)
        row.addWidget(self.save_button)
        row.addWidget(self.status_label, 1)
        layout.addLayout(row)
        layout.addStretch(1)
        self.show_settings(settings)
        self._show_token_state()

    def _engine_box(self) -> QGroupBox:
        box = QGroupBox("Engine", self)
        form = QFormLayout(box)
        self.gpu_memory = _gib_box("GPU memory Hearth may use (auto: what is free)")
        self.expert_cache = _gib_box("GPU memory for resident experts when experts live in RAM")
        self.context_length = QSpinBox(box)
        self.context_length.setRange(256, 1_048_576)
        self.context_length.setSingleStep(1024)
        self.context_length.setSuffix(" tokens")
        self.backend_kind = QComboBox(box)
        self.backend_kind.addItems(["Local engine (this machine)", "Remote backend (OpenAI-compatible URL)"])
        self.backend_url = QLineEdit(box)
        self.backend_url.setPlaceholderText("http://host:8000/v1")
        self.backend_kind.currentIndexChanged.connect(lambda i: self.backend_url.setEnabled(i == 1))
        form.addRow("GPU memory budget", self.gpu_memory)
        form.addRow("Expert cache", self.expert_cache)
        form.addRow("Context length", self.context_length)
        form.addRow("Backend", self.backend_kind)
        form.addRow("Backend URL", self.backend_url)
        self._long_context_rows(box, form)
        return box

    def _long_context_rows(self, box: QGroupBox, form: QFormLayout) -> None:
        """Scheduling and long-context options of the local engine (0 = off / as the model ships)."""
        self.scheduler = QComboBox(box)
        self.scheduler.addItems(["sync", "runahead"])
        self.scheduler.setToolTip("runahead: requests whose experts are on the GPU run ahead while others wait")
        self.mli = QCheckBox("Multi-layer Indexer (DSA models)", box)
        self.cuda_graphs = QCheckBox("Replay decode steps from CUDA graphs (GPU)", box)
        self.cuda_graphs.setToolTip("Off: every decode step launches its kernels one by one (slower; for debugging)")
        self.index_topk_freq = _count_box(box, "IndexCache: keep an indexer every N layers (0 = as shipped)")
        self.key_pages = _count_box(box, "Indexer-key pages per request kept on the GPU (0 = all)")
        self.latent_rows = _count_box(box, "Latent rows per request and layer kept on the GPU (0 = all)")
        form.addRow("Scheduler", self.scheduler)
        form.addRow("", self.mli)
        form.addRow("", self.cuda_graphs)
        form.addRow("Indexer retention", self.index_topk_freq)
        form.addRow("GPU key pages", self.key_pages)
        form.addRow("GPU latent rows", self.latent_rows)

    def _hub_box(self) -> QGroupBox:
        box = QGroupBox("Hugging Face", self)
        form = QFormLayout(box)
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
        return box

    def _look_box(self) -> QGroupBox:
        box = QGroupBox("Appearance", self)
        form = QFormLayout(box)
        self.theme = QComboBox(box)
        self.theme.addItems(THEMES)
        form.addRow("Theme", self.theme)
        return box

    def show_settings(self, settings: Settings) -> None:
        self.settings = settings
        self.gpu_memory.setValue(settings.gpu_memory_gib or 0.0)
        self.expert_cache.setValue(settings.expert_cache_gib or 0.0)
        self.context_length.setValue(settings.context_length)
        self.backend_kind.setCurrentIndex(1 if settings.backend_url else 0)
        self.backend_url.setText(settings.backend_url or "")
        self.backend_url.setEnabled(bool(settings.backend_url))
        self.endpoint.setText(settings.hf_endpoint or "")
        self.theme.setCurrentText(settings.theme)
        self.context_overflow.setCurrentIndex(max(self.context_overflow.findData(settings.context_overflow), 0))
        self.scheduler.setCurrentText(settings.scheduler)
        self.mli.setChecked(settings.mli)
        self.cuda_graphs.setChecked(settings.cuda_graphs)
        self.index_topk_freq.setValue(settings.index_topk_freq or 0)
        self.key_pages.setValue(settings.index_key_hot_pages or 0)
        self.latent_rows.setValue(settings.latent_hot_rows or 0)

    def edited(self) -> Settings:
        """The settings as the form shows them (raises SettingsError for bad values)."""
        remote = self.backend_kind.currentIndex() == 1 and self.backend_url.text().strip()
        return self.settings.replace(
            gpu_memory_gib=self.gpu_memory.value() or None, expert_cache_gib=self.expert_cache.value() or None,
            context_length=self.context_length.value(), backend_url=self.backend_url.text().strip() if remote else None,
            hf_endpoint=self.endpoint.text().strip() or None, theme=self.theme.currentText(),
            scheduler=self.scheduler.currentText(), mli=self.mli.isChecked(), cuda_graphs=self.cuda_graphs.isChecked(),
            index_topk_freq=self.index_topk_freq.value() or None, index_key_hot_pages=self.key_pages.value() or None,
            latent_hot_rows=self.latent_rows.value() or None, context_overflow=self.context_overflow.currentData())

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
                 lambda _: self._show_token_state("Token saved."), self._token_failed)

    def forget_token(self) -> None:
        run_task(lambda: hf_logout() if get_token() else None, lambda _: self._show_token_state("Logged out."),
                 self._token_failed)

    def _token_failed(self, exc: BaseException) -> None:
        self._show_token_state(f"Token not saved: {exc}")

    def _show_token_state(self, prefix: str = "") -> None:
        stored = get_token() is not None
        state = "A token is stored (hidden)." if stored else "No token stored: public models only."
        self.token_state.setText(f"{prefix} {state}".strip())
