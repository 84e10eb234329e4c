"""scripts/install.sh, which run.sh and test.sh source: Hearth is installed once, and again only
when pyproject.toml changes or extras not yet installed are asked for. pip is a stand-in that
records its arguments (no network installs in tests)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
echo "lots of setuptools warnings"
exit "${FAKE_PIP_STATUS:-0}"
"""


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return venv


def _ensure(venv: Path, project: Path, extras: str, status: int = 0) -> subprocess.CompletedProcess[str]:
    script = f'. "{ROOT}/scripts/install.sh" && hearth_ensure_installed "$1" "$2" "$3"'
    return subprocess.run(["bash", "-c", script, "ensure", str(venv), str(project), extras], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "FAKE_PIP_STATUS": str(status)}, timeout=60)


def _installs(venv: Path) -> list[str]:
    log = venv / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return [c.split(" -e ", 1)[1] for c in calls if " -e " in c]


def test_installs_once_then_only_when_pyproject_or_extras_change(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "hearth"\n')
    venv = _venv(tmp_path)

    first = _ensure(venv, project, "")
    assert first.returncode == 0 and first.stdout == ""
    assert first.stderr.startswith("Installing Hearth into") and len(first.stderr.splitlines()) == 1
    assert "setuptools" not in first.stderr and "setuptools" in (venv / "hearth-install.log").read_text()
    assert _installs(venv) == [str(project)]
    again = _ensure(venv, project, "")
    assert again.returncode == 0 and again.stderr == "" and len(_installs(venv)) == 1  # starts at once

    assert _ensure(venv, project, "[test]").returncode == 0  # test extras: one more install
    assert _ensure(venv, project, "[test]").returncode == 0
    assert _ensure(venv, project, "").returncode == 0  # implied by the [test] install
    assert _installs(venv) == [str(project), f"{project}[test]"]

    (project / "pyproject.toml").write_text('[project]\nname = "hearth"\ndependencies = ["x"]\n')
    assert _ensure(venv, project, "").returncode == 0
    assert _installs(venv)[-1] == str(project)
    assert _ensure(venv, project, "[test]").returncode == 0  # the new pyproject needs the extras again
    assert _installs(venv)[-1] == f"{project}[test]" and len(_installs(venv)) == 4


def test_a_failed_install_shows_the_log_and_is_retried(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "hearth"\n')
    venv = _venv(tmp_path)
    failed = _ensure(venv, project, "", status=1)
    assert failed.returncode == 1
    assert "lots of setuptools warnings" in failed.stderr and "error: installing Hearth failed" in failed.stderr
    assert not (venv / ".hearth-install").exists()
    assert _ensure(venv, project, "").returncode == 0
    assert (venv / "calls.log").read_text().count("--upgrade pip") == 2  # tried again
