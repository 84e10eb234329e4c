"""A remote backend chosen in Settings, against a real HTTP server on 127.0.0.1 (``FakeBackend``):
Test lists the models it serves, off the GUI thread, and says each reason it cannot be used under
the fields (closed port, unknown host, no answer in time, TLS, 401/403, 404, not JSON, not a model
list); changing the URL cancels a test under way; saving tests it too and its models become the chat's
choices (the API key typed into a password field is sent, and kept out of the settings file); a
backend that lists nothing is said above the chat, and a Test or Try again that succeeds loads a model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hearth.app.gui import backend_fields as fields_module
from hearth.app.gui.backend import DEMO_LABEL
from hearth.app.gui.main_window import MainWindow
from hearth.app.gui.qt import QApplication, QLineEdit, Qt
from hearth.app.gui.settings_tab import SettingsTab
from hearth.app.gui.tasks import wait_for_tasks
from hearth.app.paths import settings_path
from hearth.app.store.settings import Settings, load_settings
from tests.app.fake_backend import UNKNOWN_HOST, FakeBackend, closed_port_url, unknown_host_fails_at_once
from tests.app.test_gui_helpers import FAST_DOWNLOADS, ScriptedBackend, isolated_settings
from tests.app.test_gui_helpers import SCRIPTED_TIMEOUT_MS as TIMEOUT_MS

LEFT = Qt.MouseButton.LeftButton


def _picker_labels(window) -> list[str]:
    picker = window.chat.model_picker
    return [picker.itemText(i) for i in range(picker.count())]


def _test(qtbot, fields, url: str, key: str = "") -> str:
    """Type ``url`` and ``key``, press Test and wait for its answer under the fields."""
    fields.url.setText(url)
    fields.api_key.setText(key)
    qtbot.mouseClick(fields.test_button, LEFT)
    qtbot.waitUntil(lambda: not fields.is_testing, timeout=TIMEOUT_MS)
    assert not fields.result.isHidden()
    return fields.result.text()


def test_a_remote_backend_is_tested_off_the_gui_thread_and_its_models_become_the_chat_choices(
        qtbot, open_scripted_window):
    window = open_scripted_window()  # the local engine, serving the demo
    tab, fields = window.settings_tab, window.settings_tab.backend_fields
    assert fields.api_key.echoMode() == QLineEdit.EchoMode.Password
    assert not fields.url.isEnabled() and not fields.test_button.isEnabled()  # local: nothing to test
    with FakeBackend(api_key="sekret", answer="slow", delay_s=2.0) as backend:
        fields.kind.setCurrentIndex(1)
        qtbot.keyClicks(fields.url, backend.url)
        qtbot.keyClicks(fields.api_key, "sekret")
        started = time.monotonic()
        qtbot.mouseClick(fields.test_button, LEFT)
        assert time.monotonic() - started < 1.0  # the server takes 2 s: the GUI thread did not wait for it
        assert fields.result.text() == f"Testing {backend.url}…" and not fields.test_button.isEnabled()
        qtbot.waitUntil(lambda: not fields.is_testing, timeout=TIMEOUT_MS)
        assert fields.result.text() == f"Connected: {backend.url} serves 2 models: alpha, beta"
        assert fields.result.objectName() == "okLabel" and fields.test_button.isEnabled()
        assert _picker_labels(window) == [DEMO_LABEL]  # not saved: the chat still uses the local engine

        backend.answer = "models"
        qtbot.mouseClick(tab.save_button, LEFT)
        assert tab.status_label.text() == "Saved."
        qtbot.waitUntil(lambda: window.chat.connected is not None and window.chat.connected.choice.label == "alpha",
                        timeout=TIMEOUT_MS)
        assert _picker_labels(window) == ["alpha", "beta"] and window.backend.loads == [DEMO_LABEL, "alpha"]
        qtbot.waitUntil(lambda: not fields.is_testing, timeout=TIMEOUT_MS)  # (saving tests it too)
        assert fields.result.text() == f"Connected: {backend.url} serves 2 models: alpha, beta"
        assert [r[1:] for r in backend.requests] == [("/v1/models", "Bearer sekret")] * len(backend.requests)
        assert len(backend.requests) >= 3  # Test, the window's listing and the test on save
    saved = load_settings()
    assert (saved.backend_url, saved.backend_api_key) == (backend.url, "sekret")
    assert "sekret" not in settings_path().read_text()


def test_every_reason_a_backend_cannot_be_used_is_said_under_its_fields(qtbot, windows, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fields_module, "PROBE_TIMEOUT_S", 0.5)  # (the "slow" server keeps it waiting 30 s)
    tab = windows.track(SettingsTab(Settings()))
    fields = tab.backend_fields
    fields.kind.setCurrentIndex(1)
    closed = closed_port_url()
    assert _test(qtbot, fields, closed).startswith(f"Connection refused: cannot connect to {closed[:-3]}: nothing "
                                                   "is listening there (connection refused)")
    assert fields.result.objectName() == "errorLabel"
    unknown_host_fails_at_once(monkeypatch)
    assert _test(qtbot, fields, f"http://{UNKNOWN_HOST}:8000/v1").startswith(
        f"Host not found: cannot connect to http://{UNKNOWN_HOST}:8000: the host name {UNKNOWN_HOST} was not found")
    with FakeBackend(api_key="sekret", delay_s=30) as backend:
        url = backend.url
        cases = [
            ("models", "", "API key missing or refused: the server needs an API key: Missing API key (HTTP 401)"),
            ("models", "wrong", "API key missing or refused: the server refused the API key: Invalid API key "
             "(HTTP 401)"),
            ("forbidden", "sekret", "API key missing or refused: the server does not allow this API key here: this "
             "key may not list models (HTTP 403)"),
            ("missing", "sekret", f"Not an OpenAI-compatible API: {url}/models does not exist (HTTP 404): the "
             "address is not an OpenAI-compatible API"),
            ("html", "sekret", f"Not an OpenAI-compatible API (not JSON): {url}/models answered with something that "
             "is not JSON (text/html)"),
            ("not_openai", "sekret", f"Not an OpenAI-compatible API: {url}/models answered JSON without a model list"),
            ("slow", "sekret", f"No answer in time: {backend.root} did not answer in time (ReadTimeout)"),
        ]
        for answer, key, words in cases:
            backend.answer = answer
            said = _test(qtbot, fields, url, key)
            assert said.startswith(words), (answer, said)
            assert fields.result.objectName() == "errorLabel"
        assert _test(qtbot, fields, url.replace("http://", "https://"), "sekret").startswith(
            f"TLS error: cannot connect to {backend.root.replace('http://', 'https://')}: the TLS (https) handshake "
            "failed")
    with FakeBackend(tls=True) as tls:
        assert _test(qtbot, fields, tls.url).startswith(f"TLS error: cannot connect to {tls.root}: its TLS "
                                                        "certificate is not trusted")
    fields.url.setText("ftp://gpu-box/v1")
    qtbot.mouseClick(fields.test_button, LEFT)
    assert fields.result.text().startswith("Not tested: backend_url must be an http(s) URL")
    fields.url.clear()
    qtbot.mouseClick(fields.test_button, LEFT)
    assert fields.result.text() == "Not tested: Give the server's address first, such as http://host:8000/v1"


def test_changing_the_url_cancels_a_test_under_way(qtbot, windows):
    tab = windows.track(SettingsTab(Settings()))
    fields = tab.backend_fields
    listed: list[tuple] = []
    fields.models_listed.connect(lambda *args: listed.append(args))
    fields.kind.setCurrentIndex(1)
    with FakeBackend(answer="slow", delay_s=1.0) as backend:
        fields.url.setText(backend.url)
        qtbot.mouseClick(fields.test_button, LEFT)
        assert fields.is_testing and fields.result.text() == f"Testing {backend.url}…"
        qtbot.keyClick(fields.url, Qt.Key.Key_Backspace)  # ".../v" now: the test no longer answers for it
        assert not fields.is_testing and fields.result.isHidden() and fields.test_button.isEnabled()
        qtbot.waitUntil(lambda: backend.answered == 1, timeout=TIMEOUT_MS)  # the server did answer the models
        assert wait_for_tasks(10_000)
        QApplication.processEvents()  # (its answer, queued to the GUI thread, arrives now)
        assert fields.result.isHidden() and listed == []

        backend.answer = "models"
        assert _test(qtbot, fields, backend.root) == f"Connected: {backend.root} serves 2 models: alpha, beta"
        assert listed == [(backend.root, None, ["alpha", "beta"])]


def _remote_window(qtbot, windows, tmp_path: Path, url: str) -> MainWindow:
    window = MainWindow(isolated_settings(tmp_path, backend_url=url), backend=ScriptedBackend(),
                        download_options=FAST_DOWNLOADS)
    windows.track(window)
    qtbot.waitUntil(window.load_banner.isVisible, timeout=TIMEOUT_MS)
    return window


def test_a_backend_that_lists_no_model_is_said_above_the_chat_and_a_test_that_lists_some_loads_one(
        qtbot, windows, tmp_path: Path):
    with FakeBackend(answer="missing") as backend:
        window = _remote_window(qtbot, windows, tmp_path, backend.url)
        why = f"Could not list the models of {backend.url}: {backend.url}/models does not exist (HTTP 404)"
        assert window.load_banner.label.text().startswith(why) and window.chat.connected is None
        assert _picker_labels(window) == [] and window.backend.loads == []
        assert window.status.engine_label.text() == "Engine: no model: the remote backend listed none"
        fields = window.settings_tab.backend_fields  # the window's answer is said in Settings as well
        assert fields.result.text().startswith(f"Not an OpenAI-compatible API: {backend.url}/models does not exist")

        backend.answer = "models"  # fixed on the server; Settings' Test of the saved backend finds it
        window.show_view("settings")
        qtbot.mouseClick(fields.test_button, LEFT)
        qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=TIMEOUT_MS)
        assert window.chat.connected.choice.label == "alpha" and _picker_labels(window) == ["alpha", "beta"]
        assert not window.load_banner.isVisible()


def test_try_again_asks_a_remote_backend_for_its_models_again(qtbot, windows, tmp_path: Path):
    with FakeBackend(models=("gamma",), answer="html") as backend:
        window = _remote_window(qtbot, windows, tmp_path, backend.url)
        assert "answered with something that is not JSON (text/html)" in window.load_banner.label.text()
        backend.answer = "models"
        qtbot.mouseClick(window.load_banner.retry_button, LEFT)
        qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=TIMEOUT_MS)
        assert window.chat.connected.choice.label == "gamma" and window.backend.loads == ["gamma"]
        assert window.load_banner.isHidden()
