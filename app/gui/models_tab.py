"""The Models tab: recommended models with their fit verdict for this machine (a bundled list, so
it opens offline), Hub search (sort, "all architectures", sizes), a repo's files as ``pull`` would
fetch them with their total and the fit verdict, the download queue, and the installed models
(use, delete, import a local folder).

Download is offered only for what ``pull`` would accept: a repo with safetensors weights of an
architecture Hearth runs (else the details say why). Deleting a model and cancelling a download
ask first, with the size at stake. A search says it is searching, and a failed one says why in the
results area, in place of results that no longer answer the query.

All Hub calls run on the thread pool (``run_task``); downloads run in ``DownloadManager``'s own
threads and report through ``HubBridge``.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

from hearth.app.gui.dialogs import confirm
from hearth.app.gui.downloads_view import DownloadsTable, HubBridge, with_token_hint
from hearth.app.gui.qt import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSplitter,
    Qt,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
    Signal,
)
from hearth.app.gui.resources import icon
from hearth.app.gui.tasks import run_task
from hearth.app.hub import HubContext, delete_model, import_local_model, list_installed, repo_details, search_models
from hearth.app.hub import events as ev
from hearth.app.hub.fit import FitReport, assess_fit, footprint_from_config, probe_machine
from hearth.app.hub.loadable import unloadable_kinds
from hearth.app.hub.manager import DownloadManager, DownloadOptions
from hearth.app.hub.recommended import Recommendation, recommendations
from hearth.app.hub.units import GIB, format_bytes
from hearth.app.store.settings import Settings
from hearth.engine.config import SUPPORTED_MODEL_TYPES

SORTS = ("downloads", "likes", "trending", "recent")
SEARCH_COLUMNS = ("Repository", "Type", "Size", "Downloads", "Likes", "Gated")
PICK_COLUMNS = ("Repository", "Type", "Size", "Fit here")


def _table(headers: tuple[str, ...], parent: QWidget, name: str) -> QTableWidget:
    table = QTableWidget(0, len(headers), parent)
    table.setAccessibleName(name)
    table.setHorizontalHeaderLabels(headers)
    table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
    table.verticalHeader().hide()
    table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
    table.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
    table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    return table


def _fill(table: QTableWidget, rows: list[tuple[Any, ...]], headers: tuple[str, ...] | None = None) -> None:
    if headers is not None:
        table.setColumnCount(len(headers))
        table.setHorizontalHeaderLabels(headers)
    table.setRowCount(0)
    for values in rows:
        row = table.rowCount()
        table.insertRow(row)
        for column, value in enumerate(values):
            table.setItem(row, column, QTableWidgetItem(str(value)))


class ModelsTab(QWidget):
    installed_changed = Signal()
    use_model_requested = Signal(str)  # the installed model's name
    error = Signal(str)

    def __init__(self, settings: Settings, parent: QWidget | None = None,
                 options: DownloadOptions | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.bridge = HubBridge(self)
        self.bridge.event.connect(self._on_download_event)
        self._options = options or DownloadOptions()
        self.manager = self._new_manager()
        self.details: Any = None
        self.refusal: str | None = None  # why the repo shown cannot be downloaded (None: it can)
        self._shown_repo: str | None = None  # the repo the details pane is (being) filled with
        self._listed_types: dict[str, str | None] = {}
        self._searched = False  # once the user searched, the recommendations stay out of the way
        self._search_generation = 0  # drops the answer of a search made before the latest one
        self._build()
        self.refresh_installed()
        self.show_recommendations()

    def _new_manager(self) -> DownloadManager:
        manager = DownloadManager(self.settings, on_event=self.bridge, options=self._options)
        manager.start()
        return manager

    @property
    def ctx(self) -> HubContext:
        return HubContext.from_settings(self.settings)

    # ---- layout -----------------------------------------------------------------------------
    def _build(self) -> None:
        layout = QVBoxLayout(self)
        layout.addLayout(self._search_row())
        split = QSplitter(Qt.Orientation.Horizontal, self)
        left = QWidget(self)
        column = QVBoxLayout(left)
        column.setContentsMargins(0, 0, 0, 0)
        self.results_label = QLabel("", left)
        self.results_label.setWordWrap(True)
        self.results_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.results = _table(SEARCH_COLUMNS, left, "Models")
        self.results.itemSelectionChanged.connect(self._load_details)
        column.addWidget(self.results_label)
        column.addWidget(self.results, 1)
        split.addWidget(left)
        split.addWidget(self._details_box())
        split.setSizes([560, 440])
        split.setObjectName("modelsSplitter")
        self.split = split
        layout.addWidget(split, 3)
        downloads = QGroupBox("Downloads", self)
        self.downloads = DownloadsTable(downloads)
        self.downloads.pause_requested.connect(lambda i: self._manager_call(self.manager.pause, i))
        self.downloads.resume_requested.connect(lambda i: self._manager_call(self.manager.resume, i))
        self.downloads.cancel_requested.connect(self.cancel_download)
        QVBoxLayout(downloads).addWidget(self.downloads)
        layout.addWidget(downloads, 2)
        layout.addWidget(self._installed_box(), 2)
        for item in self.manager.items():  # paused or failed downloads from an earlier session
            self.downloads.restore(item)

    def _search_row(self) -> QHBoxLayout:
        row = QHBoxLayout()
        self.query_edit = QLineEdit(self)
        self.query_edit.setPlaceholderText("Search the Hugging Face Hub (e.g. DeepSeek-V3.2, GLM-5)")
        self.query_edit.setAccessibleName("Search the Hugging Face Hub")
        self.query_edit.returnPressed.connect(self.search)
        self.sort_combo = QComboBox(self)
        self.sort_combo.addItems(SORTS)
        self.sort_combo.setAccessibleName("Sort by")
        self.all_arch_check = QCheckBox("All architectures", self)
        self.all_arch_check.setToolTip("Also list models Hearth cannot run")
        self.search_button = QPushButton(icon("search"), "Search", self)
        self.search_button.clicked.connect(self.search)
        for widget in (self.query_edit, QLabel("Sort:"), self.sort_combo, self.all_arch_check, self.search_button):
            row.addWidget(widget)
        return row

    def _details_box(self) -> QGroupBox:
        box = QGroupBox("Repository", self)
        layout = QVBoxLayout(box)
        self.details_label = QLabel("Pick a model to see its files, the download size and whether it fits.", box)
        self.details_label.setWordWrap(True)
        self.fit_label = QLabel("", box)
        self.fit_label.setWordWrap(True)
        self.files_table = _table(("File", "Size"), box, "Files to download")
        self.files_table.setToolTip("The files Download fetches: weights, configs and tokenizer (never pickles)")
        self.download_button = QPushButton(icon("download"), "Download", box)
        self.download_button.setObjectName("primary")
        self.download_button.setEnabled(False)
        self.download_button.clicked.connect(self.download_selected)
        for widget in (self.details_label, self.fit_label, self.files_table, self.download_button):
            layout.addWidget(widget)
        return box

    def _installed_box(self) -> QGroupBox:
        box = QGroupBox("Installed models", self)
        layout = QVBoxLayout(box)
        self.installed_table = _table(("Name", "Size", "Type", "Source", "Ready"), box, "Installed models")
        layout.addWidget(self.installed_table)
        row = QHBoxLayout()
        actions = (("Use in chat", "chat", self._use_selected), ("Delete", "delete", self.delete_selected),
                   ("Import folder…", "folder", self.import_folder))
        for text, name, slot in actions:
            button = QPushButton(icon(name), text, box)
            button.clicked.connect(lambda _=False, s=slot: s())
            row.addWidget(button)
        row.addStretch(1)
        layout.addLayout(row)
        return box

    # ---- recommendations, search and details -------------------------------------------------
    def show_recommendations(self) -> None:
        """The bundled list with verdicts for this machine (no network needed)."""
        settings, disk = self.settings, self.ctx.cache_dir
        run_task(lambda: recommendations(settings, probe_machine(settings, disk)), self._show_picks,
                 lambda exc: self.error.emit(f"Could not rate the recommended models: {exc}"))

    def _show_picks(self, picks: list[Recommendation]) -> None:
        if self._searched:
            return
        self._listed_types = {p.repo_id: p.model_type for p in picks}
        fitting = sum(p.fits for p in picks)
        self.results_label.setText(
            f"<b>Recommended for this machine</b>: {fitting} of {len(picks)} fit here"
            + ("" if fitting else " (the demo model runs anywhere)")
            + ". Search the Hub above for more.")
        _fill(self.results, [(p.repo_id, p.model_type, f"~{format_bytes(p.weights_bytes)}", str(p.report.verdict))
                             for p in picks], PICK_COLUMNS)
        for row, pick in enumerate(picks):
            for column in range(len(PICK_COLUMNS)):
                self.results.item(row, column).setToolTip(f"{pick.why}\n{pick.report.summary}")

    def search(self) -> None:
        ctx, query = self.ctx, self.query_edit.text().strip()
        sort, all_arch = self.sort_combo.currentText(), self.all_arch_check.isChecked()
        self._searched = True
        self._search_generation += 1
        generation = self._search_generation
        self.search_button.setEnabled(False)
        self.results_label.setText(f"Searching the Hub for “{html.escape(query)}”…" if query else "Searching the Hub…")
        _fill(self.results, [], SEARCH_COLUMNS)  # the old results do not answer this query
        run_task(lambda: search_models(ctx, query, sort=sort, all_architectures=all_arch),
                 lambda results: self._show_results(results, generation),
                 lambda exc: self._search_failed(exc, generation), owner=self)

    def _show_results(self, results: list[Any], generation: int | None = None) -> None:
        if generation is not None and generation != self._search_generation:
            return  # a later search is under way
        self.search_button.setEnabled(True)
        self._listed_types = {r.repo_id: r.model_type for r in results}
        self.results_label.setText(f"<b>Search results</b>: {len(results)}")
        _fill(self.results, [(r.repo_id, r.model_type or "?",
                              format_bytes(r.weights_bytes) if r.weights_bytes else "?", f"{r.downloads:,}",
                              r.likes, "yes" if r.gated else "") for r in results], SEARCH_COLUMNS)

    def _search_failed(self, exc: BaseException, generation: int | None = None) -> None:
        if generation is not None and generation != self._search_generation:
            return
        self.search_button.setEnabled(True)
        _fill(self.results, [], SEARCH_COLUMNS)
        self.results_label.setText(f"<b>Search failed</b>: {html.escape(str(exc) or type(exc).__name__)}")

    def _load_details(self) -> None:
        rows = self.results.selectionModel().selectedRows()
        if not rows:
            return
        repo_id = self.results.item(rows[0].row(), 0).text()
        ctx, settings = self.ctx, self.settings
        # Until this repo's details arrive, Download must not queue the one shown before.
        self.details, self._shown_repo = None, repo_id
        self.download_button.setEnabled(False)
        self.download_button.setText("Download")
        self.fit_label.clear()
        self.files_table.setRowCount(0)
        self.details_label.setText(f"Loading {repo_id}…")
        run_task(lambda: _details_and_fit(ctx, settings, repo_id), self._show_details,
                 lambda exc: self._details_failed(repo_id, exc))

    def _show_details(self, result: tuple[Any, FitReport]) -> None:
        details, report = result
        if details.repo_id != self._shown_repo:
            return  # the user picked another repo meanwhile
        self.details = details
        model_type = details.model_type or self._listed_types.get(details.repo_id)
        kind = model_type or ("gated: sign in to see details" if details.gated else "unknown type")
        gated = " · gated (needs a token with access)" if details.gated else ""
        pulled = details.pulled_files()
        self.refusal = refusal = _refusal(details, model_type, pulled)
        lines = [f"<b>{html.escape(details.repo_id)}</b> @ {details.commit[:10]} · {html.escape(kind)}{gated}"]
        if refusal:
            lines.append(html.escape(refusal))
        elif details.gated and details.access_error:
            lines.append(html.escape(with_token_hint(details.access_error)))
        self.details_label.setText("<br>".join(lines))
        self.fit_label.setText("" if refusal else f"Fit: {report.summary}")
        _fill(self.files_table, [(f.filename, format_bytes(f.size)) for f in pulled])
        skipped = len(details.files) - len(pulled)
        self.files_table.setToolTip(f"The files Download fetches; {skipped} other file(s) of the repo are not needed"
                                    if skipped else "The files Download fetches")
        if refusal:
            self.download_button.setText("Cannot download: Hearth could not run it")
            self.download_button.setToolTip(refusal)
            self.download_button.setEnabled(False)
            return
        self.download_button.setText(f"Download {format_bytes(details.download_bytes())} ({len(pulled)} files)")
        self.download_button.setToolTip("")
        self.download_button.setEnabled(True)

    def _details_failed(self, repo_id: str, exc: BaseException) -> None:
        if repo_id == self._shown_repo:
            self.details_label.setText(f"Could not read the repository: {exc}")

    def download_selected(self) -> None:
        if self.details is not None and self.details.repo_id == self._shown_repo and self.refusal is None:
            self._manager_call(self.manager.enqueue, self.details.repo_id)

    def _manager_call(self, fn: Any, arg: str) -> None:
        try:
            fn(arg)
        except Exception as exc:
            self.error.emit(str(exc))

    def cancel_download(self, item_id: str) -> None:
        """The x of a download: cancel it and delete its partial files, once the user agrees to
        lose what was downloaded (nothing to ask when nothing was)."""
        done, _total = self.downloads.bytes.get(item_id, (0, 0))
        repo_id = item_id.rsplit("@", 1)[0]
        if done and not confirm(self, "Cancel download",
                                f"Cancel the download of {repo_id} and delete the {format_bytes(done)} "
                                "downloaded so far?", action="Cancel download"):
            return
        self._manager_call(lambda x: self.manager.cancel(x, delete_partials=True), item_id)

    def _on_download_event(self, event: ev.DownloadEvent) -> None:
        if isinstance(event, ev.DownloadFailed) and event.is_resumable:
            # The manager decides whether a pull has anything left to continue (a plan was made).
            event = dataclasses.replace(event, is_resumable=self._is_resumable(event.item_id))
        self.downloads.apply(event)
        if isinstance(event, ev.DownloadReady):
            self.refresh_installed()
        elif isinstance(event, ev.DownloadFailed):
            self.error.emit(f"{event.repo_id}: {with_token_hint(event.message)}")

    def _is_resumable(self, item_id: str) -> bool:
        try:
            return self.manager.item(item_id).is_resumable
        except KeyError:
            return False

    # ---- installed --------------------------------------------------------------------------
    def refresh_installed(self) -> None:
        ctx = self.ctx
        run_task(lambda: list_installed(ctx), self._show_installed, lambda exc: self.error.emit(str(exc)))

    def _show_installed(self, models: list[Any]) -> None:
        _fill(self.installed_table, [(m.name, format_bytes(m.size_bytes), m.model_type or "?", m.source,
                                      "yes" if m.is_ready else "no") for m in models])
        self.installed_changed.emit()

    def _selected_installed(self) -> str | None:
        rows = self.installed_table.selectionModel().selectedRows()
        return self.installed_table.item(rows[0].row(), 0).text() if rows else None

    def _use_selected(self) -> None:
        name = self._selected_installed()
        if name:
            self.use_model_requested.emit(name)

    def delete_selected(self, *, confirmed: bool = False) -> None:
        """Delete the selected model's files, once the user agrees (``confirmed``: already asked); an
        imported model is only forgotten (its folder stays), which needs no question."""
        name, ctx = self._selected_installed(), self.ctx
        if not name:
            return
        row = self.installed_table.selectionModel().selectedRows()[0].row()
        size = self.installed_table.item(row, 1).text()
        imported = self.installed_table.item(row, 3).text() == "imported"
        if not (confirmed or imported) and not confirm(
                self, "Delete model", f"Delete {name} ({size})? Its files are removed from disk; using it again "
                f"means downloading all {size} again."):
            return
        run_task(lambda: delete_model(name, ctx), lambda _: self.refresh_installed(),
                 lambda exc: self.error.emit(str(exc)), owner=self)

    def import_folder(self, folder: str | None = None) -> None:
        folder = folder or QFileDialog.getExistingDirectory(self, "Import a model folder")
        if folder:
            ctx = self.ctx
            run_task(lambda: import_local_model(folder, ctx=ctx), lambda _: self.refresh_installed(),
                     lambda exc: self.error.emit(str(exc)), owner=self)

    # ---- lifecycle --------------------------------------------------------------------------
    def apply_settings(self, settings: Settings) -> None:
        hub_fields = ("hf_endpoint", "hf_cache_dir", "offline", "download_parallelism")
        changed = any(getattr(settings, f) != getattr(self.settings, f) for f in hub_fields)
        self.settings = settings
        if changed:
            self.manager.close(timeout=5)
            self.manager = self._new_manager()
            self.refresh_installed()
        self.show_recommendations()  # the context length or memory caps may have changed

    def close_manager(self) -> None:
        self.manager.close(timeout=10)


def _refusal(details: Any, model_type: str | None, pulled: list[Any]) -> str | None:
    """Why ``pull`` would refuse the repo, as it does before fetching a weight, or None. A repo whose
    config.json could not be read (gated, without access) is let through: the download checks it."""
    if not any(f.filename.endswith(".safetensors") for f in pulled):
        if details.access_error and not details.files:
            return None
        kinds = unloadable_kinds(f.filename for f in details.files)
        only = f" (only {', '.join(kinds)} files)" if kinds else ""
        return (f"No .safetensors weights{only}: Hearth never loads pickle files and does not run GGUF, so there "
                "is nothing it could use.")
    runs = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
    if model_type is None:
        if details.access_error:
            return None
        return f"It names no model type (no config.json), so it is not a model Hearth can run (it runs {runs})."
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"{model_type} is not an architecture Hearth runs (it runs {runs})."
    return None


def _details_and_fit(ctx: HubContext, settings: Settings, repo_id: str) -> tuple[Any, FitReport]:
    details = repo_details(ctx, repo_id)
    footprint = footprint_from_config(details.config, details.weights_bytes)
    cache_bytes = int(settings.engine.expert_cache_gib * GIB) if settings.engine.expert_cache_gib else None
    report = assess_fit(footprint, probe_machine(settings, ctx.cache_dir), context_length=settings.context_length,
                        expert_cache_bytes=cache_bytes, download_bytes=details.weights_bytes)
    return details, report
