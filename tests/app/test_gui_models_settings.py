"""The Models tab against the fake Hub (search, details with sizes and fit, a download with
progress, pause/resume, delete, import; no Download for repos Hearth cannot run; a failure's
reason in full and Resume only when there is something to continue; questions before deleting
files; an unreachable Hub fails a search at once, in the results area) and the Settings tab
(persisted across a restart; the Hugging Face token goes to the library's login store, never to
Hearth's settings)."""

from __future__ import annotations

import html
import logging
import socket
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from hearth.app.gui import settings_tab as settings_module
from hearth.app.gui.downloads_view import TOKEN_HINT
from hearth.app.gui.models_tab import ModelsTab
from hearth.app.gui.qt import QMessageBox, QPushButton, Qt
from hearth.app.gui.settings_tab import SettingsTab
from hearth.app.hub import events as ev
from hearth.app.hub.manager import DownloadOptions
from hearth.app.paths import settings_path
from hearth.app.store.settings import Settings, load_settings
from tests.app.conftest import GATED_REPO, TINY_REPO, add_unloadable_repos, write_tiny_model
from tests.app.fakehub import FakeHub, Fault
from tests.app.test_gui_helpers import FAST_DOWNLOADS, answer_next_question

TIMEOUT_MS = 20_000


@pytest.fixture
def models_tab(qtbot, settings: Settings, windows):
    tab = ModelsTab(settings, options=FAST_DOWNLOADS)
    windows.track(tab)
    yield tab
    tab.close_manager()


def _row_of(table, text: str) -> int:
    rows = [r for r in range(table.rowCount()) if table.item(r, 0).text() == text]
    assert rows, f"{text} not in the table"
    return rows[0]


def _open_details(qtbot, tab: ModelsTab, query: str = "tiny") -> None:
    tab.query_edit.setText(query)
    tab.sort_combo.setCurrentText("likes")
    qtbot.mouseClick(tab.search_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: tab.results.rowCount() > 0 and tab.search_button.isEnabled(), timeout=TIMEOUT_MS)
    tab.results.selectRow(_row_of(tab.results, TINY_REPO))
    qtbot.waitUntil(tab.download_button.isEnabled, timeout=TIMEOUT_MS)


def _wrapped_text_fits(table, row: int, column: int) -> bool:
    """Whether the cell's text, wrapped at its column's width, fits the row's height."""
    from hearth.app.gui.qt import QRect

    text = table.item(row, column).text()
    needed = table.fontMetrics().boundingRect(QRect(0, 0, table.columnWidth(column) - 8, 100_000),
                                              Qt.TextFlag.TextWordWrap, text)
    return table.rowHeight(row) >= needed.height()


def test_search_details_and_fit(qtbot, models_tab: ModelsTab):
    _open_details(qtbot, models_tab)
    files = {models_tab.files_table.item(r, 0).text(): models_tab.files_table.item(r, 1).text()
             for r in range(models_tab.files_table.rowCount())}
    assert files["model.safetensors"].endswith("kB") and "config.json" in files
    # only what pull fetches: no pickle, no README; the button says how much that is
    assert set(files) == {"config.json", "model.safetensors", "tokenizer.json"}
    total_kb = models_tab.details.download_bytes() / 1000
    assert models_tab.download_button.text() == f"Download {total_kb:.1f} kB (3 files)"
    assert models_tab.fit_label.text().startswith("Fit: runs")
    assert TINY_REPO in models_tab.details_label.text()
    row = _row_of(models_tab.results, TINY_REPO)
    assert models_tab.results.horizontalHeaderItem(2).text() == "Size"
    assert models_tab.results.item(row, 2).text().endswith("kB")  # from the Hub's safetensors counts


