#!/usr/bin/env bash
# Build the Linux one-folder bundle and its tarball:
#   dist/hearth/                                   (the app: dist/hearth/hearth)
#   dist/hearth-<version>-linux-x86_64.tar.gz
#
#   bash packaging/build.sh          # from anywhere; uses build/pyi-venv (created if missing)
#
# Creates a clean venv, installs the CPU build of torch (README's pin), PyInstaller and Hearth
# itself (a regular, non-editable install so PyInstaller sees real package files), freezes it with
# packaging/hearth.spec, adds the .desktop entry and icons, smoke-tests the bundle (CLI on the
# bundled demo model, GUI screenshot offscreen) and packs the tarball. An AppImage is made only if
# `appimagetool` is on PATH (it is not packaged by Debian nor on PyPI; see packaging/README.md).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-build/pyi-venv}"
PYINSTALLER_VERSION="${PYINSTALLER_VERSION:-6.22.3}"

[ -f resources/demo_model/model.safetensors ] || { echo "resources/demo_model is missing" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# numpy: not in hearth's dependencies, but safetensors.torch.save_file (used when the GUI writes
# a random-weight demo model) and torch's numpy bridge need it at run time.
"$VENV/bin/python" -m pip install -q "torch==2.13.0" numpy "pyinstaller==$PYINSTALLER_VERSION"
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps .
"$VENV/bin/python" -m pip install -q .
version="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("hearth"))')"
arch="$(uname -m)"

"$VENV/bin/pyinstaller" --noconfirm --clean --log-level WARN --distpath dist --workpath build/pyinstaller \
    packaging/hearth.spec

app="dist/hearth"
mkdir -p "$app/share/icons/hicolor"
for png in packaging/icons/hearth-*.png; do
    size="$(basename "$png" .png)"; size="${size#hearth-}"
    mkdir -p "$app/share/icons/hicolor/${size}x${size}/apps"
    cp "$png" "$app/share/icons/hicolor/${size}x${size}/apps/hearth.png"
done
mkdir -p "$app/share/icons/hicolor/scalable/apps"
cp packaging/icons/hearth.svg "$app/share/icons/hicolor/scalable/apps/hearth.svg"
cp packaging/README.md "$app/README-packaging.md"

# Smoke tests of the frozen app (a fresh HOME so no installed model or setting interferes).
smoke_home="$(mktemp -d)"
trap 'rm -rf "$smoke_home"' EXIT
demo="$(find "$app/_internal" -path '*hearth/resources/demo_model' -type d | head -n 1)"
HOME="$smoke_home" "$app/hearth" --cli run --model "$demo" --prompt "The" --max-tokens 24 --seed 0 \
    --temperature 0.7
HOME="$smoke_home" QT_QPA_PLATFORM=offscreen "$app/hearth" --screenshot "build/bundle-screenshot.png" --timeout 180
echo "screenshot: build/bundle-screenshot.png"

tarball="dist/hearth-$version-linux-$arch.tar.gz"
tar -C dist -czf "$tarball" hearth
echo "bundle: $(du -sh "$app" | cut -f1)  tarball: $(du -h "$tarball" | cut -f1)  $tarball"
echo "the bundle needs libxcb-icccm4 and libxcb-keysyms1 on the machine that runs it" \
     "(Debian/Ubuntu: sudo apt install libxcb-icccm4 libxcb-keysyms1)"

if command -v appimagetool >/dev/null 2>&1; then
    appdir="build/Hearth.AppDir"
    rm -rf "$appdir" && mkdir -p "$appdir/usr/lib"
    cp -a "$app" "$appdir/usr/lib/hearth"
    cp packaging/hearth.desktop "$appdir/hearth.desktop"
    cp packaging/icons/hearth-256.png "$appdir/hearth.png"
    printf '#!/bin/sh\nexec "$(dirname "$(readlink -f "$0")")/usr/lib/hearth/hearth" "$@"\n' > "$appdir/AppRun"
    chmod +x "$appdir/AppRun"
    appimagetool "$appdir" "dist/Hearth-$version-$arch.AppImage"
else
    echo "appimagetool not found: no AppImage built (the tarball is the Linux release)"
fi
