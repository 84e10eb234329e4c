"""The chat tab: controls on top, the thread in the middle, the composer below; and the logic of
sending, stopping, regenerating, editing and versions (streaming is ``answers.Answers``'s).

Every message is written to the store when it starts (an empty, incomplete answer) and when it
completes or stops; ``save_partial()`` writes the answers still running (used when quitting). Typed
text is never lost: each chat keeps its unsent draft (and a new chat its system prompt) while another
is open, and editing a message puts the draft aside until the edit is sent or cancelled.

An answer belongs to its chat, not to the view: another chat can be opened, or a new one started,
while it streams; it goes on into its own chat. Stop, Esc, Send and the busy state follow the chat
shown. A message sent in a second chat while the first's answer streams is not refused: it waits
for that answer (the engine worker writes one at a time; its bubble says so, Stop cancels it). Why
an answer failed or was not sent is said at the end of its chat whenever that chat is shown (also
when it ended while another was), until the next answer begins there.
"""

from __future__ import annotations

from typing import Any

from hearth.app.gui.answers import Answers, Generation, chat_title
from hearth.app.gui.backend import Connected, ModelChoice
from hearth.app.gui.chat_controls import ContextMeter, ModelPicker, SamplingPanel, SystemPromptPanel
from hearth.app.gui.chat_view import ChatView
from hearth.app.gui.composer import SEND_KEY_NAMES, Composer, Draft
from hearth.app.gui.engine_worker import EngineThread, GenerationResult
from hearth.app.gui.message_widget import MessageView
from hearth.app.gui.qt import QHBoxLayout, QLabel, QPushButton, QTextCursor, QVBoxLayout, QWidget, Signal
from hearth.app.gui.resources import icon
from hearth.app.gui.tasks import run_task
from hearth.app.store.chats import ChatStore, Message, Preset
from hearth.app.store.settings import SendKey


