"""The node agent: slots, process identity, and real worker processes driven by control jobs.

The agent runs in the test process (``step()`` by step); its workers are real
``pipeline.sim.worker`` / ``workers.feeder`` processes on the session's Redis.
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
from rq.job import Job

from pipeline.control import agent as agent_mod
from pipeline.control import actions
from pipeline.dataplane import messages
from pipeline.control.agent import (Agent, Slot, SlotError, detect_slots, hand_over_pending, process_start,
                                    worker_argv)
from pipeline.control.actions import worker_key
from pipeline.dataplane.keys import (AGENTS, CONTROLLER_EPOCH, GROUP_REWARD, GROUP_ROLLOUT, JobKeys, agent_backoff,
                                     agent_desired, agent_lock, agent_log, agent_procs)
from pipeline.dataplane.streams import ensure_groups, group_pending
try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job, wait_for
except ModuleNotFoundError:
    from test_sim_workers import sim_job, wait_for

NODE = "n1"
JOB = "simtest"


def make_agent(r, url, slots=2, **kw) -> Agent:
    kw.setdefault("grace_s", 10.0)
    slot_list = slots if isinstance(slots, list) else [Slot(i, None) for i in range(slots)]
    return Agent(r, url, NODE, slot_list, **kw).start()


def step_until(agent: Agent, cond, timeout_s: float = 30.0, what: str = "condition", check=None):
    """Step the agent until ``cond()``; ``check()`` runs after every step (an invariant)."""
    def once():
        agent.step()
        if check:
            check()
        return cond()

    return wait_for(once, timeout_s, what)


def spec(run_dir, worker: str, slots: list[int], role: str = "rollout") -> dict:
    return {"job": JOB, "worker": worker, "role": role, "slots": slots, "run_dir": str(run_dir), "backend": "sim"}


def live(agent: Agent, worker: str):
    p = agent.procs.get(worker_key(JOB, worker))
    return p if p is not None and p.alive() else None


def one_worker_per_slot(agent: Agent) -> None:
    held = [s for p in agent.procs.values() if p.alive() for s in p.slots]
    assert len(held) == len(set(held)), f"two live workers share a slot: {agent.procs}"


def log_events(r) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _i, f in r.xrange(agent_log(NODE))]


@pytest.fixture
def stop_agents():
    agents = []
    yield agents
    for a in agents:
        a.shutdown(timeout_s=10)


# --- pure pieces --------------------------------------------------------------------------------


def test_slots_from_flag_env_or_nvml(monkeypatch):
    assert detect_slots(3) == [Slot(0, None), Slot(1, None), Slot(2, None)]
    assert detect_slots(None, {"LIBRA_GPUS": "4, 6"}) == [Slot(0, "4"), Slot(1, "6")]
    monkeypatch.setattr(agent_mod, "nvml_gpu_count", lambda: 2)
    assert detect_slots(None, {}) == [Slot(0, "0"), Slot(1, "1")]
    monkeypatch.setattr(agent_mod, "nvml_gpu_count", lambda: 0)
    with pytest.raises(SlotError, match="--slots N"):
        detect_slots(None, {})
    with pytest.raises(SlotError):
        detect_slots(0)


def test_nvml_gpu_count_with_a_stand_in_pynvml(monkeypatch):
    import types

    class NVMLError(Exception):
        pass

    calls = []
    fake = types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=lambda: calls.append("init"),
                                 nvmlDeviceGetCount=lambda: 4, nvmlShutdown=lambda: calls.append("shutdown"))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert agent_mod.nvml_gpu_count() == 4 and calls == ["init", "shutdown"]
    assert detect_slots(None, {}) == [Slot(i, str(i)) for i in range(4)]

    def no_driver():
        raise NVMLError("driver not loaded")

    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    assert agent_mod.nvml_gpu_count() == 0
    monkeypatch.setitem(sys.modules, "pynvml", None)       # not installed
    assert agent_mod.nvml_gpu_count() == 0


def test_process_start_tells_a_process_from_a_reused_pid():
    assert process_start(os.getpid()) == process_start(os.getpid()) > 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = process_start(child.pid)
    assert start is not None and start >= process_start(os.getpid())
    child.kill()
    child.wait()
    assert process_start(child.pid) is None


def test_worker_commands_come_from_a_fixed_table():
    assert worker_argv("sim", "learner", "/r", "learner-0")[1:5] == ["-m", "pipeline.sim.worker", "--role", "learner"]
    assert worker_argv("vllm", "rollout", "/r", "w")[1:3] == ["-m", "workers.rollout"]
    assert worker_argv("sim", "feeder", "/r", "f")[1:3] == ["-m", "workers.feeder"]
    with pytest.raises(ValueError):
        worker_argv("sim", "bash", "/r", "w")
    with pytest.raises(ValueError):
        worker_argv("docker", "rollout", "/r", "w")


def test_one_agent_per_node_name(r, redis_url, stop_agents):
    stop_agents.append(make_agent(r, redis_url))
    with pytest.raises(SystemExit, match="another agent"):
        make_agent(r, redis_url)


def test_an_agent_frees_the_lock_of_a_dead_predecessor_instead_of_waiting_out_its_ttl(r, redis_url, stop_agents):
    """An agent killed with SIGKILL leaves its node lock behind for LOCK_TTL_S; its successor (the same
    host, the same node name) frees it at once, since the holder's process is gone."""
    env = dict(os.environ, LIBRA_REDIS_URL=redis_url)
    env.pop("LIBRA_PARENT_PID", None)
    first = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "agent", "--node", NODE, "--slots", "1"], env=env)
    try:
        wait_for(lambda: r.hget(AGENTS, NODE) and json.loads(r.hget(AGENTS, NODE)).get("pid") == first.pid, 60,
                 "the first agent's heartbeat")
    finally:
        first.kill()
        first.wait()
    assert r.pttl(agent_lock(NODE)) > 5000   # the dead agent's lock would hold the name for seconds more
    successor = Agent(r, redis_url, NODE, [Slot(0, None)], grace_s=10.0).start(lock_wait_s=2.0)
    stop_agents.append(successor)
    assert successor.lock.held
    with pytest.raises(SystemExit, match="another agent"):   # a live holder is still refused
        make_agent(r, redis_url)


