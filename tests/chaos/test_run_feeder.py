"""``libra-ctl run`` keeps its feeder: a feeder killed with -9 is started again, and issuing goes on.

The chaos suite found that a run failed as soon as its feeder died. The
orchestrator here is the real one, on the session's Redis, with a real
``workers.feeder`` process on a prepared sim job's run directory (the
feeder reads only the config and the prompt file).
"""

from __future__ import annotations

import io
import os
import signal
import time

import pytest

from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.worker import load_run_config
from pipeline.run import Orchestrator, RunFailed

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job, wait_for
except ModuleNotFoundError:
    from test_sim_workers import sim_job, wait_for


def issued(r, job: str) -> int:
    return int(r.hget(JobKeys(job).counters, "issued_prompts") or 0)


@pytest.mark.timeout(120)
def test_a_killed_feeder_is_restarted_and_issues_on(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path, name="feedjob")
    out = io.StringIO()
    orch = Orchestrator(load_run_config(run_dir), run_dir, r, redis_url, out)
    orch.spawn("feeder", "workers.feeder", "feeder-0")
    try:
        wait_for(lambda: issued(r, "feedjob") > 0, 60, "the feeder's first prompt")
        first = orch.children[0].proc
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        orch.check_children()             # before the fix: RunFailed("feeder-0 exited with code -9")
        again = orch.children[0].proc
        assert again.pid != first.pid and again.poll() is None
        assert "feeder-0 exited with code -9" in out.getvalue()
        # the queue was full when it died: room made downstream is filled by the new feeder
        before = issued(r, "feedjob")
        r.hincrby(JobKeys("feedjob").counters, "trained", 64)
        wait_for(lambda: issued(r, "feedjob") > before, 60, "the restarted feeder to issue")
    finally:
        orch.stop_children()


@pytest.mark.timeout(120)
def test_a_feeder_that_keeps_dying_fails_the_run(r, redis_url, tmp_path, monkeypatch):
    import pipeline.run as run_mod

    monkeypatch.setattr(run_mod, "CHILD_RESTARTS", 2)
    run_dir = sim_job(r, redis_url, tmp_path, name="feedloop")
    orch = Orchestrator(load_run_config(run_dir), run_dir, r, redis_url, io.StringIO())
    orch.spawn("feeder", "workers.feeder", "feeder-0")
    try:
        with pytest.raises(RunFailed, match="feeder-0 exited"):
            for _ in range(10):
                p = orch.children[0].proc
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
                orch.check_children()
                time.sleep(0.1)
    finally:
        orch.stop_children()
