"""EngineProcess: the local engine host (``python -m hearth.engine.server``) as a managed subprocess.

    proc = EngineProcess.ensure_running("/models/DeepSeek-V3.2", max_model_len=16384)
    client = proc.client()            # a ChatClient with the right URL and token

``ensure_running`` reuses a host that is already running (its pid is alive and ``/health``
answers with the recorded token) when it serves the same model with the same options; otherwise
it starts one on 127.0.0.1 on a free port with a fresh random token, waits (bounded) until it
answers, and records ``{pid, port, token, model, options}`` in ``engine-host.json`` under the
user runtime folder (readable by the user only). The token reaches the child through an
environment variable, never its command line. The host runs in its own session, so Ctrl-C in a
terminal does not kill it; its output goes to ``engine-host.log`` in the log folder.

When the process dies, ``check()`` raises ``EngineDiedError`` with its exit code and last error
line, and ``restart()`` starts it again with the same model and options.

A foreground ``hearth --cli serve`` registers itself in the same folder (``serve-<pid>.json``, see
``register_serve``) without taking the background host's place; ``running_engines()`` lists both
kinds, so ``hearth --cli stats`` and ``stop`` find either.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from hearth.app.client.openai_client import ChatClient, EngineDiedError
from hearth.app.paths import log_dir, private_file, runtime_dir
from hearth.engine.api import HearthError, engine_options

STATE_FILE = "engine-host.json"
SERVE_PREFIX = "serve-"
LOG_FILE = "engine-host.log"
API_KEY_ENV = "HEARTH_API_KEY"  # the name hearth.engine.server reads (not imported: that pulls in torch)
# The host's options: its served name and every EngineConfig field, each passed as the flag of its name.
DEFAULTS: dict[str, Any] = {"served_name": None, **{option.name: option.default for option in engine_options()}}
OPTIONS = tuple(DEFAULTS)
DEFAULT_STARTUP_TIMEOUT_S = 600.0
_POLL_S = 0.05


class EngineStartError(HearthError):
    """The engine host could not start (bad model, no free memory, timeout...)."""


class EngineProcess:
    """A running engine host: where it listens, its token, and control over its process."""

    def __init__(self, pid: int, port: int, token: str, model: str | None, options: dict[str, Any],
                 popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.port = port
        self.token = token
        self.model = model
        self.options = options
        self._popen = popen

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, port={self.port}, model={self.model!r})"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        return self.token

    @property
    def started_here(self) -> bool:
        """True when this process started the host (so it is the one that should stop it)."""
        return self._popen is not None

    def client(self, timeout: float = 600.0) -> ChatClient:
        return ChatClient(self.base_url, self.token, timeout=timeout)

    # ---- finding and starting --------------------------------------------------------------

    @classmethod
    def ensure_running(cls, model: str | Path | None = None, *, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
                       **options: Any) -> EngineProcess:
        """The host serving ``model`` with ``options``, started if needed (see ``serves``). With
        ``model=None`` and no host running, it starts one with no model (load one via ``/hearth/load``)."""
        model_path = _model_path(model)
        options = _check_options(options)
        with _state_lock():
            running = cls.find_running()
            if running is not None:
                if running.serves(model_path, options):
                    return running
                running.stop()
            return cls._start(model_path, options, startup_timeout)

    @classmethod
    def find_running(cls) -> EngineProcess | None:
        """The host recorded in the runtime folder, if it is alive and answers with its token."""
        state = _read_state()
        if state is None:
            return None
        try:
            proc = cls(int(state["pid"]), int(state["port"]), str(state["token"]), state.get("model"),
                       dict(state.get("options") or {}))
        except (KeyError, TypeError, ValueError):
            return None
        return proc if proc.is_alive() else None

    @classmethod
    def _start(cls, model: str | None, options: dict[str, Any], timeout: float) -> EngineProcess:
        token = secrets.token_urlsafe(24)
        port_file = runtime_dir() / f"engine-{uuid.uuid4().hex[:8]}.port"
        log_path = private_file(log_dir() / LOG_FILE)  # prompts and paths may end up in it
        log_offset = log_path.stat().st_size
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(_command(model, options, port_file), stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, env={**os.environ, API_KEY_ENV: token},
                                     **_detached())
        try:
            port = _wait_for_port(popen, port_file, log_path, log_offset, time.monotonic() + timeout)
            proc = cls(popen.pid, port, token, model, options, popen)
            proc._wait_healthy(time.monotonic() + min(timeout, 60.0), log_path, log_offset)
        except BaseException:
            _terminate(popen)
            raise
        finally:
            port_file.unlink(missing_ok=True)
        _write_state({"pid": proc.pid, "port": port, "token": token, "model": model, "options": options})
        return proc

    def _wait_healthy(self, deadline: float, log_path: Path, log_offset: int) -> None:
        with self.client(timeout=5.0) as client:
            while not client.health():
                if self._popen is not None and self._popen.poll() is not None:
                    raise EngineStartError(_failure(log_path, log_offset, self._popen.returncode))
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine host on port {self.port} does not answer (see {log_path})")
                time.sleep(_POLL_S)

    def serves(self, model: str | None, options: dict[str, Any]) -> bool:
        """Whether this host can stand in for one started with ``model`` and ``options`` (options
        not given do not matter; one the host was not given has its default; ``model=None`` accepts
        any model)."""
        if model is not None and model != self.model:
            return False
        return all(self.options.get(k, DEFAULTS[k]) == v for k, v in options.items())

    # ---- state of a running host -----------------------------------------------------------

    def is_alive(self) -> bool:
        """The process exists and answers ``/health`` with our token."""
        if self._popen is not None:
            if self._popen.poll() is not None:
                return False
        elif not _is_engine_host(self.pid):
            return False
        with self.client(timeout=5.0) as client:
            return client.health()

    def check(self) -> None:
        """Raise ``EngineDiedError`` (with the reason) unless the host is alive."""
        if self.is_alive():
            return
        code = self._popen.poll() if self._popen is not None else None
        how = f"exited with code {code}" if code is not None else "is not running or not answering"
        log_path = log_dir() / LOG_FILE
        raise EngineDiedError(f"the engine host (pid {self.pid}) {how}; see {log_path}. Restart it to continue.")

    def restart(self, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> EngineProcess:
        """Stop this host (if anything is left of it) and start a fresh one with the same model
        and options; this object then describes the new process."""
        with _state_lock():
            self.stop()
            fresh = self._start(self.model, self.options, startup_timeout)
        self.pid, self.port, self.token, self._popen = fresh.pid, fresh.port, fresh.token, fresh._popen
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the host (SIGTERM, then SIGKILL after ``timeout``) and forget its record."""
        if self._popen is not None:
            _terminate(self._popen, timeout)
        elif _is_engine_host(self.pid):
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(self.pid)
                process.terminate()
                try:
                    process.wait(timeout)
                except psutil.TimeoutExpired:
                    process.kill()
        state = _read_state()
        if state is not None and state.get("pid") == self.pid:
            (runtime_dir() / STATE_FILE).unlink(missing_ok=True)


