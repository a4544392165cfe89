"""Inline SVG charts for ``report.html``: line, stacked-area and bar charts with their axes.

Pure drawing: each chart is a function of ``Series`` (or bars) to an HTML
``<figure>`` string, with no knowledge of runs, files or metrics. Called by
``pipeline.observe.report`` when it assembles the page, and by
``pipeline.observe.compare_report`` for an experiment's overlaid curves (a
line with a band for the spread over seeds; ``standalone_svg`` puts charts in
one SVG file of their own). ``SELF_CHECK`` is the page's inline script that
confirms, in the browser, that the charts laid out.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

W, H = 480, 250  # chart viewBox; the page scales it
LINE_COLORS = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#4b5563", "#db2777")
PAD_L, PAD_R, PAD_T, PAD_B = 52, 14, 12, 34


@dataclass
class Series:
    """One line of a chart: xs in seconds since the run's start, ys with None where there is no value."""

    name: str
    xs: list[float]
    ys: list[float | None]
    color: str
    step: bool = False  # drawn as a step function (counts that change at instants)
    dash: bool = False
    band: tuple[list, list] | None = None  # (lows, highs) per x, shaded under the line; None where unknown


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values (steps of 1, 2, 2.5 or 5 times a power of ten) spanning lo..hi."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if (hi - lo) / (m * mag) <= n)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t < hi + step * 0.999:
        ticks.append(round(t, 12))
        t += step
    return ticks


def fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def esc(s) -> str:
    return html.escape(str(s), quote=True)


class Frame:
    """Axes of one chart: data -> viewBox coordinates, ticks and grid."""

    def __init__(self, xs: list[float], ys: list[float], y_min=None, y_max=None, x_time: bool = True):
        self.minutes = x_time and bool(xs) and max(xs) - min(xs) > 900
        xs = [x / 60 for x in xs] if self.minutes else xs
        self.xt = nice_ticks(min(xs, default=0.0), max(xs, default=1.0))
        lo = min(ys, default=0.0) if y_min is None else y_min
        hi = max(ys, default=1.0) if y_max is None else max(y_max, max(ys, default=y_max))
        self.yt = nice_ticks(min(lo, 0.0) if lo >= 0 else lo, hi)
        self.x0, self.x1, self.y0, self.y1 = self.xt[0], self.xt[-1], self.yt[0], self.yt[-1]

    def px(self, x: float) -> float:
        x = x / 60 if self.minutes else x
        return PAD_L + (x - self.x0) / ((self.x1 - self.x0) or 1) * (W - PAD_L - PAD_R)

    def py(self, y: float) -> float:
        return H - PAD_B - (y - self.y0) / ((self.y1 - self.y0) or 1) * (H - PAD_T - PAD_B)

    def axes(self, x_label: str, y_label: str) -> str:
        out = []
        for t in self.yt:
            y = self.py(t)
            out.append(f'<line class="grid" x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}"/>'
                       f'<text class="tick" x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>')
        for t in self.xt:
            x = PAD_L + (t - self.x0) / ((self.x1 - self.x0) or 1) * (W - PAD_L - PAD_R)
            out.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{H - PAD_B}"/>'
                       f'<text class="tick" x="{x:.1f}" y="{H - PAD_B + 15}" text-anchor="middle">{fmt_num(t)}</text>')
        unit = "minutes" if self.minutes else "seconds"
        out.append(f'<text class="label" x="{(PAD_L + W - PAD_R) / 2}" y="{H - 4}" text-anchor="middle">'
                   f'{esc(x_label or unit + " since the start")}</text>')
        if y_label:
            out.append(f'<text class="label" transform="translate(12,{(PAD_T + H - PAD_B) / 2}) rotate(-90)" '
                       f'text-anchor="middle">{esc(y_label)}</text>')
        return "".join(out)


def _path(f: Frame, s: Series) -> str:
    parts, pen = [], False
    prev_y = None
    for x, y in zip(s.xs, s.ys):
        if y is None or (isinstance(y, float) and not math.isfinite(y)):
            pen = False
            continue
        px, py = f.px(x), f.py(y)
        if not pen:
            parts.append(f"M{px:.1f},{py:.1f}")
        elif s.step:
            parts.append(f"H{px:.1f}V{py:.1f}")
        else:
            parts.append(f"L{px:.1f},{py:.1f}")
        pen, prev_y = True, py
    if s.step and pen and prev_y is not None:
        parts.append(f"H{W - PAD_R:.1f}")  # a count holds until the end
    return "".join(parts)


