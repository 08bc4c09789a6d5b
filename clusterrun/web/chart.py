"""The loss chart of a job's page: an SVG drawn here, on the server, from ``ps --json``'s ``loss_curve``.

Drawn server-side so that the page needs no charting script (nothing from another site, no build
step) and the chart is part of the HTML a search or a screen reader sees. One line per attempt (a
restarted run's curve beside the one before it), scaled to the box of the ``viewBox``: the browser
shrinks it to the page's width, a phone's too. Each line carries its points as data
(``data-steps``, ``data-losses``: what rank 0 printed, not pixels).
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

WIDTH, HEIGHT = 480, 160  # the viewBox: the chart keeps this shape at any width
LEFT, RIGHT, TOP, BOTTOM = 62, 8, 12, 26  # room for the axes' labels
COLOURS = ("#1976d2", "#e65100", "#2e7d32", "#6a1b9a", "#c62828", "#00838f")  # by attempt, in turn


def _number(value: float) -> str:
    """A step or a loss as the data says it (``120``, ``2.3051``), not as a float's repr (``120.0``)."""
    return str(int(value)) if value == int(value) else repr(value)


def _label(value: float) -> str:
    return f"{value:.4g}"


def loss_chart(curve: Sequence[Sequence[float]] | None) -> Markup:
    """The chart of ``curve`` (``[[attempt, step, loss], ...]``, the earliest first); empty without points."""
    marks = [(int(a), float(s), float(y)) for a, s, y in curve or ()]
    if not marks:
        return Markup("")
    steps, losses = [m[1] for m in marks], [m[2] for m in marks]
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(losses), max(losses)
    pad = (y1 - y0) * 0.05 or abs(y1) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad

    def x(step: float) -> float:
        return LEFT + (step - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT) if x1 > x0 else (LEFT + WIDTH - RIGHT) / 2

    def y(loss: float) -> float:
        return TOP + (y1 - loss) / (y1 - y0) * (HEIGHT - TOP - BOTTOM)

    attempts = sorted({m[0] for m in marks})
    bottom = HEIGHT - BOTTOM
    parts = [f'<svg id="loss-chart" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'aria-labelledby="loss-chart-title" preserveAspectRatio="xMidYMid meet">',
             f'<title id="loss-chart-title">loss from {_label(marks[0][2])} to {_label(marks[-1][2])}, '
             f'step {_number(x0)} to {_number(x1)}</title>',
             f'<path d="M{LEFT} {TOP}V{bottom}H{WIDTH - RIGHT}" fill="none" stroke="#90a4ae"/>',
             f'<text x="{LEFT - 4}" y="{TOP + 12}" text-anchor="end" font-size="15">{_label(y1 - pad)}</text>',
             f'<text x="{LEFT - 4}" y="{bottom}" text-anchor="end" font-size="15">{_label(y0 + pad)}</text>',
             f'<text x="{LEFT}" y="{HEIGHT - 6}" font-size="15">step {_number(x0)}</text>',
             f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 6}" text-anchor="end" font-size="15">{_number(x1)}</text>']
    for index, attempt in enumerate(attempts):
        mine = [m for m in marks if m[0] == attempt]
        colour = COLOURS[index % len(COLOURS)]
        drawn = " ".join(f"{x(s):.1f},{y(v):.1f}" for _, s, v in mine)
        parts.append(f'<polyline class="loss" data-attempt="{attempt}" '
                     f'data-steps="{" ".join(_number(s) for _, s, _ in mine)}" '
                     f'data-losses="{" ".join(_number(v) for _, _, v in mine)}" points="{drawn}" fill="none" '
                     f'stroke="{colour}" stroke-width="1.5" vector-effect="non-scaling-stroke"/>')
        last = mine[-1]
        parts.append(f'<circle cx="{x(last[1]):.1f}" cy="{y(last[2]):.1f}" r="2.5" fill="{colour}"/>')
        if len(attempts) > 1:
            parts.append(f'<text x="{WIDTH - RIGHT}" y="{TOP + 12 + 17 * index}" text-anchor="end" font-size="15" '
                         f'fill="{colour}">attempt {escape(str(attempt))}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
