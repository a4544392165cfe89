"""A job's Redis state as a whole: reset before a new run, so a run starts from empty streams.

Called by ``libra-ctl run`` (``pipeline.run``) and by the sim backend's
``prepare_sim_run`` before a run's first write; ``clear_job`` also by the
streams benchmark, which runs throwaway jobs.
"""

from __future__ import annotations

import os
import socket

import redis

from pipeline.dataplane.keys import JobKeys


class JobRunning(RuntimeError):
    """Another live run owns the job name."""


def reset_job(r: redis.Redis, keys: JobKeys) -> None:
    """A new run of a job starts from empty streams; JobRunning if another run of it is live."""
    state = r.hgetall(keys.state)
    if state.get(b"phase") in (b"running", b"trained") and live_owner(state):
        raise JobRunning(f"job {keys.job!r} is already running (pid {state[b'pid'].decode()} on "
                         f"{state[b'host'].decode()}); stop it or choose another job.name")
    clear_job(r, keys.pattern)


def clear_job(r: redis.Redis, pattern: str) -> None:
    """Delete every key matching ``pattern`` (``JobKeys.pattern`` or ``keys.job_pattern``)."""
    doomed = list(r.scan_iter(match=pattern, count=1000))
    if doomed:
        r.delete(*doomed)


def live_owner(state: dict) -> bool:
    """Whether the process a job's state hash names (pid on host) may still be alive."""
    if state.get(b"host", b"").decode() != socket.gethostname():
        return True  # can't check a pid on another machine: assume it is alive
    try:
        os.kill(int(state[b"pid"]), 0)
        return True
    except (ProcessLookupError, ValueError, KeyError):
        return False
    except PermissionError:
        return True
