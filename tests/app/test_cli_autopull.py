"""``run``, ``chat`` and ``serve -m`` with a Hub repo id that is not installed (as Ollama's ``run``):
pulled first in a terminal, with pull's progress, refusals and resume; refused without a download
(naming the pull command) from a pipe, with --no-pull and offline; other names keep their error."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from hearth.app.cli import hub_commands
from hearth.app.cli.main import main as cli
from hearth.app.hub.context import HubContext
from hearth.app.hub.installed import list_installed
from hearth.app.hub.manager import DownloadManager, ItemState
from hearth.app.store.settings import save_settings
from hearth.engine.testing.tiny import write_tiny_model
from tests.app.cli_support import TerminalStdin
from tests.app.conftest import FAST, add_unloadable_repos
from tests.app.fakehub import FakeFile, FakeHub, FakeRepo, Fault

REPO = "hearth-test/runnable-v32"
SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("autopull") / "tiny-v32", "deepseek_v32", seed=7)


@pytest.fixture
def hub(fake_hub: FakeHub, settings, model_dir: Path, monkeypatch) -> FakeHub:
    """The fake Hub also serving a model the engine can load, and quick retries for pulls."""
    files = {p.name: FakeFile(p.name, p.read_bytes(), is_lfs=p.suffix == ".safetensors") for p in model_dir.iterdir()}
    fake_hub.add_repo(FakeRepo(REPO, files, commit="9" * 40, model_type="deepseek_v32"))
    add_unloadable_repos(fake_hub)
    monkeypatch.setattr(hub_commands, "PULL_OPTIONS", FAST)
    return fake_hub


@pytest.fixture
def terminal(monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", TerminalStdin())


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _record_serve(monkeypatch) -> list[list[str]]:
    import hearth.engine.server.main as server

    seen: list[list[str]] = []
    monkeypatch.setattr(server, "main", lambda argv: seen.append(argv) or 0)
    return seen


def test_run_pulls_a_missing_repo_then_answers(hub: FakeHub, settings, terminal, capsys):
    assert cli(["run", "-m", REPO, "--max-tokens", "1", "--json", "hi"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["model"] == REPO  # stdout holds only the answer
    assert f"{REPO} is not installed: pulling it from {hub.url} (Ctrl-C pauses; `hearth --cli pull {REPO}` " \
           "resumes)" in err
    assert f"Pulling {REPO} @ 9999999999: 7 files, 1.3 MB" in err and f"Pulled {REPO} (1.3 MB, checksums " \
           "verified)." in err
    [model] = list_installed(HubContext.from_settings(settings))
    assert (model.name, model.is_ready) == (REPO, True)
    fetched = len(hub.file_requests(REPO, SHARD))
    assert cli(["run", "-m", REPO, "--max-tokens", "1", "--json", "hi"]) == 0  # installed now: no download
    assert len(hub.file_requests(REPO, SHARD)) == fetched and "pulling" not in capsys.readouterr().err


def test_serve_pulls_a_missing_repo_and_serves_it_under_its_id(hub: FakeHub, settings, terminal, monkeypatch, capsys):
    seen = _record_serve(monkeypatch)
    assert cli(["serve", "-m", REPO, "--port", "0"]) == 0
    [argv] = seen
    assert argv[argv.index("--served-name") + 1] == REPO
    assert Path(argv[argv.index("--model") + 1], SHARD).is_file()
    assert f"Pulled {REPO}" in capsys.readouterr().err


def test_serve_checks_its_port_before_downloading(hub: FakeHub, settings, terminal, monkeypatch, capsys):
    seen = _record_serve(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli(["serve", "-m", REPO, "--port", str(port)]) == 1
    assert _error_line(capsys.readouterr().err).startswith(f"error: cannot listen on 127.0.0.1:{port}")
    assert hub.requests == [] and not seen


@pytest.mark.parametrize("argv", [["run", "-p", "hi"], ["chat"], ["serve", "--port", "0"]])
def test_without_a_terminal_nothing_is_downloaded(hub: FakeHub, settings, monkeypatch, capsys, argv):
    seen = _record_serve(monkeypatch)
    assert cli([*argv, "-m", REPO]) == 1  # pytest's stdin is not a terminal
    assert _error_line(capsys.readouterr().err) == (
        f"error: {REPO} is not installed; download it with `hearth --cli pull {REPO}` first (a missing model is "
        "downloaded by itself only when stdin is a terminal)")
    assert hub.requests == [] and not seen


def test_no_pull_and_offline_refuse_in_a_terminal_without_a_request(hub: FakeHub, settings, terminal, monkeypatch,
                                                                    capsys):
    assert cli(["run", "--no-pull", "-m", REPO, "-p", "hi"]) == 1
    assert _error_line(capsys.readouterr().err) == \
        f"error: {REPO} is not installed, and --no-pull is set; download it with `hearth --cli pull {REPO}`"
    assert cli(["--no-pull", "--model", REPO, "--prompt", "hi"]) == 1  # the one-shot form takes it too
    assert "--no-pull is set" in _error_line(capsys.readouterr().err)
    seen = _record_serve(monkeypatch)
    assert cli(["serve", "-m", REPO, "--no-pull", "--port", "0"]) == 1
    assert "--no-pull is set" in _error_line(capsys.readouterr().err) and not seen

    save_settings(settings.replace(offline=True))
    assert cli(["run", "-m", REPO, "-p", "hi"]) == 1
    assert _error_line(capsys.readouterr().err) == (
        f"error: {REPO} is not installed and cannot be downloaded now: offline mode is on (`hearth --cli config set "
        f"offline false` turns it off); once online, `hearth --cli pull {REPO}` downloads it")
    save_settings(settings)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli(["chat", "-m", REPO]) == 1
    assert "cannot be downloaded now: HF_HUB_OFFLINE is set;" in _error_line(capsys.readouterr().err)
    assert hub.requests == []


@pytest.mark.parametrize(("repo", "words"), [
    ("meta/llama-tiny", "meta/llama-tiny is a llama model, an architecture Hearth cannot run (it runs "),
    ("hearth-test/pickle-only", "hearth-test/pickle-only has no .safetensors weights (only .bin files)"),
])
def test_what_pull_refuses_is_refused_before_any_weight(hub: FakeHub, settings, terminal, capsys, repo, words):
    assert cli(["run", "-m", repo, "-p", "hi"]) == 1
    line = _error_line(capsys.readouterr().err)
    assert words in line and "nothing was downloaded" in line
    assert not [r for r in hub.requests if r.method == "GET" and r.path.endswith((".safetensors", ".bin"))]
    assert list_installed(HubContext.from_settings(settings)) == []


def test_names_that_are_no_repo_id_keep_their_error(hub: FakeHub, settings, terminal, capsys):
    assert cli(["run", "-m", "no-such-model", "-p", "hi"]) == 1
    assert "No model called no-such-model" in _error_line(capsys.readouterr().err)
    assert cli(["run", "-m", "nobody/nothing", "-p", "hi"]) == 1  # a repo id the Hub does not have
    assert "nobody/nothing was not found on" in _error_line(capsys.readouterr().err)
    assert not [r for r in hub.requests if "no-such-model" in r.path]


def test_an_unfinished_pull_is_resumed(hub: FakeHub, settings, terminal, monkeypatch, capsys):
    hub.add_fault(REPO, SHARD, Fault("drop", after_bytes=300_000))  # a partial file is kept,
    hub.add_fault(REPO, SHARD, Fault("status", status=504, times=100))  # then the pull gives up
    assert cli(["pull", REPO]) == 1
    capsys.readouterr()
    hub.clear_faults()
    seen = _record_serve(monkeypatch)
    assert cli(["serve", "-m", REPO, "--port", "0"]) == 0 and seen
    assert f"{REPO} is not fully downloaded: resuming its download" in capsys.readouterr().err
    resumed_at = hub.file_requests(REPO, SHARD)[-1].headers["range"]  # from where it stopped (whole chunks)
    assert resumed_at.startswith("bytes=") and 250_000 < int(resumed_at[6:].rstrip("-")) <= 300_000


def test_ctrl_c_pauses_the_download_and_says_how_to_resume(hub: FakeHub, settings, terminal, monkeypatch, capsys):
    real_wait = DownloadManager.wait

    def wait(self, item_id, timeout=None):
        if timeout is None:  # the user's Ctrl-C, once the download started
            raise KeyboardInterrupt
        return real_wait(self, item_id, timeout)

    monkeypatch.setattr(DownloadManager, "wait", wait)
    assert cli(["run", "-m", REPO, "-p", "hi"]) == 130
    err = capsys.readouterr().err
    assert f"run `hearth --cli pull {REPO}` again to" in err and err.rstrip().endswith("interrupted")
    assert [i.state for i in DownloadManager(settings).items()] == [ItemState.PAUSED]  # kept for `pull` to resume
