"""Follow-ups of this session's fixes, at their edges: the controller's unwritten events (two failures in a
row, a job that ends first), an agent's recovery after an outage in which it lost its node, a cut metrics line
that held a nested object, two reclaimers of one deleted entry, and an older tracking state.

Against the suite's Redis (the ``r`` fixture).
"""

from __future__ import annotations

import json
import time

import pytest
import redis as redis_mod

from pipeline.control import actions
from pipeline.control.allocation import pin
from pipeline.control.loop import Controller
from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_REWARD, JobKeys, agent_lock
from pipeline.dataplane.streams import ClaimPolicy, ensure_groups, read, reclaim

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_controller import fake_agent
    from tests.test_sim_workers import sim_job
    from tests.test_streams import unscored_group
except ModuleNotFoundError:
    from test_controller import fake_agent
    from test_sim_workers import sim_job
    from test_streams import unscored_group

JOB = "simtest"


# --- controller: the `unwritten` event --------------------------------------------------------------------------


def _pinned_events(r, rollout: int) -> list[dict]:
    from pipeline.control.events import read_events

    return [e for e in read_events(r, JOB, last=200)
            if e.get("kind") == "pinned" and e.get("to", {}).get("rollout") == rollout]


def test_a_tick_whose_replay_of_an_unwritten_event_fails_keeps_its_own_event(r, redis_url, tmp_path, monkeypatch):
    """Redis fails the event write of two ticks in a row, each of which acted: both events are written, in
    order, once it answers. Before, the second tick's replay of the first's event raised before its own was
    kept: the pin to rollout=3, which the agents were sent, never reached the events."""
    from pipeline.control import loop as loop_mod

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    agent.run_pending()
    real, fails = loop_mod.record_event, []

    def flaky(rr, info, event):
        if event.get("kind") == "pinned" and event.get("to", {}).get("rollout") == 2 and len(fails) < 2:
            fails.append(1)
            raise redis_mod.ConnectionError("Redis went away")
        return real(rr, info, event)

    monkeypatch.setattr(loop_mod, "record_event", flaky)
    pin(r, JOB, {"rollout": 2, "learner": 1})
    with pytest.raises(redis_mod.ConnectionError):
        ctl.tick()                     # acts (rollout=2), the event write fails
    agent.run_pending()
    pin(r, JOB, {"rollout": 3, "learner": 1})
    with pytest.raises(redis_mod.ConnectionError):
        ctl.tick()                     # acts (rollout=3), the replay of the first event fails
    agent.run_pending()
    ctl.tick()
    ctl.tick()
    assert _pinned_events(r, 2), "the first tick's event was never written"
    assert _pinned_events(r, 3), "the second tick acted (rollout=3) and its event was lost"


def test_an_unwritten_event_is_written_though_the_job_ended_before_the_next_tick(r, redis_url, tmp_path,
                                                                                monkeypatch):
    """A tick acts, its event write fails, and the job ends before the next tick: the event is written as the
    job is finished. Before, the job's memory went with it unwritten."""
    from pipeline.control import loop as loop_mod

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    agent.run_pending()
    real, fails = loop_mod.record_event, []

    def lost(rr, info, event):
        if event.get("kind") == "pinned" and not fails:
            fails.append(1)
            raise redis_mod.ConnectionError("Redis went away")
        return real(rr, info, event)

    monkeypatch.setattr(loop_mod, "record_event", lost)
    pin(r, JOB, {"rollout": 2, "learner": 1})
    with pytest.raises(redis_mod.ConnectionError):
        ctl.tick()
    r.hset(JobKeys(JOB).state, "phase", "done")
    ctl.tick()
    assert _pinned_events(r, 2), "the acted-on decision's event was dropped when the job ended"


# --- agent: recovery after an outage while another agent holds the node ------------------------------------------


def test_an_agent_that_lost_its_node_lock_in_an_outage_does_not_requeue_the_new_holders_job(r, redis_url,
                                                                                          tmp_path, monkeypatch):
    """During a Redis outage longer than the lock's TTL another agent took the node name and is running a
    control job. When Redis answers, the old agent finds its lock lost before it touches the queue, and
    exits. Before, it ran ``recover()`` first and put the new holder's job back on the queue: run twice."""
    from pipeline.control import agent as agent_mod

    try:
        from tests.test_agent import NODE, make_agent, spec
    except ModuleNotFoundError:
        from test_agent import NODE, make_agent, spec

    run_dir = sim_job(r, redis_url, tmp_path)
    a = make_agent(r, redis_url)
    job = actions.ensure(r, NODE, spec(run_dir, "rollout-n1-0", [0]))
    # the outage: a's lock expires, another agent takes the node and its rq worker takes the job
    r.delete(agent_lock(NODE))
    r.set(agent_lock(NODE), "otherhost:4242:feedbeef")
    other = agent_mod.ControlJobRunner(r, NODE)
    assert other.dequeue() is not None
    queue = actions.queue(r, NODE)
    assert job.id not in queue.get_job_ids()
    real_step, calls = a.step, []

    def step_after_outage():
        calls.append(1)
        if len(calls) == 1:
            raise redis_mod.ConnectionError("Redis went away")
        a._last_beat = 0.0   # the outage outlasted a heartbeat period: the lock is checked
        real_step()

    monkeypatch.setattr(a, "step", step_after_outage)
    monkeypatch.setattr(a, "shutdown", lambda: None)
    with pytest.raises(SystemExit):
        a.run()
    assert job.id not in queue.get_job_ids(), "the agent that lost the lock requeued the new holder's job"


