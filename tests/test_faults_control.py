"""Faults of the control plane: racing controllers, and a job name reused by a second run.

The lease race is replayed command by command (two ``Lease`` objects whose
Redis commands a schedule interleaves), so every ordering is tried and none
depends on timing. The agent tests run the agent in the test process
(``step()`` by step) on the session's Redis, as in test_agent.py; the slow
one has it start real ``pipeline.sim.worker`` processes.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from pipeline.control import actions
from pipeline.control.actions import Stale, _check_epoch, worker_key
from pipeline.control.agent import Proc, process_start
from pipeline.control.lease import Lease
from pipeline.dataplane.keys import AGENTS, CONTROLLER_EPOCH, CONTROLLER_LEASE, JobKeys, agent_desired

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_agent import JOB, NODE, live, log_events, make_agent, spec, step_until, stop_agents  # noqa: F401
    from tests.test_controller import fake_agent
    from tests.test_sim_workers import sim_job
except ModuleNotFoundError:
    from test_agent import JOB, NODE, live, log_events, make_agent, spec, step_until, stop_agents  # noqa: F401
    from test_controller import fake_agent
    from test_sim_workers import sim_job


# --- two controllers racing for the lease ---------------------------------------------------------


class Turns:
    """Runs the Redis commands of two threads one at a time, in the order ``schedule`` names them.

    A name whose thread has finished is skipped; once the schedule is used up
    the commands run as they come.
    """

    def __init__(self, schedule: str):
        self.order = list(schedule)
        self.finished: set[str] = set()
        self.cv = threading.Condition()

    def _head(self) -> str | None:
        while self.order and self.order[0] in self.finished:
            self.order.pop(0)
        return self.order[0] if self.order else None

    @contextmanager
    def turn(self, who: str):
        with self.cv:
            if not self.cv.wait_for(lambda: self._head() in (who, None), timeout=10):
                raise AssertionError(f"{who} never got its turn: {self.order}")
            try:
                yield
            finally:
                if self.order and self.order[0] == who:
                    self.order.pop(0)
                self.cv.notify_all()

    def finish(self, who: str) -> None:
        with self.cv:
            self.finished.add(who)
            self.cv.notify_all()


class Stepped:
    """A Redis client whose every command waits for its owner's turn."""

    def __init__(self, r, who: str, turns: Turns):
        self._r, self._who, self._turns = r, who, turns

    def __getattr__(self, name):
        attr = getattr(self._r, name)
        if not callable(attr):
            return attr

        def command(*args, **kwargs):
            with self._turns.turn(self._who):
                return attr(*args, **kwargs)

        return command


def race(r, schedule: str) -> dict[str, Lease]:
    """Two controllers' ``acquire`` with their commands interleaved as ``schedule`` says."""
    turns = Turns(schedule)
    leases = {who: Lease(Stepped(r, who, turns), CONTROLLER_LEASE, ttl_s=60, epoch_key=CONTROLLER_EPOCH)
              for who in "AB"}

    def acquire(who: str) -> None:
        try:
            leases[who].acquire()
        finally:
            turns.finish(who)

    threads = [threading.Thread(target=acquire, args=(who,)) for who in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), f"schedule {schedule} hung"
    return leases


def test_the_lease_holder_has_the_highest_epoch_whatever_the_interleaving(r):
    # every order of up to four commands from each controller (old acquire: GET, INCR, SET NX)
    schedules = ["".join("A" if i in pos else "B" for i in range(8)) for pos in itertools.combinations(range(8), 4)]
    wrong = []
    for schedule in schedules:
        r.delete(CONTROLLER_LEASE)
        r.set(CONTROLLER_EPOCH, 7)                    # earlier controllers took epochs 1..7
        leases = race(r, schedule)
        holders = [lease for lease in leases.values() if lease.held]
        assert len(holders) == 1, f"{schedule}: {len(holders)} holders"
        holder, current = holders[0], int(r.get(CONTROLLER_EPOCH))
        try:
            _check_epoch(r, holder.epoch)           # what an agent does with each action the holder sends
        except Stale:
            wrong.append(f"{schedule}: holder epoch {holder.epoch} < current {current}")
            continue
        assert holder.epoch == current > 7 and r.get(CONTROLLER_LEASE).decode() == holder.token
        assert holder.token.startswith(f"{holder.epoch}:")
    assert not wrong, f"{len(wrong)} of {len(schedules)} orders fence the holder out, e.g. {wrong[0]}"


def test_an_agent_lock_takes_no_epoch(r):
    lock = Lease(r, "libra-test-lock", ttl_s=60)
    assert lock.acquire() and lock.epoch == 0 and lock.token.startswith("0:")
    assert not Lease(r, "libra-test-lock", ttl_s=60).acquire()
    assert r.get(CONTROLLER_EPOCH) is None


