"""An experiment's ``report.html`` and ``curves.svg``: the comparison table, the verdicts, the overlaid curves.

Called by ``libra-ctl experiment`` (``pipeline.experiment``) once its runs
are done, with the document it writes as ``experiment.json``. Each value of
the varied key is one colour: its mean held-out success and reward curves
over seeds, with a band for mean ± sd. Everything is inline (SVG from
``pipeline.observe.charts``, no script, nothing fetched): the page can be
mailed or archived, and ``curves.svg`` pasted into a README.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.observe.charts import CHART_CSS, LINE_COLORS, Series, esc, line_chart, standalone_svg
from pipeline.observe.compare import comparison_table, mean_curve

# (key, title, curve, align, x, y, x is time, x label, y label) of each overlaid chart
CHARTS = (
    ("success_time", "Held-out success over time", "curve", "version", "t_s", "success", True, "", "success"),
    ("success_traj", "Held-out success over trajectories", "curve", "version", "trajectories", "success", False,
     "trajectories consumed", "success"),
    ("reward_time", "Reward over time", "reward_curve", "step", "t_s", "reward", True, "", "reward mean"),
    ("reward_traj", "Reward over trajectories", "reward_curve", "step", "trajectories", "reward", False,
     "trajectories consumed", "reward mean"),
)


def group_series(groups: list[dict], curve: str, align: str, x: str, y: str) -> list[Series]:
    """One series per value: its seeds' mean curve, banded by mean ± sd."""
    out = []
    for i, g in enumerate(groups):
        pts = mean_curve([r.get(curve) or [] for r in g["runs"] if r.get("ok", True)], align, x, y)
        if not pts:
            continue
        n = sum(1 for r in g["runs"] if r.get("ok", True))
        out.append(Series(f"{g['label']} ({n} seed{'s' if n != 1 else ''})", [p["x"] for p in pts],
                          [p["y"] for p in pts], LINE_COLORS[i % len(LINE_COLORS)],
                          band=([p["lo"] for p in pts], [p["hi"] for p in pts])))
    return out


def _kwargs(time_axis: bool, x_label: str, y_label: str, target: float | None, key: str) -> dict:
    # success is a share (floor 0); a reward may be negative (a reward model's raw logit)
    kw = {"y_label": y_label, "y_min": 0 if key.startswith("success") else None, "x_time": time_axis,
          "x_label": x_label}
    if target is not None and key.startswith("success"):
        kw["hlines"] = [(target, f"target {target:.1%}")]
    return kw


def curves_svg(doc: dict) -> str:
    """``curves.svg``: held-out success and reward over time, every value overlaid."""
    panels = []
    for key, title, curve, align, x, y, time_axis, x_label, y_label in CHARTS:
        if time_axis:
            panels.append((title, group_series(doc["groups"], curve, align, x, y),
                           _kwargs(time_axis, x_label, y_label, doc.get("target"), key)))
    return standalone_svg(panels)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#111827;background:#f9fafb}
