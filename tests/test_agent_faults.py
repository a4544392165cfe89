"""The node agent and a worker's life under faults: lost slots, Redis away at shutdown, a lock taken over,
a long crash loop, a drain during a long step.

Against a real Redis server and real processes (sleepers, the sim workers of
``tests.test_sim_workers``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pipeline.control import actions
from pipeline.control import agent as agent_mod
from pipeline.control.actions import worker_key
from pipeline.control.agent import Agent, Slot, process_start
from pipeline.dataplane.keys import JobKeys, agent_desired, agent_procs

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job
except ModuleNotFoundError:
    from test_sim_workers import sim_job

NODE = "n1"
JOB = "simtest"


def spec(run_dir, worker: str, slots: list[int], role: str = "rollout") -> dict:
    return {"job": JOB, "worker": worker, "role": role, "slots": slots, "run_dir": str(run_dir), "backend": "sim"}


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def record_proc(r, key: str, s: dict, p: subprocess.Popen) -> None:
    """What a predecessor agent published for a worker it started (the next agent adopts it)."""
    r.hset(agent_procs(NODE), key, json.dumps({**s, "generation": 0, "node": NODE, "pid": p.pid,
                                               "start": process_start(p.pid), "started_at": time.time(),
                                               "state": "running"}))


@pytest.fixture
def stop_agents():
    agents = []
    yield agents
    for a in agents:
        try:
            a.shutdown(timeout_s=10)
        except Exception:   # noqa: BLE001 - a test's agent may already be broken on purpose
            pass


def test_a_desired_worker_on_a_slot_the_agent_no_longer_has_does_not_stop_the_agent(r, redis_url, tmp_path,
                                                                                       stop_agents):
    """An agent that ran with two slots was asked for a worker on slot 1; it is restarted with one slot (a GPU
    gone, a changed ``--slots``). The record naming slot 1 is skipped with a warning (the controller places
    that worker again) and the workers it can start are started. Before, ``spawn`` raised KeyError out of
    ``step()``: the agent died, and each restart of it the same way."""
    run_dir = sim_job(r, redis_url, tmp_path)
    a = Agent(r, redis_url, NODE, [Slot(0, None), Slot(1, None)], grace_s=5.0).start()
    actions.ensure(r, NODE, spec(run_dir, "reward-n1-1", [1], role="reward"))
    a.jobs.run_pending()            # the record is written; the agent stops before it starts the worker
    a.shutdown(timeout_s=5)
    assert json.loads(r.hget(agent_desired(NODE), worker_key(JOB, "reward-n1-1")))["slots"] == [1]

    b = Agent(r, redis_url, NODE, [Slot(0, None)], grace_s=5.0).start()   # one slot now
    stop_agents.append(b)
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    try:
        b.step()
    except KeyError as exc:
        pytest.fail(f"the agent's step raised KeyError({exc}) on a desired record naming slot 1, which it lacks")
    assert worker_key(JOB, "rollout-n1-0") in b.procs, "the worker on the slot it has was not started"


def test_shutdown_while_redis_is_away_still_drains_every_worker(r, redis_url, stop_agents):
    """A shutdown while Redis is unreachable signals every worker (SIGTERM) and returns. Before, the first
    worker's ``terminate`` published the agent's processes unguarded: the ConnectionError escaped
    ``shutdown()`` and the other workers were never signalled."""
    procs = [sleeper(), sleeper()]
    try:
        for i, p in enumerate(procs):
            record_proc(r, worker_key(JOB, f"rollout-n1-{i}"), spec("/nowhere", f"rollout-n1-{i}", [i]), p)
        a = Agent(r, redis_url, NODE, [Slot(0, None), Slot(1, None)], grace_s=5.0).start()
        assert len(a.procs) == 2
        a.r = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)   # Redis is away
        raised = None
        try:
            a.shutdown(timeout_s=3)
        except redis.RedisError as exc:
            raised = exc
        time.sleep(0.5)
        codes = [p.poll() for p in procs]
        assert codes == [-signal.SIGTERM, -signal.SIGTERM] and raised is None, (
            f"exit codes {codes} (None: still running), shutdown raised {raised!r}")
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_an_agent_whose_node_lock_was_taken_over_starts_no_worker(r, redis_url, tmp_path, stop_agents):
    """An agent cut off from Redis for longer than its lock's TTL finds another agent holding its node's lock:
    its next step checks the lock first and stops (SystemExit) before it runs a control job or starts a
    worker. Before, the step ran the queued jobs and started the worker, then noticed: a second copy of a
    worker the lock holder also runs (same id, same slot) was left with no agent."""
    from pipeline.control.lease import Lease
    from pipeline.dataplane.keys import agent_lock

    run_dir = sim_job(r, redis_url, tmp_path)
    a = Agent(r, redis_url, NODE, [Slot(0, None)], grace_s=5.0).start()
    stop_agents.append(a)
    # the outage: a's lock expired, and another agent of the node took it
    r.delete(agent_lock(NODE))
    assert Lease(r, agent_lock(NODE), ttl_s=agent_mod.LOCK_TTL_S).acquire()
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    a._last_beat = 0.0   # the heartbeat is due, as after any outage
    with pytest.raises(SystemExit, match="lost the lock"):
        a.step()
    started = list(a.procs)
    assert started == [], f"the agent that lost its node lock started {started} before it noticed"


def test_the_back_off_of_a_long_crash_looping_worker_stays_at_its_longest(r, redis_url, stop_agents):
    """A worker killed again and again before ``STABLE_S`` (a SIGKILL, which does not fail the run) waits the longest back-off before each restart, whatever the count. Before, ``2 ** restarts`` was
    computed before the minimum: at about 1,100 restarts OverflowError escaped ``reap()`` and killed the
    agent, and each successor, which loaded the same count."""
    a = Agent(r, redis_url, NODE, [Slot(0, None)], grace_s=5.0).start()
    stop_agents.append(a)
    key = worker_key(JOB, "rollout-n1-0")
    a.backoff[key] = agent_mod.Backoff(restarts=1100, next_at=0.0, run_dir="/run", failures=0, code=-9)
    try:
        a.book_restart(key, 30.0, "/run", -signal.SIGKILL)
    except OverflowError as exc:
        pytest.fail(f"book_restart raised OverflowError({exc}) at restart 1101")
    assert a.backoff[key].next_at - time.time() == pytest.approx(agent_mod.BACKOFF_S[1], abs=2.0)


def test_a_draining_external_learner_keeps_its_id_until_its_last_step_is_done(r, monkeypatch, tmp_path):
    """A drain asks a worker to stop after the batch in hand; until then its heartbeat goes on, so its record
    stays live and an agent's ``learner-0`` is refused while the pool learner still trains. Before, the drain
    ended the heartbeat thread at once: after ``STALE_S`` (10 s) of a long step the record read as gone and a
    second learner registered under the same consumer name. (Scaled down: heartbeat 0.05 s, STALE_S 0.5 s.)"""
    import structlog

    from pipeline.dataplane import worker as worker_mod
    from pipeline.dataplane.keys import LEARNER
    from pipeline.dataplane.worker import WorkerContext, register, record_alive

    monkeypatch.setattr(worker_mod, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(worker_mod, "STALE_S", 0.5)
    keys = JobKeys(JOB)
    pool = WorkerContext(cfg=None, run_dir=tmp_path, keys=keys, r=r, worker_id=LEARNER, role="learner",
                         log=structlog.get_logger(), external=True, node="pool-host")
    register(pool)
    pool.publish_state("running")
    beat = __import__("threading").Thread(target=worker_mod._heartbeat, args=(pool,), daemon=True)
    beat.start()
    try:
        time.sleep(0.2)
        r.sadd(keys.external_drain, LEARNER)      # the controller asks it to drain: it finishes its step first
        time.sleep(1.2)                           # ... a step longer than STALE_S
        assert pool.drain_requested and not pool.signalled.is_set()
        rec = json.loads(r.hget(keys.workers, LEARNER))
        age = time.time() - rec["heartbeat"]
        agents_learner = WorkerContext(cfg=None, run_dir=tmp_path, keys=keys, r=r, worker_id=LEARNER,
                                       role="learner", log=structlog.get_logger(), node="n1")
        refused = False
        try:
            register(agents_learner)
        except SystemExit:
            refused = True
        assert refused and record_alive(rec, time.time()), (
            f"the draining pool learner's record ({rec['state']}, heartbeat {age:.1f}s old) counts as gone, and "
            f"the agent's learner-0 registered over it: now held by node "
            f"{json.loads(r.hget(keys.workers, LEARNER))['node']!r}")
    finally:
        pool.exiting.set()
        beat.join(timeout=2)


def leader_with_a_child(tmp_path) -> tuple[subprocess.Popen, int, Path]:
    """A worker-like group leader that starts a child in its process group (as vLLM starts its engine
    process) and exits once the returned file exists, leaving the child running; (leader, child pid, file)."""
    pid_file, go = tmp_path / "child.pid", tmp_path / "exit"
    code = ("import os, subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); "
            f"[time.sleep(0.02) for _ in iter(lambda: os.path.exists({str(go)!r}), True)]")
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the leader never started its child"
        time.sleep(0.05)
    return leader, int(pid_file.read_text()), go


def gone(pid: int, timeout_s: float = 5.0) -> bool:
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("exits", ["while adopted", "before the agent starts"])
def test_what_an_exited_worker_left_in_its_process_group_is_killed(r, redis_url, tmp_path, stop_agents, exits):
    """A worker that exits (or crashes) leaving a child in its process group (vLLM's engine process, a
    learner rank) would leave the child holding the slot's GPU under the next worker: the agent SIGKILLs
    the group once it sees the worker gone, whether the worker exits under it or died before it started
    (a recorded process found dead at adoption). Before, the child ran on."""
    leader, child, go = leader_with_a_child(tmp_path)
    try:
        key = worker_key(JOB, "rollout-n1-0")
        record_proc(r, key, spec("/nowhere", "rollout-n1-0", [0]), leader)   # as its agent recorded it
        if exits == "before the agent starts":
            go.touch()
            leader.wait(timeout=30)   # reaped by its parent, this test, as init reaps an orphaned worker
        a = Agent(r, redis_url, NODE, [Slot(0, None)], grace_s=5.0).start()
        stop_agents.append(a)
        assert (key in a.procs) == (exits == "while adopted")
        go.touch()
        leader.wait(timeout=30)
        a.reap({})
        assert key not in a.procs and gone(child), "the worker's child outlived it"
    finally:
        leader.kill()
        leader.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_worker_adopted_while_draining_is_not_restarted_as_a_crash_when_it_exits(r, redis_url, stop_agents):
    """An agent that stopped while draining a worker recorded it as ``draining``; its successor adopts it as
    draining (its SIGTERM was sent), so the worker's exit is the drain ending, not a crash: no restart is
    booked against it. Before, the state was ignored and the exit booked as a crash with a back-off."""
    p = sleeper()
    try:
        key = worker_key(JOB, "rollout-n1-0")
        s = spec("/run", "rollout-n1-0", [0])
        record_proc(r, key, s, p)
        rec = json.loads(r.hget(agent_procs(NODE), key))
        r.hset(agent_procs(NODE), key, json.dumps({**rec, "state": "draining"}))
        a = Agent(r, redis_url, NODE, [Slot(0, None)], grace_s=5.0).start()
        stop_agents.append(a)
        assert a.procs[key].term_at is not None
        p.kill()
        p.wait()
        a.reap({key: {**s, "state": actions.STATE_RUN, "seq": 1, "generation": 0}})
        assert key not in a.procs and key not in a.backoff
    finally:
        p.kill()
        p.wait()


def test_a_worker_the_oom_killer_kills_at_every_start_fails_its_run(r, redis_url, tmp_path, stop_agents):
    """A SIGKILL while the kernel's OOM count goes up (this agent's memory cgroup's, else the machine's) is
    booked as a failure: ``libra-ctl run`` fails after ``CRASH_LOOP`` of them in a row, naming the OOM killer.
    A SIGKILL with no OOM kill meanwhile (chaos, a user) still resets the count. Before, every SIGKILL reset
    it: a worker out of host memory at every start was restarted forever and its run never ended. The
    count is read from a file here, as the kernel writes it (``oom_kill N``): no test can make a real OOM."""
    from pipeline import config as config_mod
    from pipeline.run import CRASH_LOOP, Orchestrator, RunFailed

    assert isinstance(agent_mod.oom_kills(agent_mod.oom_counter()), int)   # this Linux tells its count
    counter = tmp_path / "memory.events"
    counter.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    run_dir = sim_job(r, redis_url, tmp_path)
    a = Agent(r, redis_url, NODE, [Slot(0, None)], grace_s=5.0, backoff_s=(0.05, 0.1)).start()
    stop_agents.append(a)
    a.oom_counter = counter
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    key = worker_key(JOB, "rollout-n1-0")
    orch = Orchestrator(config_mod.load(None, [f"job.name={JOB}"]), Path(run_dir), r, redis_url)
    orch.check_crash_loops()

    def kill(oom: bool) -> None:
        deadline = time.monotonic() + 60
        while (p := a.procs.get(key)) is None or not p.alive():
            assert time.monotonic() < deadline, "the worker never started"
            a.step()
            time.sleep(0.05)
        if oom:
            kills = agent_mod.oom_kills(counter)
            counter.write_text(f"low 0\nhigh 0\nmax 0\noom 1\noom_kill {kills + 1}\n")
        os.kill(p.pid, signal.SIGKILL)
        while key in a.procs:
            assert time.monotonic() < deadline, "the kill was never seen"
            a.step()
            time.sleep(0.05)

    kill(oom=True)
    assert a.backoff[key].failures == 1 and a.backoff[key].oom
    kill(oom=False)   # chaos: not a failure
    assert a.backoff[key].failures == 0 and not a.backoff[key].oom
    for n in range(1, CRASH_LOOP + 1):
        kill(oom=True)
        assert a.backoff[key].failures == n
    with pytest.raises(RunFailed, match=r"rollout-n1-0 failed \d+ times in a row \(killed by the kernel's "
                                        r"out-of-memory killer \(exit code -9\)"):
        orch.check_crash_loops()
