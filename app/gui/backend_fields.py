"""The Settings tab's backend rows: the local engine, or a remote OpenAI-compatible server (its URL
and an optional API key, typed into a password field), with a Test button.

A test (the button, and Settings' save) asks the server which models it serves (``probe_models``:
``GET …/v1/models`` with a short timeout) on the thread pool, never on the GUI thread, and says the
answer under the fields: the models, or why there are none: nothing listening, a host name that
does not resolve, no answer in time, a TLS failure, an API key missing or refused, an address that
is no OpenAI API, an answer that is not JSON. Changing the URL or the key cancels a test under way:
its answer is dropped when it comes (the request itself ends by its timeout). A test that lists
models emits ``models_listed``; the main window makes them the chat's choices when they are the
saved backend's.
"""

from __future__ import annotations

from hearth.app.client.openai_client import PROBE_TIMEOUT_S, ClientError, probe_models
from hearth.app.gui.option_row import error_label, field_column, field_row, setting_problem, show_error
from hearth.app.gui.qt import (
    QComboBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QObject,
    QPushButton,
    Qt,
    QWidget,
    Signal,
)
from hearth.app.gui.tasks import run_task
from hearth.app.store.settings import Settings

KINDS = ("Local engine (this machine)", "Remote backend (OpenAI-compatible URL)")
SHOWN_NAMES = 6  # model names listed in the result line; the rest are counted
# What went wrong, first in the result line (ClientError.kind -> words).
HEADLINES = {
    "refused": "Connection refused", "dns": "Host not found", "timeout": "No answer in time", "tls": "TLS error",
    "connect": "Cannot connect", "auth": "API key missing or refused", "not_found": "Not an OpenAI-compatible API",
    "http": "The server answered with an error", "not_json": "Not an OpenAI-compatible API (not JSON)",
    "not_openai": "Not an OpenAI-compatible API",
}


