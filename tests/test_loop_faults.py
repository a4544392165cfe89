"""The controller's loop and observer under changes of mind, long histories, restores and resumes.

A worker drained and placed again is started again at once; a controller
started on a long history sees no old learner step as new; a learner restore
counts the steps it will train again; a resumed job is observed from its
resume; a lease lapsed or lost mid-tick starts the jobs' memory afresh.
Against the suite's Redis, with a fake agent (``tests.test_controller``).
"""

from __future__ import annotations

import json
import time

from pipeline.control.allocation import pin, read_placement
from pipeline.control.allocator import Allocation
from pipeline.control.job import load_job
from pipeline.control.loop import Controller
from pipeline.control.observer import Observer
from pipeline.dataplane.keys import JobKeys, agent_desired

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_controller import fake_agent
    from tests.test_sim_workers import sim_job
except ModuleNotFoundError:
    from test_controller import fake_agent
    from test_sim_workers import sim_job

JOB = "simtest"


def _state(r, node: str, worker: str) -> str:
    return json.loads(r.hget(agent_desired(node), f"{JOB}/{worker}"))["state"]


def test_a_worker_scaled_down_then_up_again_is_started_again_at_once(r, redis_url, tmp_path):
    """``scale rollout=2``, ``rollout=1``, ``rollout=2`` a tick apart (an operator correcting himself): the
    third tick places rollout-n1-1 again and ensures it at once. Before, the ensure was taken for a resend
    of the first tick's (less than RESEND_S ago; the drain in between did not count): the agent's desired
    state stayed "drain" while the placement said the worker ran."""
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    pin(r, JOB, {"rollout": 2, "learner": 1})
    ctl.tick()
    agent.run_pending()
    assert _state(r, "n1", "rollout-n1-1") == "run"
    pin(r, JOB, {"rollout": 1, "learner": 1})
    ctl.tick()
    agent.run_pending()
    assert _state(r, "n1", "rollout-n1-1") == "drain"
    pin(r, JOB, {"rollout": 2, "learner": 1})
    ctl.tick()
    agent.run_pending()
    assert "rollout-n1-1" in read_placement(r, JOB)            # the controller placed it again ...
    assert _state(r, "n1", "rollout-n1-1") == "run"            # ... but never told the agent (still "drain")


def test_a_controller_that_starts_on_a_long_history_sees_no_old_learner_step_as_new(r, redis_url, tmp_path):
    """A fresh observer (a controller restarted, or one that took the lease over) on a job with 10,005 learner
    steps on record knows step 10,005 at its first tick, and its second tick sees no step as new. Before,
    it read 10,000 records a tick: the first stopped at step 10,000 and the second took 5 old steps for
    fresh measurements of the learner."""
    sim_job(r, redis_url, tmp_path)
    keys = JobKeys(JOB)
    pipe = r.pipeline(transaction=False)
    for i in range(1, 10_006):
        pipe.xadd(keys.metrics, {"kind": "learner_step", "data": json.dumps(
            {"step": i, "trajectories": 8, "train_s": 1.0, "gpus": 1, "at": 1.0})})
    pipe.execute()
    obs = Observer(load_job(r, JOB))
    obs.tick(r, 1000.0)
    assert obs.step == 10_005
    second = obs.tick(r, 1010.0)                      # nothing was written in between
    assert second.steps == []


def test_remaining_work_counts_the_steps_a_learner_restore_will_train_again(r, redis_url, tmp_path):
    """A learner that reached step 10 and restored its step-5 checkpoint records steps 6 and 7 again: the
    observer's step is 7, so the remaining work counts the steps to train again. Before, it kept the
    maximum (10) and the job looked nearer its end than it was (pacing, horizon, the cadence's check)."""
    sim_job(r, redis_url, tmp_path)
    keys, info = JobKeys(JOB), load_job(r, JOB)
    obs = Observer(info)
    obs.tick(r, 1000.0)
    for i in range(1, 11):
        r.xadd(keys.metrics, {"kind": "learner_step", "data": json.dumps(
            {"step": i, "trajectories": 8, "train_s": 1.0, "at": 1000.0 + i})})
    obs.tick(r, 1010.0)
    for i in (6, 7):                                  # restored from step 5's checkpoint
        r.xadd(keys.metrics, {"kind": "learner_step", "data": json.dumps(
            {"step": i, "trajectories": 8, "train_s": 1.0, "at": 1020.0 + i})})
    obs.tick(r, 1030.0)
    m = obs.metrics(Allocation(1, 1), 1e9, None, learner_slots=1)
    assert info.steps > 10
    assert (m.remaining, m.learner_steps) == ((info.steps - 7) * info.batch_size, 7)


