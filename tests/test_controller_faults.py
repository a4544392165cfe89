"""The controller under inputs it used to get wrong.

A pin after an earlier one was handed back; an agent back with fewer slots;
an operator's scale-up of a pinned job beside an auto job; a learner larger
than any node; an infinite figure in a decision event; a learner scaling
exponent or a role minimum that no plan can use.
"""

from __future__ import annotations

import json

import pytest

from pipeline import config
from pipeline.config import ConfigError
from pipeline.control.allocation import get_allocation, pin, unpin
from pipeline.control.placement import place
from pipeline.dataplane.keys import LEARNER, JobKeys


def test_pin_after_unpin_keeps_the_current_target_of_roles_not_named(r):
    """A pin of one role after an earlier pin was handed back (``--auto``) and the allocator moved the
    target: the other roles keep the current target (learner 5), not the abandoned pin's (2)."""
    k = JobKeys("j")
    r.hset(k.allocation, mapping={"mode": "auto", "target": json.dumps({"rollout": 2, "reward": 1, "learner": 2})})
    pin(r, "j", {"rollout": 2, "learner": 2})
    unpin(r, "j")
    # the allocator then moves the job: learner 2 -> 5
    r.hset(k.allocation, "target", json.dumps({"rollout": 3, "reward": 1, "learner": 5}))
    pin(r, "j", {"rollout": 4})
    assert get_allocation(r, "j")["pinned"] == {"rollout": 4, "reward": 1, "learner": 5}


def test_place_never_keeps_a_worker_on_a_slot_its_node_no_longer_has():
    """A node whose agent comes back offering [0, 1] (a GPU gone): no worker stays on slot 2 or 3, and no
    slot holds two workers."""
    cur = {LEARNER: {"role": "learner", "node": "a", "slots": [0, 3]},
           "rollout-a-2": {"role": "rollout", "node": "a", "slots": [2]}}
    nodes = {"a": [0, 1]}
    new = place({"rollout": 1, "learner": 1, "reward": 0}, cur, nodes)
    used = [(rec["node"], s) for rec in new.values() for s in rec["slots"]]
    assert all(s in nodes[n] for n, s in used), used
    assert len(used) == len(set(used))


def test_a_pin_that_grows_a_pinned_job_beside_an_auto_job_takes_effect(r, redis_url, tmp_path):
    """``libra-ctl scale`` growing a pinned job (2 -> 4 slots of 6) beside an auto job above its minimum:
    the auto job's share gives the slots up and the pin runs (the pool used to leave out only what the
    pinned job held, so the auto job kept its 4 and the pin was trimmed on every tick)."""
    from pipeline.control.loop import Controller
    from tests.test_controller import fake_agent
    from tests.test_controller_pool import running, slot_total
    from tests.test_sim_workers import sim_job

    sim_job(r, redis_url, tmp_path, name="pinned", control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 6)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    agent.run_pending()
    sim_job(r, redis_url, tmp_path, name="auto")
    ctl.tick()
    agent.run_pending()
    before = running(r, "n1")
    assert slot_total(before["pinned"]) == 2 and slot_total(before["auto"]) == 4
    pin(r, "pinned", {"rollout": 3, "learner": 1})
    for _ in range(3):
        ctl.tick()
        agent.run_pending()
    assert get_allocation(r, "pinned")["target"]["rollout"] == 3


def test_a_learner_larger_than_any_node_is_not_recorded_as_the_target(r, redis_url, tmp_path):
    """A pinned learner of 3 on two agents of 2 slots: the target records what is placed (a learner of 2,
    one process on one node), not 3 (which the allocator would read as the split)."""
    from pipeline.control.allocation import read_placement
    from pipeline.control.loop import Controller
    from pipeline.control.placement import counts
    from tests.test_controller import fake_agent
    from tests.test_sim_workers import sim_job

    sim_job(r, redis_url, tmp_path, name="j", control={"mode": "pinned"})
    agents = [fake_agent(r, "n1", 2), fake_agent(r, "n2", 2)]
    ctl = Controller(r, interval_s=1.0)
    pin(r, "j", {"rollout": 1, "learner": 3})
    for _ in range(2):
        ctl.tick()
        for a in agents:
            a.run_pending()
    placed = counts(read_placement(r, "j"), reward_on_slots=False)
    target = get_allocation(r, "j")["target"]
    assert placed.learner == target["learner"], (placed, target)