# --- metrics.jsonl: a cut line followed by the next writer's line -------------------------------------------------


def test_read_jsonl_recovers_the_record_after_a_cut_line_holding_a_nested_object(tmp_path):
    """A writer died mid-line after a nested object (``staleness_hist``); the next writer's whole line follows
    on the same line: that record is read. Before, the nested object decoded first, text followed it, and
    the reader gave up."""
    from pipeline.observe.measures import read_jsonl

    whole = {"kind": "learner_step", "step": 2, "staleness_hist": {"0": 5}, "loss": 0.1}
    cut = json.dumps({"kind": "learner_step", "step": 1, "staleness_hist": {"0": 3}, "loss": 0.2})[:-12]
    path = tmp_path / "metrics.jsonl"
    path.write_text(cut + json.dumps(whole) + "\n")
    assert read_jsonl(path, "learner_step") == [whole]


# --- a stage's reclaim of an entry deleted while pending ---------------------------------------------------------


class _Interleaved:
    """A Redis client whose ``xpending_range`` runs ``between`` once its answer is in (another worker acting
    between this worker's listing of the idle entries and its XCLAIM)."""

    def __init__(self, r, between):
        self._r, self._between = r, between

    def __getattr__(self, name):
        return getattr(self._r, name)

    def xpending_range(self, *args, **kwargs):
        out = self._r.xpending_range(*args, **kwargs)
        between, self._between = self._between, None
        if between:
            between()
        return out


def test_two_reclaimers_of_a_deleted_pending_entry_dead_letter_it_once(r):
    """Two reward workers scan for idle entries at the same time and both list an entry deleted from the stream
    while pending: it is dead-lettered once (only the worker whose XACK removed it writes the dead letter).
    Before, the second dead-lettered it again: twice in the dead-letter stream, two groups out of flight."""
    keys = JobKeys("t")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    r.hset(keys.counters, mapping={"issued": 4, "generated": 4})
    ids = [r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(str(i)))}) for i in range(2)]
    read(r, keys.rollouts, GROUP_REWARD, "reward-0", 2, 10)   # reward-0 holds both, then dies
    r.xdel(keys.rollouts, ids[0])
    time.sleep(0.05)
    policy = ClaimPolicy(min_idle_ms=10, max_deliveries=5)

    def other_worker():
        reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-2", policy, 1, "0-0")

    reclaim(_Interleaved(r, other_worker), keys, keys.rollouts, GROUP_REWARD, "reward-1", policy, 1, "0-0")
    dead = [f[b"id"] for _i, f in r.xrange(keys.dead_letters)]
    assert dead == [ids[0]], f"dead-lettered {len(dead)} times"
    assert int(r.hget(keys.counters, "dead_lettered")) == 2


# --- tracking: an older state's `described: true` ------------------------------------------------------------------


def test_a_resumed_run_whose_old_state_says_described_describes_a_tensorboard_it_never_had(tmp_path):
    """An older tracking state says ``described: true`` whatever sinks its first start had. Resumed with
    TensorBoard on, a run whose directory holds no event files gets the run's name and config. Before,
    the True stood for every sink, and TensorBoard never got them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipeline.config import load
    from pipeline.observe.tracking import Tracker

    run_dir = tmp_path / "runs" / "20260101-000000-t"
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"created_at": 1_700_000_000.0}))
    # what the older code saved after a start with tracking.tensorboard=false and no W&B
    (run_dir / "tracking.json").write_text(json.dumps({"offset": 0, "eval_cursor": "0-0", "t0": 1_700_000_000.0,
                                                       "wandb_id": None, "described": True}))
    Tracker(load(None, ["job.name=t", "job.seed=3", "tracking.wandb=off"]), run_dir).close()
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()
    assert "run/text_summary" in ea.Tags()["tensors"], ea.Tags()