def test_opens_on_recommendations_rated_for_this_machine(qtbot, models_tab: ModelsTab):
    qtbot.waitUntil(lambda: "Recommended for this machine" in models_tab.results_label.text(), timeout=TIMEOUT_MS)
    headers = [models_tab.results.horizontalHeaderItem(c).text() for c in range(models_tab.results.columnCount())]
    assert headers == ["Repository", "Type", "Size", "Fit here"]
    verdicts = [models_tab.results.item(r, 3).text() for r in range(models_tab.results.rowCount())]
    assert models_tab.results.rowCount() >= 5 and all(v.startswith(("runs", "does not fit")) for v in verdicts)
    fitting = [v for v in verdicts if v != "does not fit"]
    assert verdicts[:len(fitting)] == fitting  # the ones that fit come first
    assert f"{len(fitting)} of {len(verdicts)} fit here" in models_tab.results_label.text()
    repos = [models_tab.results.item(r, 0).text() for r in range(models_tab.results.rowCount())]
    assert "deepseek-ai/DeepSeek-V3.2" in repos


def test_download_is_bound_to_the_repo_shown_and_gated_repos_name_their_type(qtbot, models_tab: ModelsTab):
    _open_details(qtbot, models_tab, "hearth-test")
    models_tab.results.selectRow(_row_of(models_tab.results, GATED_REPO))
    assert not models_tab.download_button.isEnabled()  # not the previous repo while this one loads
    models_tab.download_selected()
    assert models_tab.manager.items() == []
    qtbot.waitUntil(models_tab.download_button.isEnabled, timeout=TIMEOUT_MS)
    assert models_tab.details.repo_id == GATED_REPO and models_tab.details.access_error
    assert "deepseek_v32" in models_tab.details_label.text()  # from the listing: config.json is gated
    assert "unknown type" not in models_tab.details_label.text()
    assert html.escape(TOKEN_HINT) in models_tab.details_label.text()  # where this app takes a token


def test_failed_download_keeps_its_reason_after_a_restart(qtbot, models_tab: ModelsTab, settings: Settings, windows):
    _open_details(qtbot, models_tab, "hearth-test")
    models_tab.results.selectRow(_row_of(models_tab.results, GATED_REPO))
    qtbot.waitUntil(models_tab.download_button.isEnabled, timeout=TIMEOUT_MS)
    models_tab.download_selected()
    item_id = f"{GATED_REPO}@main"
    qtbot.waitUntil(lambda: models_tab.downloads.state_text(item_id).startswith("failed"), timeout=TIMEOUT_MS)
    reason = models_tab.downloads.state_text(item_id)
    assert "is gated" in reason and TOKEN_HINT in reason  # where this app takes a token
    table, row = models_tab.downloads, models_tab.downloads.rows[item_id]
    assert table.item(row, 1).toolTip() == reason and _wrapped_text_fits(table, row, 1)  # shown in full
    buttons = table.buttons[item_id]
    # Nothing to continue (no access, no plan): no Resume; the x clears the row.
    assert not buttons["resume"].isVisibleTo(models_tab) and buttons["cancel"].isVisibleTo(models_tab)
    assert buttons["cancel"].toolTip() == "Remove from the list"
    models_tab.close_manager()

    again = windows.track(ModelsTab(settings, options=FAST_DOWNLOADS))
    try:
        assert again.downloads.state_text(item_id) == reason
        buttons = again.downloads.buttons[item_id]
        assert not buttons["pause"].isVisibleTo(again) and not buttons["resume"].isVisibleTo(again)
        assert buttons["cancel"].isVisibleTo(again)
    finally:
        again.close_manager()


def test_a_failure_with_something_to_continue_offers_resume(qtbot, models_tab: ModelsTab, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, "model.safetensors", Fault("status", status=503, times=100))
    item_id = models_tab.manager.enqueue(TINY_REPO)
    qtbot.waitUntil(lambda: models_tab.downloads.state_text(item_id).startswith("failed"), timeout=TIMEOUT_MS)
    assert models_tab.downloads.state_text(item_id).endswith("(resumable)")
    buttons = models_tab.downloads.buttons[item_id]
    assert buttons["resume"].isVisibleTo(models_tab) and not buttons["pause"].isVisibleTo(models_tab)


