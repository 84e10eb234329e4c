"""The GUI's view of an engine, Qt-free: which models can be chosen, the demo model, and one object
that talks to the engine host (local ``EngineProcess``) or a remote OpenAI-compatible backend.

Everything here blocks, so the GUI calls it only from its engine worker thread or the thread pool.
The model code itself never runs in the GUI process: the local engine is a separate host process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearth.app.client.context_window import ContextFit, answer_reserve, estimate_tokens, fit_messages
from hearth.app.demo_model import DEMO_LABEL
from hearth.app.paths import data_dir, prefix_cache_dir
from hearth.app.store.settings import Settings

DEMO_ARCH = "deepseek_v32"
_demo_lock = threading.Lock()


@dataclass(frozen=True)
class ModelChoice:
    """An entry of the model picker. ``path`` is the folder the local engine loads (None: remote)."""

    label: str
    path: str | None
    is_demo: bool = False
    context_length: int | None = None


@dataclass(frozen=True)
class Connected:
    """A model is loaded and served under ``server_name``; ``context_length`` is what requests may hold."""

    choice: ModelChoice
    server_name: str
    context_length: int


def demo_model_dir() -> Path:
    return data_dir() / "demo-model"


def ensure_demo_model() -> Path:
    """The demo model folder: the trained one bundled in hearth.resources, or (a build without it)
    a random-weight tiny model written on first use, whose text is gibberish."""
    from hearth.app.demo_model import bundled_demo_path

    bundled = bundled_demo_path()
    if bundled is not None:
        return bundled
    folder = demo_model_dir()
    with _demo_lock:
        if (folder / "config.json").is_file():
            return folder
        from hearth.engine.testing.tiny import write_tiny_model  # lazy: imports torch

        tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=folder.parent))
        try:
            write_tiny_model(tmp, DEMO_ARCH, seed=0)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def model_context_length(folder: str | Path | None) -> int | None:
    """``max_position_embeddings`` from a model folder's config.json, if readable."""
    if folder is None:
        return None
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        return int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cuda_available() -> bool:
    """Whether this machine has a CUDA GPU PyTorch can use (imports torch: seconds, off the GUI thread)."""
    import torch

    return bool(torch.cuda.is_available())


def available_models(settings: Settings) -> list[ModelChoice]:
    """Installed, verified models Hearth can run, then the demo model (always offered); with a
    remote backend, the models it serves (raises ``ClientError`` when it cannot say)."""
    if settings.backend_url is not None:
        return remote_models(settings)
    from hearth.app.hub import HubContext, list_installed

    choices = []
    try:
        installed = list_installed(HubContext.from_settings(settings))
    except Exception:  # a broken cache must not hide the demo model
        installed = []
    for model in installed:
        if model.is_ready and model.is_supported:
            choices.append(ModelChoice(model.name, str(model.path), False, model_context_length(model.path)))
    from hearth.app.demo_model import bundled_demo_path

    demo = bundled_demo_path() or demo_model_dir()
    choices.append(ModelChoice(DEMO_LABEL, str(demo), True, model_context_length(demo) or 2048))
    return choices


def remote_models(settings: Settings) -> list[ModelChoice]:
    """The models ``settings.backend_url`` serves (its ``/v1/models``), as choices without a folder."""
    from hearth.app.client.openai_client import probe_models

    assert settings.backend_url is not None
    return [ModelChoice(name, None) for name in probe_models(settings.backend_url, settings.backend_api_key)]


def effective_context(settings: Settings, choice: ModelChoice) -> int:
    limit = choice.context_length or model_context_length(choice.path)
    return min(settings.context_length, limit) if limit else settings.context_length


