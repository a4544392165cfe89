"""The controller's decision events: ``control_events`` in Redis and ``runs/<id>/events.jsonl``.

Written by the reconcile loop (``pipeline.control.loop``); read by
``libra-ctl events``, the live benchmark and the report. Each job has its
own stream; ``merged_events`` reads several jobs' as one timeline (every
event names its job).
"""

from __future__ import annotations

import heapq
import json
import time
import uuid
from pathlib import Path

import redis

from pipeline.control.job import JobInfo
from pipeline.dataplane.keys import JobKeys
from pipeline.logs import json_line

EVENTS_MAXLEN = 10_000


def record_event(r: redis.Redis, job: JobInfo | str, event: dict) -> None:
    """Append a decision event to the job's stream and, where this host sees it, ``runs/<id>/events.jsonl``.

    An event carries an ``eid``: a write sent twice (its reply lost, a later
    tick sends it again) is one event to the readers. A caller that
    may write an event again gives it its ``eid`` (``new_event_id``)."""
    name = job.name if isinstance(job, JobInfo) else job
    event = {"at": time.time(), "job": name, "eid": new_event_id(), **event}
    line = json_line(event)
    r.xadd(JobKeys(name).control_events, {"data": line}, maxlen=EVENTS_MAXLEN, approximate=True)
    if isinstance(job, JobInfo) and job.run_dir:
        try:
            with open(Path(job.run_dir) / "events.jsonl", "a") as f:
                f.write(line + "\n")
        except OSError:
            pass   # the run directory lives on another machine


def new_event_id() -> str:
    return uuid.uuid4().hex[:16]


def read_events(r: redis.Redis, job: str, last: int = 50) -> list[dict]:
    """The job's newest ``last`` events, by their time (a controller writes an event a tick late, after an
    outage, with the time of its decision: the stream's order is not always the events' order), each once
    (a write sent again after its reply was lost is the same ``eid``)."""
    entries = r.xrevrange(JobKeys(job).control_events, count=last)
    seen, events = set(), []
    for _id, f in reversed(entries):
        e = json.loads(f[b"data"])
        if e.get("eid") is None or e["eid"] not in seen:
            seen.add(e.get("eid"))
            events.append(e)
    return sorted(events, key=lambda e: e.get("at", 0))


def merged_events(r: redis.Redis, jobs: list[str], last: int = 50) -> list[dict]:
    """The newest ``last`` events of the given jobs together, oldest first (ordered by ``at``)."""
    timelines = [read_events(r, job, last) for job in jobs]   # each job's newest ``last``: enough for the merge
    return list(heapq.merge(*timelines, key=lambda e: e["at"]))[-last:] if last > 0 else []
