"""How ``libra-ctl run`` ends (issue 17): the README's claims about its last acts, each with its test.

- A finished run writes ``runs/<id>/report.html`` itself (README, quick start), through
  ``run._run_and_summarise``'s call of ``observe.report.write_report``: not only ``libra-ctl report``.
- Ctrl-C (SIGINT to the run, as a terminal sends it) stops the controller, the agent, the workers and the
  embedded Redis in order before the run exits 130: no process of the run is left, and the server's unix
  socket is gone, also the one in /tmp that a run directory too deep for a socket path gets.

Both start the quick-start job with the tiny policy for a step or two (slow, a few minutes on 2 cores).
The SIGKILL and SIGTERM cases are in ``test_faults_run.py``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from tests.test_faults_run import _cmdline, _gone, _start_run
from tests.test_sim_workers import wait_for

ROLES = ("workers.feeder", "workers.rollout", "workers.reward", "workers.learner", "controller", "agent",
         "redis-server")


def _of_run(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names the run directory (workers, the server's watchdog)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if str(run_dir) in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return _gone(found)


def _describe(procs: list[psutil.Process]) -> str:
    return "\n".join(f"{p.pid} {_cmdline(p)[:200]}" for p in procs)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_finished_run_writes_its_report(tmp_path):
    job = "report"
    proc, run_dir, _env = _start_run(tmp_path, job, 1)
    try:
        assert proc.wait(timeout=800) == 0, (tmp_path / f"{job}.out").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (tmp_path / f"{job}.out").read_text()
    report = run_dir / "report.html"
    assert f"report: {report}" in out, out
    page = report.read_text()
    assert f"<title>Libra report: {run_dir.name}</title>" in page      # this run's page
    assert 'data-chart="throughput"' in page and "<script src=" not in page


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_stops_every_process_of_the_run_and_removes_the_redis_socket(tmp_path):
    job = "ctrlc"
    deep = tmp_path / ("d" * 60)   # runs/<id>/redis/redis.sock would pass 100 bytes: the socket goes to /tmp
    deep.mkdir()
    # a run far longer than the test, so that Ctrl-C always lands mid-run; started with SIGINT ignored, as
    # a shell starts a script's background job (`libra-ctl run ... &`): the run takes Ctrl-C all the same
    # (two loaded suite runs failed here when an earlier test had left SIGINT ignored in pytest's process)
    proc, run_dir, _env = _start_run(deep, job, 10_000,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    family: list[psutil.Process] = []
    try:
        socket = Path((run_dir / "redis.url").read_text().strip().removeprefix("unix://"))
        assert socket.parent == Path("/tmp") and socket.exists(), socket

        def all_up():
            nonlocal family
            family = psutil.Process(proc.pid).children(recursive=True)
            names = " ".join(_cmdline(p) for p in _gone(family))
            return all(role in names for role in ROLES)
        wait_for(all_up, 600, "the feeder, controller, agent, every stage's worker and Redis")
        proc.send_signal(signal.SIGINT)   # a terminal's Ctrl-C reaches the run alone: its children have sessions
        assert proc.wait(timeout=300) == 130, (deep / f"{job}.out").read_text()
        # stopped before the run exited, not left to the watchdogs that end orphans later
        left = _gone(family) + [p for p in _of_run(run_dir) if p not in family]
        assert not left, f"still running after Ctrl-C:\n{_describe(left)}"
        assert not socket.exists(), f"the embedded Redis left its socket {socket}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _gone(family) + _of_run(run_dir):   # this run's own processes only
            p.kill()
    out = (deep / f"{job}.out").read_text()
    assert f"interrupted; stopping workers. resume with: libra-ctl resume {run_dir}" in out, out
    assert (run_dir / "redis" / "appendonly.aof").exists()   # the job's state stays, for libra-ctl resume
