"""Workers started outside the agents (``libra-ctl worker``: Procfile pools), and ``libra-ctl run`` joining.

External workers register under stable ids with ``"managed": "external"``;
the controller counts them toward the target (the agents run the rest), never
starts or signals one, and asks one to drain through ``JobKeys.external_drain``.
The fast tests drive the controller against fake agents and hand-written
worker records; the slow ones run real processes, honcho on the root Procfile
included.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis
import structlog

from pipeline import cli
from pipeline.control import actions
from pipeline.control.allocation import allocation_status, external_counts, external_workers, live_agents, pin, unpin
from pipeline.control.events import read_events
from pipeline.control.lease import Lease
from pipeline.control.loop import Controller
from pipeline.control.placement import agents_share, external_floor
from pipeline.control.allocator import RoleBounds
from pipeline.dataplane.keys import (AGENTS, CONTROLLER_EPOCH, CONTROLLER_LEASE, GROUP_ROLLOUT, LEARNER, JobKeys,
                                     agent_desired, agent_log, agent_procs)
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.dataplane.worker import (EXTERNAL, HEARTBEAT_S, IdTaken, WorkerContext, claim_external_id, finish_worker,
                                       load_run_config)
from pipeline.run import Orchestrator

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_agent import log_events, make_agent
    from tests.test_controller import desired_roles, fake_agent
    from tests.test_sim_workers import ROOT, sim_job, stop_all, wait_for, write_workload
except ModuleNotFoundError:
    from test_agent import log_events, make_agent
    from test_controller import desired_roles, fake_agent
    from test_sim_workers import ROOT, sim_job, stop_all, wait_for, write_workload

JOB = "simtest"


def external(r, wid: str, role: str, node: str = "pool", state: str = "running", pid: int = 4242,
             heartbeat: float | None = None) -> None:
    """A worker table record as a ``libra-ctl worker`` process writes it."""
    r.hset(JobKeys(JOB).workers, wid, json.dumps({
        "id": wid, "role": role, "pid": pid, "node": node, "slots": [], "state": state,
        "heartbeat": time.time() if heartbeat is None else heartbeat, "managed": EXTERNAL}))


def asked_to_drain(r) -> set[str]:
    return {w.decode() for w in r.smembers(JobKeys(JOB).external_drain)}


# --- ids ----------------------------------------------------------------------------------------------


def test_external_ids_are_stable_unique_and_reused_only_when_free(r):
    keys = JobKeys(JOB)
    assert claim_external_id(r, keys, "rollout", "h", pid=1) == "rollout-h-ext0"
    assert claim_external_id(r, keys, "rollout", "h", pid=2) == "rollout-h-ext1"
    assert claim_external_id(r, keys, "rollout", "h", pid=1) == "rollout-h-ext0"      # its own again
    rec = json.loads(r.hget(keys.workers, "rollout-h-ext0"))
    assert rec["managed"] == EXTERNAL and rec["state"] == "starting" and rec["node"] == "h"
    external(r, "rollout-h-ext0", "rollout", node="h", state="exited", pid=1)
    assert claim_external_id(r, keys, "rollout", "h", pid=3) == "rollout-h-ext0"      # an exited worker's id
    external(r, "rollout-h-ext0", "rollout", node="h", pid=3, heartbeat=time.time() - 60)
    assert claim_external_id(r, keys, "rollout", "h", pid=4) == "rollout-h-ext0"      # a silent one's
    # a worker still importing torch has not heartbeated yet: its id stays taken
    external(r, "rollout-h-ext0", "rollout", node="h", state="starting", pid=4, heartbeat=time.time() - 60)
    assert claim_external_id(r, keys, "rollout", "h", pid=5) == "rollout-h-ext2"
    with pytest.raises(IdTaken):
        claim_external_id(r, keys, "rollout", "h", pid=6, want="rollout-h-ext1")
    # started together, they never share an id (the check and the write are one transaction)
    got: list[str] = []
    threads = [threading.Thread(target=lambda p=p: got.append(claim_external_id(r, keys, "reward", "h", pid=p)))
               for p in range(100, 108)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(f"reward-h-ext{k}" for k in range(8))


def test_an_external_learner_queues_behind_the_agents_and_takes_learner_0(r):
    keys = JobKeys(JOB)
    r.hset(keys.workers, LEARNER, json.dumps({"id": LEARNER, "role": "learner", "pid": 99, "node": "n1",
                                              "slots": [0], "state": "running", "heartbeat": time.time()}))
    assert claim_external_id(r, keys, "learner", "pool", pid=7) is None
    queued = json.loads(r.hget(keys.workers, "learner-pool-ext0"))
    assert queued["state"] == "queued" and queued["managed"] == EXTERNAL
    assert external_counts(external_workers(r, JOB)) == {"learner": 1}
    r.hset(keys.workers, LEARNER, json.dumps({"id": LEARNER, "role": "learner", "pid": 99, "node": "n1",
                                              "state": "exited", "heartbeat": time.time()}))
    assert claim_external_id(r, keys, "learner", "pool", pid=7) == LEARNER
    assert not r.hexists(keys.workers, "learner-pool-ext0")                # the queued record is gone
    with pytest.raises(IdTaken, match="learner-0"):
        claim_external_id(r, keys, "learner", "other", pid=8)              # one learner process per job


def test_a_queued_learner_that_stops_removes_its_own_record_not_one_of_another_node_with_its_pid(r):
    """A pool learner queued behind an agent's learner-0 and stopped (Ctrl-C) removes its queued record;
    a worker on another node whose process has the same pid (containers are pid 1) keeps its record. Before,
    every record with that pid was deleted."""
    import threading

    from pipeline.cli import _claim_id

    keys = JobKeys(JOB)
    r.hset(keys.workers, LEARNER, json.dumps({"id": LEARNER, "role": "learner", "pid": 99, "node": "n1",
                                              "slots": [0], "state": "running", "heartbeat": time.time()}))
    other = {"id": "rollout-n2-ext0", "role": "rollout", "pid": os.getpid(), "node": "n2", "state": "running",
             "heartbeat": time.time(), "managed": EXTERNAL}
    r.hset(keys.workers, other["id"], json.dumps(other))
    stop = threading.Event()
    stop.set()
    assert _claim_id(r, keys, "learner", "pool", None, stop) is None
    assert not r.hexists(keys.workers, "learner-pool-ext0")   # ours, gone
    assert json.loads(r.hget(keys.workers, other["id"])) == other


def test_a_worker_never_starts_under_an_id_an_external_worker_holds(r, redis_url, tmp_path):
    # the controller placed learner-0 on an agent just before the pool's learner took the id
    run_dir = sim_job(r, redis_url, tmp_path)
    external(r, LEARNER, "learner")
    out = subprocess.run([sys.executable, "-m", "pipeline.sim.worker", "--role", "learner", "--run-dir", str(run_dir),
                          "--worker-id", LEARNER], cwd=ROOT, env={**os.environ, ENV_URL: redis_url},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "held by the external worker pid 4242" in out.stderr
    assert json.loads(r.hget(JobKeys(JOB).workers, LEARNER))["pid"] == 4242
    # a drained one gives way: the agent's learner may replace it
    external(r, LEARNER, "learner", state="drained")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.sim.worker", "--role", "learner", "--run-dir",
                             str(run_dir), "--worker-id", LEARNER], cwd=ROOT, env={**os.environ, ENV_URL: redis_url},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: json.loads(r.hget(JobKeys(JOB).workers, LEARNER))["pid"] == proc.pid, 30,
                 "the learner to take the id")
    finally:
        stop_all([proc])


# --- pure pieces -------------------------------------------------------------------------------------


def test_agents_run_what_external_workers_leave_and_auto_never_goes_below_them():
    assert agents_share({"rollout": 3, "learner": 1, "reward": 1}, {"rollout": 1, "reward": 2}) == \
        {"rollout": 2, "learner": 1, "reward": 0}
    b = {"rollout": RoleBounds(1, 4), "learner": RoleBounds(1, 8), "reward": RoleBounds(0, 0)}
    assert external_floor(b, {"rollout": 6, "learner": 1}) == \
        {"rollout": RoleBounds(6, 6), "learner": RoleBounds(1, 1), "reward": RoleBounds(0, 0)}


# --- the controller ------------------------------------------------------------------------------------


def test_the_controller_counts_external_workers_and_asks_them_to_drain(r, redis_url, tmp_path):
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    pin(r, JOB, {"rollout": 3})
    jobs = fake_agent(r, "n1", 4)
    external(r, "rollout-pool-ext0", "rollout")
    ctl = Controller(r, interval_s=1.0)
    assert ctl.tick()
    jobs.run_pending()
    roles = desired_roles(r, "n1")
    assert len(roles["rollout"]) == 2 and len(roles["learner"]) == 1             # target 3, one external
    desired = [json.loads(v)["worker"] for v in r.hvals(agent_desired("n1"))]
    assert not [w for w in desired if "pool" in w]                               # never placed on an agent
    assert allocation_status(r, JOB)["roles"] == {"rollout": 1}                  # the fake agent runs nothing
    assert read_events(r, JOB)[-1]["external"] == {"rollout": 1}
    # a pinned count below the pool: the highest ids are asked to drain, the agents' rollouts drained
    external(r, "rollout-pool-ext1", "rollout")
    external(r, "rollout-pool-ext2", "rollout")
    pin(r, JOB, {"rollout": 2})
    ctl.tick()
    jobs.run_pending()
    assert asked_to_drain(r) == {"rollout-pool-ext2"}
    assert "rollout" not in desired_roles(r, "n1")
    ext = external_workers(r, JOB)
    assert ext["rollout-pool-ext2"]["draining"] and external_counts(ext) == {"rollout": 2}
    assert allocation_status(r, JOB)["external"]["rollout-pool-ext2"]["state"] == "draining"
    e = read_events(r, JOB)[-1]
    assert {(a["action"], a["worker"]) for a in e["actions"] if a["action"] == "drain_external"} == \
        {("drain_external", "rollout-pool-ext2")}
    ctl.tick()
    assert asked_to_drain(r) == {"rollout-pool-ext2"}                            # asked once
    # auto mode never drains one: their slots cannot change role
    unpin(r, JOB)
    ctl.tick()
    ctl.tick()
    assert asked_to_drain(r) == {"rollout-pool-ext2"}
    # a finished job: every external worker is asked
    r.hset(JobKeys(JOB).state, "phase", "done")
    ctl.tick()
    jobs.run_pending()
    assert asked_to_drain(r) == {"rollout-pool-ext0", "rollout-pool-ext1", "rollout-pool-ext2"}
    done = read_events(r, JOB)[-1]
    assert done["kind"] == "job_done" and {a["worker"] for a in done["actions"]
                                           if a["action"] == "drain_external"} == {"rollout-pool-ext0",
                                                                                   "rollout-pool-ext1"}


def test_an_external_learner_replaces_the_agents_learner(r, redis_url, tmp_path):
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    jobs = fake_agent(r, "n1", 3)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    jobs.run_pending()
    assert desired_roles(r, "n1")["learner"] == [[0]]
    keys = JobKeys(JOB)
    r.hset(keys.workers, LEARNER, json.dumps({"id": LEARNER, "role": "learner", "pid": 99, "node": "n1",
                                              "slots": [0], "state": "running", "heartbeat": time.time()}))
    assert claim_external_id(r, keys, "learner", "pool", pid=7) is None         # queued behind it
    ctl.tick()
    jobs.run_pending()
    assert json.loads(r.hget(agent_desired("n1"), f"{JOB}/{LEARNER}"))["state"] == "drain"
    r.hset(keys.workers, LEARNER, json.dumps({"id": LEARNER, "role": "learner", "pid": 99, "node": "n1",
                                              "state": "exited", "heartbeat": time.time()}))
    assert claim_external_id(r, keys, "learner", "pool", pid=7) == LEARNER
    ctl.tick()
    jobs.run_pending()
    assert "learner" not in desired_roles(r, "n1")
    assert allocation_status(r, JOB)["roles"] == {"learner": 1}


def test_status_json_says_who_manages_each_worker(r, redis_url, tmp_path, capsys):
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    fake_agent(r, "n1", 2)
    keys = JobKeys(JOB)
    r.hset(agent_procs("n1"), f"{JOB}/rollout-n1-1", json.dumps({
        "job": JOB, "worker": "rollout-n1-1", "role": "rollout", "slots": [1], "pid": 42, "state": "running"}))
    for wid, role in (("rollout-n1-1", "rollout"), ("feeder-0", "feeder")):
        r.hset(keys.workers, wid, json.dumps({"id": wid, "role": role, "pid": 42, "node": "h", "slots": [],
                                              "state": "running", "heartbeat": time.time()}))
    external(r, "rollout-pool-ext0", "rollout")
    r.sadd(keys.external_drain, "rollout-pool-ext0")
    assert cli.main(["status", "--json", "--redis", redis_url]) == 0
    st = json.loads(capsys.readouterr().out)["jobs"][0]
    workers = {w["id"]: w for w in st["workers"]}
    assert {w: rec["managed"] for w, rec in workers.items()} == {
        "rollout-n1-1": "agent", "feeder-0": "run", "rollout-pool-ext0": "external"}
    assert set(workers["rollout-pool-ext0"]) >= {"id", "role", "pid", "node", "slots", "state"}
    assert workers["rollout-pool-ext0"]["state"] == "draining" and workers["rollout-pool-ext0"]["slots"] == []
    assert st["allocation"]["roles"] == {"rollout": 1}            # the agent's; the draining one is not counted
    assert cli.main(["status", "--redis", redis_url]) == 0
    assert "external  rollout-pool-ext0 (draining)" in capsys.readouterr().out


def test_drain_command_asks_an_external_worker_directly(r, redis_url, tmp_path, capsys):
    sim_job(r, redis_url, tmp_path)
    external(r, "rollout-pool-ext0", "rollout")
    assert cli.main(["drain", "rollout-pool-ext0", "--redis", redis_url]) == 0
    assert asked_to_drain(r) == {"rollout-pool-ext0"}
    assert cli.main(["drain", "rollout-pool-ext9", "--redis", redis_url]) == 2


def gone_pid() -> int:
    """The pid of a process that has exited: a job's owner that is gone."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_an_external_worker_that_stopped_by_itself_waits_for_its_jobs_end(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path)
    keys = JobKeys(JOB)
    ctx = WorkerContext(cfg=load_run_config(run_dir), run_dir=run_dir, keys=keys, r=r, worker_id=LEARNER,
                        role="learner", log=structlog.get_logger(), external=True, node="h")
    ctx.publish_state("running")
    seen = []

    def end_job_after_a_look():
        time.sleep(0.6)
        seen.append((json.loads(r.hget(keys.workers, ctx.worker_id))["state"],
                     external_counts(external_workers(r, JOB))))
        r.hset(keys.state, "phase", "done")
        time.sleep(HEARTBEAT_S + 0.5)   # the job's process, still writing its summary: the worker waits for it
        seen.append(json.loads(r.hget(keys.workers, ctx.worker_id))["state"])
        r.hset(keys.state, "pid", gone_pid())

    for drained, state, counted in ((False, "done", {"learner": 1}), (True, "drained", {})):
        r.hset(keys.state, mapping={"phase": "running", "pid": os.getpid()})
        ctx.drain_requested = drained
        threading.Thread(target=end_job_after_a_look).start()
        t0 = time.monotonic()
        finish_worker(ctx)    # its steps done, or drained: waits, heartbeating, until the job is over
        assert time.monotonic() - t0 >= HEARTBEAT_S + 1.1 and seen[-2:] == [(state, counted), state]
        assert json.loads(r.hget(keys.workers, ctx.worker_id))["state"] == "exited"
    # a signalled one stops at once
    r.hset(keys.state, "phase", "running")
    ctx.signalled.set()
    t0 = time.monotonic()
    finish_worker(ctx)
    assert time.monotonic() - t0 < 0.5