# --- processes ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_spawn_with_own_devices_and_identity(r, redis_url, tmp_path, stop_agents):
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url, slots=[Slot(0, "3"), Slot(1, "5")])
    stop_agents.append(a)
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-1", [1]))
    step_until(a, lambda: r.hget(JobKeys(JOB).workers, "rollout-n1-1"), what="the worker's registration")
    p = live(a, "rollout-n1-1")
    env = dict(x.split("=", 1) for x in open(f"/proc/{p.pid}/environ").read().split("\0") if "=" in x)
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["LIBRA_SLOTS"] == "1" and env["LIBRA_NODE"] == NODE
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"     # device ids as nvidia-smi and NVML number them
    rec = json.loads(r.hget(agent_procs(NODE), worker_key(JOB, "rollout-n1-1")))
    assert (rec["pid"], rec["start"]) == (p.pid, process_start(p.pid))
    assert json.loads(r.hget(JobKeys(JOB).workers, "rollout-n1-1"))["pid"] == p.pid


@pytest.mark.slow
def test_retried_actions_never_put_two_workers_on_a_slot(r, redis_url, tmp_path, stop_agents):
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    first = actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))          # sent twice
    step_until(a, lambda: live(a, "rollout-n1-0"), what="the worker", check=lambda: one_worker_per_slot(a))
    pid = live(a, "rollout-n1-0").pid
    # rq runs a retried job again with the same arguments (same seq): nothing changes
    actions.queue(r, NODE).enqueue_job(Job.fetch(first.id, connection=r, serializer=first.serializer))
    # and another worker wanting the same slot waits for it
    actions.ensure(r, NODE, spec(run_dir, "other-n1-0", [0]))
    for _ in range(15):
        a.step()
        one_worker_per_slot(a)
        time.sleep(0.05)
    assert live(a, "rollout-n1-0").pid == pid and live(a, "other-n1-0") is None
    assert sum(e["event"] == "spawned" for e in log_events(r)) == 1
    actions.drain(r, NODE, JOB, "rollout-n1-0")
    step_until(a, lambda: live(a, "other-n1-0"), what="the waiting worker", check=lambda: one_worker_per_slot(a))
    assert process_start(pid) is None            # it started only after the first one exited
    gone = json.loads(r.hget(agent_desired(NODE), worker_key(JOB, "rollout-n1-0")))
    assert gone["state"] == "gone"
    # a late retry of the old ensure (an older seq) cannot bring the drained worker back
    actions.queue(r, NODE).enqueue_job(Job.fetch(first.id, connection=r, serializer=first.serializer))
    a.step()
    assert json.loads(r.hget(agent_desired(NODE), worker_key(JOB, "rollout-n1-0")))["state"] == "gone"