def test_a_resumed_job_is_observed_from_its_resume_not_across_its_stop(r, redis_url, tmp_path):
    """A job stopped (the controller drains it) and resumed an hour later under the same run directory is
    observed from its resume: two ticks 10 s apart give a 10 s window. Before, the window started at the
    last tick before the stop, and the allocator averaged waits and counters over the hour down."""
    sim_job(r, redis_url, tmp_path)
    fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    assert ctl.lease.acquire()
    from pipeline.control.allocation import live_agents
    nodes = live_agents(r)
    t0 = time.time()
    for t in (t0, t0 + 10):
        assert ctl.observe(JOB, nodes, {}, t) is not None
    r.hset(JobKeys(JOB).state, "phase", "stopped")
    assert ctl.observe(JOB, nodes, {}, t0 + 20) is None        # the job is drained
    r.hset(JobKeys(JOB).state, "phase", "running")             # libra-ctl resume, an hour later
    ctl.observe(JOB, nodes, {}, t0 + 3600)
    view = ctl.observe(JOB, nodes, {}, t0 + 3610)
    assert view.metrics.window_s <= 10.0 + 1e-6


def test_a_lease_that_lapsed_and_was_taken_back_in_one_tick_starts_the_jobs_memory_afresh(r, redis_url, tmp_path):
    """A controller whose lease lapsed (a stall past its TTL) and which takes it back at its next tick may
    have been replaced meanwhile: it starts its jobs' memory (sent actions, observations) afresh, as when it
    takes the lease back a tick later. Before, a lease taken back at once kept the old memory."""
    from pipeline.control.loop import Controller

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    pin(r, JOB, {"rollout": 2, "learner": 1})
    ctl.tick()
    before = ctl.jobs[JOB]
    r.delete(ctl.lease.key)   # lapsed
    assert ctl.tick() is True
    assert ctl.jobs[JOB] is not before


def test_a_lease_lost_while_finishing_a_job_ends_the_tick(r, redis_url, tmp_path, monkeypatch):
    """Finishing a job drains it under the lease; a lease lost there (``LeaseLost``) ends the tick with the
    jobs' memory cleared, as it does while reconciling. Before, it was caught as a failed reconcile
    (``LeaseLost`` is a ValueError) and the tick went on acting."""
    from pipeline.control.loop import Controller, LeaseLost

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    pin(r, JOB, {"rollout": 2, "learner": 1})
    ctl.tick()
    r.hset(JobKeys(JOB).state, "phase", "done")

    def lost(jc):
        raise LeaseLost("lost the controller lease while acting")

    monkeypatch.setattr(ctl, "finish", lost)
    assert ctl.tick() is False and not ctl.jobs


def test_a_pin_made_while_the_controller_first_sees_the_job_is_kept(r, redis_url, tmp_path, monkeypatch):
    """`libra-ctl scale` right as a job starts: the pin lands between the controller reading the job's
    allocation (none yet) and creating it from the config. The creation is one transaction that sees the
    pin and keeps it. Before, the controller's write set the config's mode (auto) over it: the pin was lost."""
    from pipeline.control import loop as loop_mod

    sim_job(r, redis_url, tmp_path)                        # an auto job (the config's mode)
    fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    reads = []

    def read_then_pin(rr, job):
        got = real(rr, job)
        if not reads:                                       # the operator's pin, just after the first read
            reads.append(1)
            pin(r, JOB, {"rollout": 3, "learner": 1})
        return got

    real = loop_mod.get_allocation
    monkeypatch.setattr(loop_mod, "get_allocation", read_then_pin)
    ctl.tick()
    alloc = real(r, JOB)
    assert alloc["mode"] == "pinned" and alloc["pinned"]["rollout"] == 3, alloc


def test_a_decision_whose_event_could_not_be_written_is_recorded_by_the_next_tick(r, redis_url, tmp_path,
                                                                                  monkeypatch):
    """A tick that commits a pinned target and then fails to write its event (Redis went away between the two)
    records that event on its next tick. Before, the next tick found the target already committed ("nothing
    new"), and `libra-ctl events` never showed the change."""
    import redis as redis_mod

    from pipeline.control import loop as loop_mod
    from pipeline.control.events import read_events

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    agent.run_pending()
    pin(r, JOB, {"rollout": 2, "learner": 1})
    real, fails = loop_mod.record_event, []

    def lost(rr, info, event):
        if event.get("kind") == "pinned" and not fails:
            fails.append(1)
            raise redis_mod.ConnectionError("Redis went away")
        return real(rr, info, event)

    monkeypatch.setattr(loop_mod, "record_event", lost)
    try:
        ctl.tick()
    except redis_mod.ConnectionError:
        pass
    ctl.tick()
    pinned = [e for e in read_events(r, JOB) if e.get("kind") == "pinned" and e.get("to", {}).get("rollout") == 2]
    assert pinned, [e.get("kind") for e in read_events(r, JOB)]
