"""Phase spans per worker, and their export as a Chrome/Perfetto trace (``libra-ctl trace RUN``).

Workers time a phase with ``span(log, phase, **fields)``: on exit it logs one
structlog line ``{"event": "span", "phase", "start" (unix s), "dur_s", ...}``
to ``runs/<id>/logs/<worker>.jsonl``. The export reads those lines and also
turns the duration fields of older events into spans (``generated`` gen_s,
``weights_reloaded`` reload_s, ``trained`` train_s and wait_s,
``evaluated`` eval_s, ``engine_loaded`` load_s), unless the worker already
logs real spans of that phase. The controller's events (``events.jsonl``:
decisions, pins) become global markers. The output loads in
https://ui.perfetto.dev or chrome://tracing: one process per role, one
thread per worker.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterator

from pipeline import argtypes

# Phases a span may name; the first five are the issue's, the rest what else takes time.
PHASES = ("rollout", "reward", "train", "weight_sync", "reconfigure",
          "learner_wait", "publish", "checkpoint", "eval", "startup")

# event -> (phase, duration field): how older log events become spans, ending at the line's timestamp.
DERIVED = {
    "generated": ("rollout", "gen_s"),
    "weights_reloaded": ("weight_sync", "reload_s"),
    "trained": ("train", "train_s"),
    "evaluated": ("eval", "eval_s"),
    "engine_loaded": ("startup", "load_s"),
}
INSTANTS = ("checkpointed", "restored", "worker_started", "worker_exited", "stop_requested",
            "dead_lettered", "dead_lettered_redelivered", "reclaimed", "redis_full_waiting", "drained")
ROLE_ORDER = ("controller", "agent", "feeder", "rollout", "reward", "learner")
# Fields of a log line that are identity or bookkeeping, not a span's arguments.
META = {"event", "timestamp", "level", "logger", "job", "role", "worker", "phase", "start", "dur_s"}


@contextmanager
def span(log, phase: str, **fields) -> Iterator[dict]:
    """Time a phase and log it as one ``span`` line; yields a dict the body may add fields to.

    ``with span(ctx.log, "rollout", groups=4) as sp: ...; sp["tokens"] = n``.
    An exception is recorded in the span (``error``: its type) and re-raised.
    """
    start, t0 = time.time(), time.perf_counter()
    extra = dict(fields)
    try:
        yield extra
    except BaseException as exc:
        extra["error"] = type(exc).__name__
        raise
    finally:
        log.info("span", phase=phase, start=start, dur_s=round(time.perf_counter() - t0, 6), **extra)


@dataclass
class Span:
    worker: str
    role: str
    phase: str
    start: float  # unix s
    dur_s: float
    args: dict = field(default_factory=dict)


@dataclass
class Instant:
    worker: str | None  # None: a global marker (a controller decision)
    role: str
    name: str
    at: float
    args: dict = field(default_factory=dict)


def unix_time(ts: str | float | int | None) -> float | None:
    """structlog's ISO timestamp (or a number) as unix seconds."""
    if isinstance(ts, (int, float)):
        return float(ts)
    if not ts:
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def read_log_records(run_dir: Path) -> list[dict]:
    """Every JSON line of ``logs/*.jsonl``, each with ``worker`` set (from the file name if missing)."""
    out = []
    for path in sorted((Path(run_dir) / "logs").glob("*.jsonl")):
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                if isinstance(rec, dict):
                    rec.setdefault("worker", path.stem)
                    out.append(rec)
    return out


def _role(rec: dict) -> str:
    return rec.get("role") or rec["worker"].split("-")[0]


def _args(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in META}


def spans_from_records(records: list[dict]) -> list[Span]:
    """Spans from ``span`` lines, plus those derived from older events of phases a worker does not span."""
    spans, spanned = [], set()
    for rec in records:
        if rec.get("event") == "span" and rec.get("start") is not None and rec.get("dur_s") is not None:
            spans.append(Span(rec["worker"], _role(rec), rec.get("phase", "?"), float(rec["start"]),
                              float(rec["dur_s"]), _args(rec)))
            spanned.add((rec["worker"], rec.get("phase")))
    for rec in records:
        derived = DERIVED.get(rec.get("event"))
        end = unix_time(rec.get("timestamp"))
        if derived is None or end is None:
            continue
        phase, dur_field = derived
        dur = rec.get(dur_field)
        if dur is None or (rec["worker"], phase) in spanned:
            continue
        args = _args(rec) | {"derived_from": rec["event"]}
        spans.append(Span(rec["worker"], _role(rec), phase, end - float(dur), float(dur), args))
        wait = rec.get("wait_s")
        if rec["event"] == "trained" and wait and (rec["worker"], "learner_wait") not in spanned:
            spans.append(Span(rec["worker"], _role(rec), "learner_wait", end - float(dur) - float(wait),
                              float(wait), {"derived_from": "trained", "step": rec.get("step")}))
    return sorted(spans, key=lambda s: s.start)


