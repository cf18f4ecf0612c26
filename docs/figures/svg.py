"""The plain SVG writer every figure uses, and the shared colours and paths. No dependencies."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]
GREY, DARK, LIGHT = "#9a9a9a", "#333333", "#eeeeee"


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


CHAR_WIDTH = 0.6  # a monospace glyph is about 0.6 of the font size wide


def wrap(text: str, width_px: float, size: float) -> list[str]:
    """``text`` cut at spaces into lines that fit ``width_px`` in a monospace font of ``size``."""
    limit, lines, line = max(1, int(width_px / (CHAR_WIDTH * size))), [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > limit:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line] if line else lines


class Svg:
    """A minimal SVG writer: rectangles, text, lines and arrows, in document order."""

    def __init__(self, width: float, height: float, font_size: int = 12):
        self.width, self.height, self.parts = width, height, []
        self.font_size = font_size

    def rect(self, x, y, w, h, fill, stroke="white", text=None, text_fill="white", size=None, tooltip=None, dash=False):
        dashed = ' stroke-dasharray="3,2"' if dash else ""
        title = f"<title>{tooltip}</title>" if tooltip else ""
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" stroke="{stroke}"{dashed}>'
            f"{title}</rect>"
        )
        if text is not None:
            self.text(x + w / 2, y + h / 2 + 4, text, anchor="middle", fill=text_fill, size=size)

    def text(self, x, y, s, anchor="start", fill=DARK, size=None, weight=None):
        bold = f' font-weight="{weight}"' if weight else ""
        size = f' font-size="{size}"' if size else ""
        escaped = str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}"{size}{bold}>{escaped}</text>'
        )

    def lines(self, x, y, text, width_px, size=None, leading=1.35, **kw) -> float:
        """``text`` wrapped to ``width_px``, one <text> per line from baseline ``y``; returns the next free y."""
        size = size or self.font_size
        for line in wrap(text, width_px, size):
            self.text(x, y, line, size=size, **kw)
            y += size * leading
        return y

    def line(self, x1, y1, x2, y2, stroke=GREY, width=1.0, arrow=False):
        head = ' marker-end="url(#arrow)"' if arrow else ""
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" stroke-width="{width}"{head}/>'
        )

    def render(self) -> str:
        return "\n".join(
            [
                f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width:.0f}" height="{self.height:.0f}" '
                f'font-family="monospace" font-size="{self.font_size}">',
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="{GREY}"/></marker></defs>',
                '<rect width="100%" height="100%" fill="white"/>',
                *self.parts,
                "</svg>",
                "",
            ]
        )