def test_actions_of_a_fenced_controller_are_ignored(r, redis_url, tmp_path, stop_agents):
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    r.set(CONTROLLER_EPOCH, 5)
    job = actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]), epoch=4)
    a.jobs.run_pending()
    assert r.hget(agent_desired(NODE), worker_key(JOB, "rollout-n1-0")) is None
    assert Job.fetch(job.id, connection=r, serializer=job.serializer).return_value().startswith("ignored")
    bad = actions.ensure(r, NODE, spec(run_dir, "rollout-n1-9", [9]), epoch=5)   # no slot 9 here
    a.jobs.run_pending()
    assert r.hget(agent_desired(NODE), worker_key(JOB, "rollout-n1-9")) is None
    assert Job.fetch(bad.id, connection=r, serializer=bad.serializer).get_status() in ("scheduled", "failed")


@pytest.mark.parametrize("died", ["dequeued", "started"])
def test_an_action_a_killed_agent_took_and_did_not_finish_is_run_by_the_next_agent(r, redis_url, tmp_path,
                                                                                    stop_agents, died):
    """An agent SIGKILLed after rq took a job off its queue (into the intermediate list) or began it (the
    started registry) leaves it there; the next agent of the node puts it back and runs it."""
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url)
    job = actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    taken, queue = a.jobs.dequeue()
    assert taken.id == job.id
    if died == "started":
        a.jobs.worker.prepare_execution(taken)    # what rq's execute_job does before the action runs
        a.jobs.worker.prepare_job_execution(taken, remove_from_intermediate_queue=True)
        assert job.id in queue.started_job_registry.get_job_ids(cleanup=False)
    r.delete(agent_lock(NODE))    # the agent dies here: nothing written, its lock expires
    assert not r.hexists(agent_desired(NODE), worker_key(JOB, "rollout-n1-0"))
    b = make_agent(r, redis_url)
    stop_agents.append(b)
    assert b.jobs.run_pending() == 1
    assert json.loads(r.hget(agent_desired(NODE), worker_key(JOB, "rollout-n1-0")))["state"] == agent_mod.STATE_RUN
    assert Job.fetch(job.id, connection=r, serializer=job.serializer).get_status() == "finished"
    assert not queue.intermediate_queue.get_job_ids() and not queue.started_job_registry.get_job_ids(cleanup=False)


def test_restart_action_bumps_the_generation_once(r, redis_url, tmp_path, stop_agents):
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    key = worker_key(JOB, "rollout-n1-0")
    actions.restart(r, NODE, JOB, "rollout-n1-0")          # nothing desired yet: no-op
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    first = actions.restart(r, NODE, JOB, "rollout-n1-0")
    a.jobs.run_pending()
    assert json.loads(r.hget(agent_desired(NODE), key))["generation"] == 1
    actions.queue(r, NODE).enqueue_job(Job.fetch(first.id, connection=r, serializer=first.serializer))
    a.jobs.run_pending()                                         # the same action retried: still 1
    assert json.loads(r.hget(agent_desired(NODE), key))["generation"] == 1


