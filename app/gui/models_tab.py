"""The Models tab: Hub search (sort, "all architectures"), a repo's files with sizes and the fit
verdict, the download queue, and the installed models (use, delete, import a local folder).

All Hub calls run on the thread pool (``run_task``); downloads run in ``DownloadManager``'s own
threads and report through ``HubBridge``.
"""

from __future__ import annotations

from typing import Any

from hearth.app.gui.downloads_view import DownloadsTable, HubBridge
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
from hearth.app.hub.manager import DownloadManager, DownloadOptions
from hearth.app.hub.units import GIB, format_bytes
from hearth.app.store.settings import Settings

SORTS = ("downloads", "likes", "trending", "recent")


def _table(headers: tuple[str, ...], parent: QWidget) -> QTableWidget:
    table = QTableWidget(0, len(headers), parent)
    table.setHorizontalHeaderLabels(headers)
    table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
    table.verticalHeader().hide()
    table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
    table.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
    table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    return table


def _fill(table: QTableWidget, rows: list[tuple[Any, ...]]) -> None:
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
        self._build()
        self.refresh_installed()

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
        self.results = _table(("Repository", "Type", "Downloads", "Likes", "Gated"), self)
        self.results.itemSelectionChanged.connect(self._load_details)
        split.addWidget(self.results)
        split.addWidget(self._details_box())
        split.setSizes([500, 500])
        layout.addWidget(split, 3)
        downloads = QGroupBox("Downloads", self)
        self.downloads = DownloadsTable(downloads)
        self.downloads.pause_requested.connect(lambda i: self._manager_call(self.manager.pause, i))
        self.downloads.resume_requested.connect(lambda i: self._manager_call(self.manager.resume, i))
        self.downloads.cancel_requested.connect(
            lambda i: self._manager_call(lambda x: self.manager.cancel(x, delete_partials=True), i))
        QVBoxLayout(downloads).addWidget(self.downloads)
        layout.addWidget(downloads, 2)
        layout.addWidget(self._installed_box(), 2)
        for item in self.manager.items():  # paused downloads from an earlier session
            self.downloads.apply(ev.DownloadPaused(item.item_id, item.repo_id, item.bytes_done, item.bytes_total))

    def _search_row(self) -> QHBoxLayout:
        row = QHBoxLayout()
        self.query_edit = QLineEdit(self)
        self.query_edit.setPlaceholderText("Search the Hugging Face Hub (e.g. DeepSeek-V3.2, GLM-5)")
        self.query_edit.returnPressed.connect(self.search)
        self.sort_combo = QComboBox(self)
        self.sort_combo.addItems(SORTS)
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
        self.details_label = QLabel("Pick a search result to see its files and whether it fits.", box)
        self.details_label.setWordWrap(True)
        self.fit_label = QLabel("", box)
        self.fit_label.setWordWrap(True)
        self.files_table = _table(("File", "Size"), box)
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
        self.installed_table = _table(("Name", "Size", "Type", "Source", "Ready"), box)
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

    # ---- search and details -----------------------------------------------------------------
    def search(self) -> None:
        ctx, query = self.ctx, self.query_edit.text().strip()
        sort, all_arch = self.sort_combo.currentText(), self.all_arch_check.isChecked()
        self.search_button.setEnabled(False)
        run_task(lambda: search_models(ctx, query, sort=sort, all_architectures=all_arch),
                 self._show_results, self._search_failed)

    def _show_results(self, results: list[Any]) -> None:
        self.search_button.setEnabled(True)
        self._results = results
        _fill(self.results, [(r.repo_id, r.model_type or "?", f"{r.downloads:,}", r.likes, "yes" if r.gated else "")
                             for r in results])

    def _search_failed(self, exc: BaseException) -> None:
        self.search_button.setEnabled(True)
        self.error.emit(str(exc))

    def _load_details(self) -> None:
        rows = self.results.selectionModel().selectedRows()
        if not rows:
            return
        repo_id = self.results.item(rows[0].row(), 0).text()
        ctx, settings = self.ctx, self.settings
        self.details_label.setText(f"Loading {repo_id}…")
        run_task(lambda: _details_and_fit(ctx, settings, repo_id), self._show_details, self._details_failed)

    def _show_details(self, result: tuple[Any, FitReport]) -> None:
        details, report = result
        self.details = details
        gated = " · gated (needs a token with access)" if details.gated else ""
        support = "" if details.is_supported else " · not an architecture Hearth runs"
        self.details_label.setText(f"<b>{details.repo_id}</b> @ {details.commit[:10]} · "
                                   f"{details.model_type or 'unknown type'}{gated}{support}")
        self.fit_label.setText(f"Fit: {report.summary}")
        _fill(self.files_table, [(f.filename, format_bytes(f.size)) for f in details.files])
        self.download_button.setEnabled(True)

    def _details_failed(self, exc: BaseException) -> None:
        self.details_label.setText(f"Could not read the repository: {exc}")
        self.download_button.setEnabled(False)

    def download_selected(self) -> None:
        if self.details is not None:
            self._manager_call(self.manager.enqueue, self.details.repo_id)

    def _manager_call(self, fn: Any, arg: str) -> None:
        try:
            fn(arg)
        except Exception as exc:
            self.error.emit(str(exc))

    def _on_download_event(self, event: ev.DownloadEvent) -> None:
        self.downloads.apply(event)
        if isinstance(event, ev.DownloadReady):
            self.refresh_installed()
        elif isinstance(event, ev.DownloadFailed):
            self.error.emit(f"{event.repo_id}: {event.message}")

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

    def delete_selected(self) -> None:
        name, ctx = self._selected_installed(), self.ctx
        if name:
            run_task(lambda: delete_model(name, ctx), lambda _: self.refresh_installed(),
                     lambda exc: self.error.emit(str(exc)))

    def import_folder(self, folder: str | None = None) -> None:
        folder = folder or QFileDialog.getExistingDirectory(self, "Import a model folder")
        if folder:
            ctx = self.ctx
            run_task(lambda: import_local_model(folder, ctx=ctx), lambda _: self.refresh_installed(),
                     lambda exc: self.error.emit(str(exc)))

    # ---- lifecycle --------------------------------------------------------------------------
    def apply_settings(self, settings: Settings) -> None:
        hub_fields = ("hf_endpoint", "hf_cache_dir", "offline", "download_parallelism")
        changed = any(getattr(settings, f) != getattr(self.settings, f) for f in hub_fields)
        self.settings = settings
        if changed:
            self.manager.close(timeout=5)
            self.manager = self._new_manager()
            self.refresh_installed()

    def close_manager(self) -> None:
        self.manager.close(timeout=10)


def _details_and_fit(ctx: HubContext, settings: Settings, repo_id: str) -> tuple[Any, FitReport]:
    details = repo_details(ctx, repo_id)
    footprint = footprint_from_config(details.config, details.weights_bytes)
    cache_bytes = int(settings.engine.expert_cache_gib * GIB) if settings.engine.expert_cache_gib else None
    report = assess_fit(footprint, probe_machine(settings, ctx.cache_dir), context_length=settings.context_length,
                        expert_cache_bytes=cache_bytes, download_bytes=details.weights_bytes)
    return details, report
