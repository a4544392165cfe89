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
from pathlib import Path

import redis

from pipeline.control.job import JobInfo
from pipeline.dataplane.keys import JobKeys
from pipeline.logs import json_line

EVENTS_MAXLEN = 10_000


def record_event(r: redis.Redis, job: JobInfo | str, event: dict) -> None:
    """Append a decision event to the job's stream and, where this host sees it, ``runs/<id>/events.jsonl``."""
    name = job.name if isinstance(job, JobInfo) else job
    event = {"at": time.time(), "job": name, **event}
    line = json_line(event)
    r.xadd(JobKeys(name).control_events, {"data": line}, maxlen=EVENTS_MAXLEN, approximate=True)
    if isinstance(job, JobInfo) and job.run_dir:
        try:
            with open(Path(job.run_dir) / "events.jsonl", "a") as f:
                f.write(line + "\n")
        except OSError:
            pass   # the run directory lives on another machine


def read_events(r: redis.Redis, job: str, last: int = 50) -> list[dict]:
    """The job's newest ``last`` events, by their time (a controller writes an event a tick late, after an
    outage, with the time of its decision: the stream's order is not always the events' order)."""
    entries = r.xrevrange(JobKeys(job).control_events, count=last)
    return sorted((json.loads(f[b"data"]) for _id, f in reversed(entries)), key=lambda e: e.get("at", 0))


def merged_events(r: redis.Redis, jobs: list[str], last: int = 50) -> list[dict]:
    """The newest ``last`` events of the given jobs together, oldest first (ordered by ``at``)."""
    timelines = [read_events(r, job, last) for job in jobs]   # each job's newest ``last``: enough for the merge
    return list(heapq.merge(*timelines, key=lambda e: e["at"]))[-last:] if last > 0 else []