# ---- helpers -------------------------------------------------------------------------------


def _model_path(model: str | Path | None) -> str | None:
    if model is None:
        return None
    path = Path(model).expanduser()
    if not path.is_dir():
        raise EngineStartError(f"{path}: not a model folder")
    return str(path.resolve())


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise EngineStartError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    return {k: v for k, v in sorted(options.items()) if v is not None}


def _command(model: str | None, options: dict[str, Any], port_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "hearth.engine.server", "--host", "127.0.0.1", "--port", "0",
           "--port-file", str(port_file), "--log-level", "warning"]
    if model is not None:
        cmd += ["--model", model]
    for name, value in options.items():
        if value != DEFAULTS[name]:  # a flag at its default adds nothing: the host parses the same defaults
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd


def _detached() -> dict[str, Any]:
    """Popen arguments that keep the host out of the terminal's Ctrl-C (its own session/group)."""
    if os.name == "nt":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}  # type: ignore[attr-defined]
    return {"start_new_session": True}


def _wait_for_port(popen: subprocess.Popen[bytes], port_file: Path, log_path: Path, log_offset: int,
                   deadline: float) -> int:
    while True:
        if popen.poll() is not None:
            raise EngineStartError(_failure(log_path, log_offset, popen.returncode))
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int(port_file.read_text().strip())
        if time.monotonic() > deadline:
            raise EngineStartError(f"the engine host did not start in time (see {log_path})")
        time.sleep(_POLL_S)