# --- libra-ctl run joins what is there ----------------------------------------------------------------


def _orchestrator(r, redis_url, run_dir, **kw) -> tuple[Orchestrator, io.StringIO]:
    out = io.StringIO()
    return Orchestrator(load_run_config(run_dir), run_dir, r, redis_url, out, **kw), out


def test_run_joins_the_controller_and_agent_already_on_its_redis(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path)
    lease = Lease(r, CONTROLLER_LEASE, ttl_s=60, epoch_key=CONTROLLER_EPOCH)
    assert lease.acquire()
    fake_agent(r, "n1", 2)
    orch, out = _orchestrator(r, redis_url, run_dir)
    try:
        orch.start_workers()
    finally:
        orch.stop_children()
    assert orch.control is None and [c.worker_id for c in orch.children] == ["feeder-0"]
    assert r.get(CONTROLLER_LEASE).decode() == lease.token and set(live_agents(r)) == {"n1"}
    assert "joined the controller and agents n1" in out.getvalue() and "started" not in out.getvalue()


def test_a_run_whose_joined_controller_and_agent_are_gone_fails_saying_how_to_resume(r, redis_url, tmp_path,
                                                                                     monkeypatch):
    """Another run's controller and agent end with that run, and nothing restarts them for this one: its
    workers would never start again, and it would wait for its steps forever. It fails instead, naming resume."""
    from pipeline import run as run_mod

    monkeypatch.setattr(run_mod, "JOINED_GONE_S", 1.0)
    run_dir = sim_job(r, redis_url, tmp_path)
    lease = Lease(r, CONTROLLER_LEASE, ttl_s=60, epoch_key=CONTROLLER_EPOCH)
    assert lease.acquire()
    fake_agent(r, "n1", 2)
    orch, _out = _orchestrator(r, redis_url, run_dir)
    try:
        orch.start_workers()
        assert orch.control is None
        orch.check_children()
        lease.release()                      # the controller goes; a moment without one is no failure
        orch.check_children()
        lease.acquire()                      # ... it is back (restarted by the run that owns it)
        time.sleep(1.2)
        orch.check_children()
        real = orch.joined_gone
        orch.joined_gone = lambda: (_ for _ in ()).throw(redis.ConnectionError("away"))
        orch.check_children()                # Redis unreachable: an outage (waited out), not a verdict
        orch.joined_gone = real
        lease.release()
        r.hdel(AGENTS, "n1")                 # the run that owned them ended
        orch.check_children()
        time.sleep(1.2)
        with pytest.raises(run_mod.RunFailed, match=f"controller and the agents .* libra-ctl resume {run_dir}"):
            orch.check_children()
    finally:
        orch.stop_children()