def _band(f: Frame, s: Series) -> str:
    """The shaded area between a series' lows and highs, one closed path per unbroken stretch."""
    lows, highs = s.band
    runs, cur = [], []
    for x, lo, hi in zip(s.xs, lows, highs):
        if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
            if cur:
                runs.append(cur)
            cur = []
            continue
        cur.append((f.px(x), f.py(lo), f.py(hi)))
    if cur:
        runs.append(cur)
    paths = []
    for pts in runs:
        edge = [f"{x:.1f},{hi:.1f}" for x, _lo, hi in pts] + [f"{x:.1f},{lo:.1f}" for x, lo, _hi in reversed(pts)]
        paths.append("M" + "L".join(edge) + "Z")
    return (f'<path class="band" data-series="{esc(s.name)}" d="{"".join(paths)}" fill="{s.color}" stroke="none"/>'
            if paths else "")


def _band_ys(series: list[Series]) -> list[float]:
    return [y for s in series if s.band for ys in s.band for y in ys if y is not None and math.isfinite(y)]


def _points(f: Frame, s: Series, x_unit: str) -> str:
    pts = [(x, y) for x, y in zip(s.xs, s.ys) if y is not None and math.isfinite(y)]
    stride = max(1, len(pts) // 60)
    r = 2.4 if len(pts) <= 40 else 0
    out = []
    for x, y in pts[::stride]:
        out.append(f'<circle class="pt" cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="{r or 4}" '
                   f'fill="{s.color if r else "transparent"}"><title>{esc(s.name)}: {fmt_num(y)} at '
                   f'{x:.0f} {x_unit}</title></circle>')
    return "".join(out)


def _stack(series: list[Series]) -> list[tuple[Series, list[float], list[float]]]:
    """(series, lower, upper) per series, stacked in order; the series share their xs."""
    lower = [0.0] * len(series[0].xs)
    out = []
    for s in series:
        upper = [lo + (y or 0.0) for lo, y in zip(lower, s.ys)]
        out.append((s, lower, upper))
        lower = upper
    return out


def _step_area(f: Frame, xs: list[float], lower: list[float], upper: list[float]) -> str:
    def edge(ys):
        pts = []
        for i, (x, y) in enumerate(zip(xs, ys)):
            nxt = f.px(xs[i + 1]) if i + 1 < len(xs) else W - PAD_R
            pts += [(f.px(x), f.py(y)), (nxt, f.py(y))]
        return pts
    pts = edge(upper) + edge(lower)[::-1]
    return "M" + "L".join(f"{x:.1f},{y:.1f}" for x, y in pts) + "Z"


def line_chart(key: str, title: str, series: list[Series], *, y_label: str = "", y_min=None, y_max=None,
               markers: list[tuple[float, str]] = (), hlines: list[tuple[float, str]] = (),
               stacked: bool = False, x_range: tuple[float, float] | None = None, empty: str = "no data",
               note: str = "", x_label: str = "", x_time: bool = True) -> str:
    """A figure with one SVG line chart; ``markers`` are vertical lines with a hover label.

    ``stacked`` draws step areas on top of each other (counts per role that add up to a total);
    ``hlines`` are labelled thresholds; a series' ``band`` is shaded under its line.
    ``x_time``: the x axis is seconds (shown in minutes past 15 of them); otherwise
    ``x_label`` names its unit.
    """
    series = [s for s in series if any(y is not None for y in s.ys)]
    if not series:
        return _figure(key, title, f'<p class="empty">{esc(empty)}</p>', "", note, empty=True)
    svg = line_svg(title, series, y_label=y_label, y_min=y_min, y_max=y_max, markers=markers, hlines=hlines,
                   stacked=stacked, x_range=x_range, x_label=x_label, x_time=x_time)
    legend = "".join(f'<span><i style="background:{s.color}"></i>{esc(s.name)}</span>' for s in series)
    if markers:
        legend += f'<span><i class="mk"></i>controller decision ({len(markers)})</span>'
    return _figure(key, title, svg, legend, note)


def line_svg(title: str, series: list[Series], *, y_label: str = "", y_min=None, y_max=None,
             markers: list[tuple[float, str]] = (), hlines: list[tuple[float, str]] = (),
             stacked: bool = False, x_range: tuple[float, float] | None = None, x_label: str = "",
             x_time: bool = True, attrs: str = "") -> str:
    """The ``<svg>`` of ``line_chart`` alone (``attrs``: more attributes of the element)."""
    series = [s for s in series if any(y is not None for y in s.ys)]
    xs = [x for s in series for x in s.xs] + [m[0] for m in markers] + list(x_range or ())
    ys = ([y for s in series for y in s.ys if y is not None and math.isfinite(y)] + [h[0] for h in hlines]
          + _band_ys(series))
    layers = _stack(series) if stacked else []
    if layers:
        ys += layers[-1][2]
    f = Frame(xs, ys, y_min, y_max, x_time=x_time)
    dash = ' stroke-dasharray="5 3"'
    x_unit = "s" if x_time else x_label
    if layers:
        marks = "".join(f'<path class="series area" data-series="{esc(s.name)}" d="{_step_area(f, s.xs, lo, up)}" '
                        f'style="fill:{s.color}" stroke="{s.color}"><title>{esc(s.name)}</title></path>'
                        for s, lo, up in layers)
    else:
        marks = "".join(_band(f, s) for s in series if s.band)
        marks += "".join(f'<path class="series" data-series="{esc(s.name)}" d="{_path(f, s)}" stroke="{s.color}"'
                         f'{dash if s.dash else ""}/>' + _points(f, s, x_unit) for s in series)
    marks += "".join(f'<line class="threshold" x1="{PAD_L}" x2="{W - PAD_R}" y1="{f.py(y):.1f}" y2="{f.py(y):.1f}"/>'
                     f'<text class="tick" x="{W - PAD_R - 2}" y="{f.py(y) - 4:.1f}" text-anchor="end">{esc(lab)}</text>'
                     for y, lab in hlines)
    mk = "".join(f'<g class="decision"><line x1="{f.px(x):.1f}" x2="{f.px(x):.1f}" y1="{PAD_T}" y2="{H - PAD_B}"/>'
                 f'<path d="M{f.px(x) - 4:.1f},{PAD_T}h8l-4,6z"/><title>{esc(label)} (at {x:.0f} s)</title></g>'
                 for x, label in markers)
    return (f'<svg class="plot" viewBox="0 0 {W} {H}" role="img" aria-label="{esc(title)}"{attrs}>'
            f'<g class="axes">{f.axes("" if x_time else x_label, y_label)}</g><g class="marks">{marks}</g>'
            f'<g class="markers">{mk}</g></svg>')


def bar_chart(key: str, title: str, labels: list[str], values: list[float], colors: list[str], *,
              x_label: str, y_label: str, empty: str, note: str = "") -> str:
    if not values:
        return _figure(key, title, f'<p class="empty">{esc(empty)}</p>', "", note, empty=True)
    f = Frame([0, 1], values, 0)
    n, inner = len(values), W - PAD_L - PAD_R
    bw = inner / n
    bars = []
    for i, (lab, v, c) in enumerate(zip(labels, values, colors)):
        x, y = PAD_L + i * bw + bw * 0.15, f.py(v)
        bars.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bw * 0.7:.1f}" '
                    f'height="{max(H - PAD_B - y, 0.5):.1f}" fill="{c}"><title>{esc(lab)}: {fmt_num(v)}</title></rect>'
                    f'<text class="tick" x="{x + bw * 0.35:.1f}" y="{H - PAD_B + 15}" text-anchor="middle">'
                    f'{esc(lab)}</text><text class="val" x="{x + bw * 0.35:.1f}" y="{y - 4:.1f}" '
                    f'text-anchor="middle">{fmt_num(v)}</text>')
    grid = "".join(f'<line class="grid" x1="{PAD_L}" x2="{W - PAD_R}" y1="{f.py(t):.1f}" y2="{f.py(t):.1f}"/>'
                   f'<text class="tick" x="{PAD_L - 6}" y="{f.py(t) + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>'
                   for t in f.yt)
    svg = (f'<svg class="plot" viewBox="0 0 {W} {H}" role="img" aria-label="{esc(title)}"><g class="axes">{grid}'
           f'<text class="label" x="{(PAD_L + W - PAD_R) / 2}" y="{H - 4}" text-anchor="middle">{esc(x_label)}</text>'
           f'<text class="label" transform="translate(12,{(PAD_T + H - PAD_B) / 2}) rotate(-90)" '
           f'text-anchor="middle">{esc(y_label)}</text></g><g class="marks">{"".join(bars)}</g></svg>')
    return _figure(key, title, svg, "", note)