def _failure(log_path: Path, log_offset: int, returncode: int | None) -> str:
    """The host's own one-line error (``error: ...``) from this run's part of the log."""
    try:
        with open(log_path, "rb") as f:
            f.seek(log_offset)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        lines = []
    errors = [line[len("error:"):].strip() for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1]
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    detail = f": {last}" if last else ""
    return f"the engine host exited with code {returncode} while starting{detail} (see {log_path})"


def _terminate(popen: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout)


def _is_engine_host(pid: int) -> bool:
    """pid is alive and is an engine host (not a process that got a recycled pid)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return "hearth.engine.server" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def _read_state() -> dict[str, Any] | None:
    try:
        data = json.loads((runtime_dir() / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_state(state: dict[str, Any]) -> None:
    _write_private_json(runtime_dir() / STATE_FILE, state)  # private: it holds the token


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    """Serialises start/stop between processes (two CLIs must not start two hosts). POSIX only;
    elsewhere a race can at worst start a second host, and the later record wins."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(private_file(runtime_dir() / f"{STATE_FILE}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ---- every local engine: the background host and foreground `serve` processes ----------------


@dataclass(frozen=True)
class RunningEngine:
    """A local engine answering on ``base_url``: the background host or a ``serve`` (``kind``)."""

    kind: str
    pid: int
    base_url: str
    api_key: str | None
    model: str | None

    def describe(self) -> str:
        what = "background engine host" if self.kind == "background" else "`hearth --cli serve`"
        return f"{what} (pid {self.pid}, {self.base_url})"

    def client(self, timeout: float = 10.0) -> ChatClient:
        return ChatClient(self.base_url, self.api_key, timeout=timeout)


def serve_record_path(pid: int) -> Path:
    return runtime_dir() / f"{SERVE_PREFIX}{pid}.json"


def register_serve(host: str, port: int, api_key: str | None, model: str | None) -> Path:
    """Record this process as a running ``serve`` (readable by the user only: it may hold the key)."""
    connect_to = "127.0.0.1" if host in ("0.0.0.0", "", "localhost") else "::1" if host == "::" else host
    shown = f"[{connect_to}]" if ":" in connect_to else connect_to
    path = serve_record_path(os.getpid())
    _write_private_json(path, {"pid": os.getpid(), "url": f"http://{shown}:{port}", "api_key": api_key,
                               "model": model})
    return path


def running_engines() -> list[RunningEngine]:
    """The background host (if alive) and every live ``serve``; stale ``serve`` records are removed."""
    engines = []
    background = EngineProcess.find_running()
    if background is not None:
        engines.append(RunningEngine("background", background.pid, background.base_url, background.token,
                                     background.model))
    for path in sorted(runtime_dir().glob(f"{SERVE_PREFIX}*.json")):
        engine = _live_serve(path)
        if engine is None:  # its process is gone (killed): forget it
            path.unlink(missing_ok=True)
            path.with_suffix(".port").unlink(missing_ok=True)
        else:
            engines.append(engine)
    return engines


def stop_serve(engine: RunningEngine, timeout: float = 10.0) -> None:
    """Ask a ``serve`` process to shut down as Ctrl-C in its terminal does (SIGINT: it finishes
    cleanly and unregisters itself), then SIGKILL after ``timeout``."""
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(engine.pid)
        if os.name == "nt":
            process.terminate()
        else:
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout)
        except psutil.TimeoutExpired:
            process.kill()
    serve_record_path(engine.pid).unlink(missing_ok=True)
    serve_record_path(engine.pid).with_suffix(".port").unlink(missing_ok=True)


def _live_serve(path: Path) -> RunningEngine | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        engine = RunningEngine("serve", int(data["pid"]), str(data["url"]), data.get("api_key"), data.get("model"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        if psutil.Process(engine.pid).status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    with engine.client(timeout=5.0) as client:  # a recycled pid does not answer on the recorded port
        return engine if client.health() else None


def _write_private_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)