@pytest.mark.slow
def test_crashed_worker_restarts_with_backoff(r, redis_url, tmp_path, stop_agents):
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url, backoff_s=(0.3, 5.0))
    stop_agents.append(a)
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    key = worker_key(JOB, "rollout-n1-0")
    pids = [step_until(a, lambda: live(a, "rollout-n1-0"), what="the worker").pid]
    waits = []
    for n in (1, 2):
        os.kill(pids[-1], signal.SIGKILL)         # a crash (the test kills it, not the agent)
        step_until(a, lambda: key not in a.procs, what="the crash to be seen")
        b = a.backoff[key]
        waits.append(b.next_at - time.time())
        assert b.restarts == n
        pids.append(step_until(a, lambda: live(a, "rollout-n1-0"), what=f"restart {n}").pid)
    assert len(set(pids)) == 3
    assert waits[1] > waits[0]                     # the back-off grows
    events = [e["event"] for e in log_events(r)]
    assert events.count("spawned") == 3 and "sigkill" not in events and "sigterm" not in events


@pytest.mark.slow
def test_a_restarted_agent_keeps_the_back_off_of_a_crash_looping_worker(r, redis_url, tmp_path, stop_agents):
    """The back-off is on record in Redis: an agent that restarts while a worker waits out its back-off
    waits the rest of it, instead of starting the worker again at once."""
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url, backoff_s=(30.0, 60.0))
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    key = worker_key(JOB, "rollout-n1-0")
    os.kill(step_until(a, lambda: live(a, "rollout-n1-0"), what="the worker").pid, signal.SIGKILL)
    step_until(a, lambda: key not in a.procs, what="the crash to be seen")
    assert a.backoff[key].restarts == 1
    r.delete(agent_lock(NODE))    # the agent dies (its lock expires) while the worker waits out 30 s
    b = make_agent(r, redis_url, backoff_s=(30.0, 60.0))
    stop_agents.append(b)
    assert b.backoff[key] == a.backoff[key]
    for _ in range(20):
        b.step()
        time.sleep(0.05)
    assert key not in b.procs and [e["event"] for e in log_events(r)].count("spawned") == 1
    b.backoff[key].next_at = time.time()    # the wait is over: started again, and a next crash waits longer
    pid = step_until(b, lambda: live(b, "rollout-n1-0"), what="the restart").pid
    os.kill(pid, signal.SIGKILL)
    step_until(b, lambda: key not in b.procs, what="the second crash to be seen")
    assert b.backoff[key].restarts == 2
    assert json.loads(r.hget(agent_backoff(NODE), key))["restarts"] == 2


@pytest.mark.slow
def test_a_worker_whose_every_start_fails_fails_its_run_and_a_kill_does_not_count(r, redis_url, tmp_path,
                                                                                    stop_agents):
    """The agent counts the exits in a row with an error code; ``libra-ctl run`` fails on a worker that has
    made ``CRASH_LOOP`` of them (its agent would restart it forever, and the run wait forever), with the
    worker's last output. A SIGKILL (chaos) is not such an exit: it resets the count (one by the OOM killer is:
    ``test_agent_faults``)."""
    from pipeline import config as config_mod
    from pipeline.run import CRASH_LOOP, Orchestrator, RunFailed, crash_records

    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url, backoff_s=(0.05, 0.1))
    stop_agents.append(a)
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    key = worker_key(JOB, "rollout-n1-0")
    os.kill(step_until(a, lambda: live(a, "rollout-n1-0"), what="the worker").pid, signal.SIGKILL)
    step_until(a, lambda: key in a.backoff and key not in a.procs, what="the kill to be seen")
    assert a.backoff[key].restarts == 1 and a.backoff[key].failures == 0 and a.backoff[key].code == -9
    manifest = Path(run_dir) / "manifest.json"
    manifest.write_text(manifest.read_text()[:20])   # every start now fails reading it: exit 1
    orch = Orchestrator(config_mod.load(None, [f"job.name={JOB}"]), Path(run_dir), r, redis_url)
    orch.check_crash_loops()   # what it finds first is its base: a resume starts counting afresh
    step_until(a, lambda: a.backoff[key].failures >= CRASH_LOOP, timeout_s=120, what="five failed starts")
    assert a.backoff[key].code == 1
    assert crash_records(r, JOB, Path(run_dir))["rollout-n1-0"]["failures"] >= CRASH_LOOP
    with pytest.raises(RunFailed, match=r"rollout-n1-0 failed \d+ times in a row \(exit code 1"):
        orch.check_crash_loops()
    resumed = Orchestrator(config_mod.load(None, [f"job.name={JOB}"]), Path(run_dir), r, redis_url)
    resumed.check_crash_loops()   # the same records: nothing failed since it started
    assert crash_records(r, JOB, tmp_path / "another-run") == {}   # another run's record: not ours