def _figure(key: str, title: str, body: str, legend: str, note: str, empty: bool = False) -> str:
    return (f'<figure class="chart{" empty" if empty else ""}" data-chart="{esc(key)}">'
            f'<figcaption>{esc(title)}</figcaption>{body}'
            f'{f"<div class=legend>{legend}</div>" if legend else ""}'
            f'{f"<p class=note>{esc(note)}</p>" if note else ""}</figure>')


# Runs after layout: counts the charts whose marks have a non-empty box (what the Chromium test reads).
SELF_CHECK = """
(function(){var figs=document.querySelectorAll('figure.chart svg.plot'),n=0;
for(var i=0;i<figs.length;i++){var m=figs[i].querySelector('.marks');if(!m||!m.childElementCount)continue;
var b=m.getBBox();if(b.width>0||b.height>0){n++;figs[i].setAttribute('data-rendered','1');}}
document.body.setAttribute('data-rendered-charts',String(n));document.body.setAttribute('data-charts',String(figs.length));
var f=document.getElementById('selfcheck');if(f)f.textContent=n+' of '+figs.length+' charts rendered';})();
"""



# The chart classes, for a page of charts and for ``standalone_svg`` (which has no page around it).
CHART_CSS = """
.grid{stroke:#e5e7eb;stroke-width:1}.tick{font-size:11px;fill:#6b7280}.label{font-size:12px;fill:#374151}
path.series{fill:none;stroke-width:2}path.band{fill-opacity:.15}.title{font-size:14px;font-weight:600;fill:#111827}
.legend-text{font-size:12px;fill:#374151}.threshold{stroke:#dc2626;stroke-width:1;stroke-dasharray:4 3}
"""
LEGEND_ROW = 18   # px per legend line under a chart in ``standalone_svg``
TITLE_H = 22