def test_repos_hearth_cannot_run_offer_no_download(qtbot, models_tab: ModelsTab, fake_hub: FakeHub):
    add_unloadable_repos(fake_hub)
    models_tab.all_arch_check.setChecked(True)
    _open_details(qtbot, models_tab, "")
    reasons = {"hearth-test/gguf-only": "No .safetensors weights (only .gguf files)",
               "hearth-test/pickle-only": "No .safetensors weights (only .bin files)",
               "meta/llama-tiny": "llama is not an architecture Hearth runs",
               "meta/llama-unlisted": "llama is not an architecture Hearth runs"}
    for repo, reason in reasons.items():
        models_tab.results.selectRow(_row_of(models_tab.results, repo))
        qtbot.waitUntil(lambda r=repo: models_tab.details is not None and models_tab.details.repo_id == r,
                        timeout=TIMEOUT_MS)
        assert reason in models_tab.details_label.text(), repo
        button = models_tab.download_button
        assert not button.isEnabled() and "0 files" not in button.text() and reason in button.toolTip(), repo
        models_tab.download_selected()
        assert models_tab.manager.items() == [], repo
    models_tab.results.selectRow(_row_of(models_tab.results, TINY_REPO))  # one it can run: offered
    qtbot.waitUntil(models_tab.download_button.isEnabled, timeout=TIMEOUT_MS)
    assert models_tab.download_button.text().startswith("Download ")


def test_retry_backoff_counts_down_instead_of_reporting_a_stall(qtbot, settings: Settings, fake_hub: FakeHub,
                                                                windows):
    options = DownloadOptions(stall_timeout_s=0.3, max_retries=3, backoff_base_s=3.0, backoff_max_s=3.0,
                              progress_interval_s=0.05, chunk_bytes=16 * 1024)
    tab = windows.track(ModelsTab(settings, options=options))
    try:
        fake_hub.add_fault(TINY_REPO, "model.safetensors", Fault("status", status=503))
        states: list[str] = []
        tab.bridge.event.connect(lambda event: states.append(tab.downloads.state_text(event.item_id)))
        tab.manager.enqueue(TINY_REPO)
        item_id = f"{TINY_REPO}@main"
        qtbot.waitUntil(lambda: tab.downloads.state_text(item_id).startswith("retrying in"), timeout=TIMEOUT_MS)
        assert tab.downloads.state_text(item_id) in ("retrying in 3 s (attempt 1)", "retrying in 2 s (attempt 1)")
        qtbot.waitUntil(lambda: tab.downloads.state_text(item_id) == "ready", timeout=TIMEOUT_MS)
        assert not any(s.startswith(("no data", "stalled")) for s in states), states
        assert not any(b.isVisibleTo(tab) for b in tab.downloads.buttons[item_id].values())  # nothing to do now
    finally:
        tab.close_manager()


