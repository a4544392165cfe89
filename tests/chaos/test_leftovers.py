"""``libra-ctl chaos real`` (pipeline/chaos.py): what a seed hunt found in the harness. Each docstring says what
happened before the fix."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pipeline.chaos import ChaosRun, RealBackend
from pipeline.dataplane.lifeline import process_start


@pytest.mark.timeout(60)
def test_a_real_runs_feeder_that_outlives_the_run_is_reported_as_a_leftover(r):
    """docs/chaos.md: a chaos run fails when "a worker of the job still runs after the run ended", and the
    feeder is one of the worker roles the harness kills. Under ``chaos real`` the feeder is a child of
    ``libra-ctl run``, not of a node agent, so it never appears in an agent log's ``spawned`` events, and
    ``leftover_processes`` looked only there (plus the controllers and agents seen). Before: a feeder left
    running after ``libra-ctl run`` ended was not reported (``leftover_processes`` stayed [])."""
    job = "chaos-real"
    # a stand-in for `libra-ctl run`: its child has the feeder's command line (`... -m workers.feeder`)
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys\n"
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '-m', 'workers.feeder'])\n"
         "print(p.pid, flush=True)\n"
         "sys.stdin.readline()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    feeder_pid = int(parent.stdout.readline())
    try:
        backend = RealBackend.__new__(RealBackend)
        backend.job, backend.proc, backend.steps, backend.run_dir = job, parent, 1, None
        run = ChaosRun(backend, None, [], seed=1, timeout_s=600.0)
        run.r, run.deadline = r, time.monotonic() + 600.0

        # the harness sees the feeder as a worker of the job (it is what `kill -9 feeder` hits)...
        assert [v.pid for v in backend.workers(r, "feeder")] == [feeder_pid]
        run.tick()   # the harness watches the run while it lives
        # ...then `libra-ctl run` ends (exit 0) and the feeder it started is still running
        parent.stdin.close()
        parent.wait(timeout=30)
        assert process_start(feeder_pid) is not None

        left = run.leftovers(wait_s=0.0)
        assert feeder_pid in [v.pid for v in left], "a feeder that outlived the run is not reported"
    finally:
        subprocess.run(["kill", "-9", str(feeder_pid)], capture_output=True)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