def standalone_svg(panels: list[tuple[str, list[Series], dict]], columns: int = 2) -> str:
    """One SVG file of line charts side by side, each with its title above and its legend below.

    ``panels``: (title, series, keyword arguments of ``line_svg``). The file
    carries its own style, so it shows the same in a browser, an image
    viewer or a README.
    """
    legend_h = LEGEND_ROW * max((len(series) for _t, series, _k in panels), default=0) + 6
    cell_h = TITLE_H + H + legend_h
    rows = max(1, math.ceil(len(panels) / columns))
    width, height = W * min(columns, max(len(panels), 1)), cell_h * rows
    body = []
    for i, (title, series, kwargs) in enumerate(panels):
        x, y = (i % columns) * W, (i // columns) * cell_h
        body.append(f'<text class="title" x="{x + PAD_L}" y="{y + 16}">{esc(title)}</text>')
        body.append(line_svg(title, series, attrs=f' x="{x}" y="{y + TITLE_H}" width="{W}" height="{H}"',
                             **kwargs))
        for j, s in enumerate(series):
            ly = y + TITLE_H + H + 4 + j * LEGEND_ROW
            body.append(f'<rect x="{x + PAD_L}" y="{ly + 5}" width="14" height="3" fill="{s.color}"/>'
                        f'<text class="legend-text" x="{x + PAD_L + 20}" y="{ly + 11}">{esc(s.name)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="system-ui,-apple-system,Segoe UI,Roboto,sans-serif">'
            f'<style>{CHART_CSS}</style><rect width="100%" height="100%" fill="#fff"/>{"".join(body)}</svg>\n')
