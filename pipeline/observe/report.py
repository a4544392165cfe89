"""``libra-ctl report RUN``: one self-contained HTML page about a run (``runs/<id>/report.html``).

Throughput, reward and diversity side by side (the field guide judges a
change by the three together), the allocation over time with the
controller's decisions marked, queue lengths and learner wait, a staleness
histogram, resources, the run's events and its manifest. Everything is
inline SVG (drawn by ``pipeline.observe.charts``) and a few lines of inline
script that check the plots laid out; nothing is fetched, so the file can be
mailed or archived. This module loads the run and assembles the page.

Inputs are the run directory alone: ``metrics.jsonl`` (the learner's steps and
the sampler's samples), ``events.jsonl`` (controller decisions), ``logs/``,
``manifest.json`` and ``summary.json``. Where the sampler did not run, the
throughput comes from the learner's steps and the rollout workers' logs.
Called by the user, by ``libra-ctl run`` at the end of a run, and by
``scripts/report_screenshot.py``.

A report is one run of one job. Where several jobs share a controller's
pool, the headline gives this job's pool settings (``control.min_slots``,
``max_slots``, ``priority``) from its manifest, and the "Pool" section what
the pool decided for it, read from the ``pool`` of its decision events
(``pipeline.control.loop``): the other jobs that shared it, this job's share
over time, the slots moved between jobs, and when it was below its minimum.
A job pinned with ``libra-ctl scale`` holds its slots outside the pool; its
``pinned`` events carry no ``pool``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import argtypes
from pipeline.control.allocator import LEARNER_WAIT_THRESHOLD
from pipeline.observe.charts import SELF_CHECK, Series, bar_chart, esc, line_chart
from pipeline.observe.measures import success_text
from pipeline.observe.status import format_pool
from pipeline.redaction import redact_tree

COLORS = {"rollout": "#2563eb", "reward": "#d97706", "learner": "#059669", "feeder": "#6b7280",
          "controller": "#7c3aed"}
PALETTE = ("#2563eb", "#059669", "#d97706", "#dc2626", "#7c3aed", "#0891b2", "#4b5563", "#db2777")
MAX_EVENTS = 400
BIN_S = 10.0  # rate bins when throughput comes from logs
NOTABLE = {"checkpointed", "restored", "evaluated", "dead_lettered", "dead_lettered_redelivered",
           "worker_started", "worker_exited", "stop_requested", "redis_full_waiting", "reclaimed", "drained"}
NO_SAMPLES = "no metric samples in metrics.jsonl (the sampler was not running)"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--hide-scrollbars"]


# --- the run's data -------------------------------------------------------------------------------------


@dataclass
class RunData:
    run_dir: Path
    manifest: dict
    summary: dict
    steps: list[dict]
    samples: list[dict]
    events: list[dict]
    logs: list[dict]
    t0: float = 0.0
    notes: list[str] = field(default_factory=list)

    def x(self, at: float) -> float:
        return at - self.t0

    def x_range(self) -> tuple[float, float]:
        """The run's time span, shared by every time chart so that they line up."""
        ats = ([s["at"] for s in self.steps + self.samples] + [r["_at"] for r in self.logs] +
               [e["at"] for e in self.events if isinstance(e.get("at"), (int, float))])
        return 0.0, max(ats, default=self.t0 + 1.0) - self.t0


def load_run(run_dir: Path | str) -> RunData:
    from pipeline.observe.compare import standing_steps
    from pipeline.observe.measures import read_jsonl
    from pipeline.observe.trace import read_log_records, unix_time

    run_dir = Path(run_dir)
    notes = []

    def read(name: str) -> dict:
        try:
            doc = json.loads((run_dir / name).read_text()) if (run_dir / name).exists() else {}
        except (ValueError, OSError) as exc:   # cut short by a kill, or unreadable: the rest still reports
            notes.append(f"{name} could not be read ({type(exc).__name__}: {exc}); left out")
            return {}
        return doc if isinstance(doc, dict) else {}

    lines = read_jsonl(run_dir / "metrics.jsonl")
    logs = read_log_records(run_dir) if (run_dir / "logs").is_dir() else []
    for rec in logs:
        rec["_at"] = unix_time(rec.get("timestamp"))
    # a step a restored learner trained again stands once, as its later record (its trajectories once in the
    # staleness bars, as in the headline's trained count)
    data = RunData(run_dir, read("manifest.json"), read("summary.json"),
                   standing_steps([x for x in lines if x.get("kind") == "learner_step" and "at" in x]),
                   [x for x in lines if x.get("kind") == "sample" and "at" in x],
                   read_jsonl(run_dir / "events.jsonl"), [r for r in logs if r["_at"] is not None], notes=notes)
    times = ([data.manifest.get("created_at")] + [s["at"] for s in data.steps + data.samples] +
             [e["at"] for e in data.events if isinstance(e.get("at"), (int, float))])
    times = [t for t in times if isinstance(t, (int, float))]
    data.t0 = min(times) if times else 0.0
    return data


