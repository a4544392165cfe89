"""The publish cadence: plan_publish (pure), its Redis record, and a learner that follows it.

``plan_publish`` is tested on hand-made metrics; ``pipeline.dataplane.cadence``
against the real Redis of the test session; the sim backend's learner and the
des engine on short runs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.control.allocator import Allocation, JobSpec, Metrics, PlanConfig, plan_publish
from pipeline.control.commands import format_event
from pipeline.control.events import read_events
from pipeline.control.job import load_job
from pipeline.control.loop import Controller, JobControl, JobView
from pipeline.control.observer import Observer
from pipeline.dataplane.cadence import publishes, read_cadence, write_cadence
from pipeline.dataplane.keys import JobKeys
from pipeline.observe.audit import audit
from pipeline.observe.status import format_status, status
from tests.test_sim_workers import sim_job, start, stop_all, wait_for

JOB = JobSpec(name="t", batch_size=4096, max_staleness=4, reward_on_gpu=False, learner_scaling_exponent=0.95,
              publish_every_max=2)


def metrics(**kw) -> Metrics:
    """A 150 s window of a 36/28 split training 8,192 trajectories, publishing every step: 36 rollout GPUs
    load for 3 s and the learner publishes for 4 s per step."""
    base = dict(window_s=150.0, allocation=Allocation(rollout=36, learner=28), since_change_s=1e9,
                changed_from=None, rollout_gpu_s_per_traj=0.5, rollout_pause_frac=0.02, rollout_inflight=2304,
                rollout_queue=1000, rollout_idle_frac=0.0, reward_s_per_traj=0.05, reward_cpu_workers=32,
                traj_tokens=2000.0, learner_tokens_per_s=1e5, learner_gpus_measured=28, learner_publish_s=4.0,
                learner_wait_frac=0.05, backlog=500, backlog_trend_per_s=0.0, trained=8192, staleness_p50=1.0,
                dropped_stale=0, rollout_load_s=3.0, publish_every=1, publish_since_s=1e9,
                staleness_at_bound_frac=0.002, learner_steps=40)
    base.update(kw)
    return Metrics(**base)


def test_the_cadence_grows_while_staleness_has_room_and_the_split_in_place_gains():
    # learner-bound (28 GPUs train a batch in 81.92 s, + 4 s publishing): one publish in two saves 2 s a step
    d = plan_publish(metrics(), JOB)
    assert d.changed and d.publish_every == 2 and d.reason == "publish_less_often"
    assert d.saved_frac == pytest.approx(85.92 / 83.92 - 1)
    # one trajectory in two at the bound would come a version older: predicted dropped; rollout has room,
    # so the waste costs this split nothing
    assert d.predicted_drop_frac == pytest.approx(0.001) and d.cost_frac == pytest.approx(0.0)
    assert "publish every 2 steps" in d.summary() and json.dumps(d.event())
    # the same with 1 s publishes gains 0.6%: under the 1% a staler learner must be paid
    d = plan_publish(metrics(learner_publish_s=1.0), JOB)
    assert d.reason == "saving_below_cost" and d.saved_frac == pytest.approx(82.92 / 82.42 - 1)
    # rollout-bound (a learner three times as fast): the loads count, 36 GPUs x 3 s per 4,096 -> per 8,192
    # trajectories, less the predicted drops' waste
    d = plan_publish(metrics(learner_tokens_per_s=3e5), JOB)
    assert d.changed and d.saved_frac == pytest.approx((0.5 + 36 * 3 / 4096) / (0.5 + 36 * 3 / 8192) - 1)
    assert d.cost_frac == pytest.approx((1 + d.saved_frac) * 0.001, rel=0.1)   # drops rounded to trajectories


def test_no_longer_cadence_when_the_predicted_drops_would_eat_the_budget():
    # 0.6% of the data trained at the bound: half of it dropped one step longer is over half the 0.5% budget
    d = plan_publish(metrics(staleness_at_bound_frac=0.006), JOB)
    assert not d.changed and d.reason == "staleness_headroom_short" and d.predicted_drop_frac == pytest.approx(0.003)
    # drops already measured count too
    assert plan_publish(metrics(dropped_stale=20), JOB).reason == "staleness_headroom_short"
    # a looser budget lets it through
    assert plan_publish(metrics(staleness_at_bound_frac=0.006), JOB, PlanConfig(stale_drop_budget=0.02)).changed


def test_no_longer_cadence_when_versions_cost_next_to_nothing():
    d = plan_publish(metrics(rollout_load_s=0.0, learner_publish_s=0.0, staleness_at_bound_frac=0.004), JOB)
    assert not d.changed and d.reason == "saving_below_cost"
    # nothing predicted to drop, but 0.1 s publishes gain the learner 0.06%: older data for nothing
    d = plan_publish(metrics(rollout_load_s=0.1, learner_publish_s=0.1, staleness_at_bound_frac=0.0), JOB)
    assert not d.changed and d.reason == "saving_below_cost" and 0 < d.saved_frac < 0.01 and d.cost_frac == 0


def test_a_cadence_that_dropped_too_many_is_not_tried_again_on_the_same_split():
    m = metrics(publish_reason="drops_over_budget", publish_since_s=600.0, since_change_s=2000.0)
    assert plan_publish(m, JOB).reason == "dropped_too_many_here"
    # a new split since: worth another try
    assert plan_publish(dataclasses.replace(m, since_change_s=300.0), JOB).changed


def test_the_cadence_comes_back_when_drops_exceed_the_budget():
    d = plan_publish(metrics(publish_every=2, dropped_stale=64), JOB)      # 64 of 8,256: 0.78%
    assert d.changed and d.publish_every == 1 and d.reason == "drops_over_budget"
    # within the budget it stays, at its most
    assert plan_publish(metrics(publish_every=2, dropped_stale=16), JOB).reason == "at_most"
    # a burst: over the steps since the cadence was set the drops are within the budget; over them too, it comes back
    d = plan_publish(metrics(publish_every=2, dropped_stale=64, dropped_since_frac=0.004), JOB)
    assert not d.changed and d.reason == "drops_within_budget_since"
    assert plan_publish(metrics(publish_every=2, dropped_stale=64, dropped_since_frac=0.006), JOB).changed


def test_half_the_data_at_the_bound_is_predicted_dropped_whatever_the_cadence():
    # every 3 steps -> 4: a lag of 0..2 steps becomes 0..3, and a trajectory at the bound goes over it when its
    # new lag is the longer, one in two over the old lags (not one in four: only the longest lag is new)
    job = dataclasses.replace(JOB, publish_every_max=4)
    d = plan_publish(metrics(publish_every=3, learner_publish_s=4.0 / 3, staleness_at_bound_frac=0.006), job)
    assert not d.changed and d.reason == "staleness_headroom_short" and d.predicted_drop_frac == pytest.approx(0.003)
    d = plan_publish(metrics(publish_every=3, learner_publish_s=4.0 / 3, staleness_at_bound_frac=0.002), job)
    assert d.predicted_drop_frac == pytest.approx(0.001)


def test_back_from_a_longer_cadence_it_waits_for_that_cadences_data_to_age_out():
    # came back from 3 to 2 for drops; the window's drops (0.78%) are still of trajectories generated at 3:
    # trained up to max_staleness + 1 = 5 steps after (75 s each at this pace), then a whole window, 525 s
    job = dataclasses.replace(JOB, publish_every_max=4)
    back = dict(publish_every=2, dropped_stale=64, publish_reason="drops_over_budget")
    d = plan_publish(metrics(publish_since_s=500.0, **back), job)
    assert not d.changed and d.reason == "aging_out" and d.drop_frac == pytest.approx(64 / 8256)
    d = plan_publish(metrics(publish_since_s=530.0, **back), job)
    assert d.changed and d.publish_every == 1 and d.reason == "drops_over_budget"


def test_with_data_at_the_bound_the_cadence_grows_only_on_its_own_data():
    # at 2 for 300 s: the data trained came from versions published at 1 up to 5 steps (75 s each) ago, then a
    # window, 525 s; the share at the bound is that of the shorter cadence
    job = dataclasses.replace(JOB, publish_every_max=4)
    at2 = dict(publish_every=2, learner_publish_s=4.0, staleness_at_bound_frac=0.002)   # 8 s per version
    d = plan_publish(metrics(publish_since_s=300.0, **at2), job)
    assert not d.changed and d.reason == "bound_share_unsettled" and d.predicted_drop_frac == pytest.approx(0.001)
    assert plan_publish(metrics(publish_since_s=530.0, **at2), job).publish_every == 3
    # nothing at the bound: nothing the shorter cadence's data could hide
    assert plan_publish(metrics(publish_since_s=300.0, **{**at2, "staleness_at_bound_frac": 0.0}), job).changed


def test_a_move_of_the_split_puts_the_cadence_back():
    d = plan_publish(metrics(publish_every=2, since_change_s=60.0), JOB)
    assert d.changed and d.publish_every == 1 and d.reason == "split_changed"
    assert not plan_publish(metrics(since_change_s=60.0), JOB).changed


@pytest.mark.parametrize("kw", [dict(publish_since_s=60.0), dict(learner_steps=9), dict(trained=0)])
def test_no_change_on_a_window_that_cannot_tell(kw):
    # a window partly at the previous cadence; a learner whose data cannot have reached the bound yet
    # (2 x (max_staleness + 1) steps); nothing trained
    assert plan_publish(metrics(**kw), JOB).reason == "measuring"


def test_before_its_data_can_reach_the_bound_the_cadence_grows_while_the_stalest_is_two_steps_clear():
    # bound 4: the share at the bound is known after 10 steps; at step 5 the stalest data trained is 2 old, and
    # data up to 3 steps older than that could have come in: one step more of age keeps it clear of the bound
    early = dict(learner_steps=5, staleness_max=2, staleness_at_bound_frac=0.0)
    d = plan_publish(metrics(**early), JOB)
    assert d.changed and d.publish_every == 2 and d.reason == "publish_less_often"
    for kw in (dict(learner_steps=4),      # not yet 3 steps past the stalest data
               dict(staleness_max=3),      # one step from the bound
               dict(staleness_max=-1)):    # nothing trained over the steps since the last change
        assert plan_publish(metrics(**{**early, **kw}), JOB).reason == "measuring", kw
    # above the config's cadence, only on its own data: trained up to 5 steps (75 s) after it was set, then a
    # window, 525 s
    job = dataclasses.replace(JOB, publish_every_max=4)
    at2 = dict(early, publish_every=2, learner_steps=8, staleness_max=1)
    assert plan_publish(metrics(publish_since_s=300.0, **at2), job).reason == "measuring"
    assert plan_publish(metrics(publish_since_s=530.0, **at2), job).publish_every == 3


def test_the_cadence_stays_within_the_config_and_the_staleness_bound():
    fixed = dataclasses.replace(JOB, publish_every_max=1)
    assert plan_publish(metrics(), fixed).reason == "fixed"
    # never past max_staleness, whatever publish_every_max says
    tight = dataclasses.replace(JOB, max_staleness=1, publish_every_max=4)
    assert plan_publish(metrics(), tight).reason == "fixed"
    d = plan_publish(metrics(publish_every=3), JOB)
    assert d.changed and d.publish_every == 2 and d.reason == "out_of_bounds"
    # the config's own cadence is the floor
    d = plan_publish(metrics(), dataclasses.replace(JOB, publish_every=2, publish_every_max=3))
    assert d.reason == "out_of_bounds" and d.publish_every == 2


def published_steps(cadence: dict[int, int], steps: int = 10) -> list[int]:
    """The steps a learner publishes at, reading ``cadence[step]`` (the last entry at or before it) each step."""
    out, last, every = [], 0, 1
    for s in range(1, steps + 1):
        every = cadence.get(s, every)
        if publishes(s, last, every, steps):
            out.append(s)
            last = s
    return out


def test_publishes_counts_steps_from_the_last_published_version():
    assert published_steps({}) == list(range(1, 11))
    assert published_steps({1: 3}) == [3, 6, 9, 10]        # and always the last step
    # a cadence changed between publishes counts from the last one
    assert published_steps({1: 2, 4: 3, 9: 1}) == [2, 5, 8, 9, 10]


def test_the_cadence_record_in_redis(r):
    keys = JobKeys("cad")
    assert read_cadence(r, keys, default=1, max_staleness=4) == (1, None)
    write_cadence(r, keys, 2, "publish_less_often", at=123.5)
    assert read_cadence(r, keys, default=1, max_staleness=4) == (2, 123.5)
    # a value past the job's bound is never applied
    assert read_cadence(r, keys, default=1, max_staleness=1) == (1, None)
    r.hset(keys.publish, "every", "two")
    assert read_cadence(r, keys, default=3, max_staleness=4) == (3, None)


def test_the_sim_learner_publishes_at_the_cadence_the_controller_wrote(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path, name="simcad", time_scale=20.0, job={"steps": 6})
    write_cadence(r, JobKeys("simcad"), 2, "test", at=0.0)
    procs = [start("feeder", run_dir, "feeder-0", redis_url), start("rollout", run_dir, "rollout-n-0", redis_url),
             start("reward", run_dir, "reward-n-c0", redis_url), start("learner", run_dir, "learner-0", redis_url)]
    try:
        wait_for(lambda: r.hget(JobKeys("simcad").state, "phase") == b"trained", 120, "6 learner steps")
    finally:
        stop_all(procs)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["published"] for s in steps] == [False, True] * 3
    assert [s["publish_s"] > 0 for s in steps] == [False, True] * 3
    assert int(r.hget(JobKeys("simcad").policy, "version")) == 6
    # rollout loaded versions 0 (at start), 2 and 4 at most: never an unpublished one
    costs = json.loads(r.hget(JobKeys("simcad").worker_costs, "rollout-n-0"))
    assert costs["reloads"] <= 2
    a = audit(r, "simcad", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 6 * 32


def test_the_controller_writes_the_cadence_where_the_learner_reads_it_and_records_why(r, redis_url, tmp_path):
    sim_job(r, redis_url, tmp_path, name="ctlcad", job={"max_staleness": 4})
    info = load_job(r, "ctlcad")
    assert info.spec().publish_every_max == 4                  # control.publish_every_max's default
    ctl = Controller(r, interval_s=1.0)
    view = JobView(JobControl(info, Observer(info)), alloc={}, ext={}, ext_n={}, bounds={}, metrics=metrics())
    ctl.adapt_publish(view, now=500.0)
    assert read_cadence(r, JobKeys("ctlcad"), info.publish_every, 4) == (2, 500.0)
    e = read_events(r, "ctlcad")[-1]
    assert e["kind"] == "publish" and e["publish_every"] == 2 and e["reason"] == "publish_less_often"
    assert "publish every 2 steps" in format_event(e)
    st = status(r, "ctlcad")
    assert (st["jobs"][0]["publish_every"], st["jobs"][0]["publish_reason"]) == (2, "publish_less_often")
    assert "published every 2 steps (publish_less_often)" in format_status(st)
    # nothing to change (0.6% of the data at the bound: no room for a third step): nothing written, nothing recorded
    view.metrics = metrics(publish_every=2, publish_since_s=1e9, staleness_at_bound_frac=0.006)
    ctl.adapt_publish(view, now=600.0)
    assert read_cadence(r, JobKeys("ctlcad"), info.publish_every, 4) == (2, 500.0)
    assert len(read_events(r, "ctlcad")) == 1
    # pinned (libra-ctl scale): the user holds the split, and the learner its config's cadence
    view.metrics = None
    ctl.adapt_publish(view, now=700.0)
    assert read_cadence(r, JobKeys("ctlcad"), info.publish_every, 4) == (info.publish_every, 700.0)
    assert read_events(r, "ctlcad")[-1]["reason"] == "pinned"
    ctl.adapt_publish(view, now=800.0)
    assert len(read_events(r, "ctlcad")) == 2


def test_a_move_ordered_at_this_tick_puts_the_cadence_back_too():
    d = plan_publish(metrics(publish_every=2), JOB, moving=True)
    assert d.changed and d.publish_every == 1 and d.reason == "split_changed"
    assert plan_publish(metrics(), JOB, moving=True).reason == "split_changed"
