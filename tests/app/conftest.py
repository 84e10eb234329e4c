"""Fixtures for the app tests: an isolated Hearth home and HF token store for every test, a fake
Hub serving a tiny real model, settings pointing at it, and an event recorder with bounded waits;
for the GUI tests, ``windows`` (closes what a test opens, fails on leaked windows), a demo-model
engine host per module (``backend``) and ``open_scripted_window`` (main windows over a
``ScriptedBackend``)."""

from __future__ import annotations

import json
import random
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants as hf_constants

from hearth.app.hub.manager import DownloadManager, DownloadOptions
from hearth.app.store.settings import Settings, save_settings
from tests.app.fakehub import FakeFile, FakeHub, FakeRepo

TINY_REPO = "hearth-test/tiny-deepseek"
GATED_REPO = "hearth-test/gated-model"
TINY_CONFIG = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8, "moe_intermediate_size": 32,
    "kv_lora_rank": 32, "qk_rope_head_dim": 16, "vocab_size": 256, "torch_dtype": "bfloat16",
}


def safetensors_bytes(num_floats: int, seed: int) -> bytes:
    """A valid safetensors file holding one float32 tensor of pseudo-random values."""
    payload = random.Random(seed).randbytes(num_floats * 4)
    header = json.dumps({"weight": {"dtype": "F32", "shape": [num_floats],
                                    "data_offsets": [0, len(payload)]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + payload


def tiny_model_files(seed: int = 1, num_floats: int = 64 * 1024) -> dict[str, FakeFile]:
    files = [
        FakeFile("config.json", json.dumps(TINY_CONFIG).encode()),
        FakeFile("model.safetensors", safetensors_bytes(num_floats, seed), is_lfs=True),
        FakeFile("tokenizer.json", b'{"placeholder": "tiny tokenizer for download tests"}'),
        FakeFile("pytorch_model.bin", b"\x80\x04 pickled weights Hearth must never fetch", is_lfs=True),
        FakeFile("README.md", b"# tiny\n"),
    ]
    return {f.path: f for f in files}


def write_tiny_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in tiny_model_files().values():
        if f.path != "pytorch_model.bin":
            (folder / f.path).write_bytes(f.content)
    return folder


def add_unloadable_repos(hub: FakeHub) -> None:
    """Repos Hearth cannot load: pickle-only, GGUF-only, and llama (one whose listing names no type)."""
    config, pickle = tiny_model_files()["config.json"], tiny_model_files()["pytorch_model.bin"]
    hub.add_repo(FakeRepo("hearth-test/pickle-only", {f.path: f for f in (config, pickle)}, commit="d" * 40,
                          model_type="deepseek_v3"))
    gguf = FakeFile("model.Q4_K_M.gguf", b"GGUF" + bytes(4096), is_lfs=True)
    hub.add_repo(FakeRepo("hearth-test/gguf-only", {gguf.path: gguf}, commit="e" * 40))
    llama = {**tiny_model_files(seed=3), "config.json": FakeFile("config.json", b'{"model_type": "llama"}')}
    hub.add_repo(FakeRepo("meta/llama-tiny", llama, commit="c" * 40, model_type="llama"))
    hub.add_repo(FakeRepo("meta/llama-unlisted", dict(llama), commit="f" * 40, model_type=None))


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Hearth's folders under tmp_path, and no token from this machine's environment or login."""
    home = tmp_path / "hearth-home"
    monkeypatch.setenv("HEARTH_HOME", str(home))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-hf-token"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")  # the fake Hub speaks plain HTTP only
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    # DownloadManager tunes these process-wide; restore them after each test.
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", hf_constants.HF_HUB_DOWNLOAD_TIMEOUT)
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", hf_constants.DOWNLOAD_CHUNK_SIZE)
    return home


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub()
    hub.add_repo(FakeRepo(TINY_REPO, tiny_model_files(), commit="a" * 40, downloads=500, likes=10,
                          trending=3.0, model_type="deepseek_v3"))
    gated_files = {p: f for p, f in tiny_model_files(seed=2).items() if p != "pytorch_model.bin"}
    hub.add_repo(FakeRepo(GATED_REPO, gated_files, commit="b" * 40, gated=True, downloads=900,
                          likes=50, trending=9.0, model_type="deepseek_v32"))
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture
def settings(fake_hub: FakeHub, tmp_path: Path) -> Settings:
    """Settings pointing at the fake Hub and a fresh HF cache, saved where the CLI reads them."""
    s = Settings(hf_endpoint=fake_hub.url, hf_cache_dir=str(tmp_path / "hf-cache"), download_parallelism=2)
    save_settings(s)
    return s


FAST = DownloadOptions(stall_timeout_s=1.0, max_retries=4, backoff_base_s=0.05, backoff_max_s=0.2,
                       progress_interval_s=0.05, chunk_bytes=16 * 1024)


class EventLog:
    """Collects manager events from any thread; ``wait_for`` blocks (bounded) until one matches."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self._cond = threading.Condition()

    def __call__(self, event: Any) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, kind: type) -> list[Any]:
        with self._cond:
            return [e for e in self.events if isinstance(e, kind)]

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                match = next((e for e in self.events if predicate(e)), None)
                if match is not None:
                    return match
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no matching event within {timeout}s: {self.events[-5:]}")
                self._cond.wait(remaining)


@pytest.fixture
def make_manager(settings: Settings) -> Iterator[Callable[..., tuple[DownloadManager, EventLog]]]:
    managers: list[DownloadManager] = []

    def make(options: DownloadOptions = FAST, settings_: Settings | None = None) -> tuple[DownloadManager, EventLog]:
        log = EventLog()
        manager = DownloadManager(settings_ or settings, on_event=log, options=options)
        manager.start()
        managers.append(manager)
        return manager, log

    yield make
    for manager in managers:
        manager.close(timeout=5)


# ---- GUI modules: one engine host serving the demo model per test module ---------------------


@pytest.fixture(scope="module")
def engine_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-home")


@pytest.fixture(scope="module")
def backend(engine_home: Path) -> Iterator[Any]:
    """The GUI's Backend connected to a demo-model engine host started under ``engine_home`` (modules
    with their own ``backend``, like test_cli's HTTP server, override it)."""
    from tests.app.test_gui_helpers import shared_demo_backend  # imports Qt: only where used

    with shared_demo_backend(engine_home) as shared:
        yield shared


@pytest.fixture
def windows() -> Iterator[Any]:
    """Tracks the widgets a test opens; closes them afterwards and fails on leaked top-level widgets."""
    from tests.app.test_gui_helpers import windows_checked  # imports Qt: only where used

    with windows_checked() as opened:
        yield opened


@pytest.fixture
def open_scripted_window(qtbot: Any, tmp_path: Path, windows: Any) -> Callable[..., Any]:
    """Opens a main window over a ``ScriptedBackend`` (a new one unless given; the test writes its
    answers) with isolated settings (``changes`` on top), once its model is connected."""
    from hearth.app.gui.main_window import MainWindow
    from tests.app.test_gui_helpers import FAST_DOWNLOADS, SCRIPTED_TIMEOUT_MS, ScriptedBackend, isolated_settings

    def open_(backend: ScriptedBackend | None = None, **changes: object) -> MainWindow:
        window = MainWindow(isolated_settings(tmp_path, **changes), backend=backend or ScriptedBackend(),
                            download_options=FAST_DOWNLOADS)
        windows.track(window)
        qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=SCRIPTED_TIMEOUT_MS)
        return window

    return open_


@pytest.fixture
def open_window(qtbot: Any, backend: Any, engine_home: Path, tmp_path: Path, windows: Any) -> Callable[..., Any]:
    """Opens a main window over the module's shared demo-model ``backend`` with isolated settings
    (``changes`` on top), once its model is connected."""
    from hearth.app.gui.main_window import MainWindow
    from tests.app.test_gui_helpers import FAST_DOWNLOADS, isolated_settings, link_demo_model

    link_demo_model(engine_home)

    def open_(**changes: object) -> MainWindow:
        window = MainWindow(isolated_settings(tmp_path, **changes), backend=backend, download_options=FAST_DOWNLOADS)
        windows.track(window)
        qtbot.waitUntil(lambda: window.chat.connected is not None, timeout=60_000)
        return window

    return open_
