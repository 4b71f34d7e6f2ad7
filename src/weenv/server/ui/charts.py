"""Small inline SVG charts for the dashboard: numbers in, markup out (no I/O).

Text in a chart (titles, labels) is escaped here; the result is
:class:`markupsafe.Markup`, placed in a page as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

PHASE_COLORS = {"create": "#4e79a7", "exec": "#f28e2b", "files": "#59a14f", "destroy": "#e15759", "other": "#b07aa1"}


def _points(values: Sequence[float], top: float, width: float, height: float) -> str:
    n = len(values)
    step = width / max(1, n - 1)
    return " ".join(f"{i * step:.1f},{height - min(v, top) / top * (height - 2) - 1:.1f}" for i, v in enumerate(values))


def usage_spark(
    used: Sequence[float], limit: Sequence[float | None], *, title: str, width: int = 120, height: int = 28
) -> Markup:
    """Usage (a filled line) against its quota (a dashed line) over the same samples."""
    limits = [x for x in limit if x]
    top = max([*used, *limits, 1e-9])
    parts = [
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
        f"<title>{escape(title)}</title>",
    ]
    if len(used) >= 2:
        pts = _points(used, top, width, height)
        parts.append(f'<polygon class="used-area" points="0,{height} {pts} {width},{height}"/>')
        parts.append(f'<polyline class="used" points="{pts}"/>')
    if len(limits) >= 2 and len(limits) == len(limit):
        parts.append(f'<polyline class="limit" points="{_points(limits, top, width, height)}"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def stacked_bars(bars: Sequence[tuple[str, dict[str, float]]], *, width: int = 720, height: int = 240) -> Markup:
    """One bar per ``(label, {phase: seconds})``, its phases stacked in
    :data:`PHASE_COLORS` order, scaled to the tallest bar; a legend below."""
    pad_left, pad_bottom, legend = 48, 18, 22
    plot_h = height - pad_bottom - legend
    total = max([sum(p.values()) for _, p in bars] + [1e-9])
    n = max(1, len(bars))
    slot = (width - pad_left) / n
    bar_w = max(2.0, min(40.0, slot * 0.7))
    out = [
        f'<svg class="bars" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
        "<title>environment seconds by phase, per batch</title>",
        f'<line class="axis" x1="{pad_left}" y1="{plot_h}" x2="{width}" y2="{plot_h}"/>',
        f'<text class="tick" x="{pad_left - 4}" y="10" text-anchor="end">{total:.3g} s</text>',
        f'<text class="tick" x="{pad_left - 4}" y="{plot_h}" text-anchor="end">0</text>',
    ]
    for i, (label, phases) in enumerate(bars):
        x = pad_left + i * slot + (slot - bar_w) / 2
        y = float(plot_h)
        out.append(f'<g class="bar" data-batch="{escape(label)}">')
        for phase, color in PHASE_COLORS.items():
            s = phases.get(phase, 0.0)
            if s <= 0:
                continue
            h = s / total * (plot_h - 4)
            y -= h
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}" fill="{color}">'
                f"<title>{escape(label)}: {phase} {s:.3f} s</title></rect>"
            )
        out.append(
            f'<text class="tick" x="{x + bar_w / 2:.1f}" y="{plot_h + 13}" text-anchor="middle">'
            f"{escape(label if len(label) <= 14 else label[:13] + '…')}</text></g>"
        )
    x = pad_left
    for phase, color in PHASE_COLORS.items():
        out.append(
            f'<rect x="{x}" y="{height - 14}" width="10" height="10" fill="{color}"/>'
            f'<text class="tick" x="{x + 14}" y="{height - 5}">{phase}</text>'
        )
        x += 80
    out.append("</svg>")
    return Markup("".join(out))