def test_an_exit_seen_while_redis_fails_is_booked_on_the_next_pass(r, redis_url, tmp_path, stop_agents,
                                                                   monkeypatch):
    """An adopted learner's exit is judged by reading its job's phase; a Redis error right there must not
    forget the process unjudged (its crash's back-off lost): the next pass books it."""
    run_dir = sim_job(r, redis_url, tmp_path)
    key, s = worker_key(JOB, "learner-0"), {**spec(run_dir, "learner-0", [0], role="learner"), "generation": 0}
    learner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        r.hset(agent_procs(NODE), key, json.dumps({**s, "node": NODE, "pid": learner.pid,
                                                    "start": process_start(learner.pid),
                                                    "started_at": time.time(), "state": "running"}))
        a = make_agent(r, redis_url)
        stop_agents.append(a)
        assert a.procs[key].popen is None     # adopted: its exit code is not ours to read
        learner.kill()
        learner.wait()
        desired = {key: {**s, "state": agent_mod.STATE_RUN, "seq": 7}}
        real, calls = a.job_run, []

        def fails_once(job, runs):
            calls.append(job)
            if len(calls) == 1:
                raise redis.ConnectionError("Redis went away")
            return real(job, runs)

        monkeypatch.setattr(a, "job_run", fails_once)
        with pytest.raises(redis.ConnectionError):
            a.reap(desired)
        assert key in a.procs                  # not forgotten
        a.reap(desired)
        assert key not in a.procs and a.backoff[key].restarts == 1
        assert [e["event"] for e in log_events(r) if e["key"] == key] == ["exited"]
    finally:
        learner.kill()
        learner.wait()


@pytest.mark.slow
def test_worker_that_exits_cleanly_is_not_restarted(r, redis_url, tmp_path, stop_agents):
    run_dir = sim_job(r, redis_url, tmp_path)
    r.hset(JobKeys(JOB).state, "phase", "trained")    # a feeder of a trained job exits 0 at once
    a = make_agent(r, redis_url, backoff_s=(0.1, 0.1))
    stop_agents.append(a)
    actions.ensure(r, NODE, spec(run_dir, "feeder-0", [], role="feeder"))
    step_until(a, lambda: any(e["event"] == "exited" for e in log_events(r)), what="the feeder to exit")
    for _ in range(10):
        a.step()
        time.sleep(0.05)
    assert [e["event"] for e in log_events(r)].count("spawned") == 1


def test_desired_workers_of_a_finished_job_are_not_started(r, redis_url, tmp_path, stop_agents):
    run_dir = sim_job(r, redis_url, tmp_path)
    r.hset(JobKeys(JOB).state, "phase", "done")
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    for _ in range(5):
        a.step()
    assert r.hget(agent_desired(NODE), worker_key(JOB, "rollout-n1-0")) and not a.procs
    assert not log_events(r)


def test_the_workers_of_a_job_that_is_over_are_drained_though_no_drain_came(r, redis_url, tmp_path, stop_agents):
    """The controller drains a finished job on the agents it sees; an agent away at that moment still has the
    job's workers desired to run when it is back, and must stop them rather than hold their slots for good."""
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url, grace_s=5.0)
    stop_agents.append(a)
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    actions.ensure(r, NODE, spec(run_dir, "learner-0", [1], role="learner"))
    step_until(a, lambda: live(a, "rollout-n1-0") and live(a, "learner-0"), what="both workers")
    r.hset(JobKeys(JOB).state, "phase", "done")
    step_until(a, lambda: not a.procs, 20, "the finished job's workers to exit")
    for _ in range(5):
        a.step()
    assert not a.procs and not a.busy_slots()
    assert sorted(e["key"] for e in log_events(r) if e["event"] == "sigterm") == sorted(
        worker_key(JOB, w) for w in ("learner-0", "rollout-n1-0"))   # drained, not left to die