class ChatPanel(QWidget):
    conversation_changed = Signal(int)  # a conversation was created or changed (sidebar refresh)
    model_chosen = Signal(object)  # ModelChoice
    busy_changed = Signal(bool)  # the chat shown has (True) or no longer has an answer running or waiting
    generating_changed = Signal(bool)  # some chat has (True) or no chat has any more an answer running or waiting

    def __init__(self, store: ChatStore, engine: EngineThread, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store, self.engine = store, engine
        self.conversation_id: int | None = None
        self.connected: Connected | None = None
        self.editing_id: int | None = None
        self._draft_before_edit = ""  # the message box's text when an edit began (back when it ends)
        self._drafts: dict[int | None, Draft] = {}  # per conversation (None: the new, unsaved chat)
        self._notices: dict[int, str] = {}  # per chat: why its last answer failed or was not sent
        self._shown_busy = False  # what busy_changed last said
        self._any_busy = False  # what generating_changed last said
        self._meter: tuple[int, bool] | None = None  # (tokens in the context, exact) between answers
        self._count_generation = 0  # drops stale background counts
        self.context_policy = "truncate"  # Settings.context_overflow: "truncate" or "stop"
        self._build()
        self.answers = Answers(store, engine, self.view, lambda: self.conversation_id, self)
        self._wire()

    # ---- layout -----------------------------------------------------------------------------
    def _build(self) -> None:
        layout = QVBoxLayout(self)
        top = QHBoxLayout()
        self.model_picker = ModelPicker(self)
        self.system_button = self._toggle("System prompt", "system")
        self.sampling_button = self._toggle("Sampling", "settings")
        self.think_button = QPushButton("Think", self)
        self.think_button.setCheckable(True)
        self.think_button.setToolTip("Ask the model to reason before it answers (the chat template's thinking "
                                     "switch: DeepSeek-V3.2, GLM, Qwen3). gpt-oss always reasons.")
        self.context_meter = ContextMeter(self)
        for widget in (QLabel("Model:"), self.model_picker, self.system_button, self.sampling_button,
                       self.think_button):
            top.addWidget(widget)
        top.addStretch(1)
        top.addWidget(self.context_meter)
        layout.addLayout(top)
        self.system_panel = SystemPromptPanel(self)
        self.sampling_panel = SamplingPanel(self)
        self.system_panel.hide()
        self.sampling_panel.hide()
        self.system_button.toggled.connect(self.system_panel.setVisible)
        self.sampling_button.toggled.connect(self.sampling_panel.setVisible)
        layout.addWidget(self.system_panel)
        layout.addWidget(self.sampling_panel)
        self.view = ChatView(self)
        layout.addWidget(self.view, 1)
        self.edit_banner = QLabel("Editing a message: Send adds it as a new version (Esc cancels).", self)
        self.edit_banner.setObjectName("hintLabel")
        self.edit_banner.hide()
        layout.addWidget(self.edit_banner)
        layout.addLayout(self._composer_row())

    def _composer_row(self) -> QHBoxLayout:
        row = QHBoxLayout()
        self.composer = Composer(self)
        self.send_button = QPushButton(icon("send"), "Send", self)
        self.send_button.setObjectName("primary")
        self.send_button.setToolTip("Send (Enter)")
        self.stop_button = QPushButton(icon("stop"), "Stop", self)
        self.stop_button.setToolTip("Stop the answer (Esc)")
        self.stop_button.hide()
        row.addWidget(self.composer, 1)
        row.addWidget(self.send_button)
        row.addWidget(self.stop_button)
        return row

    def _toggle(self, text: str, icon_name: str) -> QPushButton:
        button = QPushButton(icon(icon_name), text, self)
        button.setCheckable(True)
        return button

    def _wire(self) -> None:
        self.composer.submitted.connect(self.send)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.stop)
        self.model_picker.chosen.connect(self.model_chosen)
        self.view.edit_requested.connect(self.begin_edit)
        self.view.regenerate_requested.connect(self.regenerate)
        self.view.version_requested.connect(self.show_version)
        self.sampling_panel.changed.connect(self._save_sampling)
        self.system_panel.save_preset_requested.connect(self._save_preset)
        self.system_panel.delete_preset_requested.connect(self._delete_preset)
        self.system_panel.preset_chosen.connect(self._apply_preset)
        self.answers.changed.connect(self._update_buttons)
        self.answers.progressed.connect(self._update_meter)
        self.answers.ended.connect(self._on_answer_ended)
        self.system_panel.set_presets(self.store.presets())

    # ---- state ------------------------------------------------------------------------------
    @property
    def is_busy(self) -> bool:
        """The chat shown has an answer running or waiting for its turn."""
        return self.answers.shown is not None

    @property
    def is_generating(self) -> bool:
        """Some chat, shown or not, has an answer running or waiting."""
        return self.answers.is_any

    def generating_in(self, conversation_id: int) -> bool:
        return self.answers.of(conversation_id) is not None

    def set_send_key(self, send_key: SendKey) -> None:
        """Which Enter sends (``Settings.send_key``); the message box, Send and the empty chat's hint say it."""
        self.composer.set_send_key(send_key)
        self.view.set_send_key(send_key)
        self._update_buttons()

    def set_connected(self, connected: Connected | None) -> None:
        self.connected = connected
        self.view.set_demo_hint(connected is not None and connected.choice.is_demo)
        if connected is not None:
            self.sampling_panel.set_values(self.store.model_sampling(connected.choice.label))
        self._update_buttons()
        self.count_context()

    def _update_buttons(self) -> None:
        shown, elsewhere = self.answers.shown, self.answers.elsewhere()
        busy = shown is not None
        self.send_button.setVisible(not busy)
        self.stop_button.setVisible(busy)
        self.send_button.setEnabled(self.connected is not None)
        send = f"Send ({SEND_KEY_NAMES[self.composer.send_key]})"
        self.send_button.setToolTip(send if elsewhere is None else f"{send}: the answer starts once the one being "
                                    f"written in “{chat_title(self.store, elsewhere.conversation_id)}” is done")
        self.stop_button.setToolTip("Cancel this waiting answer (Esc)" if shown is not None and shown.is_waiting
                                    else "Stop the answer (Esc)")
        self.model_picker.setEnabled(not self.is_generating)
        self.model_picker.setToolTip("" if not self.is_generating else
                                     "The model can change once every answer being written is done")
        self.view.set_busy(busy)
        if busy != self._shown_busy:
            self._shown_busy = busy
            self.busy_changed.emit(busy)
        if self.is_generating != self._any_busy:
            self._any_busy = self.is_generating
            self.generating_changed.emit(self._any_busy)

    def cancel_generation(self, conversation_id: int) -> None:
        """Stop the answer being written (or waiting) in a chat about to be deleted, and forget it:
        its late chunks and its end are ignored, and nothing more of it is stored."""
        self.answers.cancel(conversation_id)

    def conversation_deleted(self, conversation_id: int) -> None:
        """The store no longer has this conversation: its answer is stopped and forgotten, and if it
        is the open one, a fresh chat is shown."""
        self.cancel_generation(conversation_id)
        self._notices.pop(conversation_id, None)
        self._drafts.pop(conversation_id, None)
        if conversation_id != self.conversation_id:
            return
        self.conversation_id = None  # nothing of it is left to save
        self.load_conversation(None, keep_draft=False)  # what was typed in it goes with it

    def load_conversation(self, conversation_id: int | None, *, keep_draft: bool = True) -> None:
        """Show a conversation (None: a fresh, unsaved one); what was typed in the one shown before
        is kept for when it is opened again (unless ``keep_draft`` is False). An answer being written
        in either goes on: the one left keeps streaming into its chat, the one opened shows as far as
        it has come."""
        self.save_system_prompt()
        self.cancel_edit()
        if keep_draft:
            self._keep_draft()
        self.conversation_id = conversation_id
        draft = self._drafts.pop(conversation_id, Draft())
        conv = self.store.conversation(conversation_id) if conversation_id is not None else None
        self.system_panel.editor.setPlainText(conv.system_prompt if conv else draft.system_prompt)
        self.composer.setPlainText(draft.text)
        self.composer.moveCursor(QTextCursor.MoveOperation.End)
        self._reload_thread()
        self.view.clear_notice()  # (the chat left may have had one)
        notice = self._notices.get(conversation_id) if conversation_id is not None else None
        if notice:
            self.view.show_notice(notice)
        self._update_buttons()
        self.count_context()

    def _keep_draft(self) -> None:
        """Set aside what was typed in the open chat (and a new chat's system prompt)."""
        system = self.system_panel.editor.toPlainText() if self.conversation_id is None else ""
        draft = Draft(self.composer.toPlainText(), system)
        if draft.text or draft.system_prompt:
            self._drafts[self.conversation_id] = draft
        else:
            self._drafts.pop(self.conversation_id, None)

    def _reload_thread(self) -> None:
        thread = self.store.thread(self.conversation_id) if self.conversation_id is not None else []
        views = [MessageView(m, tuple(v.id for v in self.store.versions(m.id))) for m in thread]
        self.view.set_thread(views)
        self.view.set_context_marker(_context_start(thread))
        self.answers.show_live()  # an answer being written here, as far as it has come
        self._update_meter()

    # ---- actions ----------------------------------------------------------------------------
    def send(self) -> None:
        text = self.composer.toPlainText().strip()
        if not text or self.is_busy or self.connected is None:
            return
        conv_id = self._ensure_conversation(text)
        if self.editing_id is not None:
            parent_id = self.store.message(self.editing_id).parent_id
        else:
            parent_id = self.store.conversation(conv_id).current_leaf_id
        user = self.store.add_message(conv_id, "user", text, parent_id=parent_id)
        self.composer.clear()
        self.cancel_edit()  # an edit sent: the draft put aside for it comes back
        self._start_answer(user)

    def regenerate(self, assistant_id: int) -> None:
        if self.is_busy or self.connected is None:
            return
        parent_id = self.store.message(assistant_id).parent_id
        if parent_id is not None:
            self._start_answer(self.store.message(parent_id))

    def show_version(self, message_id: int) -> None:
        if not self.is_busy:
            self.store.select_version(message_id)
            self._reload_thread()

    def begin_edit(self, user_id: int) -> None:
        """Put a sent message in the message box to edit; what was typed there waits aside."""
        if self.is_busy:
            return
        if self.editing_id is None:
            self._draft_before_edit = self.composer.toPlainText()
        self.editing_id = user_id
        self.composer.setPlainText(self.store.message(user_id).content)
        self.composer.moveCursor(QTextCursor.MoveOperation.End)
        self.edit_banner.show()
        self.composer.setFocus()

    def cancel_edit(self) -> None:
        """End an edit (sent or not): the message box gets back what was typed before it."""
        if self.editing_id is None:
            return
        self.editing_id = None
        self.edit_banner.hide()
        self.composer.setPlainText(self._draft_before_edit)
        self.composer.moveCursor(QTextCursor.MoveOperation.End)
        self._draft_before_edit = ""

    def stop(self) -> None:
        """Esc: stop the answer being written in the chat shown (one still waiting for its turn is
        cancelled at once), or cancel an edit (never clears what was typed)."""
        if self.is_busy:
            self.answers.stop(self.conversation_id)
        else:
            self.cancel_edit()

    def _ensure_conversation(self, first_text: str) -> int:
        if self.conversation_id is None:
            title = " ".join(first_text.split())[:48] or "New chat"
            conv = self.store.create_conversation(title, system_prompt=self.system_panel.text(),
                                                  model=self._model_label())
            self.conversation_id = conv.id
            self._drafts.pop(None, None)  # the new chat's draft became this conversation
        else:
            self.save_system_prompt()
        self.conversation_changed.emit(self.conversation_id)
        return self.conversation_id

    def _start_answer(self, user: Message) -> None:
        assert self.conversation_id is not None and self.connected is not None
        history = self.store.thread(self.conversation_id, user.id)
        answer = self.store.add_message(self.conversation_id, "assistant", "", parent_id=user.id,
                                        model=self._model_label(), is_complete=False)
        sent = [m for m in history if m.content or m.role == "user"]
        self._notices.pop(self.conversation_id, None)  # what went wrong last time is not this answer's
        self.view.clear_notice()
        self._count_generation += 1
        self.answers.begin(self.conversation_id, answer, sent, self._messages(sent), self._request_options(),
                           self.context_policy)
        self._reload_thread()
        self._update_buttons()

    def _messages(self, history: list[Message]) -> list[dict[str, str]]:
        """The request's messages: the answers' content only, as the releases' templates drop
        earlier reasoning anyway."""
        system = self.system_panel.text()
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": m.role, "content": m.content} for m in history]

    def _request_options(self) -> dict[str, Any]:
        """Sampling, plus the templates' thinking switch (both names templates use) when Think is on."""
        options: dict[str, Any] = self.sampling_panel.values()
        if self.think_button.isChecked():
            options["chat_template_kwargs"] = {"thinking": True, "enable_thinking": True}
        return options

    def _model_label(self) -> str | None:
        return self.connected.choice.label if self.connected else None

    # ---- an answer ended --------------------------------------------------------------------
    def _on_answer_ended(self, generation: Generation, result: GenerationResult, message: Message | None) -> None:
        """Show how an answer ended if its chat is shown; otherwise why it failed waits for that chat."""
        shown = generation.conversation_id == self.conversation_id
        notice = None
        if result.finish_reason == "context_full":
            notice = result.error or "This chat has outgrown the model's context."
            if shown:
                self._reload_thread()  # without the answer that was never sent
        elif shown and message is not None:
            self.view.update_message(message)
            stats = message.stats
            if stats is not None and stats.prompt_tokens is not None and stats.completion_tokens is not None:
                self._meter = (stats.prompt_tokens + stats.completion_tokens, True)
            else:
                self.count_context()
        if result.error and result.finish_reason != "context_full" and not result.engine_died:
            notice = f"The answer failed: {result.error}"
        if notice:
            self._notices[generation.conversation_id] = notice  # said again when the chat is opened again
            if shown:
                self.view.show_notice(notice)
        self._update_buttons()
        self._update_meter()
        self.conversation_changed.emit(generation.conversation_id)

    def save_partial(self) -> None:
        """Write every answer being written as it is now (quitting mid-answer keeps them) and stop them."""
        self.answers.save_partial()

    # ---- context meter, sampling, presets ---------------------------------------------------
    def _update_meter(self) -> None:
        """Tokens in the model's context: the running request's prompt (counted by the server)
        plus what has streamed, or between answers the last count."""
        limit = self.connected.context_length if self.connected else 0
        shown = self.answers.shown
        if shown is not None:
            if shown.prompt_tokens is None:
                return  # counted before the first chunk arrives
            streamed = (len(shown.text) + len(shown.reasoning) + 3) // 4
            self.context_meter.set_usage(shown.prompt_tokens + streamed, limit, estimated=streamed > 0)
        elif self._meter is not None:
            self.context_meter.set_usage(self._meter[0], limit, estimated=not self._meter[1])
        else:
            self.context_meter.set_usage(0, limit)

    def count_context(self) -> None:
        """Count this conversation as it would be sent now (a background request to the server)."""
        self._count_generation += 1
        if self.is_busy and self.connected is not None:
            return  # the answer's own count follows it; one made now would be dropped (see show)
        generation, backend = self._count_generation, self.engine.worker.backend
        thread = self.store.thread(self.conversation_id) if self.conversation_id is not None else []
        messages = self._messages([m for m in thread if m.content or m.role == "user"])
        if self.connected is None or not messages:
            self._meter = None
            self._update_meter()
            return

        def show(result: tuple[int, bool]) -> None:
            if generation == self._count_generation and not self.is_busy:
                self._meter = result
                self._update_meter()

        # on failure the meter keeps its value
        run_task(lambda: backend.count_tokens(messages), show, lambda _exc: None, owner=self)

    def _save_sampling(self) -> None:
        if self.connected is not None:
            self.store.save_model_sampling(self.connected.choice.label, self.sampling_panel.values())

    def save_system_prompt(self) -> None:
        if self.conversation_id is not None:
            self.store.update_conversation(self.conversation_id, system_prompt=self.system_panel.text())

    def _save_preset(self, name: str) -> None:
        if not name:
            self.window().statusBar().showMessage("Give the preset a name first", 5000)
            return
        self.store.save_preset(Preset(name, self.system_panel.text(), self.sampling_panel.values()))
        self.system_panel.set_presets(self.store.presets())

    def _delete_preset(self, name: str) -> None:
        if name:
            self.store.delete_preset(name)
            self.system_panel.set_presets(self.store.presets())

    def _apply_preset(self, preset: Preset | None) -> None:
        if preset is None:
            return
        self.system_panel.editor.setPlainText(preset.system_prompt)
        if preset.sampling:
            self.sampling_panel.set_values(preset.sampling)
            self._save_sampling()
        self.save_system_prompt()

    def set_choices(self, choices: list[ModelChoice], current_label: str | None) -> None:
        self.model_picker.set_choices(choices, current_label)


def _context_start(thread: list[Message]) -> int | None:
    """Where the model's context began for the thread's latest answer (None: nothing was dropped)."""
    for message in reversed(thread):
        if message.role == "assistant" and message.stats is not None:
            start = message.stats.context_start_id
            return start if start is not None and any(m.id == start for m in thread) else None
    return None