def test_a_decision_event_is_strict_json(r):
    """An infinite figure in a decision event (``publish_since_s`` before the first cadence) is written as
    ``null``, not ``Infinity`` (no JSON for jq or a browser)."""
    import math

    from pipeline.control.events import record_event

    record_event(r, "j", {"kind": "decision", "inputs": {"publish_since_s": math.inf}})
    (_id, fields), = r.xrange(JobKeys("j").control_events)

    def strict(name):
        raise ValueError(f"not JSON: {name}")

    event = json.loads(fields[b"data"], parse_constant=strict)
    assert event["inputs"]["publish_since_s"] is None


@pytest.mark.parametrize("setting", ["control.learner_scaling_exponent=0", "control.learner_scaling_exponent=-0.5",
                                     "control.min_learner=0", "control.min_rollout=0", "control.min_reward=0"])
def test_a_control_setting_no_plan_can_use_is_refused_at_load(setting):
    """A scaling exponent of 0 made the allocator divide by zero and kill the controller on its first
    measured window; a role minimum of 0 lets a plan leave a stage without a worker. Both are refused
    when the job is loaded, naming the key."""
    with pytest.raises(ConfigError, match=setting.split("=")[0].replace(".", r"\.")):
        config.load(None, [setting])


def test_a_controller_that_lost_its_lease_mid_tick_does_not_overwrite_the_placement(r, redis_url, tmp_path):
    """The lease lapses between a controller's actions and its write of the placement (a pause longer than
    the TTL) and another controller takes it: the old one writes nothing, stops its tick, and forgets its
    jobs, instead of overwriting its successor's placement and target."""
    from pipeline.control.allocation import read_placement
    from pipeline.control.loop import Controller
    from pipeline.dataplane.keys import CONTROLLER_LEASE
    from tests.test_controller import fake_agent
    from tests.test_sim_workers import sim_job

    sim_job(r, redis_url, tmp_path, name="j", control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    assert ctl.tick()
    agent.run_pending()
    before = (read_placement(r, "j"), get_allocation(r, "j")["target"])
    pin(r, "j", {"rollout": 1, "learner": 1})
    acted = ctl.act

    def act_then_lose(*args, **kw):
        orders = acted(*args, **kw)
        r.set(CONTROLLER_LEASE, "99:another-controller", px=60_000)   # ours lapsed; another took it
        return orders

    ctl.act = act_then_lose
    assert ctl.tick() is False
    assert (read_placement(r, "j"), get_allocation(r, "j")["target"]) == before
    assert not ctl.jobs


def test_the_default_cpu_slots_of_a_run_hold_its_workers_with_reward_on_slots():
    """On a machine without a GPU, the run's own agent offers by default the slots the run's workers hold
    at the start: with ``control.reward_on_slots`` the reward workers' too, so the run is admitted on the
    pool its own agent starts. Before, the reward workers were left out and ``libra-ctl run
    examples/quickstart.toml --set control.reward_on_slots=true`` was refused at admission ("needs at
    least 3 slots ... a pool of 2")."""
    from pipeline.control import allocator
    from pipeline.control.job import config_spec
    from pipeline.control.local import cpu_slots

    cfg = config.load("examples/quickstart.toml", ["control.reward_on_slots=true"])
    slots = cpu_slots(cfg)
    assert slots == cfg.rollout.workers + cfg.learner.workers + cfg.reward.workers
    allocator.admit(allocator.Inventory(gpus=slots, switch_cost_s=cfg.control.switch_cost_s), [config_spec(cfg)])
    assert cpu_slots(config.load("examples/quickstart.toml", ["run.slots=5"])) == 5


def test_a_pin_keeps_the_target_the_controller_commits_while_it_is_made(r, monkeypatch):
    """``scale rollout=3`` keeps the current target for the roles it does not name. A target the controller
    commits between the pin's read and its write is the one kept (read and write are one transaction).
    Before, the pin wrote the roles it had read, the old target's."""
    from pipeline.control import allocation

    key = JobKeys("j").allocation
    r.hset(key, mapping={"mode": "auto", "target": json.dumps({"rollout": 2, "learner": 2, "reward": 1})})
    read = allocation.get_allocation
    commits = []

    def read_then_commit(client, job):
        got = read(client, job)
        if not commits:   # the controller commits a new split right after the pin's first read
            commits.append(1)
            r.hset(key, "target", json.dumps({"rollout": 3, "learner": 1, "reward": 1}))
        return got

    monkeypatch.setattr(allocation, "get_allocation", read_then_commit)
    pin(r, "j", {"rollout": 3})
    assert json.loads(r.hget(key, "pinned")) == {"rollout": 3, "learner": 1, "reward": 1}
