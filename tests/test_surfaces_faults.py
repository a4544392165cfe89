"""The observation commands as a user meets them: `libra-ctl status / events / trace / report / metrics-serve`
on a sim job's run, a finished job, an empty Redis, a mistyped job, a taken port, an output path that cannot
be written and a reader that goes away. A review found each wrong; the docstrings say what happened before.

Against the suite's Redis and real sim workers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job, start, stop_all, wait_for
except ModuleNotFoundError:
    from test_sim_workers import sim_job, start, stop_all, wait_for

from pipeline.dataplane.keys import JobKeys

ROOT = Path(__file__).resolve().parent.parent


def ctl(*args: str, url: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, LIBRA_REDIS_URL=url)
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# --- odd inputs ---------------------------------------------------------------------------------


def test_events_json_on_an_empty_redis_prints_json(redis_url):
    """`libra-ctl events --json` is for scripts; on a Redis with no jobs it must still print JSON
    (`status --json` prints {"jobs": []}); it prints the sentence "no jobs on this Redis"."""
    p = ctl("events", "--json", url=redis_url)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_metrics_serve_refuses_a_job_that_never_ran(r, redis_url, tmp_path):
    """`metrics-serve --job J` with a J this Redis never ran: `status`, `top`, `events` and `doctor` say
    "no job 'J' on this Redis (...)" and exit 2; metrics-serve exports nothing and exits 0 (without --once
    it serves an empty exporter forever, so a typo in a Prometheus set-up goes unnoticed)."""
    sim_job(r, redis_url, tmp_path, name="real")
    for cmd in (["status", "--job", "nope"], ["events", "--job", "nope"]):
        p = ctl(*cmd, url=redis_url)
        assert p.returncode == 2 and "no job 'nope'" in p.stderr, (cmd, p.returncode, p.stderr)
    p = ctl("metrics-serve", "--once", "--job", "nope", url=redis_url)
    assert p.returncode == 2, f"rc {p.returncode}; stdout {p.stdout[-300:]!r}"
    assert "no job 'nope'" in p.stderr


# --- report.html of a sim job --------------------------------------------------------------------


def _sim_run(r, redis_url, tmp_path, steps: int = 3) -> Path:
    """A short sim pipeline run to its end (feeder, rollout, reward, learner; no sampler, as `sim-job` runs it)."""
    run_dir = sim_job(r, redis_url, tmp_path, name="simrep", time_scale=20.0, job={"steps": steps})
    procs = [start("feeder", run_dir, "feeder-0", redis_url), start("rollout", run_dir, "rollout-n-0", redis_url),
             start("reward", run_dir, "reward-n-c0", redis_url), start("learner", run_dir, "learner-0", redis_url)]
    try:
        wait_for(lambda: r.hget(JobKeys("simrep").state, "phase") == b"trained", 120, f"{steps} learner steps")
    finally:
        stop_all(procs)
    return run_dir


def test_report_of_a_sim_run_shows_its_trained_total_and_throughput(r, redis_url, tmp_path):
    """`libra-ctl report` of a `sim-job` run (finished or stopped with Ctrl-C) prints "None" for
    "trajectories trained" and "dropped as stale", and its throughput chart reads "no throughput data",
    although metrics.jsonl holds every learner step with its `trajectories` and `at`. The sim learner's
    learner_step lines lack the running totals `trained_total` / `dropped_stale_total` that
    docs/observability.md lists in the schema, and the report reads only those."""
    run_dir = _sim_run(r, redis_url, tmp_path)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) >= 3 and all(s["trajectories"] > 0 for s in steps)
    p = ctl("report", str(run_dir), url=redis_url)
    assert p.returncode == 0, p.stderr
    page = (run_dir / "report.html").read_text()
    head = dict(re.findall(r"<dt>([^<]*)</dt><dd>([^<]*)</dd>", page))
    assert head.get("trajectories trained") == str(sum(s["trajectories"] for s in steps)), head
    assert head.get("dropped as stale") not in ("None", "nan", ""), head
    assert "no throughput data" not in page
    assert all("trained_total" in s and "dropped_stale_total" in s for s in steps), sorted(steps[-1])
    assert steps[-1]["trained_total"] == sum(s["trajectories"] for s in steps)


# --- a view piped into head ------------------------------------------------------------------------


def test_status_piped_into_head_ends_quietly(r, redis_url, tmp_path):
    """`libra-ctl status --json | head -3` (or `events | head`, `top --once | head`): once the reader has
    gone, the command dies with a Python traceback ending in BrokenPipeError and exits 1. A Unix view should
    stop quietly (the usual SIGPIPE ending), not print a traceback."""
    sim_job(r, redis_url, tmp_path, name="piped")
    for cmd in (["status", "--json"], ["top", "--once"], ["events", "--job", "piped"]):
        rd, wr = os.pipe()
        os.close(rd)                                   # the reader (head) has already gone
        p = subprocess.run([sys.executable, "-m", "pipeline.cli", *cmd], cwd=ROOT,
                           env=dict(os.environ, LIBRA_REDIS_URL=redis_url), stdout=wr, stderr=subprocess.PIPE,
                           text=True, timeout=60)
        os.close(wr)
        assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, (cmd, p.stderr[-400:])


# --- finished jobs in the live views ----------------------------------------------------------------


def test_a_finished_jobs_exited_workers_show_no_rate(r, redis_url, tmp_path):
    """After a job ends, `status --json` (and `top`'s worker table, which reads it) still gives each exited
    worker its last `rate_per_s` (hundreds of trajectories/s in a sim job) while the same view's stage rates,
    summed over live workers, read 0. A worker that has exited produces nothing: its rate is 0 (or null),
    so the two figures of one view agree."""
    _sim_run(r, redis_url, tmp_path)
    wait_for(lambda: all(json.loads(v)["state"] == "exited" for v in r.hvals(JobKeys("simrep").workers)),
             30, "every worker exited")
    p = ctl("status", "--json", "--job", "simrep", url=redis_url)
    assert p.returncode == 0, p.stderr
    job = json.loads(p.stdout)["jobs"][0]
    assert all(s["rate_per_s"] == 0 for s in job["stages"]), job["stages"]
    assert {w["id"]: w["rate_per_s"] for w in job["workers"] if w["rate_per_s"]} == {}, job["workers"]


# --- report / trace: an output path that cannot be written -------------------------------------------


def test_report_and_trace_to_an_unwritable_path_say_so_in_one_line(r, redis_url, tmp_path):
    """`libra-ctl report RUN_DIR -o missing/dir/x.html` and `trace RUN_DIR -o missing/x.json` die with a
    19-line FileNotFoundError traceback (exit 1). A bad `-o` is bad input: one line naming the path, exit 2,
    as both commands already do for a RUN_DIR that is not a run directory."""
    run_dir = sim_job(r, redis_url, tmp_path, name="outpath")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "learner_step", "step": 1, "policy_version": 1,
                                                       "at": 1.0, "trajectories": 4}) + "\n")
    for cmd, out in (("report", "x.html"), ("trace", "x.json")):
        p = ctl(cmd, str(run_dir), "-o", str(tmp_path / "missing" / "dir" / out), url=redis_url)
        assert "Traceback" not in p.stderr, (cmd, p.stderr[-300:])
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (cmd, p.returncode, p.stderr)


# --- metrics-serve on a port it cannot have -----------------------------------------------------------


def test_metrics_serve_on_a_port_in_use_says_so_in_one_line(r, redis_url, tmp_path):
    """`libra-ctl controller` serves /metrics on 9464 by default (control.metrics_port), the same default as
    `libra-ctl metrics-serve`; run both and metrics-serve dies with an `OSError: [Errno 98] Address already
    in use` traceback (and `--port 99999` with an OverflowError one). Now one line for a taken port (exit 1),
    and a usage error naming the range for one out of it (exit 2)."""
    import socket

    sim_job(r, redis_url, tmp_path, name="porty")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = ctl("metrics-serve", "--port", str(port), url=redis_url, timeout=30)
        assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, \
            p.stderr[-300:]
        p = ctl("metrics-serve", "--port", "99999", url=redis_url, timeout=30)
        assert p.returncode == 2 and "Traceback" not in p.stderr and "a port is 0 to 65535" in p.stderr, \
            p.stderr[-300:]
