"""Phase spans: the ``span`` helper, spans derived from older log events, and the Chrome trace export."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.observe.trace import chrome_trace, export, instants_from_records, span, spans_from_records

ROOT = Path(__file__).resolve().parent.parent


class ListLog:
    def __init__(self):
        self.lines = []

    def info(self, event, **kw):
        self.lines.append({"event": event, **kw})


def test_span_logs_phase_start_and_duration():
    log = ListLog()
    with span(log, "rollout", groups=4) as sp:
        sp["tokens"] = 100
    (line,) = log.lines
    assert line["event"] == "span" and line["phase"] == "rollout"
    assert line["groups"] == 4 and line["tokens"] == 100 and line["dur_s"] >= 0 and line["start"] > 1e9


def test_span_records_an_error_and_reraises():
    log = ListLog()
    with pytest.raises(KeyError):
        with span(log, "reward"):
            raise KeyError("x")
    assert log.lines[0]["error"] == "KeyError"


def rec(worker, event, ts, **kw):
    return {"worker": worker, "role": worker.split("-")[0], "event": event, "timestamp": ts, **kw}


def test_derived_spans_and_dedup():
    records = [
        rec("rollout-n-0", "generated", "2026-01-01T00:00:10Z", gen_s=4.0),
        rec("rollout-n-0", "weights_reloaded", "2026-01-01T00:00:11Z", reload_s=0.5),
        rec("learner-0", "trained", "2026-01-01T00:00:20Z", step=1, train_s=2.0, wait_s=3.0),
        # The reward worker logs real spans: its derived ones (none here) would be skipped.
        {"worker": "reward-n-0", "role": "reward", "event": "span", "phase": "reward",
         "start": 1767225605.0, "dur_s": 0.25, "groups": 2},
        # A worker that logs both: the real span wins over the derived one.
        rec("rollout-n-1", "generated", "2026-01-01T00:00:10Z", gen_s=4.0),
        {"worker": "rollout-n-1", "role": "rollout", "event": "span", "phase": "rollout",
         "start": 1767225606.0, "dur_s": 4.0},
    ]
    spans = spans_from_records(records)
    by = {(s.worker, s.phase): s for s in spans}
    t10 = 1767225610.0  # 2026-01-01T00:00:10Z
    assert by[("rollout-n-0", "rollout")].start == pytest.approx(t10 - 4.0)
    assert by[("rollout-n-0", "weight_sync")].dur_s == 0.5
    assert by[("learner-0", "train")].start == pytest.approx(t10 + 10 - 2.0)
    assert by[("learner-0", "learner_wait")].start == pytest.approx(t10 + 10 - 5.0)
    assert by[("reward-n-0", "reward")].args == {"groups": 2}
    assert sum(1 for s in spans if s.worker == "rollout-n-1") == 1
    assert by[("rollout-n-1", "rollout")].start == 1767225606.0


def test_chrome_trace_shape():
    records = [rec("learner-0", "trained", "2026-01-01T00:00:20Z", step=1, train_s=2.0, wait_s=0.0),
               rec("learner-0", "checkpointed", "2026-01-01T00:00:21Z", step=1)]
    events = [{"kind": "decision", "at": 1767225615.0, "allocation": {"rollout": 3}, "reason": "learner waits"}]
    trace = chrome_trace(spans_from_records(records), instants_from_records(records, events), "r1")
    evs = trace["traceEvents"]
    x = [e for e in evs if e["ph"] == "X"]
    assert [e["name"] for e in x] == ["train"] and x[0]["dur"] == 2e6
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert {"learner", "learner-0", "controller"} <= names
    decision = next(e for e in evs if e["name"] == "decision")
    assert decision["s"] == "g" and decision["args"]["reason"] == "learner waits"
    assert min(e["ts"] for e in evs if "ts" in e) == 0
    json.dumps(trace)


def test_export_from_real_structlog_files(tmp_path):
    """Workers' logs as pipeline.logs writes them, through libra-ctl trace."""
    run = tmp_path / "run"
    code = textwrap.dedent(f"""
        import structlog
        from pathlib import Path
        from pipeline import logs
        from pipeline.observe.trace import span
        structlog.contextvars.bind_contextvars(job="j", role="rollout", worker="rollout-n-0", policy_version=3)
        log = logs.configure(Path({str(run / 'logs')!r}), "rollout-n-0", console=False)
        with span(log, "rollout", groups=2):
            pass
        with span(log, "weight_sync", version=4):
            pass
        log.info("generated", gen_s=1.5)
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    (run / "events.jsonl").write_text(json.dumps({"kind": "decision", "at": 2e9, "reason": "x"}) + "\n")
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "trace", str(run)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    trace = json.loads((run / "trace.json").read_text())
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in x) == ["rollout", "weight_sync"]  # "generated" deduplicated by the span
    assert x[0]["args"]["policy_version"] == 3
    path, _ = export(run, tmp_path / "other.json")
    assert path.exists()
