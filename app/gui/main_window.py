"""The main window: Chat (sidebar + chat panel), Models, Settings and Server tabs, the status bar, the
keyboard shortcuts, and the wiring between them and the engine thread.

A model that fails to load is said in the chat area with the reason and a way back to the model
used before (``LoadErrorBanner``); only an engine host that dies while serving is a crash
(``CrashBanner``). The default model is saved once a model has loaded, so a broken one is not
loaded again at the next start. With a remote backend the chat's models are the ones it serves
(``GET /v1/models``, off the GUI thread); one that does not answer is said there the same way.

A model, an engine option or the backend changed while an answer is being written waits for every
answer to end (``PendingReload``; the status bar says "… will reload when the answer ends"): the
engine, and the settings it was started with, stay as they are until then, since reloading under
an answer would cut it off, and switching the backend under it would send its chat's next turn
elsewhere. Stop ends the wait as well.

Quitting writes a running answer as it is (``ChatPanel.save_partial``), pauses downloads, stops the
API server switch, stops the engine host when this window started it, and saves the window's
geometry, its splitters and the open chat (``STATE_FILE``), which the next start restores.
"""

from __future__ import annotations

import logging

from hearth.app.gui.backend import Backend, Connected, ModelChoice, available_models, cuda_available
from hearth.app.gui.chat_panel import ChatPanel
from hearth.app.gui.engine_worker import EngineThread
from hearth.app.gui.models_tab import ModelsTab
from hearth.app.gui.pending_reload import PendingReload
from hearth.app.gui.qt import (
    QApplication,
    QByteArray,
    QCloseEvent,
    QKeySequence,
    QMainWindow,
    QMessageBox,
    QSettings,
    QShortcut,
    QSplitter,
    Qt,
    QTabWidget,
    QTimer,
    QVBoxLayout,
    QWidget,
)
from hearth.app.gui.resources import apply_theme, icon, resolve_theme
from hearth.app.gui.server_tab import ServerTab
from hearth.app.gui.settings_tab import SettingsTab
from hearth.app.gui.sidebar import Sidebar
from hearth.app.gui.status_bar import CrashBanner, EngineStatusBar, LoadErrorBanner, StatsPoller
from hearth.app.gui.tasks import run_task, wait_for_tasks
from hearth.app.hub.manager import DownloadOptions
from hearth.app.paths import data_dir, private_file
from hearth.app.store.chats import ChatStore
from hearth.app.store.settings import Settings, backend_changed, load_settings, restart_needed, save_settings

logger = logging.getLogger(__name__)
STATE_FILE = "window-state.ini"  # under the data folder: geometry, splitters, the open chat


class EngineGoneError(RuntimeError):
    """The engine host process is not running any more."""


