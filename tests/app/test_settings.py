"""Settings: defaults, round trip, unknown keys kept, bad values and corrupt files survived, atomic
writes; and Hearth's folders under HEARTH_HOME."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from hearth.app import paths
from hearth.app.client.local_engine import DEFAULTS
from hearth.app.store import settings as settings_module
from hearth.app.store.settings import Settings, SettingsError, folder_problem, load_settings, save_settings


def test_missing_file_gives_defaults():
    assert load_settings() == Settings()
    assert Settings().hf_endpoint is None and Settings().hf_cache_dir is None  # the environment's, else the Hub


def test_round_trip_keeps_unknown_keys(tmp_path):
    path = paths.settings_path()
    path.write_text(json.dumps({"theme": "dark", "future_option": {"x": 1}}))
    settings = load_settings()
    assert settings.theme == "dark"
    changed = settings.replace(download_parallelism=8, gpu_memory_gib=20.5, default_model="org/m")
    save_settings(changed)
    assert load_settings() == changed
    raw = json.loads(path.read_text())
    assert raw["future_option"] == {"x": 1} and raw["download_parallelism"] == 8
    assert not [k for k in raw if k.lower().endswith("token")]  # the HF token never lands in the file
    assert [p.name for p in path.parent.iterdir()] == ["settings.json"]  # no temp file left


def test_corrupt_file_is_set_aside_not_lost(caplog):
    path = paths.settings_path()
    path.write_text('{"theme": "dark",')
    with caplog.at_level(logging.WARNING):
        assert load_settings() == Settings()
    assert "not valid JSON" in caplog.text
    [aside] = [p for p in path.parent.iterdir() if p.name.startswith("settings.json.corrupt-")]
    assert aside.read_text() == '{"theme": "dark",' and not path.exists()
    save_settings(Settings(theme="light"))
    assert load_settings().theme == "light"


def test_a_bad_value_falls_back_alone(caplog):
    paths.settings_path().write_text(json.dumps(
        {"theme": "neon", "offline": True, "download_parallelism": "4", "context_length": True}))
    with caplog.at_level(logging.WARNING):
        settings = load_settings()
    assert settings.offline is True
    assert (settings.theme, settings.download_parallelism, settings.context_length) == ("system", 4, 8192)
    assert "theme" in caplog.text and "download_parallelism" in caplog.text


@pytest.mark.parametrize("changes", [
    {"hf_endpoint": "ftp://mirror"}, {"download_parallelism": 0}, {"gpu_memory_gib": -1.0},
    {"context_length": 1}, {"theme": "blue"}, {"offline": "yes"}, {"send_key": "shift+enter"},
])
def test_invalid_values_are_rejected(changes):
    with pytest.raises(SettingsError):
        Settings().replace(**changes)


def test_endpoint_trailing_slash_is_dropped():
    assert Settings(hf_endpoint="https://hf-mirror.com/").hf_endpoint == "https://hf-mirror.com"


def test_hearth_home_holds_every_folder(isolated_home: Path):
    folders = [paths.config_dir(), paths.data_dir(), paths.cache_dir(), paths.runtime_dir(), paths.log_dir()]
    assert all(f.is_dir() and f.parent == isolated_home for f in folders)
    assert len(set(folders)) == 5
    assert paths.settings_path() == isolated_home / "config" / "settings.json"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="XDG folders are Linux's")
def test_platform_folders_without_hearth_home(monkeypatch, tmp_path):
    monkeypatch.delenv("HEARTH_HOME")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    assert paths.config_dir() == tmp_path / "xdg-config" / "hearth"
    assert paths.data_dir() == tmp_path / "xdg-data" / "hearth"


def test_long_context_settings_reach_the_engine_options(tmp_path, monkeypatch):
    """The GUI backend turns the saved scheduling / long-context settings into engine-host options."""
    from hearth.app.gui.backend import Backend, ModelChoice

    settings = Settings().replace(scheduler="runahead", mli=True, index_topk_freq=2, index_key_hot_pages=4,
                                  latent_hot_rows=512, gpu_memory_gib=10.0, cuda_graphs=False)
    options = Backend(settings)._engine_options(ModelChoice("m", str(tmp_path), False, 4096))
    changed = {"max_model_len": 4096, "gpu_memory_gib": 10.0, "scheduler": "runahead", "mli": True,
               "index_topk_freq": 2, "index_key_hot_pages": 4, "latent_hot_rows": 512, "cuda_graphs": False,
               "prefix_cache_dir": str(paths.prefix_cache_dir())}  # unset: the app's own chat-cache folder
    assert {k: v for k, v in options.items() if v != DEFAULTS[k]} == changed
    assert None not in options.values() and set(options) <= set(DEFAULTS)
    with pytest.raises(SettingsError):
        Settings().replace(scheduler="fast")


def test_legacy_context_length_key_is_read_and_renamed():
    path = paths.settings_path()
    path.write_text(json.dumps({"context_length": 32768, "theme": "dark"}))
    settings = load_settings()
    assert settings.context_length == 32768 == settings.engine.max_model_len
    save_settings(settings.replace(context_length=16384))
    raw = json.loads(path.read_text())
    assert raw["max_model_len"] == 16384 and "context_length" not in raw
    assert load_settings().context_length == 16384


def test_every_engine_option_is_saved_and_restarts_the_engine():
    """Each EngineConfig field round-trips through the settings file, and changing any of them (or
    the backend) asks for an engine restart; app-only settings do not."""
    from hearth.app.store.settings import restart_needed
    from hearth.engine.api import engine_options

    base = Settings()
    for option in engine_options():
        value = _another_value(option)
        changed = base.replace(**{option.name: value})
        save_settings(changed)
        assert getattr(load_settings().engine, option.name) == value, option.name
        assert restart_needed(base, changed), option.name
    assert restart_needed(base, base.replace(backend_url="http://gpu-box:8000/v1"))
    assert not restart_needed(base, base.replace(theme="dark", download_parallelism=2, default_model="x"))


def _another_value(option):
    """A valid value other than the default, for any option kind."""
    if option.kind == "bool":
        return not option.default if option.default is not None else True
    if option.kind == "choice":
        return next(c for c in option.choices if c != option.default)
    if option.name == "block_size":
        return option.default * 2  # a power of two (the kernels' page sizes)
    if option.kind == "int":
        return (option.default or option.text.minimum or 1) + 3
    if option.kind == "float":
        return 1.5
    return "cpu" if option.name == "device" else "FSFS"


@pytest.mark.parametrize(("changes", "words"), [
    ({"backend_url": "ftp://gpu-box/v1"}, "backend_url must be an http(s) URL"),
    ({"backend_url": "gpu-box:8000"}, "backend_url must be an http(s) URL"),
    ({"hf_cache_dir": "models/hf"}, "hf_cache_dir must be an absolute folder path"),
    ({"block_size": 65}, "block_size must be a power of two of at least 16"),
    ({"block_size": 8}, "block_size must be a power of two of at least 16"),
    ({"api_host": "my host"}, "api_host must be an IP address or a host name"),
    ({"api_host": "http://0.0.0.0"}, "api_host must be an IP address or a host name"),
    ({"index_topk_pattern": ""}, "index_topk_pattern must be one letter per layer"),
    ({"index_topk_pattern": "SFF"}, "starting with F"),
    ({"index_topk_pattern": "FSX"}, "F (own indexer) or S (reuse)"),
    ({"index_topk_pattern": "FS", "index_topk_freq": 2}, "index_topk_pattern replaces index_topk_freq"),
])
def test_values_that_would_fail_later_are_refused_now(changes, words):
    with pytest.raises(SettingsError, match=re.escape(words)):
        Settings().replace(**changes)


def test_values_the_engine_and_the_server_take_are_accepted():
    settings = Settings().replace(backend_url="https://gpu-box:8000/v1", hf_cache_dir="~/models", block_size=128,
                                  api_host="::1", index_topk_pattern="fssf")
    assert settings.engine.block_size == 128 and settings.engine.index_topk_pattern == "fssf"
    for host in ("0.0.0.0", "localhost", "gpu-box.lan"):
        assert Settings(api_host=host).api_host == host


def test_config_set_warns_about_a_default_model_that_is_not_installed(capsys):
    from hearth.app.cli.main import main as cli

    assert cli(["config", "set", "default_model", "org/later"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "default_model = org/later\n"  # kept: it may be pulled afterwards
    assert captured.err.startswith("warning: org/later cannot be loaded yet: No model called org/later")
    assert cli(["config", "set", "default_model", "demo"]) == 0
    assert capsys.readouterr().err == ""
    assert cli(["config", "set", "block_size", "100"]) == 1
    assert "block_size must be a power of two" in capsys.readouterr().err


def test_the_send_key_is_a_setting_the_cli_and_the_app_share(capsys):
    from hearth.app.cli.main import main as cli

    assert Settings().send_key == "enter"  # LM Studio's, Ollama's and Jan's convention
    assert cli(["config", "set", "send_key", "ctrl+enter"]) == 0
    assert load_settings().send_key == "ctrl+enter"
    assert cli(["config", "set", "send_key", "alt+enter"]) == 1
    assert "send_key must be enter or ctrl+enter" in capsys.readouterr().err
    paths.settings_path().write_text(json.dumps({"send_key": "space"}))
    assert load_settings().send_key == "enter"  # a bad value falls back alone


def test_a_models_folder_must_be_one_hearth_can_write_to(tmp_path, monkeypatch):
    assert folder_problem(str(tmp_path)) is None
    assert folder_problem(str(tmp_path / "not" / "yet")) is None  # created when saved: its parent is writable
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert folder_problem(str(a_file / "models")) == f"{a_file} is a file, not a folder"
    assert "is not an absolute path" in folder_problem("models")

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(settings_module.tempfile, "TemporaryFile", refuse)  # (the tests run as root: chmod is no test)
    assert folder_problem(str(tmp_path)) == f"Hearth cannot write to {tmp_path} (Permission denied)"


def test_the_backend_api_key_is_kept_apart_from_the_settings_file(capsys, caplog):
    from hearth.app.cli.main import main as cli
    from hearth.app.store.settings import restart_needed

    remote = Settings(backend_url="http://gpu-box:8000/v1", backend_api_key="  sk-local-123\n")
    assert remote.backend_api_key == "sk-local-123" and "sk-local" not in repr(remote)
    save_settings(remote)
    key_file = paths.settings_path().parent / settings_module.BACKEND_KEY_FILE
    assert key_file.read_text() == "sk-local-123\n"
    if sys.platform != "win32":
        assert key_file.stat().st_mode & 0o777 == 0o600
    assert "sk-local" not in paths.settings_path().read_text() and "backend_api_key" not in remote.to_json()
    assert load_settings() == remote
    assert cli(["config", "list", "--json"]) == 0 and "sk-local" not in capsys.readouterr().out
    assert cli(["config", "get", "backend_api_key"]) == 1  # not a setting of the file
    assert restart_needed(remote, remote.replace(backend_api_key="sk-other"))  # another key: reconnect
    assert not restart_needed(Settings(), Settings(backend_api_key="sk-other"))  # (unused by the local engine)

    save_settings(remote.replace(backend_api_key=None))
    assert not key_file.exists() and load_settings().backend_api_key is None
    with pytest.raises(SettingsError, match="one line of printable ASCII without spaces"):
        Settings(backend_api_key="two words")
    key_file.write_text("bad\x00key")
    with caplog.at_level(logging.WARNING):
        assert load_settings().backend_api_key is None
    assert "Ignoring the backend API key file" in caplog.text


def test_config_set_hf_cache_dir_checks_the_folder_as_the_settings_tab_does(tmp_path, monkeypatch, capsys):
    from hearth.app.cli.main import main as cli

    save_settings(Settings(theme="dark"))
    before = paths.settings_path().read_bytes()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert cli(["config", "set", "hf_cache_dir", str(a_file / "models")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: hf_cache_dir not changed: {a_file} is a file, not a folder\n"

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patch:  # (the tests run as root: chmod is no test)
        patch.setattr(settings_module.tempfile, "TemporaryFile", refuse)
        assert cli(["config", "set", "hf_cache_dir", str(tmp_path / "locked" / "models")]) == 1
    assert capsys.readouterr().err == f"error: hf_cache_dir not changed: Hearth cannot write to {tmp_path} " \
                                      "(Permission denied)\n"
    assert paths.settings_path().read_bytes() == before  # nothing written either time

    folder = tmp_path / "big-disk" / "models"
    assert cli(["config", "set", "hf_cache_dir", str(folder)]) == 0
    assert capsys.readouterr().out == f"hf_cache_dir = {folder}\n"
    assert folder.is_dir() and load_settings().hf_cache_dir == str(folder)  # made, as the Settings tab makes it
    assert cli(["config", "set", "hf_cache_dir", "null"]) == 0 and load_settings().hf_cache_dir is None