def _role_color(name: str, i: int) -> str:
    return COLORS.get(name, PALETTE[i % len(PALETTE)])


def _binned(records: list[dict], t0: float, value) -> tuple[list[float], list[float]]:
    """Per-second rate of ``value(record)`` in BIN_S bins of the records' times."""
    if not records:
        return [], []
    bins: dict[int, float] = {}
    for rec in records:
        bins[int((rec["_at"] - t0) // BIN_S)] = bins.get(int((rec["_at"] - t0) // BIN_S), 0.0) + value(rec)
    lo, hi = min(bins), max(bins)
    xs = [(b + 0.5) * BIN_S for b in range(lo, hi + 1)]
    return xs, [bins.get(b, 0.0) / BIN_S for b in range(lo, hi + 1)]


def throughput_series(d: RunData) -> tuple[list[Series], list[Series], str]:
    """(trajectory rates, token rate, where they came from)."""
    if len(d.samples) >= 2:
        xs = [d.x(s["at"]) for s in d.samples]
        tp = [s.get("throughput", {}) for s in d.samples]
        per_min = [t.get("trajectories_per_min") for t in tp]
        traj = [Series("generated /s", xs, [v / 60 if v is not None else None for v in per_min], PALETTE[0]),
                Series("scored /s", xs, [t.get("scored_per_s") for t in tp], PALETTE[2], dash=True),
                Series("trained /s", xs, [t.get("learner_samples_per_s") for t in tp], PALETTE[1])]
        tok = [t.get("rollout_tokens_per_s") for t in tp]
        if any(v is not None for v in tok):
            return traj, [Series("rollout tokens /s", xs, tok, PALETTE[4])], "sampler"
        gen = [r for r in d.logs if r.get("event") == "generated" and r.get("tokens") is not None]
        gx, gy = _binned(gen, d.t0, lambda r: r["tokens"])
        return traj, ([Series("rollout tokens /s", gx, gy, PALETTE[4])] if gx else []), "sampler"
    traj = []
    gen = [r for r in d.logs if r.get("event") == "generated"]
    if gen:
        gx, gy = _binned(gen, d.t0, lambda r: r.get("trajectories", 0))
        traj.append(Series("generated /s", gx, gy, PALETTE[0]))
    if len(d.steps) >= 2:
        xs, ys = [], []
        for a, b in zip(d.steps, d.steps[1:]):
            dt = b["at"] - a["at"]
            # a restore sets trained_total back to its checkpoint's: no rate across it. A sim learner's steps
            # carry no running total: the step's own trajectories over the time since the one before.
            if dt > 0 and "trained_total" in b and "trained_total" in a and b["trained_total"] >= a["trained_total"]:
                xs.append(d.x(b["at"]))
                ys.append((b["trained_total"] - a["trained_total"]) / dt)
            elif dt > 0 and "trained_total" not in b and isinstance(b.get("trajectories"), (int, float)):
                xs.append(d.x(b["at"]))
                ys.append(b["trajectories"] / dt)
        traj.append(Series("trained /s", xs, ys, PALETTE[1]))
    tok = [r for r in d.logs if r.get("event") == "generated" and r.get("tokens") is not None]
    tx, ty = _binned(tok, d.t0, lambda r: r["tokens"])
    return traj, ([Series("rollout tokens /s", tx, ty, PALETTE[4])] if tx else []), "learner steps and logs"


def step_series(d: RunData, key: str, name: str, color: str, fn=None) -> Series:
    xs = [d.x(s["at"]) for s in d.steps]
    ys = [fn(s) if fn else s.get(key) for s in d.steps]
    return Series(name, xs, ys, color)


def diversity_series(d: RunData) -> list[Series]:
    out = [step_series(d, "", "equal-reward groups", PALETTE[3],
                       lambda s: (s["zero_signal_groups"] / s["groups"]
                                  if s.get("groups") and "zero_signal_groups" in s else None))]
    div = [s for s in d.steps if s.get("diversity_groups")]
    if div:
        xs = [d.x(s["at"]) for s in div]
        out.insert(0, Series("distinct rate", xs, [s.get("diversity_distinct_rate") for s in div], PALETTE[0]))
        out.insert(1, Series("4-gram similarity", xs, [s.get("diversity_similarity") for s in div], PALETTE[2]))
    return out


def allocation_series(d: RunData) -> list[Series]:
    if d.samples:
        xs = [d.x(s["at"]) for s in d.samples]
        roles = sorted({r for s in d.samples for r in (s.get("allocation") or {})})
        return [Series(role, xs, [(s.get("allocation") or {}).get(role, 0) for s in d.samples],
                       _role_color(role, i), step=True) for i, role in enumerate(roles)]
    moves = [e for e in d.events if isinstance(e.get("to"), dict) and isinstance(e.get("at"), (int, float))]
    if not moves:
        return []
    roles = sorted({r for e in moves for r in e["to"]})
    xs = [d.x(moves[0]["at"])] + [d.x(e["at"]) for e in moves]
    first = moves[0].get("from") or moves[0]["to"]
    return [Series(role, xs, [first.get(role, 0)] + [e["to"].get(role, 0) for e in moves], _role_color(role, i),
                   step=True) for i, role in enumerate(roles)]


def decision_markers(d: RunData) -> list[tuple[float, str]]:
    out = []
    for e in d.events:
        if e.get("kind") in ("decision", "pinned") and isinstance(e.get("at"), (int, float)):
            change = ""
            if isinstance(e.get("from"), dict) and isinstance(e.get("to"), dict):
                change = " " + ", ".join(f"{r} {e['from'].get(r, 0)}→{n}" for r, n in sorted(e["to"].items())
                                         if e["from"].get(r, 0) != n)
            out.append((d.x(e["at"]), f"{e['kind']}: {e.get('summary') or e.get('reason', '')}{change}"))
    return out


def queue_series(d: RunData) -> list[Series]:
    if not d.samples:
        return []
    xs = [d.x(s["at"]) for s in d.samples]
    stages = [st for st in ("rollout", "reward", "learner")
              if any(st in ((s.get("queues") or {}).get("stages") or {}) for s in d.samples)]
    return [Series(f"{st} input", xs, [(((s.get("queues") or {}).get("stages") or {}).get(st) or {}).get("backlog")
                                       for s in d.samples], _role_color(st, i)) for i, st in enumerate(stages)]


def wait_series(d: RunData) -> list[Series]:
    out = []
    if d.samples:
        out.append(Series("sampled", [d.x(s["at"]) for s in d.samples],
                          [(s.get("queues") or {}).get("learner_wait_ratio") for s in d.samples], PALETTE[0]))
    if d.steps:
        out.append(step_series(d, "", "per step", PALETTE[6], lambda s: s["wait_s"] / (s["wait_s"] + s["train_s"])
                               if s.get("wait_s") is not None and s.get("train_s") is not None
                               and s["wait_s"] + s["train_s"] > 0 else None))
        out[-1].dash = bool(d.samples)
    return out


def staleness_bars(d: RunData) -> tuple[list[str], list[float], list[str]]:
    hist: dict[int, int] = {}
    for s in d.steps:
        for k, v in (s.get("staleness_hist") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    if not hist:
        return [], [], []
    labels = [str(k) for k in range(0, max(hist) + 1)]
    values = [float(hist.get(k, 0)) for k in range(0, max(hist) + 1)]
    colors = [PALETTE[1]] * len(values)
    dropped = sum(s.get("dropped_stale", 0) for s in d.steps)
    if dropped:
        labels.append("dropped")
        values.append(float(dropped))
        colors.append(PALETTE[3])
    return labels, values, colors


def resource_series(d: RunData) -> tuple[list[Series], list[Series], list[Series]]:
    if not d.samples:
        return [], [], []
    xs = [d.x(s["at"]) for s in d.samples]
    by_role = [((s.get("resources") or {}).get("by_role") or {}) for s in d.samples]
    roles = sorted({r for b in by_role for r in b})
    cpu = [Series(r, xs, [b.get(r, {}).get("cpu_percent") for b in by_role], _role_color(r, i))
           for i, r in enumerate(roles)]
    rss = [Series(r, xs, [(b[r]["rss_bytes"] / 2**20) if r in b else None for b in by_role], _role_color(r, i))
           for i, r in enumerate(roles)]
    gpus: dict[str, list] = {}
    for n, s in enumerate(d.samples):
        for g in (s.get("resources") or {}).get("gpus") or []:
            gpus.setdefault(f"gpu{g['index']}", [None] * len(d.samples))[n] = g.get("util_percent")
    gpu = [Series(k, xs, v, PALETTE[i % len(PALETTE)]) for i, (k, v) in enumerate(sorted(gpus.items()))]
    return cpu, rss, gpu


# --- the page ---------------------------------------------------------------------------------------------


def manifest_pool(manifest: dict) -> dict:
    """The job's share of the controller's pool, as ``status.pool_settings`` gives it for a live job.

    The manifest's own ``control`` table wins over its config's, as for the
    controller (``control.job.load_job``); a key missing from both is at its default.
    """
    ctl = _manifest_control(manifest)
    return {"min_slots": ctl.get("min_slots", 0), "max_slots": ctl.get("max_slots", 0),
            "priority": ctl.get("priority", 1.0)}


def _manifest_control(manifest: dict) -> dict:
    return manifest.get("control") or (manifest.get("config") or {}).get("control") or {}


def headline(d: RunData) -> list[tuple[str, str]]:
    s, m = d.summary, d.manifest
    last = d.steps[-1] if d.steps else {}
    rows = [("run", d.run_dir.name), ("job", (m.get("config") or {}).get("job", {}).get("name", "?")),
            # a job configured pinned starts outside the pool (a pin by libra-ctl scale shows in its events)
            ("pool", format_pool(manifest_pool(m), _manifest_control(m).get("mode", "auto")))]
    if s:
        rows += [("held-out success", f"{success_text(s.get('success_rate_start'), s.get('eval_prompts_start'))} → "
                                      f"{success_text(s.get('success_rate_end'), s.get('eval_prompts'))}"),
                 ("trajectories trained", str(s.get("trajectories_trained"))),
                 ("trajectories/s", str(s.get("trajectories_per_s"))), ("wall time", f"{s.get('wall_s', 0):.0f} s"),
                 ("dropped as stale", str(s.get("dropped_stale"))), ("dead-lettered", str(s.get("dead_lettered")))]
    elif last:   # no summary (a sim job, a stopped run): the steps' running totals, else their sums
        total = lambda key, per_step: last.get(key, sum(s.get(per_step) or 0 for s in d.steps))
        rows += [("learner steps", str(last.get("step", "-"))),
                 ("trajectories trained", str(total("trained_total", "trajectories"))),
                 ("dropped as stale", str(total("dropped_stale_total", "dropped_stale")))]
    if last:
        rows.append(("policy version", str(last.get("policy_version"))))
    return rows


def pool_lines(d: RunData) -> list[str]:
    """What the controller's pool decided for this job, in a few lines; [] where no decision carries a ``pool``.

    From the ``pool`` of its decision events (``Controller.decide``): the
    other jobs in ``shares`` with their range of slots, this job's ``share``
    from lowest to highest, the pool's ``moved_between_jobs`` summed over the
    decisions (each records the tick it was made in, so a move between two
    other jobs counts where this job's decision was recorded in the same tick),
    and the spans in which ``below_min`` named this job.
    """
    pooled = [e for e in d.events if isinstance(e.get("pool"), dict) and isinstance(e.get("at"), (int, float))]
    if not pooled:
        return []
    me = pooled[0].get("job") or (d.manifest.get("config") or {}).get("job", {}).get("name")
    seen: dict[str, list[int]] = {}
    for e in pooled:
        for job, n in (e["pool"].get("shares") or {}).items():
            seen.setdefault(job, []).append(n)
    span = lambda ns: f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}–{max(ns)}"
    others = [f"{job} ({span(ns)} slots)" for job, ns in sorted(seen.items()) if job != me]
    mine = [e["pool"]["share"] for e in pooled if isinstance(e["pool"].get("share"), int)]
    moves = [e["pool"].get("moved_between_jobs") or 0 for e in pooled]
    lines = ["shared with " + ", ".join(others) if others else "no other job shared the pool",
             f"this job's share: {span(mine)} slots over {len(pooled)} decisions (last {mine[-1]})" if mine
             else "this job's share: not recorded",
             f"slots moved between jobs: {sum(moves)}, in {sum(1 for n in moves if n)} of its decisions"]
    below = _below_min_spans(d, me)
    if below:
        least = manifest_pool(d.manifest)["min_slots"]
        lines.append(f"below its minimum (min_slots {least}; the pool was smaller than the minimums' sum): "
                     + ", ".join(below))
    return lines


def _below_min_spans(d: RunData, job: str | None) -> list[str]:
    """Run-relative spans (``12–40 s``, ``80 s–end``) from a decision naming ``job`` in ``below_min`` to the next
    event that does not (a decision that no longer names it, or a pin, which takes the job out of the pool)."""
    spans, start = [], None
    for e in d.events:
        if not isinstance(e.get("at"), (int, float)) or e.get("kind") not in ("decision", "pinned"):
            continue
        short = job in ((e.get("pool") or {}).get("below_min") or ())
        if short and start is None:
            start = d.x(e["at"])
        elif not short and start is not None:
            spans.append(f"{start:.0f}–{d.x(e['at']):.0f} s")
            start = None
    if start is not None:
        spans.append(f"{start:.0f} s–end")
    return spans


def pool_section(d: RunData) -> str:
    lines = pool_lines(d)
    if not lines:
        return ""
    items = "".join(f"<li>{esc(line)}</li>" for line in lines)
    return (f"<h2>Pool</h2><ul class=pool>{items}</ul><p class=note>from the controller's decisions "
            "(events.jsonl); the headline gives this job's pool settings</p>")


def events_table(d: RunData) -> str:
    rows = []
    for e in d.events:
        if isinstance(e.get("at"), (int, float)):
            detail = e.get("summary") or e.get("reason") or ""
            if isinstance(e.get("from"), dict) and isinstance(e.get("to"), dict):
                detail += f"  {json.dumps(e['from'])} → {json.dumps(e['to'])}"
            rows.append((e["at"], "controller", e.get("kind", "event"), detail))
    for r in d.logs:
        ev = r.get("event")
        if ev in NOTABLE or r.get("level") in ("warning", "error", "critical"):
            detail = ", ".join(f"{k}={v}" for k, v in r.items()
                               if k not in ("event", "timestamp", "level", "job", "role", "worker", "_at"))
            rows.append((r["_at"], r.get("worker", "?"), ev, detail))
    rows.sort(key=lambda row: row[0])
    cut = len(rows) > MAX_EVENTS
    rows = rows[:MAX_EVENTS // 2] + rows[-MAX_EVENTS // 2:] if cut else rows
    body = "".join(f"<tr><td>{d.x(at):.1f}</td><td>{esc(src)}</td><td>{esc(ev)}</td><td>{esc(detail[:300])}</td></tr>"
                   for at, src, ev, detail in rows)
    more = f"<p class=note>{MAX_EVENTS} of the events shown (first and last).</p>" if cut else ""
    if not rows:
        return "<p class=empty>no events recorded</p>"
    return (f"<table class=events><thead><tr><th>s</th><th>source</th><th>event</th><th>detail</th></tr></thead>"
            f"<tbody>{body}</tbody></table>{more}")


CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#111827;background:#f9fafb}
header{background:#111827;color:#f9fafb;padding:14px 24px}header h1{margin:0;font-size:20px}
header dl{display:flex;flex-wrap:wrap;gap:4px 22px;margin:8px 0 0}header dt{color:#9ca3af;font-size:12px}
header dd{margin:0;font-weight:600}main{padding:12px 24px}h2{font-size:16px;margin:22px 0 6px}
.grid3{display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:12px}
.grid2{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:12px}
@media (max-width:1100px){.grid3,.grid2{grid-template-columns:minmax(0,1fr)}}
figure.chart{margin:0;background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:8px 10px}
figcaption{font-weight:600;margin-bottom:4px}svg.plot{width:100%;height:auto;display:block}
.grid{stroke:#e5e7eb;stroke-width:1}.tick{font-size:11px;fill:#6b7280}.label{font-size:12px;fill:#374151}
.val{font-size:10px;fill:#111827}path.series{fill:none;stroke-width:2}
path.series.area{fill-opacity:.55;stroke-width:1}.threshold{stroke:#dc2626;stroke-width:1;stroke-dasharray:4 3}
.decision line{stroke:#7c3aed;stroke-width:1.2;stroke-dasharray:3 3}.decision path{fill:#7c3aed}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;color:#374151}
.legend i{display:inline-block;width:12px;height:3px;margin-right:5px;vertical-align:middle}
.legend i.mk{background:#7c3aed;height:10px;width:2px}
.empty{color:#9ca3af;font-style:italic;padding:30px 0;text-align:center}.note{font-size:12px;color:#6b7280;margin:4px 0 0}
table.events{border-collapse:collapse;width:100%;font-size:12px;background:#fff}
table.events td,table.events th{border-bottom:1px solid #e5e7eb;padding:3px 6px;text-align:left;vertical-align:top}
table.events td:first-child{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
ul.pool{margin:4px 0;padding-left:20px}
pre{background:#fff;border:1px solid #e5e7eb;padding:10px;overflow:auto;font-size:12px;max-height:520px}
footer{color:#9ca3af;font-size:12px;padding:10px 24px 24px}
"""


def render(d: RunData) -> str:
    """The page: the headline, three rows of charts, the pool (where decided), the events and the manifest."""
    timeline = functools.partial(line_chart, x_range=d.x_range())  # every time axis spans the whole run
    markers = decision_markers(d)
    traj, tok, tp_src = throughput_series(d)
    one_page = _outcome_row(d, timeline, markers, traj, tp_src)
    pipeline_row = _pipeline_row(d, timeline, markers)
    res_row = _resource_row(d, timeline, tok)
    head = "".join(f"<div><dt>{esc(k)}</dt><dd>{esc(v)}</dd></div>" for k, v in headline(d))
    manifest = json.dumps(redact_tree(d.manifest), indent=2)
    summary = json.dumps(d.summary, indent=2) if d.summary else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>Libra report: {esc(d.run_dir.name)}</title><style>{CSS}</style></head>
<body><header><h1>Libra run report</h1><dl>{head}</dl></header><main>
{"".join(f'<p class="note">{esc(n)}</p>' for n in d.notes)}
<h2>Throughput, reward and diversity</h2><div class="grid3">{one_page}</div>
<h2>Pipeline</h2><div class="grid2">{pipeline_row}</div>
<h2>Resources</h2><div class="grid2">{res_row}</div>
{pool_section(d)}<h2>Events</h2>{events_table(d)}
<h2>Manifest</h2><details open><summary>manifest.json</summary><pre>{esc(manifest)}</pre></details>
{f"<details><summary>summary.json</summary><pre>{esc(summary)}</pre></details>" if summary else ""}
</main><footer>written by libra-ctl report from {esc(d.run_dir.resolve())} · <span id="selfcheck">charts not
checked (scripts off)</span></footer><script>{SELF_CHECK}</script></body></html>
"""


def _outcome_row(d: RunData, timeline, markers, traj: list[Series], tp_src: str) -> str:
    """Throughput, reward and diversity: the three the field guide judges a change by."""
    return "".join([
        timeline("throughput", "Throughput (trajectories/s)", traj, y_label="trajectories / s", y_min=0,
                 markers=markers, note=f"from the {tp_src}", empty="no throughput data"),
        timeline("reward", "Reward", [step_series(d, "reward_mean", "reward mean", PALETTE[1]),
                                      step_series(d, "success_rate", "success rate", PALETTE[0]),
                                      step_series(d, "reward_std", "reward std", PALETTE[6])],
                 # no floor at 0: a reward model's score is a raw logit, often negative
                 y_label="per learner step", y_min=None, markers=markers, empty="no learner steps"),
        timeline("diversity", "Diversity", diversity_series(d), y_label="share", y_min=0, y_max=1,
                 markers=markers, empty="no learner steps",
                 note="" if any(s.get("diversity_groups") for s in d.steps) else
                 "distinct rate and similarity appear when the learner computes them (metrics.diversity_every)"),
    ])


def _pipeline_row(d: RunData, timeline, markers) -> str:
    labels, values, colors = staleness_bars(d)
    wait = LEARNER_WAIT_THRESHOLD
    return "".join([
        timeline("allocation", "Allocation (workers per role, stacked)", allocation_series(d), y_label="workers",
                 y_min=0, markers=markers, stacked=True, empty="no allocation recorded (no samples, no controller events)"),
        timeline("queues", "Queue lengths (entries waiting or in flight)", queue_series(d),
                 y_label="stream entries", y_min=0, markers=markers, empty=NO_SAMPLES),
        timeline("wait", "Learner wait (share of time)", wait_series(d), y_label="share", y_min=0, y_max=1,
                 markers=markers, hlines=[(wait, f"{wait:.0%}: rollout short")], empty="no learner steps",
                 note=f"above {wait:g} over a period, rollout is the bottleneck (the field guide's rule)"),
        bar_chart("staleness", "Staleness of trained trajectories", labels, values, colors,
                  x_label="policy versions behind", y_label="trajectories", empty="no learner steps",
                  note="red: dropped as older than learner.max_staleness" if "dropped" in labels else ""),
    ])


def _resource_row(d: RunData, timeline, tok: list[Series]) -> str:
    cpu, rss, gpu = resource_series(d)
    return "".join([
        timeline("tokens", "Rollout tokens/s", tok, y_label="tokens / s", y_min=0, empty="no token counts"),
        timeline("cpu", "CPU by role (100 = one core)", cpu, y_label="percent", y_min=0, empty=NO_SAMPLES),
        timeline("rss", "Resident memory by role", rss, y_label="MiB", y_min=0, empty=NO_SAMPLES),
        timeline("gpu", "GPU utilisation", gpu, y_label="percent", y_min=0, y_max=100,
                 empty="no GPU samples (CPU-only run or no sampler)"),
    ])


def write_report(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Write ``report.html`` (or ``out``) for a run directory; returns its path."""
    d = load_run(run_dir)
    path = Path(out) if out else Path(run_dir) / "report.html"
    page = render(d)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        # /dev/stdout, a pipe, a link: written through; a replace would put a file in its place (as root,
        # over /dev/null itself)
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
        return path
    tmp = path.with_name(path.name + ".tmp")   # a file: replaced whole, never seen half-written
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)
    return path


# --- headless Chromium (the test and the screenshot script) ------------------------------------------------


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium(html_path: Path, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Run headless Chromium on a local file with the flags that keep it offline and self-contained."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="libra-chromium-") as profile:
        return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args,
                               Path(html_path).resolve().as_uri()],
                              capture_output=True, text=True, timeout=timeout_s)


def dump_dom(html_path: Path) -> str:
    """The DOM after scripts ran."""
    proc = chromium(html_path, "--virtual-time-budget=5000", "--dump-dom")
    if proc.returncode != 0:
        raise RuntimeError(f"chromium --dump-dom failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def screenshot(html_path: Path, png: Path, width: int = 1400, height: int = 1700) -> Path:
    png = Path(png).resolve()
    proc = chromium(html_path, "--virtual-time-budget=5000", f"--window-size={width},{height}",
                    f"--screenshot={png}")
    if proc.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium --screenshot failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return png


# --- libra-ctl report ---------------------------------------------------------------------------------------


def cmd_report(args) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "manifest.json").exists() and not (run_dir / "metrics.jsonl").exists():
        print(f"libra-ctl report: {run_dir} is not a run directory (no manifest.json or metrics.jsonl)")
        return 2
    bad_out = argtypes.unwritable("-o", args.output)
    if bad_out:
        print(f"libra-ctl report: {bad_out}", file=sys.stderr)
        return 2
    path = write_report(run_dir, args.output)
    print(f"report: {path}")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("report", help="write RUN_DIR/report.html: throughput, reward, diversity, allocation, queues")
    p.add_argument("run_dir", help="run directory, e.g. runs/<id>")
    p.add_argument("-o", "--output", help="output file (default: RUN_DIR/report.html)")
    p.set_defaults(func=cmd_report)