class MainWindow(QMainWindow):
    def __init__(self, settings: Settings | None = None, store: ChatStore | None = None,
                 backend: Backend | None = None, download_options: DownloadOptions | None = None) -> None:
        super().__init__()
        self.settings = settings or load_settings()
        self.store = store or ChatStore()
        self._owns_store = store is None
        self.backend = backend or Backend(self.settings)
        self._owns_backend = backend is None
        self.choices: list[ModelChoice] = []
        self.connected: Connected | None = None
        self._loading: ModelChoice | None = None  # the model asked for last (it may have failed to load)
        self._last_loaded: ModelChoice | None = None  # the model that loaded last: the way back after a failure
        self._restarting = False
        self._closing = False  # (a stats poll that fails while the window closes finds the store closed)
        self._pending: PendingReload | None = None  # a reload waiting for the answers to end
        self._connecting = 0  # model listings under way that load a model when they end
        self.setWindowTitle("Hearth")
        self.setWindowIcon(icon("hearth"))
        self.resize(1280, 820)
        self.engine = EngineThread(self.backend, self)
        self._build(download_options)
        self._wire()
        self._shortcuts()
        self._restore_state()
        self.poller = StatsPoller(self._fetch_stats, self)
        self.poller.stats.connect(self.status.show_stats)
        self.poller.failed.connect(self._on_poll_failed)
        self.poller.timer.start()
        run_task(cuda_available, self.settings_tab.set_cuda_available)
        self.recovery_notice: QMessageBox | None = None
        if self.store.recovery is not None:
            self._tell_chats_recovered(self.store.recovery.describe())
        self.refresh_models(connect=True)

    # ---- layout -----------------------------------------------------------------------------
    def _build(self, download_options: DownloadOptions | None) -> None:
        self.tabs = QTabWidget(self)
        self.sidebar = Sidebar(self.store, self)
        self.chat = ChatPanel(self.store, self.engine, self)
        self.chat.context_policy = self.settings.context_overflow
        self.chat.view.show_thinking = self.settings.show_thinking
        self.chat.view.dark = resolve_theme(self.settings.theme) == "dark"
        self.chat.think_button.setChecked(self.settings.think)
        self.chat.set_send_key(self.settings.send_key)
        self.sidebar.is_generating = self.chat.generating_in
        self.crash_banner = CrashBanner(self)
        self.load_banner = LoadErrorBanner(self)
        right = QWidget(self)
        column = QVBoxLayout(right)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.crash_banner)
        column.addWidget(self.load_banner)
        column.addWidget(self.chat, 1)
        split = QSplitter(Qt.Orientation.Horizontal, self)
        split.setObjectName("chatSplitter")
        split.addWidget(self.sidebar)
        split.addWidget(right)
        split.setStretchFactor(1, 1)
        split.setSizes([260, 1020])
        self.chat_split = split
        self.models_tab = ModelsTab(self.settings, self, download_options)
        self.settings_tab = SettingsTab(self.settings, self)
        self.server_tab = ServerTab(self.settings, self.backend.upstream, self)
        self.tabs.addTab(split, icon("chat"), "Chat")
        self.tabs.addTab(self.models_tab, icon("models"), "Models")
        self.tabs.addTab(self.settings_tab, icon("settings"), "Settings")
        self.tabs.addTab(self.server_tab, icon("send"), "Server")
        self.setCentralWidget(self.tabs)
        self.status = EngineStatusBar(self)
        self.setStatusBar(self.status)

    def _wire(self) -> None:
        worker = self.engine.worker
        worker.connected.connect(self._on_connected)
        worker.connect_failed.connect(self._on_connect_failed)
        worker.engine_died.connect(self.show_engine_died)
        self.status.restart_requested.connect(self.restart_engine)
        self.crash_banner.restart_requested.connect(self.restart_engine)
        self.load_banner.fallback_requested.connect(self._use_fallback)
        self.load_banner.retry_requested.connect(self._retry_load)
        self.sidebar.selected.connect(self.open_conversation)
        self.sidebar.deleting.connect(self.chat.cancel_generation)
        self.sidebar.deleted.connect(self._on_deleted)
        self.chat.conversation_changed.connect(self._on_conversation_changed)
        self.chat.model_chosen.connect(self.choose_model)
        self.chat.generating_changed.connect(self._on_generating_changed)
        self.models_tab.installed_changed.connect(self._on_installed_changed)
        self.models_tab.use_model_requested.connect(self._use_installed)
        self.models_tab.error.connect(lambda text: self.status.showMessage(text, 10_000))
        self.settings_tab.settings_saved.connect(self.apply_settings)
        self.settings_tab.backend_fields.models_listed.connect(self._on_backend_tested)
        self.server_tab.settings_changed.connect(self._save_server_settings)
        self.chat.think_button.toggled.connect(self._save_think)

    def _shortcuts(self) -> None:
        """Ctrl+N and Ctrl+F from anywhere; Ctrl+Enter (send) and Esc (stop, cancel an edit) only
        while the chat tab shows: on another tab they are left to its widgets."""
        bindings = (("Ctrl+Return", self.chat.send, True), ("Ctrl+Enter", self.chat.send, True),
                    ("Esc", self.chat.stop, True), ("Ctrl+N", self.new_chat, False),
                    ("Ctrl+F", self.focus_search, False))
        self.chat_shortcuts: list[QShortcut] = []
        for keys, slot, chat_only in bindings:
            shortcut = QShortcut(QKeySequence(keys), self)
            shortcut.setContext(Qt.ShortcutContext.WindowShortcut)
            shortcut.activated.connect(slot)
            if chat_only:
                self.chat_shortcuts.append(shortcut)
        self.tabs.currentChanged.connect(self._enable_chat_shortcuts)
        self._enable_chat_shortcuts(self.tabs.currentIndex())

    def _enable_chat_shortcuts(self, index: int) -> None:
        for shortcut in self.chat_shortcuts:
            shortcut.setEnabled(self.tabs.widget(index) is self.chat_split)

    def _tell_chats_recovered(self, text: str) -> None:
        """Once, without blocking start-up: the chat file was unreadable and was set aside."""
        box = QMessageBox(QMessageBox.Icon.Warning, "Chat history recovered", text, QMessageBox.StandardButton.Ok,
                          self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.setModal(False)
        box.show()
        self.recovery_notice = box

    # ---- conversations ----------------------------------------------------------------------
    def new_chat(self) -> None:
        self.tabs.setCurrentIndex(0)
        self.chat.load_conversation(None)
        self.sidebar.select_id(None)
        self.chat.composer.setFocus()

    def show_view(self, name: str) -> None:
        """Bring a tab to the front by name: chat (or truncated, thinking), models, settings, server."""
        pages = {"models": self.models_tab, "settings": self.settings_tab, "server": self.server_tab}
        self.tabs.setCurrentIndex(self.tabs.indexOf(pages[name]) if name in pages else 0)

    def focus_search(self) -> None:
        self.tabs.setCurrentIndex(0)
        self.sidebar.focus_search()

    def open_conversation(self, conversation_id: int | None) -> None:
        if conversation_id is None:
            self.new_chat()
        else:
            self.chat.load_conversation(conversation_id)

    def _on_conversation_changed(self, _conversation_id: int) -> None:
        """A chat was created or changed (an answer ended in it, shown or not): list it anew, keeping
        the chat shown selected."""
        self.sidebar.refresh()
        self.sidebar.select_id(self.chat.conversation_id)

    def _on_deleted(self, conversation_id: int) -> None:
        self.chat.conversation_deleted(conversation_id)
        # The engine host deletes the chat's cache too (it may hold the chat's words in RAM and on disk).
        backend = self.backend
        run_task(lambda: backend.drop_conversation(conversation_id),
                 on_error=lambda exc: logger.warning("could not delete the chat's engine cache: %s", exc))

    # ---- models and engine ------------------------------------------------------------------
    def refresh_models(self, *, connect: bool) -> None:
        """List the models to choose from (a remote backend's: ask it), off the GUI thread; with
        ``connect``, then load the default one (else the first)."""
        settings = self.settings
        self._connecting += int(connect)
        if settings.backend_url and connect:
            self.status.set_engine_state(f"asking {settings.backend_url} for its models…")
        run_task(lambda: available_models(settings), lambda choices: self._on_listed(settings, choices, connect),
                 lambda exc: self._on_listing_failed(settings, exc, connect), owner=self)

    def _on_installed_changed(self) -> None:
        if not self.settings.backend_url:  # (a remote backend's models are not the ones installed here)
            self.refresh_models(connect=False)

    def _on_listed(self, settings: Settings, choices: list[ModelChoice], connect: bool) -> None:
        self._connecting -= int(connect)
        if backend_changed(settings, self.settings):
            return  # the backend asked is no longer the one in the settings
        if settings.backend_url:
            self.settings_tab.backend_fields.show_result(settings.backend_url, settings.backend_api_key,
                                                         [c.label for c in choices])
            if not choices:
                self._no_remote_models(f"{settings.backend_url} serves no model", connect)
                return
        self._set_choices(choices, connect)

    def _on_listing_failed(self, settings: Settings, exc: BaseException, connect: bool) -> None:
        self._connecting -= int(connect)
        if backend_changed(settings, self.settings):
            return
        if not settings.backend_url:
            self.status.showMessage(f"Could not list models: {exc}", 10_000)
            return
        self.settings_tab.backend_fields.show_result(settings.backend_url, settings.backend_api_key, exc)
        self._no_remote_models(f"Could not list the models of {settings.backend_url}: {exc}", connect)

    def _no_remote_models(self, message: str, connect: bool) -> None:
        """The remote backend offers nothing to load: say why above the chat (Try again asks again);
        a model in use that still answers is left alone, and the message goes to the status bar."""
        self.status.showMessage(message, 15_000)
        if self.connected is not None and not connect:
            return
        self.choices = []
        self.chat.set_choices([], None)
        self._loading = None
        self.status.set_engine_state("no model: the remote backend listed none")
        self.load_banner.show_failure(message, None, can_retry=True)

    def _on_backend_tested(self, url: str, api_key: str | None, names: list[str]) -> None:
        """Settings' Test listed the saved backend's models: they become the chat's choices (and,
        when it had none, the default or first one loads)."""
        switching = self._pending is not None and self._pending.switch  # (the answers still use the old one)
        if url != self.settings.backend_url or api_key != self.settings.backend_api_key or switching:
            return
        if self._connecting:
            return  # the window's own listing of that backend is under way, and loads a model when it ends
        connect = not self.choices and self.connected is None
        self.load_banner.hide()
        self._set_choices([ModelChoice(name, None) for name in names], connect)

    def _set_choices(self, choices: list[ModelChoice], connect: bool) -> None:
        self.choices = choices
        current = self.connected.choice.label if self.connected else self.settings.default_model
        self.chat.set_choices(choices, current)
        if connect and choices:
            by_label = {c.label: c for c in choices}
            self.choose_model(by_label.get(self.settings.default_model or "", choices[0]))

    def choose_model(self, choice: ModelChoice | None) -> None:
        if choice is None:
            return
        if self.chat.is_generating:  # (the chat's model list is greyed out meanwhile)
            pending = self._pending or PendingReload()
            pending.load(choice)
            self._wait_for_answers(pending)
            return
        # No model is connected while this one loads: the stats poll must not see the old one's
        # host stopping as a crash, and a failed load leaves none (see _on_connect_failed).
        self.connected = None
        self._loading = choice
        self.load_banner.hide()
        self.crash_banner.hide()
        self.status.set_engine_state(f"loading {choice.label}…")
        self.chat.set_connected(None)
        self.settings_tab.set_model_context(choice.context_length, choice.label)
        self.server_tab.set_model(None)
        self.engine.request_connect.emit(choice)

    def _use_installed(self, name: str) -> None:
        choice = next((c for c in self.choices if c.label == name), None)
        if choice is None:
            self.status.showMessage(f"{name} is not a model Hearth can run here", 8000)
            return
        self.chat.set_choices(self.choices, name)
        self.choose_model(choice)
        self.tabs.setCurrentIndex(0)

    def _on_connected(self, connected: Connected) -> None:
        self.connected = connected
        self._loading = self._last_loaded = connected.choice
        self._restarting = False
        self.crash_banner.hide()
        self.load_banner.hide()
        if connected.choice.label != self.settings.default_model:  # the next start loads it (it loads)
            self.settings = self.settings.replace(default_model=connected.choice.label)
            self.settings_tab.settings = self.settings  # its Save must not bring the old default back
            save_settings(self.settings)
        self.chat.set_choices(self.choices or [connected.choice], connected.choice.label)
        self.chat.set_connected(connected)
        self.server_tab.set_model(connected.server_name)
        where = "remote backend" if self.backend.is_remote else "local engine"
        self.status.set_engine_state(f"{connected.choice.label} ready ({where})")

    def _on_connect_failed(self, message: str) -> None:
        """A model did not load: say why in the chat area, offer the model used before (or the demo)."""
        self._restarting = False
        self.connected = None
        self.chat.set_connected(None)
        self.server_tab.set_model(None)
        self.crash_banner.hide()
        self.status.set_engine_state("failed to load", crashed=not self.backend.is_remote)
        self.status.showMessage(message, 15_000)
        self.load_banner.show_failure(message, self._fallback_for(self._loading), can_retry=self._loading is not None)

    def _fallback_for(self, failed: ModelChoice | None) -> ModelChoice | None:
        """The model to offer instead of ``failed``: the one loaded before, else the demo."""
        if self.backend.is_remote:
            return None  # every choice goes to the same backend URL
        candidates = [self._last_loaded, *(c for c in self.choices if c.is_demo)]
        return next((c for c in candidates if c is not None and (failed is None or c.label != failed.label)), None)

    def _use_fallback(self, choice: ModelChoice | None) -> None:
        if choice is not None:
            self.chat.set_choices(self.choices or [choice], choice.label)
            self.choose_model(choice)

    def _retry_load(self) -> None:
        if self._loading is not None:
            self.choose_model(self._loading)
        elif self.settings.backend_url:  # the remote backend listed nothing: ask it again
            self.load_banner.hide()
            self.refresh_models(connect=True)

    def show_engine_died(self, reason: str) -> None:
        if self._restarting or self._closing:
            return
        self.connected = None
        self.chat.set_connected(None)
        self.server_tab.set_model(None)
        self.status.set_engine_state("stopped", crashed=True)
        self.crash_banner.show_crash(reason)

    def restart_engine(self) -> None:
        """Restart the engine host (after a failed load: try that model again); the worker always
        answers, with ``connected`` or ``connect_failed``."""
        self._restarting = True
        self.crash_banner.restart_button.setEnabled(False)
        self.load_banner.hide()
        self.status.set_engine_state("restarting…")
        self.engine.request_restart.emit()

    def _fetch_stats(self) -> dict:
        if self.backend.connected is None:
            return {}
        if not self.backend.is_alive():
            raise EngineGoneError("the engine process exited")
        return self.backend.stats()

    def _on_poll_failed(self, message: str) -> None:
        if self.connected is not None and not self._restarting and not self._closing and not self.backend.is_alive():
            self.show_engine_died(message)

    # ---- settings and quitting --------------------------------------------------------------
    def apply_settings(self, settings: Settings) -> None:
        """Saved settings take effect: at once, or, for the engine and the backend while an answer is
        being written, once every answer has ended (see the module docstring)."""
        switched = backend_changed(self.settings, settings)
        engine_changed = restart_needed(self.settings, settings)
        self.settings = settings
        self.chat.context_policy = settings.context_overflow
        self.chat.set_send_key(settings.send_key)
        self.chat.view.set_show_thinking(settings.show_thinking)
        app = QApplication.instance()
        if app is not None:
            self.chat.view.set_dark(apply_theme(app, settings.theme) == "dark")
        self.models_tab.apply_settings(settings)
        if self.chat.is_generating:
            pending = self._pending or PendingReload()
            if switched:
                pending.switch = True
            elif engine_changed and self.connected is not None:
                pending.reload(self.connected.choice)
            if pending.switch or pending.choice is not None:
                self._wait_for_answers(pending)
            return
        self.backend.settings = settings
        if switched:
            self._switch_backend()
        elif engine_changed and self.connected is not None:
            self.choose_model(self.connected.choice)
        elif settings.backend_url and not self.choices and not self._connecting:
            self.refresh_models(connect=True)  # saved again after the backend listed nothing: ask again

    def _switch_backend(self) -> None:
        """Over to the saved backend: the old one's models are no choice there; list the new one's
        and load the default (or first) of them."""
        self.connected = None
        self._loading = self._last_loaded = None
        self.choices = []
        self.chat.set_connected(None)
        self.chat.set_choices([], None)
        self.server_tab.set_model(None)
        self.load_banner.hide()
        self.crash_banner.hide()
        self.refresh_models(connect=True)

    def _wait_for_answers(self, pending: PendingReload) -> None:
        self._pending = pending
        self.status.set_pending(pending.describe(self.settings.backend_url or "the local engine",
                                                 self.chat.answers.count))

    def _on_generating_changed(self, generating: bool) -> None:
        if not generating and self._pending is not None:
            # NOTE: after the answer's own end handling (the chat stores it first), not inside it.
            QTimer.singleShot(0, self._run_pending)

    def _run_pending(self) -> None:
        """The answers have ended: do the reload that waited for them."""
        pending = self._pending
        if pending is None or self.chat.is_generating or self._closing:
            return  # (another answer began meanwhile: it waits for that one too)
        self._pending = None
        self.status.set_pending(None)
        self.backend.settings = self.settings  # held back while the answers used the engine
        if pending.switch:
            self._switch_backend()
        elif pending.choice is not None:
            self.choose_model(pending.choice)

    def _save_think(self, think: bool) -> None:
        self.settings = self.settings.replace(think=think)
        self.settings_tab.settings = self.settings  # its Save must not turn the switch back
        save_settings(self.settings)

    def _save_server_settings(self, server_settings: Settings) -> None:
        self.settings = self.settings.replace(api_host=server_settings.api_host, api_port=server_settings.api_port)
        save_settings(self.settings)

    # ---- window state ---------------------------------------------------------------------------
    def _state(self) -> QSettings:
        return QSettings(str(private_file(data_dir() / STATE_FILE)), QSettings.Format.IniFormat)

    def _restore_state(self) -> None:
        """Geometry and splitters as the last window left them, and the chat it had open."""
        state = self._state()
        for key, restore in (("window/geometry", self.restoreGeometry), ("window/state", self.restoreState),
                             ("chat/splitter", self.chat_split.restoreState),
                             ("models/splitter", self.models_tab.split.restoreState)):
            value = state.value(key)
            if isinstance(value, QByteArray) and not value.isEmpty():
                restore(value)
        if state.value("chat/store") != str(self.store.path):
            return  # the open chat was one of another chat file's
        try:
            conversation_id = int(state.value("chat/last_conversation"))
            self.store.conversation(conversation_id)
        except (TypeError, ValueError, KeyError):
            return  # none was open, or it has been deleted since
        self.chat.load_conversation(conversation_id)
        self.sidebar.select_id(conversation_id)

    def _save_state(self) -> None:
        state = self._state()
        state.setValue("window/geometry", self.saveGeometry())
        state.setValue("window/state", self.saveState())
        state.setValue("chat/splitter", self.chat_split.saveState())
        state.setValue("models/splitter", self.models_tab.split.saveState())
        state.setValue("chat/store", str(self.store.path))
        if self.chat.conversation_id is None:
            state.remove("chat/last_conversation")
        else:
            state.setValue("chat/last_conversation", self.chat.conversation_id)
        state.sync()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt's virtual
        self._closing = True  # (the engine stops below: that is no crash to show)
        self._save_state()
        self.server_tab.stop_server()
        self.chat.save_partial()
        self.chat.save_system_prompt()
        self.poller.timer.stop()
        self.models_tab.close_manager()
        if self._owns_backend:
            self.backend.close()  # ends a stream still waiting on the engine host
        self.engine.shutdown()
        wait_for_tasks(5000)
        if self._owns_store:
            self.store.close()
        super().closeEvent(event)