def test_run_waits_for_a_controller_starting_beside_it(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path)
    fake_agent(r, "n1", 2)
    lease = Lease(r, CONTROLLER_LEASE, ttl_s=60, epoch_key=CONTROLLER_EPOCH)
    threading.Timer(0.5, lease.acquire).start()
    orch, out = _orchestrator(r, redis_url, run_dir, join_wait_s=20.0)
    t0 = time.monotonic()
    try:
        orch.start_workers()
    finally:
        orch.stop_children()
    assert time.monotonic() - t0 < 10 and orch.control is None
    assert "joined the controller and agents n1" in out.getvalue()


def test_a_new_run_forgets_the_workers_an_earlier_run_left_desired(r, redis_url, tmp_path):
    from pipeline.dataplane.jobs import reset_job

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    jobs = fake_agent(r, "n1", 2)
    Controller(r, interval_s=1.0).tick()
    jobs.run_pending()
    assert desired_roles(r, "n1")      # the run stopped with its controller: its workers are still desired
    r.hset(JobKeys(JOB).state, "phase", "stopped")
    reset_job(r, JobKeys(JOB))         # what the next run of the job does first; the agent drains what is gone
    assert desired_roles(r, "n1") == {}


@pytest.mark.slow
def test_run_starts_only_what_is_missing(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path)
    lease = Lease(r, CONTROLLER_LEASE, ttl_s=60, epoch_key=CONTROLLER_EPOCH)
    assert lease.acquire()                       # a controller, and no agent
    orch, out = _orchestrator(r, redis_url, run_dir)
    try:
        orch.start_workers()
        assert [name for name, _p in orch.control.procs] == ["agent"]
        wait_for(lambda: r.hlen(AGENTS), 30, "the agent run started")
    finally:
        orch.stop_children()
    assert r.get(CONTROLLER_LEASE).decode() == lease.token
    assert "joined the controller on this Redis; started agent" in out.getvalue()
    assert all(p.poll() is not None for _n, p in orch.control.procs)


