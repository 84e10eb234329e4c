"""The repository's static contracts: ruff is clean, mypy passes on app/engine/offload, and the
import-linter layers hold (only hearth.app imports Qt; kernels import only torch/triton; nothing
imports transformers)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)


def test_ruff_clean():
    result = _run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts():
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports, "import-linter is a test dependency"
    result = _run(lint_imports)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def test_mypy_clean():
    """mypy over hearth.app, hearth.engine and hearth.offload with pyproject.toml's [tool.mypy]. The
    editable install's import hook is invisible to mypy, so the folders are linked as hearth.* in a
    fixed place beside mypy's cache (fixed paths keep the cache valid between runs)."""
    cache = ROOT / ".mypy_cache"
    namespace = cache / "namespace" / "hearth"
    namespace.mkdir(parents=True, exist_ok=True)
    for folder in ("app", "engine", "kernels", "offload", "resources"):
        link = namespace / folder
        if not link.is_symlink():
            link.symlink_to(ROOT / folder, target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(namespace.parent)}
    result = _run(sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--cache-dir", str(cache),
                  "-p", "hearth.app", "-p", "hearth.engine", "-p", "hearth.offload", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
