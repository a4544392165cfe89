"""Follow-ups of this session's fixes, third pass: controller events across a lost lease and written late, and
a run of an experiment that could not start. Against the suite's Redis (the ``r`` fixture).
"""

from __future__ import annotations

import errno
import json
import time

import pytest
import redis as redis_mod

from pipeline import experiment as ex
from pipeline.control.allocation import pin
from pipeline.control.loop import Controller
from pipeline.dataplane.keys import CONTROLLER_LEASE

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests import test_experiment
    from tests.test_controller import fake_agent
    from tests.test_sim_workers import sim_job
except ModuleNotFoundError:
    import test_experiment
    from test_controller import fake_agent
    from test_sim_workers import sim_job

QUICK = test_experiment.QUICK
fake_runs = test_experiment.fake_runs
JOB = "simtest"


def _pinned(r, rollout: int) -> list[dict]:
    from pipeline.control.events import read_events

    return [e for e in read_events(r, JOB, last=200)
            if e.get("kind") == "pinned" and e.get("to", {}).get("rollout") == rollout]


def _fail_first_write_of_pin(monkeypatch, rollout: int):
    from pipeline.control import loop as loop_mod

    real, fails = loop_mod.record_event, []

    def flaky(rr, info, event):
        if event.get("kind") == "pinned" and event.get("to", {}).get("rollout") == rollout and not fails:
            fails.append(time.time())
            raise redis_mod.ConnectionError("Redis went away")
        return real(rr, info, event)

    monkeypatch.setattr(loop_mod, "record_event", flaky)
    return fails


# --- controller: an acted-on event whose write failed is dropped when the outage outlasts the lease ----------


def test_an_unwritten_event_survives_an_outage_longer_than_the_lease(r, redis_url, tmp_path, monkeypatch):
    """A tick sends a pin's orders, then its event write fails, and the outage outlasts the lease: the event is
    written by the next tick that reaches Redis. Before, losing the lease dropped the jobs' memory with the
    event in it: only a fresh "pinned" event from 2 to 2, with no actions, was recorded."""
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    agent.run_pending()
    _fail_first_write_of_pin(monkeypatch, 2)
    pin(r, JOB, {"rollout": 2, "learner": 1})
    with pytest.raises(redis_mod.ConnectionError):
        ctl.tick()                  # acts: ensure rollout-n1-1; the event write fails
    agent.run_pending()
    r.delete(CONTROLLER_LEASE)      # the outage outlasted the lease: it expired meanwhile
    ctl.tick()
    ctl.tick()
    acted = [e for e in _pinned(r, 2) if e.get("actions")]
    assert acted, f"the event of the orders sent was lost: {_pinned(r, 2)}"


# --- controller: an event written late carries the time it was written, not when it was decided ------------


def test_an_event_written_a_tick_late_keeps_the_time_of_its_decision(r, redis_url, tmp_path, monkeypatch):
    """An event written a tick late keeps the time of its decision. Before, it carried the time of the retry:
    after an outage its marker came after the change it caused."""
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    agent.run_pending()
    fails = _fail_first_write_of_pin(monkeypatch, 2)
    pin(r, JOB, {"rollout": 2, "learner": 1})
    with pytest.raises(redis_mod.ConnectionError):
        ctl.tick()
    decided = fails[0]
    time.sleep(0.05)                # the outage
    retry_at = time.time()
    ctl.tick()
    late = [e for e in _pinned(r, 2) if e.get("actions")]
    assert late, "the event was not written at all"
    assert late[0]["at"] <= decided < retry_at, (late[0]["at"], decided, retry_at)


# --- experiment: a run that could not start: why is lost from its record ------------------------------------


def test_a_run_that_could_not_start_records_why(tmp_path, fake_runs, capsys, monkeypatch):
    """A run that could not start records why ("could not start: No space left on device") in its record and
    the summary. Before, its record said "(no output)": the reason was only in the progress lines."""
    real = ex.start_run
    calls = []

    def start(config, spec, devices):
        calls.append(spec)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(config, spec, devices)

    monkeypatch.setattr(ex, "start_run", start)
    code = ex.experiment(QUICK, [], "learner.lr=5e-4,1e-3", repeat=1, out=str(tmp_path / "e"), parallel=1)
    assert code == 1
    doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
    failed = [rec for g in doc["groups"] for rec in g["runs"] if not rec["ok"]]
    assert len(failed) == 1 and failed[0]["exit_code"] == 127
    assert "No space left" in failed[0]["error"], failed[0]["error"]
    out = capsys.readouterr().out
    assert "No space left" in [ln for ln in out.splitlines() if ln.startswith("failed (exit 127)")][0]


# --- a stage's reclaim of a deleted entry, stopping while Redis is full: the entry is acked, never dead-lettered


def test_an_event_redis_refuses_for_good_is_given_up_not_retried_by_every_tick(r, redis_url, tmp_path, monkeypatch):
    """An event whose write Redis refuses for a reason that will not pass (a WRONGTYPE, not an outage or a full
    Redis) is logged and given up: the next ticks write their own events. Kept in the job's memory, it would
    be tried first by every tick and stop each one's events behind it."""
    from pipeline.control import loop as loop_mod

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    agent.run_pending()
    real, refused = loop_mod.record_event, []

    def refused_for_good(rr, info, event):   # this one event can never be written
        if event.get("kind") == "pinned" and event.get("to", {}).get("rollout") == 2:
            refused.append(1)
            raise redis_mod.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
        return real(rr, info, event)

    monkeypatch.setattr(loop_mod, "record_event", refused_for_good)
    pin(r, JOB, {"rollout": 2, "learner": 1})
    ctl.tick()
    pin(r, JOB, {"rollout": 3, "learner": 1})
    ctl.tick()
    assert _pinned(r, 3) and not ctl.jobs[JOB].unwritten


def test_orphaned_events_wait_out_a_full_redis_and_the_controller_goes_on(r, redis_url, tmp_path, monkeypatch):
    """Events kept from a lost lease are written first by the next tick; Redis full then, they wait for a
    later tick and the tick goes on. Before, the full Redis's refusal escaped tick() (outside its handlers)
    and ended the controller."""
    from pipeline.control import loop as loop_mod

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    info = ctl.jobs[JOB].info
    ctl.orphans.append((info, {"at": time.time(), "kind": "pinned", "to": {"rollout": 9}, "actions": []}))
    real = loop_mod.record_event

    def full(rr, i, event):
        raise redis_mod.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")

    monkeypatch.setattr(loop_mod, "record_event", full)
    ctl.tick()                                    # no exception: the orphan waits
    assert len(ctl.orphans) == 1
    monkeypatch.setattr(loop_mod, "record_event", real)
    ctl.tick()
    assert not ctl.orphans and _pinned(r, 9)
