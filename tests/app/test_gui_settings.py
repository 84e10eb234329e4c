"""The Settings tab's chat, models-folder, download and engine-number settings on real widgets:
the send key (Enter or Ctrl+Enter) saved and applied to the message box at once; the models folder
chosen in a file dialog, checked, and used by the Models tab and the chat's model list without a
restart; offline mode and parallel downloads taking effect when saved; and values that cannot be
saved said under their fields, in red, with nothing saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from hearth.app.gui import settings_tab as settings_module
from hearth.app.gui.qt import Qt
from hearth.app.gui.settings_tab import SettingsTab
from hearth.app.paths import settings_path
from hearth.app.store.settings import Settings, load_settings
from tests.app.conftest import TINY_REPO
from tests.app.fakehub import FakeHub
from tests.app.test_gui_helpers import SCRIPTED_TIMEOUT_MS as TIMEOUT_MS
from tests.app.test_gui_helpers import finish

CTRL = Qt.KeyboardModifier.ControlModifier
LEFT = Qt.MouseButton.LeftButton


def _shown(label) -> bool:
    return not label.isHidden() and bool(label.text())


def _picker_labels(window) -> list[str]:
    picker = window.chat.model_picker
    return [picker.itemText(i) for i in range(picker.count())]


def _search(qtbot, window, query: str) -> None:
    models = window.models_tab
    models.query_edit.setText(query)
    qtbot.mouseClick(models.search_button, LEFT)
    qtbot.waitUntil(models.search_button.isEnabled, timeout=TIMEOUT_MS)


# ---- the send key ------------------------------------------------------------------------------

def test_the_send_key_is_saved_and_applies_to_the_message_box_at_once(qtbot, open_scripted_window):
    window = open_scripted_window()
    chat, tab, composer = window.chat, window.settings_tab, window.chat.composer
    assert composer.placeholderText() == "Message the model (Enter to send, Shift+Enter for a new line, Esc to stop)"
    assert tab.send_key.currentText() == "Enter to send, Shift+Enter for a new line"
    tab.send_key.setCurrentIndex(tab.send_key.findData("ctrl+enter"))
    assert tab.send_key.currentText() == "Ctrl+Enter to send, Enter for a new line"
    qtbot.mouseClick(tab.save_button, LEFT)
    assert tab.status_label.text() == "Saved." and load_settings().send_key == "ctrl+enter"

    assert composer.placeholderText() == "Message the model (Ctrl+Enter to send, Enter for a new line, Esc to stop)"
    assert composer.toolTip().startswith("Ctrl+Enter sends; Enter starts a new line")
    assert chat.send_button.toolTip() == "Send (Ctrl+Enter)"
    assert chat.view._placeholder.text().startswith("Start the conversation: type below and press Ctrl+Enter "
                                                    "(Enter starts a new line).")
    window.show_view("chat")
    qtbot.keyClicks(composer, "first paragraph")
    qtbot.keyClick(composer, Qt.Key.Key_Return)
    qtbot.keyClicks(composer, "second")
    qtbot.keyClick(composer, Qt.Key.Key_Enter, Qt.KeyboardModifier.KeypadModifier)
    qtbot.keyClicks(composer, "third")
    qtbot.keyClick(composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(composer, "fourth")
    assert composer.toPlainText() == "first paragraph\nsecond\nthird\nfourth" and not chat.is_busy
    qtbot.keyClick(composer, Qt.Key.Key_Return, CTRL)
    assert chat.is_busy and composer.toPlainText() == ""
    finish(qtbot, window)
    assert window.store.thread(chat.conversation_id)[0].content == "first paragraph\nsecond\nthird\nfourth"

    tab.send_key.setCurrentIndex(tab.send_key.findData("enter"))  # and back: Enter sends again
    tab.save()
    qtbot.keyClicks(composer, "short one")
    qtbot.keyClick(composer, Qt.Key.Key_Return)
    assert chat.is_busy and composer.toPlainText() == "" and chat.send_button.toolTip() == "Send (Enter)"
    finish(qtbot, window)


def test_the_settings_tab_shows_the_saved_send_key(qtbot, windows):
    Path(settings_path()).parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text('{"send_key": "ctrl+enter"}')
    tab = windows.track(SettingsTab(load_settings()))
    assert tab.send_key.currentData() == "ctrl+enter"
    assert tab.edited().send_key == "ctrl+enter"


# ---- the models folder, offline mode, parallel downloads -------------------------------------

def test_the_models_folder_is_used_for_downloads_and_the_installed_list_without_a_restart(
        qtbot, open_scripted_window, fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    window = open_scripted_window(hf_endpoint=fake_hub.url, offline=False)
    tab, models = window.settings_tab, window.models_tab
    old = Path(window.settings.hf_cache_dir)
    new = tmp_path / "big-disk" / "models"
    new.mkdir(parents=True)
    asked: list[str] = []

    def pick(_parent, caption: str, start: str) -> str:
        asked.append(caption)
        return str(new)

    monkeypatch.setattr(settings_module.QFileDialog, "getExistingDirectory", pick)
    qtbot.mouseClick(tab.models_folder_button, LEFT)
    assert asked == ["Models folder"] and tab.models_folder.text() == str(new)
    qtbot.mouseClick(tab.save_button, LEFT)
    assert tab.status_label.text() == "Saved." and load_settings().hf_cache_dir == str(new)

    _search(qtbot, window, "tiny")  # a download goes to the new folder
    row = next(r for r in range(models.results.rowCount()) if models.results.item(r, 0).text() == TINY_REPO)
    models.results.selectRow(row)
    qtbot.waitUntil(models.download_button.isEnabled, timeout=TIMEOUT_MS)
    qtbot.mouseClick(models.download_button, LEFT)
    qtbot.waitUntil(lambda: models.installed_table.rowCount() == 1, timeout=TIMEOUT_MS)
    assert (new / "models--hearth-test--tiny-deepseek").is_dir() and not old.exists()
    qtbot.waitUntil(lambda: TINY_REPO in _picker_labels(window), timeout=TIMEOUT_MS)

    tab.models_folder.setText(str(old))  # the old folder has none: the lists say so at once
    tab.save()
    qtbot.waitUntil(lambda: models.installed_table.rowCount() == 0, timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: TINY_REPO not in _picker_labels(window), timeout=TIMEOUT_MS)
    tab.models_folder.setText(str(new))  # and back: listed from there again, nothing downloaded
    requests = len(fake_hub.requests)
    tab.save()
    qtbot.waitUntil(lambda: models.installed_table.rowCount() == 1, timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: TINY_REPO in _picker_labels(window), timeout=TIMEOUT_MS)
    assert len(fake_hub.requests) == requests


def test_a_models_folder_hearth_cannot_use_is_said_under_it_and_not_saved(qtbot, windows, tmp_path: Path):
    tab = windows.track(SettingsTab(Settings()))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    tab.models_folder.setText(str(a_file))
    tab.save()
    assert _shown(tab.models_folder_error) and tab.models_folder_error.text() == f"{a_file} is a file, not a folder"
    assert tab.status_label.text() == f"Not saved: {a_file} is a file, not a folder"
    assert not settings_path().exists()
    tab.models_folder.setText("models")
    tab.save()
    assert "models is not an absolute path" in tab.models_folder_error.text() and not settings_path().exists()

    tab.models_folder.clear()
    qtbot.keyClicks(tab.models_folder, str(tmp_path / "new" / "models"))  # typing clears the complaint
    assert tab.models_folder_error.isHidden()
    tab.save()
    assert tab.status_label.text() == "Saved." and tab.models_folder_error.isHidden()
    assert load_settings().hf_cache_dir == str(tmp_path / "new" / "models")
    assert (tmp_path / "new" / "models").is_dir()  # made now, so a download's disk check finds it


def test_offline_mode_and_parallel_downloads_take_effect_when_saved(qtbot, open_scripted_window, fake_hub: FakeHub):
    window = open_scripted_window(hf_endpoint=fake_hub.url, offline=False)
    tab, models = window.settings_tab, window.models_tab
    assert not tab.offline.isChecked() and tab.download_parallelism.value() == Settings().download_parallelism
    assert "installed models still load" in tab.offline_hint.text()
    tab.offline.setChecked(True)
    tab.download_parallelism.setValue(2)
    qtbot.mouseClick(tab.save_button, LEFT)
    saved = load_settings()
    assert saved.offline and saved.download_parallelism == 2
    assert models.manager.ctx.parallelism == 2  # the download queue was rebuilt with the new settings

    asked = len([r for r in fake_hub.requests if r.path == "/api/models"])
    _search(qtbot, window, "tiny")
    assert "Offline mode is on" in models.results_label.text() and models.results.rowCount() == 0
    assert len([r for r in fake_hub.requests if r.path == "/api/models"]) == asked  # the Hub was not contacted

    tab.offline.setChecked(False)
    tab.save()
    _search(qtbot, window, "tiny")
    assert models.results_label.text().startswith("<b>Search results</b>")
    assert TINY_REPO in [models.results.item(r, 0).text() for r in range(models.results.rowCount())]


# ---- numbers out of range ------------------------------------------------------------------------

def test_a_number_out_of_range_is_said_under_its_box_and_not_saved(qtbot, windows):
    tab = windows.track(SettingsTab(Settings()))
    parallel = tab.row("max_num_seqs")  # the engine's parallel requests, under the CLI's key
    box = parallel.editor
    box.selectAll()
    qtbot.keyClicks(box, "0")
    assert _shown(parallel.error)
    assert parallel.error.text() == "“0” is not allowed: Parallel requests takes a whole number 1 or more."
    tab.save()
    assert tab.status_label.text() == f"Not saved: {parallel.error.text()}" and not settings_path().exists()

    qtbot.keyClick(box, Qt.Key.Key_Return)  # Qt puts the old number back: said, and that save is refused too
    assert box.value() == Settings().engine.max_num_seqs and _shown(parallel.error)
    assert parallel.error.text().endswith(f"It was set back to {Settings().engine.max_num_seqs}.")
    tab.save()
    assert tab.status_label.text().startswith("Not saved: “0” is not allowed") and not settings_path().exists()
    tab.save()  # said once: now what the box shows is saved
    assert tab.status_label.text() == "Saved." and parallel.error.isHidden()

    box.selectAll()
    qtbot.keyClicks(box, "3")
    assert parallel.error.isHidden()
    context = tab.row("max_model_len")
    context.editor.selectAll()
    qtbot.keyClicks(context.editor, "0")  # below the "auto" that stands for the model's own length
    assert context.error.text() == ("“0” is not allowed: Context length takes a whole number 2 or more tokens, "
                                    "or auto.")
    context.editor.selectAll()
    qtbot.keyClicks(context.editor, "32768")
    disk = tab.row("prefix_cache_disk_gib")  # in range for the box, but the engine takes no 0 GiB cache
    disk.editor.setValue(0.0)
    tab.save()
    assert disk.error.text() == "Chat cache on disk: prefix_cache_disk_gib must be > 0." and _shown(disk.error)
    assert tab.status_label.text() == f"Not saved: {disk.error.text()}"
    assert load_settings().engine.max_num_seqs == Settings().engine.max_num_seqs  # (the file holds the last save)
    disk.editor.setValue(8.0)
    tab.save()
    assert tab.status_label.text() == "Saved." and context.error.isHidden()
    assert load_settings().engine.max_num_seqs == 3 and load_settings().context_length == 32768


def test_a_bad_mirror_url_is_said_under_its_field(qtbot, windows):
    tab = windows.track(SettingsTab(Settings()))
    tab.endpoint.setText("hf-mirror.com")
    tab.save()
    assert _shown(tab.endpoint_error) and "hf_endpoint must be an http(s) URL" in tab.endpoint_error.text()
    assert tab.status_label.text().startswith("Not saved: hf_endpoint must be") and not settings_path().exists()
    tab.endpoint.setText("https://hf-mirror.com")
    tab.save()
    assert tab.endpoint_error.isHidden() and load_settings().hf_endpoint == "https://hf-mirror.com"