class BackendFields(QObject):
    """The backend's rows, added to ``form``: ``kind`` (local or remote), ``url``, ``api_key``,
    ``test_button`` and ``result`` (the last test's answer)."""

    models_listed = Signal(str, object, object)  # url, API key (None: none), the model names

    def __init__(self, form: QFormLayout, parent: QWidget) -> None:
        super().__init__(parent)
        self.kind = QComboBox(parent)
        self.kind.addItems(KINDS)
        self.url = QLineEdit(parent)
        self.url.setPlaceholderText("http://host:8000/v1")
        self.url.setAccessibleName("Backend URL")
        self.url_error = error_label(parent)
        self.test_button = QPushButton("Test", parent)
        self.test_button.setToolTip(f"Ask the server which models it serves (GET …/v1/models, at most "
                                    f"{PROBE_TIMEOUT_S:g} s)")
        self.api_key = QLineEdit(parent)
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setAccessibleName("API key")
        self.api_key.setPlaceholderText("optional: sent as a Bearer token; kept apart from the settings file")
        self.api_key_error = error_label(parent)
        self.result = QLabel(parent)
        self.result.setWordWrap(True)
        self.result.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.result.hide()
        form.addRow("Backend", self.kind)
        form.addRow("Backend URL", field_column(parent, field_row(parent, self.url, self.test_button), self.url_error))
        form.addRow("API key", field_column(parent, self.api_key, self.api_key_error, self.result))
        self._test_id = 0  # drops the answers of tests cancelled since
        self._testing: tuple[str, str | None] | None = None  # (url, key) of the test under way
        self.kind.currentIndexChanged.connect(self._kind_changed)
        self.url.textChanged.connect(self._edited)
        self.api_key.textChanged.connect(self._edited)
        self.test_button.clicked.connect(self.test)

    @property
    def is_remote(self) -> bool:
        return self.kind.currentIndex() == 1

    @property
    def is_testing(self) -> bool:
        return self._testing is not None

    def show_settings(self, settings: Settings) -> None:
        self.kind.setCurrentIndex(1 if settings.backend_url else 0)
        self.url.setText(settings.backend_url or "")
        self.api_key.setText(settings.backend_api_key or "")
        self._kind_changed(self.kind.currentIndex())
        show_error(self.url_error, None)
        show_error(self.api_key_error, None)

    def values(self) -> tuple[str | None, str | None]:
        """(backend_url, backend_api_key) as the fields show them; the URL is None for the local
        engine. The key is kept either way (switching back to the remote backend finds it)."""
        url = self.url.text().strip()
        return (url if self.is_remote and url else None), self.api_key.text().strip() or None

    def problems(self) -> list[str]:
        """Why the fields cannot be saved (each also said under its field)."""
        url, key = self.values()
        found = []
        for label, change in ((self.url_error, {"backend_url": url}), (self.api_key_error, {"backend_api_key": key})):
            problem = setting_problem(**change)
            show_error(label, problem)
            if problem:
                found.append(problem)
        return found

    # ---- the test ---------------------------------------------------------------------------
    def test(self) -> None:
        """Ask the URL the fields show for its models, off the GUI thread; the answer is shown under
        the fields. A test of the same URL and key already under way is not started again."""
        url, key = self.url.text().strip(), self.api_key.text().strip() or None
        if not self._untestable(url, key) and self._testing != (url, key):
            self._test_id += 1
            test_id, self._testing = self._test_id, (url, key)
            self._say(f"Testing {url}…", "hintLabel")
            self.test_button.setEnabled(False)
            run_task(lambda: probe_models(url, key, PROBE_TIMEOUT_S),
                     lambda names: self._tested(test_id, url, key, names),
                     lambda exc: self._tested(test_id, url, key, exc), owner=self)

    def _untestable(self, url: str, key: str | None) -> bool:
        """Say why ``url`` and ``key`` cannot be tested; True when they cannot."""
        problem = setting_problem(backend_url=url or None, backend_api_key=key) if url else (
            "Give the server's address first, such as http://host:8000/v1")
        if problem:
            self._cancel()
            self._say(f"Not tested: {problem}", "errorLabel")
        return problem is not None

    def show_result(self, url: str, api_key: str | None, result: list[str] | BaseException) -> None:
        """Show what another asker (the main window, listing the saved backend's models) got, when
        the fields still show that backend and no test of their own is under way."""
        if not self.is_testing and (self.url.text().strip(), self.api_key.text().strip() or None) == (url, api_key):
            self._show(url, result)

    def _tested(self, test_id: int, url: str, key: str | None, result: list[str] | BaseException) -> None:
        if test_id != self._test_id:
            return  # cancelled: the URL or the key changed since
        self._testing = None
        self.test_button.setEnabled(self.is_remote)
        self._show(url, result)
        if isinstance(result, list):
            self.models_listed.emit(url, key, result)

    def _show(self, url: str, result: list[str] | BaseException) -> None:
        if isinstance(result, BaseException):
            headline = HEADLINES.get(getattr(result, "kind", None) or "", "Test failed")
            detail = str(result) if isinstance(result, ClientError) else f"{type(result).__name__}: {result}"
            self._say(f"{headline}: {detail}", "errorLabel")
        elif not result:
            self._say(f"Connected, but {url} serves no model.", "errorLabel")
        else:
            names = ", ".join(result[:SHOWN_NAMES]) + (f" and {len(result) - SHOWN_NAMES} more"
                                                       if len(result) > SHOWN_NAMES else "")
            count = f"{len(result)} model{'s' if len(result) != 1 else ''}"
            self._say(f"Connected: {url} serves {count}: {names}", "okLabel")

    def _say(self, text: str, style: str) -> None:
        self.result.setObjectName(style)  # errorLabel is red, okLabel green, in both themes
        self.result.style().unpolish(self.result)  # (the stylesheet's #name rules apply anew)
        self.result.style().polish(self.result)
        self.result.setText(text)
        self.result.setToolTip(text)
        self.result.setVisible(bool(text))

    def _edited(self) -> None:
        """The URL or the key changed: a test under way no longer answers for them, nor does the last."""
        self._cancel()
        self._say("", "hintLabel")
        show_error(self.url_error, None)
        show_error(self.api_key_error, None)

    def _cancel(self) -> None:
        if self._testing is not None:
            self._test_id += 1
            self._testing = None
        self.test_button.setEnabled(self.is_remote)

    def _kind_changed(self, index: int) -> None:
        remote = index == 1
        for widget in (self.url, self.api_key):
            widget.setEnabled(remote)
        self._edited()