header{background:#111827;color:#f9fafb;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:6px 0 0;color:#d1d5db}main{padding:12px 24px}h2{font-size:16px;margin:22px 0 6px}
table{border-collapse:collapse;background:#fff;font-size:13px}td,th{border:1px solid #e5e7eb;padding:4px 8px;
text-align:right;white-space:nowrap}td:first-child,th:first-child{text-align:left}th{background:#f3f4f6}
.grid2{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:12px}
@media (max-width:1100px){.grid2{grid-template-columns:minmax(0,1fr)}}
figure.chart{margin:0;background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:8px 10px}
figcaption{font-weight:600;margin-bottom:4px}svg.plot{width:100%;height:auto;display:block}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;color:#374151}
.legend i{display:inline-block;width:12px;height:3px;margin-right:5px;vertical-align:middle}
.empty{color:#9ca3af;font-style:italic;padding:30px 0;text-align:center}.note{font-size:12px;color:#6b7280}
.warn{background:#fef3c7;border:1px solid #f59e0b;padding:8px 12px;border-radius:6px}
.ok{color:#059669}.bad{color:#dc2626}.unknown{color:#6b7280}pre{background:#fff;border:1px solid #e5e7eb;
padding:8px;font-size:12px;overflow:auto;max-height:240px}
""" + CHART_CSS


def _table_html(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _verdicts_html(groups: list[dict]) -> str:
    items = []
    for g in groups:
        v = g["verdict"]
        crits = "".join(f'<li class="{"ok" if c["ok"] else "unknown" if c["ok"] is None else "bad"}">'
                        f'{"✓" if c["ok"] else "?" if c["ok"] is None else "✗"} {esc(c["name"])}: '
                        f'{esc(c["detail"])}</li>' for c in v["criteria"])
        items.append(f"<li><b>{esc(g['label'])}</b>: {esc(v['summary'])}<ul>{crits}</ul></li>")
    return f"<ul>{''.join(items)}</ul>"


def _runs_html(groups: list[dict], page_dir: Path) -> str:
    rows = []
    for g in groups:
        for r in g["runs"]:
            link = "-"
            if r.get("run_dir"):
                report = Path(r["run_dir"]) / "report.html"
                link = (f'<a href="{esc(os.path.relpath(report, page_dir))}">{esc(Path(r["run_dir"]).name)}</a>'
                        if report.exists() else esc(r["run_dir"]))
            status = "ok" if r.get("ok", True) else f"failed (exit {r.get('exit_code')})"
            err = f"<pre>{esc(r['error'])}</pre>" if r.get("error") else ""
            rows.append(f"<tr><td>{esc(g['label'])}</td><td>{r.get('seed', '-')}</td><td>{esc(status)}</td>"
                        f"<td>{link}{err}</td></tr>")
    return ("<table><thead><tr><th>value</th><th>seed</th><th>status</th><th>run</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def render(doc: dict, page_dir: Path) -> str:
    """The whole page for an experiment document (``experiment.json``); links are relative to ``page_dir``."""
    target = doc.get("target")
    header, rows = comparison_table(doc["groups"], target)
    charts = "".join(
        line_chart(key, title, group_series(doc["groups"], curve, align, x, y), note=_note(curve),
                   empty="no curve recorded", **_kwargs(time_axis, x_label, y_label, target, key))
        for key, title, curve, align, x, y, time_axis, x_label, y_label in CHARTS)
    notes = "".join(f'<p class="warn">{esc(n)}</p>' for n in doc.get("warnings", []))
    sets = " ".join(f"--set {s}" for s in doc.get("sets", []))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>Libra experiment: {esc(doc['id'])}</title><style>{CSS}</style></head>
<body><header><h1>Libra experiment {esc(doc['id'])}: {esc(doc.get('key', ''))}</h1>
<p>{esc(doc.get('config', ''))} {esc(sets)} · seeds {esc(', '.join(map(str, doc.get('seeds', []))))} ·
baseline: {esc(doc.get('baseline', {}).get('label', ''))} ({esc(doc.get('baseline', {}).get('source', ''))}) ·
target {target:.1%} held-out success ({esc(doc.get('target_source', ''))})</p></header><main>
{notes}
<h2>Comparison</h2>{_table_html(header, rows)}
<p class="note">mean ± sd over seeds. Time and trajectories to the target are interpolated along each run's
held-out curve (k/n: the runs that reached it). Slot busy: slot-seconds busy over slot-seconds held while
training; its fluctuation is the sd of the sampled busy share over time.</p>
<h2>Verdict against the baseline</h2>{_verdicts_html(doc['groups'])}
<p class="note">The field guide's test: time to the target down, fluctuation down, reward and success no
worse (a mean difference above -max(2 sd of the baseline / sqrt(seeds), {doc.get('floor', 0.01)})).</p>
<h2>Curves</h2><div class="grid2">{charts}</div>
<h2>Runs</h2>{_runs_html(doc['groups'], page_dir)}
</main></body></html>
"""


def _note(curve: str) -> str:
    return ("mean over seeds, band: mean ± sd; each evaluated version placed where the learner produced it"
            if curve == "curve" else "mean over seeds per learner step, band: mean ± sd")


def write(doc: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``report.html`` and ``curves.svg`` into ``out_dir``; returns their paths."""
    page, svg = out_dir / "report.html", out_dir / "curves.svg"
    page.write_text(render(doc, out_dir), encoding="utf-8")
    svg.write_text(curves_svg(doc), encoding="utf-8")
    return page, svg