def test_download_shows_progress_and_completes(qtbot, models_tab: ModelsTab, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, "model.safetensors", Fault("slow", chunk=16 * 1024, seconds=0.04))
    progress: list[tuple[int, str]] = []

    def record(event: object) -> None:
        if isinstance(event, ev.DownloadProgress):
            bar = models_tab.downloads.progress_bar(event.item_id)
            row = models_tab.downloads.rows[event.item_id]
            progress.append((bar.value(), models_tab.downloads.item(row, 3).text()))

    models_tab.bridge.event.connect(record)
    _open_details(qtbot, models_tab)
    qtbot.mouseClick(models_tab.download_button, Qt.MouseButton.LeftButton)
    item_id = f"{TINY_REPO}@main"
    qtbot.waitUntil(lambda: models_tab.downloads.state_text(item_id) == "ready", timeout=TIMEOUT_MS)
    assert any(0 < value < 1000 and speed.endswith("/s") for value, speed in progress), progress
    assert models_tab.downloads.progress_bar(item_id).value() == 1000
    assert not any(b.isVisibleTo(models_tab) for b in models_tab.downloads.buttons[item_id].values())
    qtbot.waitUntil(lambda: models_tab.installed_table.rowCount() == 1, timeout=TIMEOUT_MS)
    row = _row_of(models_tab.installed_table, TINY_REPO)
    assert models_tab.installed_table.item(row, 4).text() == "yes"

    models_tab.installed_table.selectRow(row)
    delete = next(b for b in models_tab.findChildren(QPushButton) if b.text() == "Delete")
    size = models_tab.installed_table.item(row, 1).text()
    asked: list[tuple[str, bool]] = []
    answer_next_question(QMessageBox.StandardButton.No, asked)
    qtbot.mouseClick(delete, Qt.MouseButton.LeftButton)
    assert asked == [(f"Delete {TINY_REPO} ({size})? Its files are removed from disk; using it again means "
                      f"downloading all {size} again.", True)]  # asked, No by default, and No keeps it
    models_tab.refresh_installed()
    qtbot.waitUntil(lambda: models_tab.installed_table.rowCount() == 1, timeout=TIMEOUT_MS)
    models_tab.installed_table.selectRow(0)
    answer_next_question(QMessageBox.StandardButton.Yes, asked)
    qtbot.mouseClick(delete, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: models_tab.installed_table.rowCount() == 0, timeout=TIMEOUT_MS)


def test_pause_resume_and_cancel(qtbot, models_tab: ModelsTab, fake_hub: FakeHub):
    fake_hub.add_fault(TINY_REPO, "model.safetensors", Fault("slow", chunk=8 * 1024, seconds=0.1))
    _open_details(qtbot, models_tab)
    models_tab.download_selected()
    item_id = f"{TINY_REPO}@main"
    qtbot.waitUntil(lambda: models_tab.downloads.progress_bar(item_id) is not None
                    and models_tab.downloads.progress_bar(item_id).value() > 0, timeout=TIMEOUT_MS)
    models_tab.downloads.pause_requested.emit(item_id)
    qtbot.waitUntil(lambda: models_tab.downloads.state_text(item_id) == "paused", timeout=TIMEOUT_MS)
    models_tab.downloads.resume_requested.emit(item_id)
    qtbot.waitUntil(lambda: models_tab.downloads.state_text(item_id) == "ready", timeout=TIMEOUT_MS)

    fake_hub.add_fault(TINY_REPO, "model.safetensors", Fault("slow", chunk=8 * 1024, seconds=0.1))
    qtbot.waitUntil(lambda: models_tab.installed_table.rowCount() == 1, timeout=TIMEOUT_MS)
    models_tab.installed_table.selectRow(0)
    models_tab.delete_selected(confirmed=True)
    qtbot.waitUntil(lambda: models_tab.installed_table.rowCount() == 0, timeout=TIMEOUT_MS)
    models_tab.download_selected()
    qtbot.waitUntil(lambda: models_tab.downloads.state_text(item_id) == "downloading", timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: models_tab.downloads.bytes[item_id][0] > 0, timeout=TIMEOUT_MS)
    cancel = models_tab.downloads.buttons[item_id]["cancel"]
    asked: list[tuple[str, bool]] = []
    answer_next_question(QMessageBox.StandardButton.No, asked)
    qtbot.mouseClick(cancel, Qt.MouseButton.LeftButton)
    assert len(asked) == 1 and asked[0][1] and asked[0][0].startswith(f"Cancel the download of {TINY_REPO} and "
                                                                       "delete the ")
    assert item_id in models_tab.downloads.rows and models_tab.manager.item(item_id).state != "cancelled"
    answer_next_question(QMessageBox.StandardButton.Yes, asked)
    qtbot.mouseClick(cancel, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: item_id not in models_tab.downloads.rows, timeout=TIMEOUT_MS)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_an_unreachable_hub_fails_the_search_at_once_in_the_results_area(qtbot, settings: Settings, windows):
    with socket.socket() as sock:  # a port nothing listens on: connections are refused
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    tab = windows.track(ModelsTab(settings.replace(hf_endpoint=dead), options=FAST_DOWNLOADS))
    records = _Records()
    library = logging.getLogger("huggingface_hub")
    library.addHandler(records)
    try:
        qtbot.waitUntil(lambda: tab.results.rowCount() > 0, timeout=TIMEOUT_MS)  # the recommendations
        tab.query_edit.setText("deepseek")
        qtbot.mouseClick(tab.search_button, Qt.MouseButton.LeftButton)
        assert tab.results_label.text() == "Searching the Hub for “deepseek”…" and tab.results.rowCount() == 0
        qtbot.waitUntil(tab.search_button.isEnabled, timeout=TIMEOUT_MS)
        assert tab.results_label.text().startswith("<b>Search failed</b>: ")
        assert f"cannot reach {dead}" in tab.results_label.text() and tab.results.rowCount() == 0
        assert not [m for m in records.messages if "Retrying" in m]  # one attempt, not the library's back-off
    finally:
        library.removeHandler(records)
        tab.close_manager()


