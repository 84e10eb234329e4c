"""Render packaging/icons/hearth.svg to the PNG sizes desktops and installers ask for, with Qt only.

    QT_QPA_PLATFORM=offscreen python packaging/render_icons.py [--out packaging/icons]

writes ``hearth-<N>.png`` for N in SIZES (square, transparent background). No external tools
(Inkscape, rsvg, ImageMagick) are needed: QtSvg draws the SVG into a QImage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ICONS = Path(__file__).resolve().parent / "icons"


def render(svg: Path, out: Path, sizes: tuple[int, ...] = SIZES) -> list[Path]:
    """Draw ``svg`` at each size into ``out/hearth-<size>.png``; returns the files written."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app = QGuiApplication.instance() or QGuiApplication(["render_icons", "-platform", "offscreen"])
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise ValueError(f"{svg}: not a valid SVG")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for size in sizes:
        image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter)
        painter.end()
        path = out / f"hearth-{size}.png"
        if not image.save(str(path), "PNG"):
            raise OSError(f"could not write {path}")
        written.append(path)
    del _app
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--svg", type=Path, default=ICONS / "hearth.svg")
    parser.add_argument("--out", type=Path, default=ICONS)
    args = parser.parse_args(argv)
    for path in render(args.svg, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
