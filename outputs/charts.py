"""Bar charts as inline SVG, written by Python: `genq report`'s page shows its pictures with no
script and nothing fetched from the network."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 640, 180
LEFT, BOTTOM, TOP = 64, 22, 8  # room for the y label, the x labels and the top bar


@dataclass
class Bar:
    value: float
    name: str  # where it stands on the x axis (the first and last bar's are written under it)
    title: str  # plain text shown on hover


def bar_chart(bars: list[Bar], label: str, unit: str, x_unit: str) -> str:
    """One ``<rect class="bar">`` per bar, left to right, scaled to the tallest; the y axis says the
    tallest value in ``unit``, the x axis the first and last bar's names, then ``x_unit``. Every
    string is escaped here."""
    top = max((b.value for b in bars), default=0)
    plot_w, plot_h = WIDTH - LEFT, HEIGHT - BOTTOM - TOP
    step = plot_w / max(len(bars), 1)
    rects = []
    for i, bar in enumerate(bars):
        h = plot_h * bar.value / top if top else 0
        rects.append(
            f'<rect class="bar" x="{LEFT + i * step + step * 0.1:.1f}" y="{TOP + plot_h - h:.1f}" '
            f'width="{step * 0.8:.1f}" height="{h:.1f}"><title>{escape(bar.title)}</title></rect>'
        )
    base = TOP + plot_h
    return (
        f'<svg class="chart" role="img" aria-label="{escape(label)}" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}">'
        f'<text x="{LEFT - 6}" y="{TOP + 10}" text-anchor="end">{top:,.0f}</text>'
        f'<text x="{LEFT - 6}" y="{TOP + 24}" text-anchor="end">{escape(unit)}</text>'
        f'<text x="{LEFT - 6}" y="{base}" text-anchor="end">0</text>'
        f'<line x1="{LEFT}" y1="{base}" x2="{WIDTH}" y2="{base}"/>'
        + "".join(rects)
        + f'<text x="{LEFT}" y="{HEIGHT - 6}">{escape(bars[0].name) if bars else ""}</text>'
        f'<text x="{WIDTH}" y="{HEIGHT - 6}" text-anchor="end">'
        f"{escape(f'{bars[-1].name} {x_unit}'.strip()) if bars else ''}</text></svg>"
    )
