"""Which worker a chaos kill hits: one at work, never one still loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

from pipeline.chaos import ChaosRun, Victim
from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.lifeline import process_start


def test_a_kill_waits_for_a_worker_at_work(r):
    """A kill of a role picks only a process whose record in the worker table is its own and past
    ``starting``: a successor still loading (no record of its own yet, or ``starting``) waits. Before, a kill
    due while the worker restarted hit the new process a poll (0.2 s) after its start: that tested only the
    agent's back-off, and a schedule of 10 rollout kills on one rollout slot grew it to a minute per restart
    and starved the job past its timeout."""
    job = "targets"
    run = ChaosRun.__new__(ChaosRun)   # only what at_work reads
    run.r, run.backend = r, SimpleNamespace(job=job)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        v = Victim("rollout-n1-0", proc.pid, process_start(proc.pid))
        workers = JobKeys(job).workers

        def record(pid: int, state: str) -> None:
            r.hset(workers, v.name, json.dumps({"pid": pid, "state": state, "heartbeat": time.time()}))

        assert not run.at_work(v)                  # no record: not started
        record(os.getpid(), "running")             # the killed predecessor's record
        assert not run.at_work(v)
        record(proc.pid, "starting")               # loading its engine
        assert not run.at_work(v)
        record(proc.pid, "running")
        assert run.at_work(v)
        record(proc.pid, "waiting")                # held back by backpressure: at work all the same
        assert run.at_work(v)
    finally:
        proc.kill()
        proc.wait()