# --- real processes: libra-ctl redis and worker, and honcho on the root Procfile ----------------------------


@pytest.mark.slow
def test_redis_command_serves_the_procfiles_server_and_waits_for_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    data = tmp_path / "rd"
    cmd = [sys.executable, "-m", "pipeline.cli", "redis", "--dir", str(data)]
    waiter = subprocess.Popen(cmd + ["--wait", "--timeout", "30", "--", sys.executable, "-c",
                                     f"import os; print('got', os.environ['{ENV_URL}'])"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        url = f"unix://{data.resolve() / 'redis.sock'}"
        assert waiter.communicate(timeout=60)[0].strip() == f"got {url}"     # it waited, then ran the command
        assert (data / "redis.url").read_text().strip() == url
        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "already runs" in second.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        out = server.communicate(timeout=30)[0]
    assert server.returncode == 0 and "redis: stopped" in out
    assert not (data / "redis.url").exists() and not (data / "redis.sock").exists()
    assert (data / "appendonly.aof").exists()




def start_pool_worker(role: str, url: str, log_dir: Path, node: str = "pool") -> subprocess.Popen:
    out = open(log_dir / f"pool-{role}-{time.monotonic_ns()}.out", "ab")
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", role, "--job", JOB, "--redis", url,
                             "--node", node], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def working(r, role: str) -> list[str]:
    return sorted(w for w, rec in external_workers(r, JOB).items() if rec["role"] == role and rec["counted"]
                  and rec["state"] == "running")


def reconcile_until(ctl: Controller, agent, cond, timeout_s: float, what: str):
    def once():
        ctl.tick()
        for _ in range(3):
            agent.step()
        return cond()

    return wait_for(once, timeout_s, what)


@pytest.mark.slow
def test_pool_workers_register_are_counted_never_signalled_and_drain_when_asked(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path, time_scale=20.0, control={"mode": "pinned"})
    keys = JobKeys(JOB)
    pin(r, JOB, {"rollout": 3})                 # before the controller first sees the job
    pool = [start_pool_worker("rollout", redis_url, tmp_path) for _ in range(2)]
    agent = make_agent(r, redis_url, slots=4)
    ctl = Controller(r, interval_s=1.0)
    try:
        ids = wait_for(lambda: working(r, "rollout") if len(working(r, "rollout")) == 2 else None, 60,
                       "two pool workers running")
        assert ids == ["rollout-pool-ext0", "rollout-pool-ext1"]
        recs = {w: json.loads(r.hget(keys.workers, w)) for w in ids}
        assert {rec["pid"] for rec in recs.values()} == {p.pid for p in pool}    # the exec'd worker kept the pid
        actions.ensure(r, "n1", {"job": JOB, "worker": "feeder-0", "role": "feeder", "slots": [],
                                 "run_dir": str(run_dir), "backend": "sim"})
        # counted: the target is 3 rollout workers, the agent runs 1 of them
        reconcile_until(ctl, agent, lambda: allocation_status(r, JOB)["roles"].get("rollout") == 3, 60,
                        "three rollout workers, two of them external")
        agent_rollouts = [p for p in agent.procs.values() if p.spec["role"] == "rollout"]
        assert len(agent_rollouts) == 1
        wait_for(lambda: int(r.hget(keys.counters, "generated") or 0) > 0, 60, "the pool generating")
        # a pinned count below the pool: the controller asks ext1 to drain; it finishes its batch and waits
        pin(r, JOB, {"rollout": 1})
        reconcile_until(ctl, agent, lambda: json.loads(r.hget(keys.workers, ids[1]))["state"] == "drained", 60,
                        "the drained pool worker to stop working")
        assert pool[1].poll() is None and pool[0].poll() is None                 # honcho would keep running
        pending = {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(keys.prompts, GROUP_ROLLOUT)}
        assert pending.get(ids[1], 0) == 0                                       # its batch was written and acked
        assert allocation_status(r, JOB)["roles"]["rollout"] == 1
        reconcile_until(ctl, agent, lambda: not [p for p in agent.procs.values() if p.spec["role"] == "rollout"],
                        30, "the agent's rollout worker drained")
        # the job ends, and its process exits: the controller asks the other one, and both exit by themselves
        r.hset(keys.state, mapping={"phase": "done", "pid": gone_pid()})
        reconcile_until(ctl, agent, lambda: all(p.poll() is not None for p in pool), 60, "the pool to exit")
        assert [p.returncode for p in pool] == [0, 0]
    finally:
        stop_all(pool)
        agent.shutdown(timeout_s=10)
    signalled = {int(e["pid"]) for e in log_events(r) if e["event"] in ("sigterm", "sigkill")}
    assert not signalled & {p.pid for p in pool}
    assert all(json.loads(r.hget(keys.workers, w))["state"] == "exited" for w in ids)


@pytest.mark.slow
def test_a_pool_learner_takes_over_from_the_agents_learner(r, redis_url, tmp_path):
    from pipeline.observe.audit import audit

    run_dir = sim_job(r, redis_url, tmp_path, time_scale=20.0, control={"mode": "pinned"})
    keys = JobKeys(JOB)
    agent = make_agent(r, redis_url, slots=3)
    ctl = Controller(r, interval_s=1.0)
    actions.ensure(r, "n1", {"job": JOB, "worker": "feeder-0", "role": "feeder", "slots": [],
                             "run_dir": str(run_dir), "backend": "sim"})
    pool = None

    def trained() -> int:
        return int(r.hget(keys.counters, "trained") or 0)

    try:
        reconcile_until(ctl, agent, lambda: trained() > 0, 60, "the agent's learner training")
        pool = start_pool_worker("learner", redis_url, tmp_path)
        # it queues behind the agent's learner-0; the controller drains that one, and the pool's takes the id
        reconcile_until(ctl, agent, lambda: json.loads(r.hget(keys.workers, LEARNER)).get("managed") == EXTERNAL
                        and json.loads(r.hget(keys.workers, LEARNER))["state"] == "running", 60,
                        "the pool learner running as learner-0")
        assert not [p for p in agent.procs.values() if p.spec["role"] == "learner"]
        assert json.loads(r.hget(keys.workers, LEARNER))["pid"] == pool.pid
        before = trained()
        reconcile_until(ctl, agent, lambda: trained() >= before + 64, 60, "the pool learner training on")
        r.hset(keys.state, mapping={"phase": "done", "pid": gone_pid()})
        reconcile_until(ctl, agent, lambda: pool.poll() is not None, 60, "the pool learner to exit")
        assert pool.returncode == 0
        reconcile_until(ctl, agent, lambda: not agent.procs, 30, "the agent's workers drained")
    finally:
        stop_all([pool] if pool else [])
        agent.shutdown(timeout_s=10)
    a = audit(r, JOB, str(run_dir))
    assert a["ok"], a["problems"]
    assert a["duplicates_trained"] == 0


def _tree(pid: int) -> set[int]:
    try:
        p = psutil.Process(pid)
        return {pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_honcho_on_the_root_procfile_runs_two_rollout_pool_workers(r, redis_url, tmp_path):
    honcho, libra = ROOT / ".venv" / "bin" / "honcho", ROOT / ".venv" / "bin" / "libra-ctl"
    if not (honcho.exists() and libra.exists()):
        pytest.skip("the Procfile runs .venv/bin/libra-ctl: set up .venv with scripts/setup")
    keys, node = JobKeys(JOB), socket.gethostname().split(".")[0]
    env = {**os.environ, ENV_URL: redis_url, "LIBRA_JOB": JOB, "LIBRA_AGENT_SLOTS": "2"}
    env.pop("LIBRA_NODE", None)
    out = open(tmp_path / "honcho.out", "wb")
    # every line of the root Procfile but the job (a vLLM run); the test starts a sim job in its place
    proc = subprocess.Popen([str(honcho), "-f", "Procfile", "start", "-c", "rollout=2", "--no-colour",
                             "redis", "controller", "agent", "rollout", "reward", "learner"],
                            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pids: set[int] = set()
    try:
        # as libra-ctl run --join-wait does: the job starts once the controller and an agent are there
        agent_node = wait_for(lambda: r.exists(CONTROLLER_LEASE) and next(iter(live_agents(r)), None), 60,
                              "the controller and the agent")
        run_dir = sim_job(r, redis_url, tmp_path, time_scale=20.0)
        actions.ensure(r, agent_node, {"job": JOB, "worker": "feeder-0", "role": "feeder", "slots": [],
                                       "run_dir": str(run_dir), "backend": "sim"})
        want = [f"rollout-{node}-ext0", f"rollout-{node}-ext1"]
        wait_for(lambda: working(r, "rollout") == want, 90, "two rollout pool workers registered")
        pool = {want[0]: "rollout", want[1]: "rollout", f"reward-{node}-ext0": "reward", LEARNER: "learner"}
        # the learner's pool worker may have queued behind an agent's learner-0 (if the controller placed the
        # job before it registered); either way the pool's runs it in the end, and no agent runs one
        wait_for(lambda: {w: rec["role"] for w, rec in external_workers(r, JOB).items()
                          if rec["state"] == "running"} == pool, 60, "the pools running")
        wait_for(lambda: int(r.hget(keys.counters, "trained") or 0) > 0, 90, "a learner step through the pools")
        wait_for(lambda: LEARNER not in allocation_status(r, JOB)["workers"], 30, "no learner under the agent")
        roles = allocation_status(r, JOB)["roles"]
        assert roles["rollout"] >= 2 and roles["learner"] == 1
        spawned = {int(e[b"pid"]) for _i, e in r.xrange(agent_log(agent_node)) if e[b"event"] == b"spawned"}
        pids = _tree(proc.pid) | {json.loads(v)["pid"] for v in r.hvals(keys.workers)} | spawned
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert len(pids) >= 8         # honcho, its shells' processes, the pools, the agent's workers
    wait_for(lambda: not [p for p in pids if _alive(p)], 30, "every process to exit")
    assert not live_agents(r) and not r.exists(CONTROLLER_LEASE)


# waits (up to 120 s) for a live agent on the Redis at {url}
AGENT_UP = ("import time; from pipeline.control.allocation import live_agents; "
            "from pipeline.dataplane.redisconn import connect; r = connect('{url}'); t = time.time() + 120; "
            "[time.sleep(0.5) for _ in iter(lambda: not live_agents(r) and time.time() < t, False)]")


def test_under_honcho_the_job_line_ends_first_and_its_exit_code_is_honchos(r, redis_url, tmp_path):
    """Procfile: "the job line exits once the job has trained, and honcho sends SIGTERM to the rest". A review
    found a pool line first to stop, on every run with pools: its worker left as soon as the job's phase left
    running, while the job line was still stopping its workers and writing its summary and report; honcho then
    SIGTERMed the job line (rc -15), and honcho's exit code was the pool worker's 0, not the job's."""
    honcho, libra = ROOT / ".venv" / "bin" / "honcho", ROOT / ".venv" / "bin" / "libra-ctl"
    if not (honcho.exists() and libra.exists()):
        pytest.skip("honcho and libra-ctl come with .venv: set up .venv with scripts/setup")
    wl = write_workload(tmp_path / "wl.toml", job={"steps": 3})
    (tmp_path / "Procfile").write_text(
        f"agent: {libra} agent --slots 4 --node local\n"
        f"controller: {libra} controller --interval 1\n"
        # the job starts once the agent is up (deploy/Procfile.sim sleeps 3 s; a loaded machine needs more)
        f"job: {sys.executable} -c \"{AGENT_UP.format(url=redis_url)}\" && {libra} sim-job {wl} --job {JOB} "
        f"--time-scale 50 --runs-dir {tmp_path / 'runs'}\n"
        f"rollout: {libra} worker rollout --job {JOB}\n"
        f"reward: {libra} worker reward --job {JOB}\n")
    env = {**os.environ, ENV_URL: redis_url}
    env.pop("LIBRA_NODE", None)
    proc = subprocess.Popen([str(honcho), "-f", str(tmp_path / "Procfile"), "-d", str(ROOT), "start", "--no-colour"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=240)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stopped = re.findall(r"\| (\w+\.\d+) stopped \(rc=(-?\d+)\)", out)
    assert stopped and stopped[0] == ("job.1", "0"), (stopped, out[-3000:])
    assert proc.returncode == 0, out[-3000:]
