"""The Server tab's API switch (an OpenAI-compatible endpoint forwarding to the chat's engine host,
checked with the openai client), the status bar's message label, and labels on every button; against
the real demo model in a real engine host."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import openai
import pytest

from hearth.app.gui.main_window import MainWindow
from hearth.app.gui.qt import QAbstractButton, QLineEdit, QSizePolicy
from hearth.app.store.settings import load_settings
from tests.app.test_gui_helpers import (
    FAST_DOWNLOADS,
    isolated_settings,
    link_demo_model,
    windows_checked,
)

TIMEOUT_MS = 60_000


@pytest.fixture
def window(qtbot, backend, engine_home: Path, tmp_path: Path):
    link_demo_model(engine_home)
    with windows_checked() as windows:
        win = MainWindow(isolated_settings(tmp_path, api_port=free_port()), backend=backend,
                         download_options=FAST_DOWNLOADS)
        windows.track(win)
        qtbot.waitUntil(lambda: win.chat.connected is not None, timeout=TIMEOUT_MS)
        yield win


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_switch_serves_the_chat_model_to_openai_clients(qtbot, window: MainWindow):
    tab = window.server_tab
    port = tab.port.value()
    assert tab.switch.text() == "Start server" and "Off" in tab.state_label.text()
    tab.switch.click()
    url = f"http://127.0.0.1:{port}/v1"
    assert tab.server is not None and url in tab.state_label.text() and tab.switch.text() == "Stop server"
    model = window.connected.server_name
    assert model in tab.state_label.text() and url in tab.example.toPlainText()

    client = openai.OpenAI(base_url=url, api_key="none")
    assert [m.id for m in client.models.list()] == [model]
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert answer.choices[0].message.content and answer.usage.completion_tokens >= 1
    streamed = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    # Hearth's control routes are not reachable through it, and a foreign Host header is refused
    assert httpx.post(f"http://127.0.0.1:{port}/hearth/unload").status_code == 404
    rebound = httpx.get(f"{url}/models", headers={"Host": "evil.example:80"})
    assert rebound.status_code == 403
    assert load_settings().api_port == port  # remembered for next time

    tab.switch.click()
    assert tab.server is None and tab.switch.text() == "Start server"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/models")


def test_server_switch_with_an_api_key_and_a_taken_port(qtbot, window: MainWindow):
    tab = window.server_tab
    tab.api_key.setText("s3cret")
    tab.start_server()
    url = tab.server.url
    assert httpx.get(f"{url}/models").status_code == 401
    assert httpx.get(f"{url}/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    tab.stop_server()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        tab.port.setValue(taken.getsockname()[1])
        tab.start_server()
    assert tab.server is None and "Could not listen on 127.0.0.1" in tab.state_label.text()

    tab.api_key.clear()
    tab.host.setCurrentIndex(tab.host.findData("0.0.0.0"))
    tab.start_server()
    assert tab.server is None and "API key" in tab.state_label.text()


def test_status_messages_do_not_cover_the_engine_state(qtbot, window: MainWindow):
    status = window.status
    engine_text = status.engine_label.text()
    status.showMessage("Could not list models: " + "a very long reason " * 20, 10_000)
    assert status.message_label.text().startswith("Could not list models")
    assert status.engine_label.isVisible() and status.engine_label.text() == engine_text
    # the message label gives way to the engine state instead of running under it
    assert status.message_label.sizePolicy().horizontalPolicy() == QSizePolicy.Policy.Ignored
    assert status.message_label.geometry().right() < status.engine_label.geometry().left()
    status.clearMessage()
    assert status.currentMessage() == ""


def test_context_meter_label_sits_beside_the_bar(qtbot, window: MainWindow):
    meter = window.chat.context_meter
    assert not meter.bar.isTextVisible() and meter.text().startswith("context ")
    assert meter.label.geometry().left() >= meter.bar.geometry().right()


def test_every_button_has_a_label_or_a_tooltip_and_a_name(qtbot, window: MainWindow):
    for index in range(window.tabs.count()):
        window.tabs.setCurrentIndex(index)
        for button in window.findChildren(QAbstractButton):
            # Qt's own buttons (qt_*: a table's corner, the tab bar's scroll arrows; a line edit's actions)
            parent = button.parent()
            qt_own = button.objectName().startswith("qt_") or parent.objectName().startswith("qt_")
            if button.text().strip() or qt_own or isinstance(parent, QLineEdit):
                continue
            where = f"{button.objectName() or type(button).__name__} in {button.parent()}"
            assert button.toolTip(), f"an icon-only button has no tooltip: {where}"
            assert button.accessibleName(), f"an icon-only button has no accessible name: {where}"