# --- a job name reused by a second run ------------------------------------------------------------------


def running_proc(agent, s: dict) -> Proc:
    """A process the agent holds for worker ``s`` (a stand-in that only sleeps; SIGTERM ends it)."""
    popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    p = Proc(worker_key(s["job"], s["worker"]), {**s, "generation": 0}, popen.pid, process_start(popen.pid),
             time.time(), popen)
    agent.procs[p.key] = p
    return p


def desired_runs(r, node: str) -> dict[str, str]:
    """Worker key -> run directory of every record in the node's desired hash."""
    return {k.decode(): json.loads(v).get("run_dir", "") for k, v in r.hgetall(agent_desired(node)).items()}


def test_reset_job_forgets_the_desired_workers_of_earlier_runs(r, redis_url, tmp_path):
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
    run1 = sim_job(r, redis_url, tmp_path / "one")
    n1, n2 = fake_agent(r, "n1", 2), fake_agent(r, "n2", 2)
    actions.ensure(r, "n1", spec(run1, "rollout-n1-0", [0]))
    actions.ensure(r, "n2", spec(run1, "rollout-n2-0", [1]))
    actions.ensure(r, "n1", {**spec(run1, "rollout-n1-1", [1]), "job": "other"})     # another job's worker
    n1.run_pending()
    n2.run_pending()
    r.hdel(AGENTS, "n2")                    # n2's agent is down; its desired hash waits for it
    r.hset(JobKeys(JOB).state, "phase", "stopped")
    run2 = sim_job(r, redis_url, tmp_path / "two")
    assert run2 != run1
    assert desired_runs(r, "n1") == {"other/rollout-n1-1": str(run1)}
    assert desired_runs(r, "n2") == {}


def test_a_desired_record_of_another_run_is_another_worker(r, redis_url, tmp_path, stop_agents, monkeypatch):
    run_dir = sim_job(r, redis_url, tmp_path)                  # the job's second run, running now
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    old = running_proc(a, spec(tmp_path / "first-run", "rollout-n1-0", [0]))   # the first run's process
    spawned = []
    monkeypatch.setattr(a, "spawn", lambda key, d: spawned.append(d["run_dir"]))
    # the second run wants a worker of the same id, role and slot
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    a.step()
    assert old.term_at is not None, "the first run's process was kept for the second run"
    step_until(a, lambda: spawned, 10, "the second run's worker")
    assert old.popen.poll() is not None and set(spawned) == {str(run_dir)}


def test_a_late_action_of_an_earlier_run_is_never_started(r, redis_url, tmp_path, stop_agents, monkeypatch):
    sim_job(r, redis_url, tmp_path)                            # the job's second run, running now
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    spawned = []
    monkeypatch.setattr(a, "spawn", lambda key, d: spawned.append(d["run_dir"]))
    # an ensure of the first run, retried by rq after the second run's reset_job
    actions.ensure(r, NODE, spec(tmp_path / "first-run", "rollout-n1-0", [0]))
    for _ in range(5):
        a.step()
    assert spawned == []


def _only_second_run(a, old: dict[str, int]) -> bool:
    p = live(a, "rollout-n1-0")
    return (p is not None and p.pid != old["rollout-n1-0"] and live(a, "rollout-n1-1") is None
            and all(process_start(pid) is None for pid in old.values()))


@pytest.mark.slow
def test_a_second_run_of_a_job_never_gets_the_first_runs_workers(r, redis_url, tmp_path, stop_agents):
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
    run1 = sim_job(r, redis_url, tmp_path / "one")
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    workers = (("rollout-n1-0", 0), ("rollout-n1-1", 1))
    for w, s in workers:
        actions.ensure(r, NODE, spec(run1, w, [s]))
    step_until(a, lambda: all(r.hget(JobKeys(JOB).workers, w) for w, _s in workers), what="run 1's workers")
    old = {w: live(a, w).pid for w, _s in workers}
    # run 1's orchestrator dies (kill -9): its workers stay desired and its state names a dead pid
    dead = subprocess.Popen(["true"])
    dead.wait()
    r.hset(JobKeys(JOB).state, "pid", dead.pid)
    run2 = sim_job(r, redis_url, tmp_path / "two")
    actions.ensure(r, NODE, spec(run2, "rollout-n1-0", [0]))   # run 2 places a worker of the same id
    step_until(a, lambda: _only_second_run(a, old), 30, "run 1's workers to be drained and run 2's started")
    for _ in range(10):
        a.step()
        time.sleep(0.05)
    p = live(a, "rollout-n1-0")
    argv = open(f"/proc/{p.pid}/cmdline").read().split("\0")
    assert argv[argv.index("--run-dir") + 1] == str(run2) and live(a, "rollout-n1-1") is None
    assert [e["event"] for e in log_events(r)].count("spawned") == 3