class Backend:
    """One engine connection: the local engine host (default) or ``settings.backend_url``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._engine: Any = None  # hearth.app.client.local_engine.EngineProcess
        self._client: Any = None  # hearth.app.client.openai_client.ChatClient (streams)
        self._stats_client: Any = None  # a second client: stats are polled from another thread
        self._can_count = True  # the server counts tokens (/hearth/tokenize); False: estimate
        self.connected: Connected | None = None
        self.choice: ModelChoice | None = None  # the model last asked for (loaded or not): what restart() loads

    @property
    def is_remote(self) -> bool:
        return bool(self.settings.backend_url)

    def connect(self, choice: ModelChoice) -> Connected:
        """Load ``choice`` (starting the engine host if needed); returns what is now served. Until
        it is, nothing counts as connected: a failed load leaves no model (and no crash to report)."""
        self.connected = None
        self.choice = choice
        self.connected = self._load(choice)
        return self.connected

    def _load(self, choice: ModelChoice) -> Connected:
        from hearth.app.client.openai_client import ChatClient

        if choice.is_demo:
            ensure_demo_model()
        if self.is_remote:
            base_url, api_key = self.settings.backend_url, self.settings.backend_api_key
        else:
            base_url, api_key = self._ensure_local(choice)
        self._close_clients()
        self._client = ChatClient(base_url, api_key=api_key)
        self._stats_client = ChatClient(base_url, api_key=api_key)
        self._can_count = True
        server_name = self._server_name(choice)
        return Connected(choice, server_name, effective_context(self.settings, choice))

    def _ensure_local(self, choice: ModelChoice) -> tuple[str, str | None]:
        from hearth.app.client.local_engine import EngineProcess

        if choice.path is None:
            raise ValueError(f"{choice.label} has no local folder to load")
        path = str(Path(choice.path).expanduser().resolve())
        options = self._engine_options(choice)
        engine = self._engine
        if not (engine is not None and engine.model == path and engine.options == options and engine.is_alive()):
            self._engine = EngineProcess.ensure_running(path, **options)
            if engine is not None and engine.pid != self._engine.pid and engine.is_alive():
                engine.stop()  # the host this window used before (another home's, say): not left behind
        return self._engine.base_url, self._engine.api_key

    def _engine_options(self, choice: ModelChoice) -> dict[str, Any]:
        """The engine host's options: every engine setting (None ones are left to the host's planner),
        with the context length capped by the model's."""
        engine = dataclasses.replace(self.settings.engine, max_model_len=effective_context(self.settings, choice))
        if engine.prefix_cache_dir is None:
            engine = dataclasses.replace(engine, prefix_cache_dir=str(prefix_cache_dir()))
        return {key: value for key, value in dataclasses.asdict(engine).items() if value is not None}

    def _server_name(self, choice: ModelChoice) -> str:
        try:
            names = [_model_id(m) for m in self._client.models()]
        except Exception:
            names = []
        if self.is_remote:
            return choice.label if choice.label in names or not names else names[0]
        return names[0] if names else (choice.path or choice.label)

    def stream(self, messages: list[dict[str, str]], sampling: dict[str, Any],
               conversation_id: int | None = None) -> Iterator[Any]:
        """``ChatChunk``s of one answer; closing the iterator aborts the request. The local engine
        host learns the chat (``conversation_id``), so it keeps the chat's cache for the next turn."""
        if self.connected is None or self._client is None:
            raise RuntimeError("No model is loaded")
        chat = cache_key(conversation_id) if conversation_id is not None and not self.is_remote else None
        return self._client.stream_chat(self.connected.server_name, messages, conversation_id=chat, **sampling)

    def drop_conversation(self, conversation_id: int) -> int:
        """Delete a deleted chat's cache on the local engine host; 0 when none is connected (its
        files then go when the cache's disk budget needs the room)."""
        client = self._stats_client
        if client is None or self.is_remote:
            return 0
        return client.drop_conversation(cache_key(conversation_id))

    def count_tokens(self, messages: list[dict[str, Any]]) -> tuple[int, bool]:
        """The prompt length of ``messages`` and whether it is exact (counted by the server with
        the model's tokenizer and template) or estimated (servers that cannot count)."""
        client, connected = self._stats_client, self.connected
        if client is None or connected is None:
            raise RuntimeError("No model is loaded")
        if self._can_count:
            count = client.count_tokens(connected.server_name, messages)
            if count is not None:
                return count, True
            self._can_count = False
        return estimate_tokens(messages), False

    def fit_context(self, messages: list[dict[str, Any]], max_tokens: int | None, policy: str) -> ContextFit:
        """``messages`` made to fit the model's context by ``policy`` (the ``context_overflow``
        setting; raises ``ContextFullError`` when they cannot be)."""
        if self.connected is None:
            raise RuntimeError("No model is loaded")
        limit = self.connected.context_length
        fit = fit_messages(messages, lambda batch: self.count_tokens(list(batch))[0], context_length=limit,
                           reserve=answer_reserve(limit, max_tokens), policy=policy)
        return dataclasses.replace(fit, exact=self._can_count)

    def upstream(self) -> tuple[str, str | None] | None:
        """(base URL, token) of the engine now in use, or None with no model; thread-safe (the app's
        API server switch calls it per request)."""
        client = self._stats_client
        return (client.base_url, client.api_key) if client is not None and self.connected is not None else None

    def stats(self) -> dict[str, Any]:
        if self._stats_client is None:
            return {}
        return dict(self._stats_client.stats())

    def is_alive(self) -> bool:
        if self.is_remote:
            return self._stats_client is not None
        return self._engine is not None and bool(self._engine.is_alive())

    def engine_pid(self) -> int | None:
        return None if self._engine is None else int(self._engine.pid)

    def restart(self) -> Connected:
        """Start the engine host again (same model and options) and reconnect to it; after a load
        that failed, try that model again. Raises when no model was ever chosen."""
        choice = self.connected.choice if self.connected else self.choice
        if choice is None:
            raise RuntimeError("no model has been chosen yet: pick one in the chat's model list")
        self.connected = None
        engine = self._engine
        if engine is not None and not self.is_remote and engine.model == _folder(choice):
            engine.restart()  # (a host of another model is replaced by connect, not restarted first)
        return self.connect(choice)

    def _close_clients(self) -> None:
        for client in (self._client, self._stats_client):
            if client is not None:
                client.close()
        self._client = self._stats_client = None

    def close(self) -> None:
        self._close_clients()
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
        self.connected = None


def _folder(choice: ModelChoice) -> str | None:
    return str(Path(choice.path).expanduser().resolve()) if choice.path is not None else None


def cache_key(conversation_id: int) -> str:
    """The engine host's name of a chat of the chat store."""
    return f"chat-{conversation_id}"


def _model_id(entry: Any) -> str:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        return str(entry.get("id"))
    return str(getattr(entry, "id", entry))