def test_import_local_folder(qtbot, models_tab: ModelsTab, tmp_path: Path):
    folder = write_tiny_model(tmp_path / "my-model")
    models_tab.import_folder(str(folder))
    qtbot.waitUntil(lambda: models_tab.installed_table.rowCount() == 1, timeout=TIMEOUT_MS)
    assert models_tab.installed_table.item(0, 0).text() == "my-model"
    assert models_tab.installed_table.item(0, 3).text() == "imported"


def test_settings_persist_across_restarts(qtbot, windows):
    tab = windows.track(SettingsTab(load_settings()))
    saved: list[Settings] = []
    tab.settings_saved.connect(saved.append)
    tab.row("gpu_memory_gib").editor.setValue(20.0)
    tab.row("expert_cache_gib").editor.setValue(6.5)
    tab.row("max_model_len").editor.setValue(32768)
    tab.backend_kind.setCurrentIndex(1)
    tab.backend_url.setText("http://gpu-box:8000/v1")
    tab.endpoint.setText("https://hf-mirror.example/")
    tab.theme.setCurrentText("dark")
    tab.row("scheduler").editor.setCurrentText("runahead")
    tab.row("mli").editor.setChecked(True)
    assert tab.row("cuda_graphs").editor.isChecked()  # on by default
    tab.row("cuda_graphs").editor.setChecked(False)
    tab.row("index_key_hot_pages").editor.setValue(8)
    tab.row("latent_hot_rows").editor.setValue(4096)
    tab.row("keep_fp8").editor.setCurrentText("off")
    tab.row("index_topk_pattern").editor.setText("FSSF")
    qtbot.mouseClick(tab.save_button, Qt.MouseButton.LeftButton)
    assert tab.status_label.text() == "Saved." and len(saved) == 1
    windows.close(tab)

    expected = Settings(backend_url="http://gpu-box:8000/v1", hf_endpoint="https://hf-mirror.example", theme="dark"
                        ).replace(gpu_memory_gib=20.0, expert_cache_gib=6.5, context_length=32768,
                                  scheduler="runahead", mli=True, index_key_hot_pages=8, latent_hot_rows=4096,
                                  cuda_graphs=False, keep_fp8=False, index_topk_pattern="FSSF")
    assert load_settings() == expected == saved[0]
    again = windows.track(SettingsTab(load_settings()))
    assert again.row("gpu_memory_gib").editor.value() == 20.0 and again.row("expert_cache_gib").editor.value() == 6.5
    assert again.backend_kind.currentIndex() == 1 and again.backend_url.text() == "http://gpu-box:8000/v1"
    assert again.theme.currentText() == "dark" and again.row("max_model_len").editor.value() == 32768
    assert again.row("scheduler").editor.currentText() == "runahead" and again.row("mli").editor.isChecked()
    assert again.row("index_key_hot_pages").editor.value() == 8 and again.row("keep_fp8").value() is False
    assert not again.row("cuda_graphs").editor.isChecked()
    again.row("gpu_memory_gib").editor.setValue(0.0)  # "auto"
    again.row("index_topk_pattern").editor.setText("")  # "none"
    again.backend_kind.setCurrentIndex(0)
    again.save()
    reloaded = load_settings()
    assert reloaded.engine.gpu_memory_gib is None and reloaded.backend_url is None
    assert reloaded.engine.index_topk_pattern is None


