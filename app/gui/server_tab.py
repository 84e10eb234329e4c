"""The Server tab: a switch that serves the OpenAI-compatible API on a port (like LM Studio's
developer tab), the URL and model name to use, and a snippet to try it.

The server is an ``ApiProxy`` in this process that forwards to the engine the chat already uses, so
no model is loaded twice and it follows model switches and engine restarts. It binds 127.0.0.1
unless the user opens it to other machines, which needs an API key (never saved to disk).
"""

from __future__ import annotations

from hearth.app.client.api_proxy import ApiProxy, Upstream
from hearth.app.gui.qt import (
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    Qt,
    QVBoxLayout,
    QWidget,
    Signal,
)
from hearth.app.gui.resources import icon
from hearth.app.store.settings import Settings

HOSTS = (("This machine only (127.0.0.1)", "127.0.0.1"), ("Other machines too (0.0.0.0, needs an API key)", "0.0.0.0"))


class ServerTab(QWidget):
    settings_changed = Signal(object)  # Settings with the port and host the server last started on

    def __init__(self, settings: Settings, upstream: Upstream, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self._upstream = upstream
        self.server: ApiProxy | None = None
        self.failed: str | None = None
        self._model: str | None = None
        layout = QVBoxLayout(self)
        layout.addWidget(self._switch_box())
        layout.addWidget(self._usage_box(), 1)
        self._show_state()

    def _switch_box(self) -> QGroupBox:
        box = QGroupBox("OpenAI-compatible API server", self)
        form = QFormLayout(box)
        self.port = QSpinBox(box)
        self.port.setRange(1, 65535)
        self.port.setValue(self.settings.api_port or 8000)
        self.port.setToolTip("The TCP port clients connect to")
        self.host = QComboBox(box)
        for label, value in HOSTS:
            self.host.addItem(label, value)
        self.host.setCurrentIndex(max(self.host.findData(self.settings.api_host), 0))
        self.api_key = QLineEdit(box)
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText("optional on this machine; clients send it as a Bearer token (not saved)")
        self.switch = QPushButton(icon("send"), "Start server", box)
        self.switch.setObjectName("primary")
        self.switch.setCheckable(True)
        self.switch.setToolTip("Serve the model the chat uses as an OpenAI-compatible API")
        self.switch.clicked.connect(self._toggle)
        self.state_label = QLabel(box)
        self.state_label.setWordWrap(True)
        self.state_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row = QHBoxLayout()
        row.addWidget(self.switch)
        row.addWidget(self.state_label, 1)
        form.addRow("Port", self.port)
        form.addRow("Reachable from", self.host)
        form.addRow("API key", self.api_key)
        form.addRow(row)
        return box

    def _usage_box(self) -> QGroupBox:
        box = QGroupBox("Try it", self)
        layout = QVBoxLayout(box)
        self.example = QPlainTextEdit(box)
        self.example.setReadOnly(True)
        self.example.setObjectName("codeExample")
        layout.addWidget(self.example)
        return box

    # ---- switching ----------------------------------------------------------------------------
    def _toggle(self) -> None:
        if self.server is None:
            self.start_server()
        else:
            self.stop_server()

    def start_server(self) -> None:
        """Listen on the chosen host and port; a taken port or a missing key shows why."""
        if self.server is not None:
            return
        host, port = self.host.currentData(), self.port.value()
        proxy = ApiProxy(self._upstream, host=host, port=port, api_key=self.api_key.text().strip() or None)
        try:
            proxy.start()
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.failed = f"Could not listen on {host}:{port}: {reason}"
            self._show_state()
            return
        self.server, self.failed = proxy, None
        if (host, port) != (self.settings.api_host, self.settings.api_port):
            self.settings = self.settings.replace(api_host=host, api_port=port)
            self.settings_changed.emit(self.settings)
        self._show_state()

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        self._show_state()

    def set_model(self, served_name: str | None) -> None:
        """The model name clients use (what the chat has loaded), or None while none is."""
        self._model = served_name
        self._show_state()

    # ---- what the tab says --------------------------------------------------------------------
    def _show_state(self) -> None:
        running = self.server is not None
        self.switch.setChecked(running)
        self.switch.setText("Stop server" if running else "Start server")
        for widget in (self.port, self.host, self.api_key):
            widget.setEnabled(not running)
        model = self._model or "(load a model in the Chat tab)"
        if running:
            assert self.server is not None
            self.state_label.setText(f"Running at <b>{self.server.url}</b> · model <b>{model}</b>")
        else:
            self.state_label.setText(self.failed or "Off. Start it to use this model from other apps.")
        self.example.setPlainText(self._example(model))

    def _example(self, model: str) -> str:
        url = self.server.url if self.server is not None else f"http://127.0.0.1:{self.port.value()}/v1"
        has_key = bool(self.api_key.text().strip())
        key = 'os.environ["HEARTH_API_KEY"]' if has_key else '"none"'
        auth = '-H "Authorization: Bearer $HEARTH_API_KEY" ' if has_key else ""
        return (f"curl {url}/chat/completions {auth}-H 'Content-Type: application/json' \\\n"
                f"  -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'\n\n"
                "from openai import OpenAI\n"
                f"client = OpenAI(base_url=\"{url}\", api_key={key})\n"
                f"client.chat.completions.create(model=\"{model}\", "
                "messages=[{\"role\": \"user\", \"content\": \"Hi\"}])\n\n"
                "Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (streaming or not). "
                "The server stops when Hearth quits.")