@pytest.mark.slow
def test_drain_kills_after_grace_and_hands_pending_work_over(r, redis_url, tmp_path, stop_agents):
    # a call of one group takes ~4 s: the worker cannot finish it within the grace
    run_dir = sim_job(r, redis_url, tmp_path, time_scale=1.0,
                      rollout={"decode_tokens_per_s": 25.0, "weight_sync_s": 0.0})
    keys = JobKeys(JOB)
    a = make_agent(r, redis_url, grace_s=0.5)
    stop_agents.append(a)
    for w, s in (("rollout-n1-0", 0), ("rollout-n1-1", 1)):
        actions.ensure(r, NODE, spec(run_dir, w, [s]))
    step_until(a, lambda: all(r.hget(keys.workers, w) for w in ("rollout-n1-0", "rollout-n1-1")),
               what="both workers registered")
    r.xadd(keys.prompts, {messages.FIELD: messages.encode(messages.Prompt("p0", "Q", 1, time.time()))})
    holder = step_until(a, lambda: next((c["name"].decode() for c in r.xinfo_consumers(keys.prompts, GROUP_ROLLOUT)
                                         if c["pending"]), None), what="a worker to take the prompt")
    actions.drain(r, NODE, JOB, holder)
    step_until(a, lambda: worker_key(JOB, holder) not in a.procs, what="the drained worker to be reaped")
    events = log_events(r)
    assert [e["event"] for e in events if e["key"] == worker_key(JOB, holder)][-3:] == ["sigterm", "sigkill", "exited"]
    # its prompt went to the other worker, which generates it: nothing lost
    step_until(a, lambda: r.xlen(keys.rollouts) == 1, 60, "the other worker to generate the handed-over prompt")
    assert group_pending(r, keys.prompts, GROUP_ROLLOUT) == 0


def test_every_pending_entry_of_an_exited_worker_is_handed_over_past_one_listing(r):
    """More entries pending than one XPENDING listing returns (10,000): all go to the live worker before the
    exited one's consumer is deleted (deleting it drops what it holds from the pending list: lost)."""
    keys = JobKeys(JOB)
    ensure_groups(r, keys)
    n = agent_mod.HAND_OVER_PAGE + 5
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(keys.rollouts, {"i": i})
    pipe.execute()
    r.xreadgroup(GROUP_REWARD, "reward-n1-0", {keys.rollouts: ">"}, count=n)
    r.hset(keys.workers, "reward-n1-1", json.dumps({"id": "reward-n1-1", "role": "reward", "state": "running",
                                                    "heartbeat": time.time()}))
    assert hand_over_pending(r, JOB, "reward", "reward-n1-0") == n
    consumers = {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(keys.rollouts, GROUP_REWARD)}
    assert consumers == {"reward-n1-1": n} and group_pending(r, keys.rollouts, GROUP_REWARD) == n


@pytest.mark.slow
def test_restarted_agent_adopts_its_workers_and_stops_only_its_own(r, redis_url, tmp_path, stop_agents):
    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url)
    actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    pid = step_until(a, lambda: live(a, "rollout-n1-0"), what="the worker").pid
    # a process that is not ours, recorded under a worker key with its pid but another start time
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        forged = {"job": JOB, "worker": "rollout-n1-1", "role": "rollout", "slots": [1], "backend": "sim",
                  "generation": 0, "node": NODE, "pid": stranger.pid, "start": process_start(stranger.pid) + 1,
                  "started_at": time.time(), "state": "running"}
        r.hset(agent_procs(NODE), worker_key(JOB, "rollout-n1-1"), json.dumps(forged))
        # the agent dies without stopping anything; its lock expires
        r.delete(agent_lock(NODE))
        b = make_agent(r, redis_url)
        stop_agents.append(b)
        assert list(b.procs) == [worker_key(JOB, "rollout-n1-0")] and b.procs[worker_key(JOB, "rollout-n1-0")].pid == pid
        actions.drain(r, NODE, JOB, "rollout-n1-1")      # drain the stranger's key: nothing to signal
        actions.drain(r, NODE, JOB, "rollout-n1-0")
        step_until(b, lambda: not b.procs, what="the adopted worker to be drained")
        assert process_start(pid) is None and stranger.poll() is None
        signalled = {int(e["pid"]) for e in log_events(r) if e["event"] in ("sigterm", "sigkill")}
        spawned = {int(e["pid"]) for e in log_events(r) if e["event"] == "spawned"}
        assert signalled == {pid} and signalled <= spawned
        b.shutdown(timeout_s=5)
        stop_agents.remove(b)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize("phase, finished", [("trained", True), ("done", True), ("running", False)])
