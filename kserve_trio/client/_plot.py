"""A dependency-free PNG line chart: latency percentiles against concurrency for ``bench``.

matplotlib is not a dependency of kserve_trio, and one small chart does not justify it: this
module rasterizes axes, ticks, labelled polylines and a legend into an RGB buffer with a 3x5
pixel font, and writes it as a PNG (zlib + CRC32 from the standard library). The x axis is
logarithmic (base 2) when the values span a factor of 8 or more, linear otherwise.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

Color = tuple[int, int, int]

PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (214, 39, 40), (44, 160, 44))
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)

# 3x5 glyphs: five rows of three cells per character ('#' = ink)
_GLYPHS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", "..#", "..#", "..#"),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
    ".": ("...", "...", "...", "...", ".#."),
    "-": ("...", "...", "###", "...", "..."),
    "/": ("..#", "..#", ".#.", "#..", "#.."),
    "(": (".#.", "#..", "#..", "#..", ".#."),
    ")": (".#.", "..#", "..#", "..#", ".#."),
    ":": ("...", ".#.", "...", ".#.", "..."),
    "%": ("#.#", "..#", ".#.", "#..", "#.#"),
    " ": ("...", "...", "...", "...", "..."),
    "A": (".#.", "#.#", "###", "#.#", "#.#"),
    "B": ("##.", "#.#", "##.", "#.#", "##."),
    "C": (".##", "#..", "#..", "#..", ".##"),
    "D": ("##.", "#.#", "#.#", "#.#", "##."),
    "E": ("###", "#..", "###", "#..", "###"),
    "F": ("###", "#..", "###", "#..", "#.."),
    "G": (".##", "#..", "#.#", "#.#", ".##"),
    "H": ("#.#", "#.#", "###", "#.#", "#.#"),
    "I": ("###", ".#.", ".#.", ".#.", "###"),
    "J": ("..#", "..#", "..#", "#.#", ".#."),
    "K": ("#.#", "#.#", "##.", "#.#", "#.#"),
    "L": ("#..", "#..", "#..", "#..", "###"),
    "M": ("#.#", "###", "###", "#.#", "#.#"),
    "N": ("##.", "#.#", "#.#", "#.#", "#.#"),
    "O": (".#.", "#.#", "#.#", "#.#", ".#."),
    "P": ("##.", "#.#", "##.", "#..", "#.."),
    "Q": (".#.", "#.#", "#.#", ".#.", "..#"),
    "R": ("##.", "#.#", "##.", "#.#", "#.#"),
    "S": (".##", "#..", ".#.", "..#", "##."),
    "T": ("###", ".#.", ".#.", ".#.", ".#."),
    "U": ("#.#", "#.#", "#.#", "#.#", "###"),
    "V": ("#.#", "#.#", "#.#", "#.#", ".#."),
    "W": ("#.#", "#.#", "###", "###", "#.#"),
    "X": ("#.#", "#.#", ".#.", "#.#", "#.#"),
    "Y": ("#.#", "#.#", ".#.", ".#.", ".#."),
    "Z": ("###", "..#", ".#.", "#..", "###"),
}


class Canvas:
    """An RGB raster with the few drawing operations the chart needs."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.width + x)
        return tuple(self.pixels[i : i + 3])  # type: ignore[return-value]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thickness: int = 1) -> None:
        """Bresenham, thickened with a square pen."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = thickness // 2
        while True:
            self.rect(x0 - half, y0 - half, x0 + half, y0 + half, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: Color = BLACK, scale: int = 2) -> None:
        """Draw ``s`` (upper-cased) with its top-left corner at ``(x, y)``."""
        for ch in s.upper():
            rows = _GLYPHS.get(ch, _GLYPHS[" "])
            for r in range(5):
                for c in range(3):
                    if rows[r][c] == "#":
                        self.rect(
                            x + c * scale,
                            y + r * scale,
                            x + (c + 1) * scale - 1,
                            y + (r + 1) * scale - 1,
                            color,
                        )
            x += 4 * scale

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return max(0, len(s) * 4 * scale - scale)

    def png(self) -> bytes:
        """The canvas as PNG bytes (8-bit RGB, no interlace, filter 0 on every row)."""
        stride = 3 * self.width
        raw = b"".join(
            b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (
                struct.pack(">I", len(data))
                + kind
                + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
            )

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / max(1, ticks)
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for mult in (1, 2, 2.5, 5, 10):
        if raw <= mult * power:
            return mult * power
    return 10 * power


def _fmt(v: float) -> str:
    if v == int(v):
        return str(int(v))
    return f"{v:.2f}".rstrip("0").rstrip(".")


def line_chart(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    width: int = 720,
    height: int = 440,
) -> Canvas:
    """Draw one polyline (with square markers) per named series of ``(x, y)`` points."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 80, width - 170, 50, height - 60
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    if not xs:
        xs, ys = [1.0], [1.0]
    x_min, x_max = min(xs), max(xs)
    log_x = x_min > 0 and x_max / x_min >= 8
    fx = (lambda v: math.log2(v)) if log_x else (lambda v: v)
    lo, hi = fx(x_min), fx(x_max)
    if hi == lo:
        lo, hi = lo - 1, hi + 1
    y_step = _nice_step(max(ys) * 1.1 if max(ys) > 0 else 1.0)
    y_top = y_step * math.ceil(max(max(ys), 1e-9) * 1.05 / y_step)

    def px(x: float) -> int:
        return round(left + (fx(x) - lo) / (hi - lo) * (right - left))

    def py(y: float) -> int:
        return round(bottom - y / y_top * (bottom - top))

    # grid and y ticks
    tick = 0.0
    while tick <= y_top + 1e-9:
        y = py(tick)
        canvas.line(left, y, right, y, GRID)
        label = _fmt(tick)
        canvas.text(left - 8 - Canvas.text_width(label), y - 5, label)
        tick += y_step
    # x ticks: the data's own x values
    for x in sorted(set(xs)):
        canvas.line(px(x), bottom, px(x), bottom + 5, BLACK)
        label = _fmt(x)
        canvas.text(px(x) - Canvas.text_width(label) // 2, bottom + 10, label)
    canvas.line(left, top, left, bottom, BLACK, 2)
    canvas.line(left, bottom, right, bottom, BLACK, 2)
    # series
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        ordered = sorted(pts)
        for (x0, y0), (x1, y1) in itertools.pairwise(ordered):
            canvas.line(px(x0), py(y0), px(x1), py(y1), color, 3)
        for x, y in ordered:
            canvas.rect(px(x) - 3, py(y) - 3, px(x) + 3, py(y) + 3, color)
        ly = top + 10 + 24 * i
        canvas.rect(right + 20, ly, right + 40, ly + 10, color)
        canvas.text(right + 50, ly, name)
    canvas.text(left, 8, title)
    canvas.text((left + right) // 2 - Canvas.text_width(x_label) // 2, height - 26, x_label)
    canvas.text(8, top - 18, y_label)
    return canvas


def write_line_chart(
    path: str | Path, series: Mapping[str, Sequence[tuple[float, float]]], **kw
) -> None:
    """``line_chart(series, **kw)`` written to ``path`` as a PNG."""
    Path(path).write_bytes(line_chart(series, **kw).png())


__all__ = ["Canvas", "line_chart", "write_line_chart"]