def test_every_engine_option_has_a_row_with_its_explanation(qtbot, windows):
    """Rows come from EngineConfig's metadata: each field has an editor, its one-line help under it
    and as tooltip; the common ones show, the rest sit in the collapsed advanced group."""
    from hearth.engine.api import BASIC, engine_options

    tab = windows.track(SettingsTab(Settings()))
    tab.resize(1100, 900)
    tab.show()
    assert [option.name for option in engine_options()] == list(tab.rows)
    for option in engine_options():
        row = tab.row(option.name)
        assert row.hint.text() == option.text.help == row.editor.toolTip(), option.name
        assert row.value() == getattr(Settings().engine, option.name), option.name
        assert row.editor.isVisible() == (option.text.section == BASIC), option.name
    for jargon in ("index_topk_freq", "index_key_hot_pages", "latent_hot_rows", "mli"):
        assert tab.row(jargon).hint.isVisible() and len(tab.row(jargon).hint.text()) > 40
    qtbot.mouseClick(tab.advanced_toggle, Qt.MouseButton.LeftButton)
    assert tab.row("max_num_seqs").editor.isVisible() and tab.advanced_toggle.text().startswith("Hide")
    # The editors stretch across the window rather than keeping their size hint.
    assert tab.row("gpu_memory_gib").editor.width() > 500


def test_cuda_graphs_greyed_without_cuda_and_context_capped_by_the_model(qtbot, windows):
    from hearth.app.gui.settings_tab import NO_CUDA_TIP

    tab = windows.track(SettingsTab(Settings().replace(context_length=32768)))
    tab.set_cuda_available(False)
    graphs = tab.row("cuda_graphs")
    assert not graphs.editor.isEnabled() and graphs.editor.toolTip() == NO_CUDA_TIP
    tab.set_cuda_available(True)
    assert graphs.editor.isEnabled() and graphs.editor.toolTip() == graphs.option.text.help
    context = tab.row("max_model_len")
    tab.set_model_context(2048, "Demo")
    assert context.editor.maximum() == 2048 and context.value() == 2048
    assert "At most 2,048 tokens for Demo" in context.editor.toolTip()
    assert tab.edited().context_length == 32768  # kept for bigger models while the box shows the cap
    context.editor.setValue(1024)
    assert tab.edited().context_length == 1024
    tab.set_model_context(None)
    assert context.editor.maximum() > 1_000_000 and context.value() == 32768


def test_bad_endpoint_is_not_saved(qtbot, windows):
    tab = windows.track(SettingsTab(Settings()))
    tab.endpoint.setText("ftp://nope")
    tab.save()
    assert tab.status_label.text().startswith("Not saved") and not settings_path().exists()


def test_token_goes_to_the_login_store_only(qtbot, windows, monkeypatch: pytest.MonkeyPatch):
    logged_in: list[str] = []

    def fake_login(token: str, add_to_git_credential: bool) -> None:  # the real one asks the Hub (whoami)
        logged_in.append(token)
        Path(hf_constants.HF_TOKEN_PATH).write_text(token)

    monkeypatch.setattr(settings_module, "hf_login", fake_login)
    tab = windows.track(SettingsTab(Settings()))
    assert "No token stored" in tab.token_state.text()
    tab.token_edit.setText("hf_secret_value_123")
    tab.save_token()
    assert tab.token_edit.text() == ""
    qtbot.waitUntil(lambda: "A token is stored" in tab.token_state.text(), timeout=TIMEOUT_MS)
    assert logged_in == ["hf_secret_value_123"]
    tab.save()
    assert "hf_secret" not in settings_path().read_text() and "hf_secret" not in tab.token_state.text()
