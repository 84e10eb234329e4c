"""What a new user expects of the CLI (issue U2): the Hub's environment conventions and
``config``, model resolution (default, the only installed one, short names, the demo), ``serve``
seen by ``stats`` and ``stop``, and the small things (help texts, a private runtime folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hearth.app.cli import hub_commands
from hearth.app.cli.common import resolve_model_path
from hearth.app.cli.main import main as cli
from hearth.app.client import ChatClient
from hearth.app.demo_model import bundled_demo_path
from hearth.app.hub import import_local_model
from hearth.app.paths import settings_path
from hearth.app.store.settings import Settings, load_settings, save_settings
from hearth.engine.api import HearthError
from hearth.engine.testing.tiny import write_tiny_model
from tests.app.cli_support import fake_openai_server, hearth_cmd
from tests.app.conftest import FAST, GATED_REPO, TINY_REPO
from tests.app.fakehub import FakeHub


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def runnable(tmp_path_factory) -> Path:
    """A real tiny DeepSeek-V3.2 checkpoint the engine can load."""
    return write_tiny_model(tmp_path_factory.mktemp("u2") / "tiny-v32", "deepseek_v32", seed=7)


# ---- 1. HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_OFFLINE and `config` ----------------------------


def test_hf_endpoint_applies_in_a_real_process(fake_hub: FakeHub, isolated_home):
    env = {**os.environ, "HEARTH_HOME": str(isolated_home), "HF_ENDPOINT": fake_hub.url}
    result = subprocess.run(hearth_cmd("search", "tiny"), capture_output=True, text=True, env=env, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert TINY_REPO in result.stdout and "Traceback" not in result.stderr
    assert any(r.path == "/api/models" for r in fake_hub.requests)


def test_a_failed_search_says_so_and_names_the_endpoint(monkeypatch, capsys):
    with fake_openai_server() as url:  # answers 404 to /api/models: a mirror that is not a Hub
        endpoint = url.removesuffix("/v1")
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        assert cli(["search", "x"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: Search for 'x' failed: ") and f"{endpoint} answered HTTP 404" in line
    assert "Cannot download" not in line


def test_the_setting_overrides_hf_endpoint(fake_hub: FakeHub, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    save_settings(Settings(hf_endpoint=fake_hub.url))
    assert cli(["search", "tiny", "--json"]) == 0
    assert [r["repo_id"] for r in json.loads(capsys.readouterr().out)] == [TINY_REPO]


def test_pull_uses_hf_token_and_hf_home(fake_hub: FakeHub, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hub_commands, "PULL_OPTIONS", FAST)
    fake_hub.granted_tokens["hf_granted"] = {GATED_REPO}
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert cli(["pull", GATED_REPO]) == 1  # no token yet: the gated repo refuses
    assert "gated" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert cli(["pull", GATED_REPO]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Ready: {GATED_REPO}") and str(tmp_path / "hf-home" / "hub") in out
    assert fake_hub.file_requests(GATED_REPO, "model.safetensors")[-1].headers["authorization"] == "Bearer hf_granted"
    assert cli(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["name"] == GATED_REPO


def test_hf_hub_offline_in_the_environment_means_offline(fake_hub: FakeHub, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli(["search", "tiny"]) == 1
    assert "Offline mode is on" in _one_error_line(capsys.readouterr().err)
    assert fake_hub.requests == []


def test_config_get_set_unset_list(monkeypatch, capsys):
    assert cli(["config", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(settings_path())
    assert cli(["config", "set", "gpu_memory_gib", "20.5"]) == 0
    assert cli(["config", "set", "mli", "on"]) == 0
    assert cli(["config", "set", "default_model", "org/model"]) == 0
    assert capsys.readouterr().out.splitlines() == ["gpu_memory_gib = 20.5", "mli = true", "default_model = org/model"]
    assert load_settings() == Settings().replace(gpu_memory_gib=20.5, mli=True, default_model="org/model")
    assert cli(["config", "get", "gpu_memory_gib"]) == 0
    assert capsys.readouterr().out == "20.5\n"
    assert cli(["config", "unset", "gpu_memory_gib"]) == 0
    assert cli(["config", "get", "gpu_memory_gib"]) == 0
    assert capsys.readouterr().out.splitlines() == ["gpu_memory_gib = null", "null"]

    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example")
    assert cli(["config", "list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == f"# {settings_path()}"
    rows = {line.split(" = ")[0].rstrip(): line.split(" = ", 1)[1] for line in listing[1:]}
    assert rows["hf_endpoint"] == "null  (in effect: http://mirror.example, from HF_ENDPOINT)"
    assert rows["mli"] == "true" and rows["max_model_len"] == "8192"  # engine options sit beside the rest
    assert cli(["config", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["default_model"] == "org/model"


@pytest.mark.parametrize(("argv", "words"), [
    (["set", "max_model_len", "lots"], "max_model_len takes a whole number (or null), not 'lots'"),
    (["set", "max_model_len", "1"], "max_model_len must be >= 2"),
    (["set", "offline", "maybe"], "offline is true or false, not 'maybe'"),
    (["set", "hf_endpoint", "ftp://mirror"], "hf_endpoint must be an http(s) URL"),
    (["set", "scheduler", "null"], "scheduler must be auto, sync, runahead or prefetch, not 'null'"),
    (["get", "colour"], "unknown setting 'colour'; known: hf_endpoint, "),
])
def test_config_refuses_bad_keys_and_values_in_one_line(argv, words, capsys):
    save_settings(Settings(theme="dark"))
    before = settings_path().read_bytes()
    assert cli(["config", *argv]) == 1
    assert words in _one_error_line(capsys.readouterr().err)
    assert settings_path().read_bytes() == before  # nothing written


def test_an_older_file_with_the_default_endpoint_lets_hf_endpoint_apply():
    path = settings_path()
    path.write_text(json.dumps({"hf_endpoint": "https://huggingface.co", "theme": "dark"}))
    assert load_settings() == Settings(theme="dark")  # the old default is not a user's choice
    save_settings(Settings(hf_endpoint="https://huggingface.co"))  # chosen now: it stays
    assert load_settings().hf_endpoint == "https://huggingface.co"
    assert json.loads(path.read_text())["settings_version"] == 2


# ---- 3. which model: --model, the default, the only installed one, the demo ---------------------


def test_run_uses_the_only_installed_model_and_its_short_name(runnable, capsys):
    import_local_model(runnable, "Tiny-DeepSeek-V3.2")
    assert cli(["run", "-p", "hi", "--max-tokens", "2", "--temperature", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "Tiny-DeepSeek-V3.2"  # its installed name
    assert cli(["run", "-m", "tiny-deepseek-v3.2", "-p", "hi", "--max-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["usage"]["completion_tokens"] == 2 and out["model"] == "tiny-deepseek-v3.2"  # the name given


def test_resolution_order_and_ambiguous_short_names(runnable, settings, capsys):
    demo = bundled_demo_path()
    assert demo is not None
    assert resolve_model_path(None, settings) == demo  # nothing installed
    assert "bundled tiny demo model" in capsys.readouterr().err
    assert cli(["pull", TINY_REPO]) == 0  # a download (not runnable, but it counts as installed)
    import_local_model(runnable, "mine")
    with pytest.raises(HearthError, match=r"2 are installed \(hearth-test/tiny-deepseek, mine\).*"
                                          r"config set default_model NAME"):
        resolve_model_path(None, settings)
    assert resolve_model_path(None, settings.replace(default_model="mine")) == runnable
    assert resolve_model_path("Demo", settings.replace(default_model="mine")) == demo
    snapshot = resolve_model_path(TINY_REPO, settings)
    assert resolve_model_path("TINY-deepseek", settings) == snapshot  # the repo's name, any case
    import_local_model(runnable, "Tiny-DeepSeek")
    with pytest.raises(HearthError, match="tiny-deepseek could be hearth-test/tiny-deepseek, Tiny-DeepSeek; pass"):
        resolve_model_path("tiny-deepseek", settings)
    assert resolve_model_path("Tiny-DeepSeek", settings) == runnable  # an exact name is never ambiguous
    with pytest.raises(HearthError, match="No model called nothing-like-it"):
        resolve_model_path("nothing-like-it", settings)


def test_unknown_model_on_the_command_line_is_one_line(capsys):
    assert cli(["run", "-m", "no-such-model", "-p", "hi"]) == 1
    assert "No model called no-such-model" in _one_error_line(capsys.readouterr().err)


# ---- 4. `stats` sees a `serve`; `stop` stops a kept engine host ---------------------------------


def test_stats_sees_a_running_serve_and_stop_all_ends_it(runnable, isolated_home, capsys):
    proc = subprocess.Popen(hearth_cmd("serve", "--model", str(runnable), "--port", "0", "--max-model-len", "256"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stderr.readline()  # the server listens
        assert "tiny-v32 on http://127.0.0.1:" in banner, banner + proc.stderr.read()
        record = _wait_for(lambda: next((isolated_home / "run").glob("serve-*.json"), None))
        assert record.stat().st_mode & 0o777 == 0o600
        assert cli(["stats", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["model"] == "tiny-v32"
        assert cli(["stats"]) == 0
        assert f"`hearth --cli serve` (pid {proc.pid}, http://127.0.0.1:" in capsys.readouterr().out

        assert cli(["stop"]) == 0  # no background host: says so, and names the serve it left alone
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "No engine host is running in the background."
        assert out[1].startswith(f"Still running: `hearth --cli serve` (pid {proc.pid}") and proc.poll() is None
        assert cli(["stop", "--all"]) == 0
        assert capsys.readouterr().out.startswith(f"Stopped `hearth --cli serve` (pid {proc.pid}")
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list((isolated_home / "run").glob("serve-*"))
    assert cli(["stats"]) == 0
    assert capsys.readouterr().out.startswith("No local engine is running")


def test_stop_stops_a_kept_background_host(runnable, capsys):
    from hearth.app.client.local_engine import EngineProcess

    proc = EngineProcess.ensure_running(runnable, max_model_len=256)  # what `chat --keep-engine` leaves
    try:
        assert cli(["stats"]) == 0
        assert f"background engine host (pid {proc.pid}" in capsys.readouterr().out
        assert cli(["stop"]) == 0
        said = capsys.readouterr().out.strip()
        assert said == f"Stopped the background engine host (pid {proc.pid}, model tiny-v32)."
        assert not proc.is_alive() and EngineProcess.find_running() is None
        assert cli(["stop"]) == 0
        assert capsys.readouterr().out.strip() == "No engine host is running in the background."
    finally:
        proc.stop()


def _wait_for(probe, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return found


# ---- 10. the small ones -------------------------------------------------------------------------


def test_stats_counters_survive_unload_and_load(runnable, tmp_path, capsys):
    import httpx

    from tests.engine.test_server_support import start_server

    server = start_server(runnable, tmp_path / "server", max_model_len=256)
    messages = [{"role": "user", "content": "Hello"}]

    def stats() -> dict:
        assert cli(["stats", "--backend", server.base_url, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    def finished(n: int) -> dict | None:  # the host counts a request when its last event is dispatched
        current = stats()
        return current if current["requests_finished"] == n else None

    try:
        with ChatClient(server.base_url) as client:
            list(client.stream_chat("tiny-v32", messages, max_tokens=3, temperature=0))
            first = _wait_for(lambda: finished(1))
            assert first["requests_total"] == 1 and first["generated_tokens"] == 3
            assert httpx.post(f"{server.base_url}/hearth/unload", json={}, timeout=30).status_code == 200
            assert (stats()["requests_total"], stats()["generated_tokens"]) == (1, 3)
            loaded = httpx.post(f"{server.base_url}/hearth/load", json={"model": str(runnable)}, timeout=60)
            assert loaded.status_code == 200, loaded.text
            assert stats()["generated_tokens"] == 3  # a fresh engine does not reset the host's count
            list(client.stream_chat("tiny-v32", messages, max_tokens=2, temperature=0))
            after = _wait_for(lambda: finished(2))
            assert after["requests_total"] == 2 and after["generated_tokens"] == 5
    finally:
        server.stop()


def test_no_runtime_dir_warning_without_xdg_runtime_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "HEARTH_HOME")
           and not k.startswith("XDG_")}
    env["HOME"] = str(tmp_path / "home")  # the config and data folders land here, not in the real home
    result = subprocess.run(hearth_cmd("stats"), capture_output=True, text=True, env=env, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert (result.returncode, result.stderr) == (0, "")  # no RuntimeDirWarning
    assert result.stdout.startswith("No local engine is running")
    where = subprocess.run([sys.executable, "-c", "from hearth.app.paths import runtime_dir; print(runtime_dir())"],
                           capture_output=True, text=True, env=env, timeout=60, check=True)
    assert where.stderr == "" and Path(where.stdout.strip()).stat().st_mode & 0o777 == 0o700


def test_help_texts_name_every_option_without_raw_markup(capsys):
    from hearth.app import main as hearth_main
    from hearth.app.gui.main import TABS

    assert hearth_main.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert f"--tab {'|'.join(TABS)}" in usage and "config" in usage and "stop" in usage
    for command in ("serve", "run", "chat", "stats", "stop", "config", "models", "search", "pull", "import", "rm"):
        with pytest.raises(SystemExit):
            cli([command, "--help"])
        text = capsys.readouterr().out
        assert text.startswith(f"usage: hearth --cli {command}") and "``" not in text, text


def test_readme_agrees_with_the_app():
    from hearth.app.demo_model import DEMO_LABEL

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert f'"{DEMO_LABEL}"' in readme and "random weights" not in readme
    assert "`hf auth login`" in readme and "huggingface-cli" not in readme
    assert "packaging/build.sh" in readme and "libxcb-icccm4 libxcb-keysyms1" in readme
    assert "libxcb-icccm4 and libxcb-keysyms1" in (root / "packaging" / "build.sh").read_text(encoding="utf-8")