def instants_from_records(records: list[dict], events: list[dict] = ()) -> list[Instant]:
    out = []
    for rec in records:
        at = unix_time(rec.get("timestamp"))
        if rec.get("event") in INSTANTS and at is not None:
            out.append(Instant(rec["worker"], _role(rec), rec["event"], at, _args(rec)))
    for ev in events:  # the controller's decisions and pins: markers across every track
        at = unix_time(ev.get("at"))
        if at is not None:
            out.append(Instant(None, "controller", ev.get("kind", "event"), at,
                               {k: v for k, v in ev.items() if k not in ("kind", "at")}))
    return sorted(out, key=lambda i: i.at)


def chrome_trace(spans: list[Span], instants: list[Instant], run: str = "") -> dict:
    """The Trace Event Format: complete events ("X") per worker thread, instants ("i"), metadata ("M")."""
    times = [s.start for s in spans] + [i.at for i in instants]
    t0 = min(times) if times else 0.0
    us = lambda t: round((t - t0) * 1e6, 1)
    roles = sorted({s.role for s in spans} | {i.role for i in instants},
                   key=lambda r: (ROLE_ORDER.index(r) if r in ROLE_ORDER else len(ROLE_ORDER), r))
    pid = {r: n + 1 for n, r in enumerate(roles)}
    workers = sorted({(s.role, s.worker) for s in spans} | {(i.role, i.worker) for i in instants if i.worker})
    tid = {w: n + 1 for n, (_r, w) in enumerate(workers)}
    events: list[dict] = []
    for role in roles:
        events.append({"ph": "M", "name": "process_name", "pid": pid[role], "tid": 0, "args": {"name": role}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid[role], "tid": 0,
                       "args": {"sort_index": pid[role]}})
    for role, worker in workers:
        events.append({"ph": "M", "name": "thread_name", "pid": pid[role], "tid": tid[worker],
                       "args": {"name": worker}})
    for s in spans:
        events.append({"ph": "X", "name": s.phase, "cat": s.role, "pid": pid[s.role], "tid": tid[s.worker],
                       "ts": us(s.start), "dur": round(s.dur_s * 1e6, 1), "args": s.args})
    for i in instants:
        ev = {"ph": "i", "name": i.name, "cat": i.role, "pid": pid[i.role], "ts": us(i.at), "args": i.args}
        if i.worker:
            ev.update(s="t", tid=tid[i.worker])
        else:
            ev.update(s="g", tid=0)
        events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run": run, "t0_unix_s": t0, "generator": "libra-ctl trace"}}


def export(run_dir: Path | str, out: Path | str | None = None) -> tuple[Path, dict]:
    """Write the run's trace; returns its path and the trace."""
    from pipeline.observe.measures import read_jsonl

    run_dir = Path(run_dir)
    records = read_log_records(run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    trace = chrome_trace(spans_from_records(records), instants_from_records(records, events), run_dir.name)
    path = Path(out) if out else run_dir / "trace.json"
    path.write_text(json.dumps(trace))
    return path, trace


# --- libra-ctl trace ----------------------------------------------------------------------------


def cmd_trace(args) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "logs").is_dir():
        print(f"libra-ctl trace: {run_dir} has no logs/ directory (give a run directory, e.g. runs/<id>)")
        return 2
    bad_out = argtypes.unwritable("-o", args.output)
    if bad_out:
        print(f"libra-ctl trace: {bad_out}", file=sys.stderr)
        return 2
    path, trace = export(run_dir, args.output)
    spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"{path}: {spans} spans; open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("trace", help="export a run's phase spans as a Chrome/Perfetto trace JSON")
    p.add_argument("run_dir", help="run directory, e.g. runs/<id>")
    p.add_argument("-o", "--output", help="output file (default: RUN_DIR/trace.json)")
    p.set_defaults(func=cmd_trace)
