"""``hearth --cli serve`` (issue S2): a downloaded model is served under its repo id (not the commit
hash of its snapshot folder), ``/hearth/load`` opens installed models but nothing else, and a
non-loopback bind without an API key refuses to start."""

from __future__ import annotations

import re
import signal
import subprocess

import httpx
import pytest

from hearth.app.cli.main import main as cli
from hearth.app.store.settings import Settings, save_settings
from hearth.engine.testing.tiny import write_tiny_model
from tests.app.cli_support import hearth_cmd, install_download

REPO = "hearth-test/tiny-v32"
COMMIT = "c0ffee" + "0" * 34


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny-v32", "deepseek_v32", seed=7)


@pytest.fixture
def installed(model_dir, tmp_path):
    """The tiny model as a verified download of REPO in a Hugging Face cache (the layout the Hub
    client writes: models--org--name/snapshots/<commit>/)."""
    return install_download(model_dir, tmp_path / "hf-cache", REPO, COMMIT)


def test_serve_a_repo_id_under_its_name_and_load_only_installed_models(installed, model_dir):
    proc = subprocess.Popen(hearth_cmd("serve", "--model", REPO, "--port", "0", "--max-model-len", "256"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stderr.readline()  # blocks until the server listens (or exits)
        match = re.search(rf"{REPO} on (http://127.0.0.1:\d+)/v1", banner)
        assert match, banner + proc.stderr.read()
        base = match.group(1)
        assert [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]] == [REPO]
        outside = httpx.post(f"{base}/hearth/load", json={"model": str(model_dir)}, timeout=30)
        assert outside.status_code == 403  # a model folder, but not an installed one
        again = httpx.post(f"{base}/hearth/load", json={"model": str(installed), "served_name": REPO}, timeout=60)
        assert again.status_code == 200 and again.json()["model"] == REPO
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_on_all_interfaces_needs_a_key(model_dir, capsys, monkeypatch):
    monkeypatch.delenv("HEARTH_API_KEY", raising=False)
    assert cli(["serve", "--model", str(model_dir), "--host", "0.0.0.0", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without an API key" in err[0] and "--insecure-no-key" in err[0]


def test_serve_takes_engine_flags_over_the_settings(model_dir, monkeypatch):
    """Every engine option is a ``serve`` flag; options not given come from the settings file."""
    import hearth.engine.server.main as server

    save_settings(Settings().replace(max_num_seqs=3, scheduler="prefetch", max_model_len=1024))
    seen: list[list[str]] = []
    monkeypatch.setattr(server, "main", lambda argv: seen.append(argv) or 0)
    assert cli(["serve", "--model", str(model_dir), "--offload", "always", "--expert-cache-slots", "4",
                "--scheduler", "runahead", "--mli", "true"]) == 0
    argv = seen[0]

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--offload") == "always" and value("--expert-cache-slots") == "4"
    assert value("--scheduler") == "runahead" and value("--mli") == "true"  # the flags win
    assert value("--max-num-seqs") == "3" and value("--max-model-len") == "1024"  # the rest: settings
