"""plan() over several jobs on one pool: guarantees, priorities, fair share and the cost of moves (pure)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.control.allocator import (AdmissionError, Allocation, Decision, Inventory, JobSpec, Metrics,
                                        PlanConfig, PoolDecision, RoleBounds, admit, max_share, min_share, plan)

INV = Inventory(gpus=8, switch_cost_s=10.0)
CFG = PlanConfig(horizon_s=900.0, cooldown_s=60.0)


def job(name: str, **kw) -> JobSpec:
    return JobSpec(name=name, batch_size=64, max_staleness=2, reward_on_gpu=False, learner_scaling_exponent=0.9,
                   **kw)


def measured(alloc: Allocation, *, rollout_s: float = 1.0, step_s: float = 8.0, since: float = 1e9,
             inflight: int = 0, exponent: float = 0.9) -> Metrics:
    """A job measured on ``alloc``: a rollout slot makes 1/rollout_s trajectories/s; a step on one learner
    slot takes step_s (64 trajectories of 1,000 tokens)."""
    return Metrics(window_s=60.0, allocation=alloc, since_change_s=since, changed_from=None,
                   rollout_gpu_s_per_traj=rollout_s, rollout_pause_frac=0.0, rollout_inflight=inflight,
                   rollout_queue=0, rollout_idle_frac=0.0, reward_s_per_traj=0.0, reward_cpu_workers=4,
                   traj_tokens=1000.0, learner_tokens_per_s=64 * 1000.0 / step_s * alloc.learner ** exponent,
                   learner_gpus_measured=alloc.learner, learner_publish_s=0.0, learner_wait_frac=0.0,
                   backlog=0, backlog_trend_per_s=0.0, trained=64, staleness_p50=1.0, dropped_stale=0)


def unmeasured(alloc: Allocation = Allocation(0, 0, 0)) -> Metrics:
    """A job that has finished nothing yet (just submitted, or still loading)."""
    return dataclasses.replace(measured(Allocation(1, 1)), allocation=alloc, rollout_gpu_s_per_traj=0.0,
                               learner_tokens_per_s=0.0, learner_gpus_measured=0, traj_tokens=0.0, trained=0)


def check(d: PoolDecision, jobs: list[JobSpec], inv: Inventory = INV) -> None:
    """What every pool decision must satisfy."""
    assert sum(d.shares.values()) <= inv.gpus
    for j in jobs:
        a = d.decisions[j.name].allocation
        assert a.total == d.shares[j.name], (j.name, a, d.shares)
        assert d.shares[j.name] <= max_share(j, inv.gpus)
        if sum(min_share(x) for x in jobs) <= inv.gpus:
            assert d.shares[j.name] >= min_share(j), (j.name, d.shares)
        if a.total:
            assert all(j.bound(r).min <= a.get(r) <= j.bound(r).max for r in ("rollout", "reward", "learner"))


# --- admission -----------------------------------------------------------------------------------------


def test_minimum_is_at_least_the_smallest_runnable_split():
    assert min_share(job("a")) == 2                           # one rollout worker and one learner slot
    assert min_share(job("a", min_slots=5)) == 5
    assert min_share(dataclasses.replace(job("a"), reward_on_gpu=True)) == 3
    assert max_share(job("a", max_slots=3), 8) == 3 and max_share(job("a"), 8) == 8


def test_admission_refuses_minimums_the_pool_cannot_hold():
    admit(INV, [job("a", min_slots=4), job("b", min_slots=4)])
    with pytest.raises(AdmissionError, match=r"a=4, b=5\) add up to 9 slots; the pool has 8"):
        admit(INV, [job("a", min_slots=4), job("b", min_slots=5)])
    with pytest.raises(AdmissionError, match="job 'c' needs at least 4 slots"):
        admit(INV, [job("c", min_slots=4, max_slots=3)])


# --- guarantees ------------------------------------------------------------------------------------------


def test_a_job_arriving_while_another_holds_every_slot_gets_its_minimum_at_once():
    a, b = job("a"), job("b", min_slots=3)
    # a holds the whole pool and has just moved (in cooldown): the guarantee does not wait for it
    d = plan({"a": measured(Allocation(6, 2), since=1.0), "b": unmeasured()}, INV, [a, b], CFG)
    check(d, [a, b])
    assert d.shares == {"a": 5, "b": 3} and d.reason == "guarantee" and d.moved_between_jobs == 3
    assert d.decisions["a"].changed and d.decisions["a"].reason == "share_shrunk"
    assert d.decisions["b"].allocation == Allocation(2, 1)   # the smallest split, grown at rollout


def test_pre_emption_stops_at_the_lower_jobs_minimum():
    low, high = job("low", min_slots=4, priority=1.0), job("high", priority=10.0)
    # high's rollout is the bottleneck by far: every slot it gets raises its rate, low's barely matters
    m = {"low": measured(Allocation(3, 3), rollout_s=0.1, step_s=1.0),
         "high": measured(Allocation(1, 1), rollout_s=8.0, step_s=1.0)}
    shares = {"low": 6, "high": 2}
    for _ in range(10):
        d = plan(m, INV, [low, high], CFG)
        check(d, [low, high])
        shares = d.shares
        m = {n: measured(d.decisions[n].allocation, rollout_s=m[n].rollout_gpu_s_per_traj, step_s=1.0)
             for n in m}
    assert shares == {"low": 4, "high": 4}


def test_a_pool_that_shrinks_keeps_the_higher_priority_minimum_first():
    a, b = job("a", min_slots=4, priority=2.0), job("b", min_slots=4)
    d = plan({"a": measured(Allocation(3, 1)), "b": measured(Allocation(3, 1))}, Inventory(6, 10.0), [a, b], CFG)
    assert d.shares == {"a": 4, "b": 2} and d.below_min == ("b",)
    assert d.reason.startswith("fit")


# --- spare capacity and fair share ---------------------------------------------------------------------------


def test_two_new_jobs_split_an_empty_pool_by_priority():
    a, b = job("a", priority=3.0), job("b")
    d = plan({"a": unmeasured(), "b": unmeasured()}, INV, [a, b], CFG)
    check(d, [a, b])
    assert d.shares == {"a": 6, "b": 2} and d.reason == "guarantee+spare"


def test_new_jobs_share_an_empty_pool_by_priority_times_the_work_they_declare():
    # before any rate is measured a job's fair share weighs the trajectories it has to train (steps x batch):
    # four times the work, four times the slots (each of the three holds at least its smallest split, 2)
    a, b, c = job("a"), job("b"), job("c")
    m = {n: dataclasses.replace(unmeasured(), remaining=left) for n, left in (("a", 8192), ("b", 8192), ("c", 2048))}
    d = plan(m, Inventory(gpus=18, switch_cost_s=10.0), [a, b, c], CFG)
    check(d, [a, b, c], Inventory(gpus=18, switch_cost_s=10.0))
    assert d.shares == {"a": 8, "b": 8, "c": 2}


def test_spare_slots_go_to_the_highest_weighted_marginal_gain():
    # a is rollout-bound (each slot adds a seventh of its demand); b is learner-bound on a learner that
    # barely scales (on 2 slots it already makes 82% of what 8 would give it)
    a, b = job("a"), dataclasses.replace(job("b"), learner_scaling_exponent=0.1)
    ma = measured(Allocation(1, 1), rollout_s=4.0, step_s=2.0)
    mb = measured(Allocation(1, 1), rollout_s=0.1, step_s=16.0, exponent=0.1)
    d = plan({"a": ma, "b": mb}, INV, [a, b], CFG)
    check(d, [a, b])
    assert d.shares == {"a": 6, "b": 2} and d.reason == "spare"
    # the same two jobs, b with a priority that outweighs a's larger gain
    d2 = plan({"a": ma, "b": mb}, INV, [a, dataclasses.replace(b, priority=50.0)], CFG)
    assert d2.shares["b"] > 2


def test_max_slots_caps_a_share_and_the_rest_goes_to_the_others():
    a, b = job("a", max_slots=3), job("b")
    d = plan({"a": unmeasured(), "b": unmeasured()}, INV, [a, b], CFG)
    check(d, [a, b])
    assert d.shares == {"a": 3, "b": 5}


# --- moves between measured jobs ---------------------------------------------------------------------------


def test_rebalance_moves_slots_when_the_gain_pays_the_switch():
    a, b = job("a"), job("b")
    # a: rollout-bound at 4 s a trajectory; b: over-provisioned (6 slots, rollout far ahead of its learner)
    m = {"a": measured(Allocation(1, 1), rollout_s=4.0, step_s=1.0),
         "b": measured(Allocation(5, 1), rollout_s=0.5, step_s=16.0)}
    d = plan(m, INV, [a, b], CFG)
    check(d, [a, b])
    assert d.reason == "rebalance_jobs" and d.shares["a"] > 2 and d.expected_gain > d.transition_cost > 0
    # the same move over a horizon too short to pay for the switch is not made
    short = plan(m, Inventory(8, switch_cost_s=2000.0), [a, b], dataclasses.replace(CFG, horizon_s=60.0))
    assert short.reason == "kept" and short.shares == {"a": 2, "b": 6}
    # nor while either job is in its cooldown
    cool = plan({**m, "b": dataclasses.replace(m["b"], since_change_s=5.0)}, INV, [a, b], CFG)
    assert cool.reason == "kept" and not cool.decisions["a"].changed


def test_a_job_keeping_its_share_is_planned_as_a_single_job():
    a, b = job("a"), job("b")
    m = {"a": measured(Allocation(2, 2), rollout_s=2.0, step_s=1.0), "b": measured(Allocation(2, 2))}
    d = plan(m, INV, [a, b], CFG)
    assert d.shares == {"a": 4, "b": 4}
    alone = plan(m["a"], Inventory(4, INV.switch_cost_s), [a], CFG)
    assert isinstance(alone, Decision) and d.decisions["a"] == alone


def test_one_job_in_a_mapping_takes_the_pool():
    a = job("a")
    d = plan({"a": unmeasured()}, INV, [a], CFG)
    assert d.shares == {"a": 8} and d.decisions["a"].allocation == Allocation(7, 1)


def test_a_finished_jobs_slots_are_handed_out_again():
    a, b = job("a"), job("b")
    d = plan({"b": measured(Allocation(3, 1), rollout_s=2.0, step_s=1.0)}, INV, [b], CFG)
    assert d.shares == {"b": 8} and "spare" in d.reason
    assert a.name not in d.shares


# --- jobs that know their remaining work (paced) ------------------------------------------------------------


def paced(alloc: Allocation, left: int) -> Metrics:
    """A job of the one shape these tests use (2 s a trajectory per rollout slot, 1 s a step) with work left."""
    return dataclasses.replace(measured(alloc, rollout_s=2.0, step_s=1.0), remaining=left)


def test_paced_spare_slots_go_to_the_job_that_would_finish_last():
    # two jobs of one shape; b has four times a's work left, so it gets the free slots
    a, b = job("a"), job("b")
    m = {"a": paced(Allocation(1, 1), 640), "b": paced(Allocation(1, 1), 2560)}
    d = plan(m, INV, [a, b], CFG)
    check(d, [a, b])
    assert d.reason == "spare" and d.shares["b"] > d.shares["a"]
    # unpaced (no remaining work known), b is worth no more than a
    unpaced = plan({n: dataclasses.replace(x, remaining=0) for n, x in m.items()}, INV, [a, b], CFG)
    assert unpaced.shares["b"] <= unpaced.shares["a"]


def test_paced_rebalance_brings_the_later_finish_nearer_and_stops_when_they_meet():
    a, b = job("a"), job("b")
    # a holds 6 slots for 640 trajectories, b 2 for 6400: b would finish far later
    m = {"a": paced(Allocation(5, 1), 640), "b": paced(Allocation(1, 1), 6400)}
    d = plan(m, INV, [a, b], CFG)
    check(d, [a, b])
    assert d.reason == "rebalance_jobs" and d.shares["b"] > 2 and d.moved_between_jobs > 0
    assert d.expected_gain > d.transition_cost > 0
    # equal work left on equal shares: no move pays
    level = {n: paced(Allocation(3, 1), 3200) for n in ("a", "b")}
    assert plan(level, INV, [a, b], CFG).reason == "kept"
    # a switch that takes longer than what b has left is not made
    slow = plan(m, Inventory(8, switch_cost_s=1e6), [a, b], CFG)
    assert slow.reason == "kept"


def test_paced_move_that_turns_back_the_last_one_needs_the_larger_gain():
    # 64 slots, 32 each (rate 15.5/s); b has 10% more left: one slot a -> b brings the later finish 3.1% nearer
    a, b = job("a"), job("b")
    inv = Inventory(gpus=64, switch_cost_s=10.0)
    m = {"a": paced(Allocation(31, 1), 15_500), "b": paced(Allocation(31, 1), 17_050)}
    assert plan(m, inv, [a, b], CFG).reason == "kept"      # under pool_gain_frac (5%): not worth two restarts
    cfg = dataclasses.replace(CFG, pool_gain_frac=0.02)
    d = plan(m, inv, [a, b], cfg)
    assert d.reason == "rebalance_jobs" and d.shares == {"a": 31, "b": 33}
    # b has just given a slot up (to a): taking it back needs reverse_gain_frac (5%), and 3.1% is not enough
    back = {"a": dataclasses.replace(m["a"], changed_from=Allocation(30, 1)),
            "b": dataclasses.replace(m["b"], changed_from=Allocation(32, 1))}
    assert plan(back, inv, [a, b], cfg).reason == "kept"


def test_a_grown_share_keeps_the_learner_when_a_restart_would_cost_more_than_the_better_split_gains():
    # a is rollout-bound on 4/2; on 8 slots its best split is 7/1 (3.5/s against 6/2's 3/s), but a learner
    # of another size restarts: with little work left and a long switch, 6/2 finishes first
    a = job("a")
    short = plan({"a": paced(Allocation(4, 2), 640)}, Inventory(gpus=8, switch_cost_s=100.0), [a], CFG)
    assert short.shares == {"a": 8} and short.decisions["a"].allocation == Allocation(6, 2)
    # with much work left the better split pays for its restart
    long = plan({"a": paced(Allocation(4, 2), 6400)}, Inventory(gpus=8, switch_cost_s=10.0), [a], CFG)
    assert long.decisions["a"].allocation == Allocation(7, 1)


def test_paced_higher_priority_takes_slots_down_to_the_lower_jobs_minimum():
    # equal work left on equal shares: a (priority 2) takes b's slots while they bring its end nearer, however
    # late that leaves b, but never below b's minimum
    a, b = job("a", priority=2.0), job("b", min_slots=3)
    m = {n: paced(Allocation(3, 1), 3200) for n in ("a", "b")}
    d = plan(m, INV, [a, b], CFG)
    check(d, [a, b])
    assert d.reason == "rebalance_jobs" and d.shares == {"a": 5, "b": 3}
    # the other way round nothing moves: b does not take from a job of higher priority
    m2 = {"a": paced(Allocation(4, 1), 640), "b": paced(Allocation(2, 1), 6400)}
    assert plan(m2, INV, [a, b], CFG).reason == "kept"


# --- invariants on random pools ---------------------------------------------------------------------------------

_alloc = st.builds(Allocation, rollout=st.integers(0, 6), learner=st.integers(0, 4))


@settings(max_examples=300, deadline=None)
@given(gpus=st.integers(2, 24), spec=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12),
                                                        st.sampled_from([0.5, 1.0, 3.0]), st.booleans(), _alloc,
                                                        st.floats(0.2, 8.0), st.floats(0.5, 30.0),
                                                        st.sampled_from([0, 64, 6400])),
                                              min_size=1, max_size=4))
def test_every_pool_decision_keeps_the_invariants(gpus, spec):
    jobs, m = [], {}
    for i, (lo, hi, prio, is_measured, alloc, rollout_s, step_s, left) in enumerate(spec):
        j = job(f"j{i}", min_slots=lo, max_slots=max(hi, lo, 2) if hi else 0, priority=prio,
                bounds={"learner": RoleBounds(1, 3)})
        jobs.append(j)
        if alloc.total and alloc.rollout and alloc.learner and alloc.learner <= 3:
            m[j.name] = (dataclasses.replace(measured(alloc, rollout_s=rollout_s, step_s=step_s), remaining=left)
                         if is_measured else unmeasured(alloc))
    inv = Inventory(gpus, 10.0)
    d = plan(m, inv, jobs, CFG)
    check(d, jobs, inv)
    if sum(min_share(j) for j in jobs) <= gpus:
        assert d.below_min == ()
