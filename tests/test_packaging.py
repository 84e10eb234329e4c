"""Cheap static checks of packaging/: the PyInstaller spec, the frozen entry point, the Linux
.desktop entry, the icons and the build script. The full build (packaging/build.sh) is not a CI test.
"""

from __future__ import annotations

import ast
import configparser
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

PACKAGING = Path(__file__).resolve().parents[1] / "packaging"
SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
# Keys of the Desktop Entry specification 1.5 used by applications (a typo would be silently ignored).
DESKTOP_KEYS = {"Type", "Version", "Name", "GenericName", "NoDisplay", "Comment", "Icon", "Hidden", "OnlyShowIn",
                "NotShowIn", "DBusActivatable", "TryExec", "Exec", "Path", "Terminal", "Actions", "MimeType",
                "Categories", "Implements", "Keywords", "StartupNotify", "StartupWMClass", "URL",
                "PrefersNonDefaultGPU", "SingleMainWindow"}


def test_spec_parses_and_bundles_what_the_app_needs() -> None:
    source = (PACKAGING / "hearth.spec").read_text(encoding="utf-8")
    tree = ast.parse(source)
    calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert {"Analysis", "PYZ", "EXE", "COLLECT"} <= calls  # one-folder: COLLECT, exclude_binaries
    assert "exclude_binaries=True" in source
    for needed in ('"hearth_entry.py"', '"hearth.resources"', '"PySide6.QtSvg"', '"hearth.kernels": "pyz+py"',
                   'collect_submodules("hearth")', '"hearth.engine.server.__main__"'):
        assert needed in source, needed


def test_frozen_entry_point_runs_modules_like_python_dash_m() -> None:
    entry = PACKAGING / "hearth_entry.py"
    ast.parse(entry.read_text(encoding="utf-8"))
    done = subprocess.run([sys.executable, str(entry), "-m", "hearth.app.main", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: hearth"), done.stderr
    done = subprocess.run([sys.executable, str(entry), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "hearth --cli" in done.stdout
    # the GUI's engine host: a package run through its __main__, as `python -m` does
    done = subprocess.run([sys.executable, str(entry), "-m", "hearth.engine.server", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m hearth.engine.server"), done.stderr


def test_desktop_entry_has_valid_keys() -> None:
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive
    parser.read(PACKAGING / "hearth.desktop", encoding="utf-8")
    assert parser.sections() == ["Desktop Entry"]
    entry = parser["Desktop Entry"]
    assert set(entry) <= DESKTOP_KEYS, set(entry) - DESKTOP_KEYS
    assert entry["Type"] == "Application" and entry["Name"] == "Hearth" and entry["Icon"] == "hearth"
    assert entry["Exec"].split()[0] == "hearth" and entry["Terminal"] in ("true", "false")
    for key in ("Categories", "Keywords"):
        assert entry[key].endswith(";"), key
    assert entry["Version"] in ("1.0", "1.1", "1.2", "1.3", "1.4", "1.5")


@pytest.mark.parametrize("size", SIZES)
def test_png_icons_are_valid_and_square(size: int) -> None:
    data = (PACKAGING / "icons" / f"hearth-{size}.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, chunk = struct.unpack(">I4s", data[8:16])
    assert chunk == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (size, size)
    assert data[-12:-4] == b"\x00\x00\x00\x00IEND"


def test_svg_icon_is_valid() -> None:
    root = ET.parse(PACKAGING / "icons" / "hearth.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.get("viewBox") == "0 0 512 512"


def test_build_script_is_valid_bash() -> None:
    for script in ("build.sh",):
        done = subprocess.run(["bash", "-n", str(PACKAGING / script)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
