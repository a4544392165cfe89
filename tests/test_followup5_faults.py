"""Faults seen in earlier sessions and left open, fixed now.

Each docstring says what should happen; "Before" says what happened until the fix."""

from __future__ import annotations

import json
import time

from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.worker import AGENT, SLOTS_ENV, WorkerContext
from pipeline.observe.status import job_status


def test_status_names_an_exited_agent_worker_agent_not_run(r, monkeypatch):
    """A worker an agent started shows `managed agent` in `libra-ctl status`, also once it has exited and the
    allocation no longer places it.

    Before: `managed` was derived from the placement alone, so an agent's exited (or drained) worker read `run`,
    as if the user had started it by hand.
    """
    monkeypatch.setenv(SLOTS_ENV, "1")
    ctx = WorkerContext.__new__(WorkerContext)      # only the fields record() reads
    for k, v in dict(worker_id="rollout-n-1", role="rollout", node="n", state="exited", done=3, rate_per_s=0.0,
                     policy_version=2, external=False, devices=None, failure=None).items():
        setattr(ctx, k, v)
    rec = ctx.record()
    assert rec["managed"] == AGENT
    monkeypatch.delenv(SLOTS_ENV)
    assert "managed" not in ctx.record()          # started by hand: the status derives "run"
    keys = JobKeys("j5")
    r.hset(keys.workers, rec["id"], json.dumps(rec))
    r.hset(keys.workers, "rollout-h", json.dumps({**rec, "id": "rollout-h", "heartbeat": time.time()}
                                                 | {"managed": None}))
    got = {w["id"]: w["managed"] for w in job_status(r, "j5")["workers"]}
    assert got == {"rollout-n-1": "agent", "rollout-h": "run"}


def test_no_agent_learner_starts_while_a_draining_external_learner_holds_learner_0(r, redis_url, tmp_path):
    """`libra-ctl drain learner-0` of a pool learner: the agents' learner-0 is placed once the pool learner has
    finished its batch and given the id up, not while it still works under it.

    Before: the controller placed learner-0 on an agent at the next tick. That process found the id held by the
    live external learner and exited 1 (``register``), again at each restart while the batch in hand lasted; the
    agent counts such exits, and after 5 in a row ``libra-ctl run`` failed the job.
    """
    from pipeline.control.loop import Controller
    from pipeline.dataplane.keys import LEARNER

    try:
        from tests.test_controller import desired_roles, fake_agent
        from tests.test_pools import JOB, asked_to_drain, external
        from tests.test_sim_workers import sim_job
    except ModuleNotFoundError:
        from test_controller import desired_roles, fake_agent
        from test_pools import JOB, asked_to_drain, external
        from test_sim_workers import sim_job

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    jobs = fake_agent(r, "n1", 3)
    external(r, LEARNER, "learner")
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    jobs.run_pending()
    assert "learner" not in desired_roles(r, "n1")
    r.sadd(JobKeys(JOB).external_drain, LEARNER)             # what `libra-ctl drain learner-0` does
    for _ in range(2):
        ctl.tick()
        jobs.run_pending()
        assert "learner" not in desired_roles(r, "n1")       # it still trains its batch under learner-0
    assert asked_to_drain(r) == {LEARNER}
    external(r, LEARNER, "learner", state="drained")          # its batch done: it waits for the job's end
    ctl.tick()
    jobs.run_pending()
    assert len(desired_roles(r, "n1")["learner"]) == 1       # now the agents' learner-0 starts


def test_scale_notes_a_learner_wider_than_any_one_node(r, redis_url, capsys):
    """`libra-ctl scale learner=3` on two live agents of 2 slots each: 4 slots in all, so the slot count fits, but
    the learner's ranks run on one node and none offers 3. `scale` says the controller cuts the learner to 2.

    Before: no note: the pin fitted the slot count, and `status` then showed learner=2 with no word why.
    """
    from types import SimpleNamespace

    from pipeline.control.commands import cmd_scale
    from pipeline.dataplane.keys import AGENTS, JOBS

    now = time.time()
    for node in ("a", "b"):
        r.hset(AGENTS, node, json.dumps({"node": node, "host": node, "pid": 1, "heartbeat": now,
                                         "slots": [{"index": i} for i in range(2)]}))
    r.sadd(JOBS, "j")
    r.hset(JobKeys("j").state, mapping={"phase": "running"})
    args = SimpleNamespace(job="j", auto=False, counts=["learner=3", "rollout=1"], wait=None, redis=redis_url)
    assert cmd_scale(args) == 0
    err = capsys.readouterr().err
    assert "learner=3 runs on one node" in err and "offers j 2 slot(s)" in err