def test_an_adopted_learner_that_exits_after_its_last_step_is_not_restarted(r, redis_url, tmp_path, stop_agents,
                                                                            phase, finished):
    """A restarted agent cannot read an adopted process's exit code: a learner that leaves once its job is
    trained finished; one that leaves while the job still runs crashed and is restarted."""
    run_dir = sim_job(r, redis_url, tmp_path)
    key, s = worker_key(JOB, "learner-0"), {**spec(run_dir, "learner-0", [0], role="learner"), "generation": 0}
    learner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        record = {**s, "node": NODE, "pid": learner.pid, "start": process_start(learner.pid),
                  "started_at": time.time(), "state": "running"}
        r.hset(agent_procs(NODE), key, json.dumps(record))
        a = make_agent(r, redis_url)
        stop_agents.append(a)
        assert a.procs[key].popen is None     # adopted, not started by this agent
        r.hset(JobKeys(JOB).state, "phase", phase)
        learner.kill()
        learner.wait()
        a.reap({key: {**s, "state": agent_mod.STATE_RUN, "seq": 7}})
        assert key not in a.procs
        assert (a.completed.get(key) == 7) is finished and (key in a.backoff) is not finished
        assert [e["event"] for e in log_events(r) if e["key"] == key] == ["exited"]   # nothing spawned
    finally:
        learner.kill()
        learner.wait()


def test_no_learner_is_started_for_a_job_whose_training_is_done(r, redis_url, tmp_path, stop_agents):
    """An agent started after the learner exited 0 has no record of that exit; the job's phase says it."""
    run_dir = sim_job(r, redis_url, tmp_path)
    r.hset(JobKeys(JOB).state, "phase", "trained")
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    key = worker_key(JOB, "learner-0")
    a.drive({key: {**spec(run_dir, "learner-0", [0], role="learner"), "generation": 0,
                   "state": agent_mod.STATE_RUN, "seq": 3}})
    assert key not in a.procs and not [e for e in log_events(r) if e["key"] == key]


def test_an_action_an_outage_cut_off_is_run_once_redis_is_back(r, redis_url, tmp_path, stop_agents, monkeypatch):
    """Redis goes away while the agent's rq worker holds a control job (taken off the queue, not finished):
    once Redis answers again the agent puts the job back and runs it. Before, it stayed in rq's intermediate
    list until the agent restarted, and the worker it asked for never started."""
    import threading

    import redis as redis_mod

    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url)
    stop_agents.append(a)
    job = actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    real_step, calls = a.step, []

    def step_cut_off():
        calls.append(1)
        if len(calls) == 1:
            a.jobs.dequeue()                                   # rq took the job ...
            raise redis_mod.ConnectionError("Redis went away")  # ... and the connection dropped
        real_step()
        if r.hexists(agent_desired(NODE), worker_key(JOB, "rollout-n1-0")):
            a.stop_event.set()

    monkeypatch.setattr(a, "step", step_cut_off)
    monkeypatch.setattr(a, "shutdown", lambda: None)
    t = threading.Thread(target=a.run, daemon=True)
    t.start()
    t.join(30)
    a.stop_event.set()
    t.join(10)
    assert json.loads(r.hget(agent_desired(NODE), worker_key(JOB, "rollout-n1-0")))["state"] == agent_mod.STATE_RUN
    assert Job.fetch(job.id, connection=r, serializer=job.serializer).get_status() == "finished"
