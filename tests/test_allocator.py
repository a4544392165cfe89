"""plan(): the pure allocator, tested on hand-made metrics (no Redis, no simulator)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.control.allocator import Allocation, Inventory, JobSpec, Metrics, PlanConfig, RoleBounds, plan

G = 64
INV = Inventory(gpus=G, switch_cost_s=40.0)
JOB = JobSpec(name="t", batch_size=4096, max_staleness=4, reward_on_gpu=False, learner_scaling_exponent=0.95)
# learner speed that makes 28 GPUs train a 4096 x 2000-token batch in ~57.6 s (+2 s publish): ~68.7 traj/s
SPEED_28 = 6000.0 * 28 ** 0.95


def metrics(**kw) -> Metrics:
    """A window of a 36/28 split with rollout at 72 traj/s and learner at ~68.7 traj/s (near balance)."""
    base = dict(window_s=150.0, allocation=Allocation(rollout=36, learner=28), since_change_s=1e9,
                changed_from=None,
                rollout_gpu_s_per_traj=0.5, rollout_pause_frac=0.0, rollout_inflight=36 * 64, rollout_queue=1000,
                rollout_idle_frac=0.0,
                reward_s_per_traj=0.05, reward_cpu_workers=32,
                traj_tokens=2000.0, learner_tokens_per_s=SPEED_28, learner_gpus_measured=28,
                learner_publish_s=2.0, learner_wait_frac=0.05, backlog=500, backlog_trend_per_s=0.0,
                trained=8192, staleness_p50=2.0, dropped_stale=0)
    base.update(kw)
    return Metrics(**base)


def test_balanced_split_stays():
    d = plan(metrics(), INV, [JOB])
    assert not d.changed and d.reason in ("balanced", "gain_below_cost")
    assert d.allocation == Allocation(36, 28)


def test_rollout_short_moves_gpus_to_rollout():
    # rollout needs 1 GPU-s per trajectory: 36 GPUs make 36/s while the learner could take ~69/s
    d = plan(metrics(rollout_gpu_s_per_traj=1.0, learner_wait_frac=0.45), INV, [JOB])
    assert d.changed and d.reason == "rebalance_rollout_short"
    assert d.allocation.rollout > 36 and d.allocation.total == G
    assert d.predicted_rate > d.current_rate
    assert d.expected_gain > d.transition_cost > 0


def test_learner_short_moves_gpus_to_learner():
    d = plan(metrics(traj_tokens=5000.0, backlog=20000, backlog_trend_per_s=20.0), INV, [JOB])
    assert d.changed and d.reason == "rebalance_learner_short"
    assert d.allocation.learner > 28 and d.allocation.total == G


def test_cooldown_blocks_any_move():
    d = plan(metrics(rollout_gpu_s_per_traj=1.0, since_change_s=30.0), INV, [JOB], PlanConfig(cooldown_s=150))
    assert not d.changed and d.reason == "cooldown"
    assert d.allocation == Allocation(36, 28)


def test_no_move_while_the_window_reaches_back_past_the_last_change():
    # a window stretched to hold two learner steps (300 s here) that began before the move of 200 s ago mixes
    # both splits and the move's own transient: the plan waits until the window is the new split's alone
    m = dict(rollout_gpu_s_per_traj=1.0, learner_wait_frac=0.45, window_s=300.0,
             changed_from=Allocation(rollout=40, learner=24))
    assert plan(metrics(since_change_s=200.0, **m), INV, [JOB]).reason == "cooldown"
    assert plan(metrics(since_change_s=300.0, **m), INV, [JOB]).changed


def test_weight_loads_cost_per_version_not_per_window():
    # 3 s loads, one version per 4096-trajectory batch. A 150 s window at ~60 traj/s holds the loads of one
    # version or of two (pause share 2% or 4%): with the measured load time the plan is the same for both
    one, two = (metrics(rollout_pause_frac=f, rollout_load_s=3.0, rollout_gpu_s_per_traj=0.6,
                        learner_wait_frac=0.3) for f in (0.02, 0.04))
    d1, d2 = plan(one, INV, [JOB]), plan(two, INV, [JOB])
    assert d1.allocation == d2.allocation and d1.current_rate == pytest.approx(d2.current_rate)
    # without it the share is all the plan has, and the two windows disagree
    assert plan(dataclasses.replace(one, rollout_load_s=0.0), INV, [JOB]).current_rate != pytest.approx(
        plan(dataclasses.replace(two, rollout_load_s=0.0), INV, [JOB]).current_rate)
    # every rollout GPU loads every version: 36 GPUs x 3 s per 4096 trajectories on top of 0.6 GPU-s each
    assert d1.current_rate == pytest.approx(36 / (0.6 + 36 * 3.0 / 4096))
    # and a learner that publishes every other step loads half as often
    assert plan(dataclasses.replace(one, publish_every=2), INV, [JOB]).current_rate == pytest.approx(
        36 / (0.6 + 36 * 3.0 / 8192))


def test_warming_up_without_measured_rates():
    assert plan(metrics(learner_tokens_per_s=0.0), INV, [JOB]).reason == "warming_up"
    assert plan(metrics(rollout_gpu_s_per_traj=0.0), INV, [JOB]).reason == "warming_up"


def test_bounds_are_respected():
    job = dataclasses.replace(JOB, bounds={"rollout": RoleBounds(1, 40), "learner": RoleBounds(25, 64)})
    d = plan(metrics(rollout_gpu_s_per_traj=1.0, learner_wait_frac=0.45), INV, [job])
    assert d.changed
    assert d.allocation.rollout <= 40 and d.allocation.learner >= 25


def test_learner_min_bound_holds_when_model_wants_more_rollout():
    job = dataclasses.replace(JOB, bounds={"learner": RoleBounds(28, 64)})
    d = plan(metrics(rollout_gpu_s_per_traj=1.0, learner_wait_frac=0.45), INV, [job])
    assert d.allocation == Allocation(36, 28)
    assert not d.changed


def test_no_move_when_gain_is_below_transition_cost():
    # rollout a little short (~69 vs ~72 traj/s learner side): the learner gives GPUs up, so it restarts and
    # trains nothing for the 40 s switch (~69 x 40 = 2,741 trajectories); worth it over an hour ...
    m = metrics(rollout_gpu_s_per_traj=0.54, traj_tokens=1900.0)
    cheap = plan(m, INV, [JOB], PlanConfig(min_gain_frac=0.0, horizon_s=3600.0))
    assert cheap.changed and cheap.allocation.learner < 28
    assert cheap.transition_cost == pytest.approx(cheap.predicted_rate * INV.switch_cost_s, rel=0.01)
    # ... not over 15 minutes (1,667 gained)
    short = plan(m, INV, [JOB], PlanConfig(min_gain_frac=0.0))
    assert not short.changed and short.reason == "gain_below_cost"
    # ... not when a switch costs an hour and the horizon is 15 minutes
    dear = plan(m, Inventory(gpus=G, switch_cost_s=3600.0), [JOB], PlanConfig(min_gain_frac=0.0))
    assert not dear.changed and dear.reason == "gain_below_cost"
    assert dear.transition_cost > dear.expected_gain


def test_lost_inflight_work_counts_in_the_cost():
    m = metrics(rollout_gpu_s_per_traj=0.45, traj_tokens=2400.0)      # learner short: rollout GPUs leave
    few = plan(m, INV, [JOB], PlanConfig(min_gain_frac=0.0))
    many = plan(dataclasses.replace(m, rollout_inflight=36 * 5000), INV, [JOB], PlanConfig(min_gain_frac=0.0))
    assert few.changed
    assert many.transition_cost > few.transition_cost
    assert not many.changed


def test_undoing_the_last_move_needs_a_clearer_gain():
    # the learner looks ~3.5% short; moving 36/28 -> 35/29 (a learner restart) pays over an hour after a
    # quiet spell ...
    m = metrics(traj_tokens=2050.0)
    hour = PlanConfig(horizon_s=3600.0)
    assert plan(m, INV, [JOB], hour).changed
    # ... but not right after rollout was grown from 34 to 36: near balance that is noise, not drift
    back = plan(dataclasses.replace(m, changed_from=Allocation(34, 30)), INV, [JOB], hour)
    assert not back.changed and back.reason == "gain_below_cost"
    # a clear shift (~6%) still goes through
    assert plan(dataclasses.replace(m, traj_tokens=2200.0, changed_from=Allocation(34, 30)), INV, [JOB], hour).changed


def test_a_move_that_put_the_cadence_back_is_not_undone_for_the_cadence():
    # the last move took rollout from 38 to 36 at two steps per version and put the cadence back to one:
    # at one version per step the loads (3 s per version) leave rollout short, so the window asks for 38 again
    m = metrics(rollout_gpu_s_per_traj=0.7, rollout_load_s=3.0, learner_wait_frac=0.3, since_change_s=180.0,
                changed_from=Allocation(38, 26), publish_every=1, publish_reason="split_changed",
                publish_since_s=180.0)
    held = plan(m, INV, [JOB])
    assert not held.changed and held.reason == "cadence_settling" and held.allocation == Allocation(36, 28)
    # the same window once the cadence has moved again, or after three windows at one: the split's own imbalance
    for later in (dict(publish_reason="publish_less_often"), dict(publish_since_s=450.0)):
        d = plan(dataclasses.replace(m, **later), INV, [JOB])
        assert d.changed and d.allocation.rollout > 36
    # the cadence was put back by an earlier move, and the last one (180 s ago) found it at one: nothing to wait for
    d = plan(dataclasses.replace(m, publish_since_s=300.0), INV, [JOB])
    assert d.changed and d.allocation.rollout > 36
    # a move in the same direction (more learner) is not held: it does not undo the last one
    more_learner = dataclasses.replace(m, rollout_gpu_s_per_traj=0.5,
                                       traj_tokens=5000.0, backlog=20000, backlog_trend_per_s=20.0,
                                       learner_wait_frac=0.0)
    d = plan(more_learner, INV, [JOB])
    assert d.changed and d.allocation.learner > 28


def test_window_bound_when_both_sides_idle():
    # learner waits and rollout slots stand empty: the in-flight bound limits, moving GPUs would not help
    d = plan(metrics(rollout_gpu_s_per_traj=1.0, learner_wait_frac=0.6, rollout_idle_frac=0.5), INV, [JOB])
    assert not d.changed and d.reason == "window_bound"


def test_learner_wait_signal_vetoes_shrinking_rollout():
    # the rate model says learner short, but the learner idles 40% of the window: rollout is short
    m = metrics(traj_tokens=5000.0, learner_wait_frac=0.4)
    d = plan(m, INV, [JOB])
    assert "rollout_short" in d.signals
    assert d.allocation.rollout >= 36


def test_backlog_signal_vetoes_shrinking_learner():
    # the model says rollout short, but a growing backlog of several batches says the learner is short
    m = metrics(rollout_gpu_s_per_traj=1.0, backlog=3 * 4096, backlog_trend_per_s=10.0)
    d = plan(m, INV, [JOB])
    assert "learner_short" in d.signals
    assert d.allocation.learner >= 28


def test_staleness_bound_vetoes_more_rollout():
    m = metrics(rollout_gpu_s_per_traj=1.0, staleness_p50=4.0)
    d = plan(m, INV, [JOB])
    assert "at_staleness_bound" in d.signals
    assert d.allocation.rollout <= 36


def test_empty_rollout_slots_veto_more_rollout_but_not_a_bigger_learner():
    # the window's few finished trajectories are long tails (2 GPU-s each) while 70% of the decode slots stand
    # empty: the model would grow rollout, but rollout has nothing more to run
    tails = metrics(rollout_gpu_s_per_traj=2.0, rollout_idle_frac=0.7)
    assert plan(dataclasses.replace(tails, rollout_idle_frac=0.0), INV, [JOB]).allocation.rollout > 36
    d = plan(tails, INV, [JOB])
    assert "rollout_idle" in d.signals and not d.changed and d.reason == "vetoed_by_signals"
    # the same empty slots while scored data piles up: the learner grows, as it should
    d = plan(metrics(traj_tokens=5000.0, backlog=20000, backlog_trend_per_s=20.0, rollout_idle_frac=0.7), INV, [JOB])
    assert "rollout_idle" in d.signals and d.changed and d.allocation.learner > 28


def test_a_shift_under_the_window_sizes_the_move_on_the_last_interval():
    # the window (rollout 0.7 GPU-s per trajectory) asks for 41/23; the last interval's trajectories cost
    # 1.0 (43% more: responses grew under the window), and the move goes there at once
    window = metrics(rollout_gpu_s_per_traj=0.7, learner_wait_frac=0.45)
    plain = plan(window, INV, [JOB])
    assert plain.changed and plain.allocation == Allocation(41, 23) and "shifting" not in plain.signals
    shifted = plan(dataclasses.replace(window, rollout_gpu_s_per_traj_last=1.0, traj_tokens_last=2000.0),
                   INV, [JOB])
    assert shifted.changed and shifted.allocation.rollout > 41 and "shifting" in shifted.signals
    assert shifted.predicted_rate > shifted.current_rate
    # within shift_frac of the window (0.8 is 14% more), or pointing the other way: the window's move
    for last in (0.8, 0.4):
        assert plan(dataclasses.replace(window, rollout_gpu_s_per_traj_last=last, traj_tokens_last=2000.0),
                    INV, [JOB]) == plain
    # nothing finished in the last interval: nothing to read there
    assert plan(dataclasses.replace(window, rollout_gpu_s_per_traj_last=0.0), INV, [JOB]) == plain


def test_a_shift_of_tokens_grows_the_learner_further():
    window = metrics(traj_tokens=2600.0, backlog=20000, backlog_trend_per_s=20.0)
    plain = plan(window, INV, [JOB])
    shifted = plan(dataclasses.replace(window, rollout_gpu_s_per_traj_last=0.5, traj_tokens_last=3400.0),
                   INV, [JOB])
    assert plain.changed and shifted.changed and "shifting" in shifted.signals
    assert shifted.allocation.learner > plain.allocation.learner > 28


def test_the_last_interval_alone_starts_no_move():
    # the window is balanced; a last interval 2x dearer is not enough: its few trajectories are noisy
    d = plan(metrics(rollout_gpu_s_per_traj_last=1.0, traj_tokens_last=2000.0), INV, [JOB])
    assert not d.changed and d.allocation == Allocation(36, 28)


def test_reward_on_gpu_gets_its_share():
    job = dataclasses.replace(JOB, reward_on_gpu=True)
    m = metrics(allocation=Allocation(rollout=35, learner=28, reward=1), reward_s_per_traj=0.2,
                learner_wait_frac=0.5)
    d = plan(m, INV, [job])
    # one reward GPU scores 5 traj/s: far below the other stages, so reward GPUs are added
    assert d.changed and d.allocation.reward > 1 and d.allocation.total == G


def test_reward_scores_what_is_dropped_later_too():
    # 12 reward GPUs at 0.2 s score 60 traj/s; when one trajectory in five scored is dropped as stale
    # afterwards, they serve 60 x 0.8 = 48 trained trajectories a second
    job = dataclasses.replace(JOB, reward_on_gpu=True)
    m = metrics(allocation=Allocation(rollout=30, learner=22, reward=12), reward_s_per_traj=0.2)
    caps = allocator_model(m, job).caps(m.allocation)
    assert caps["reward"] == pytest.approx(60.0)
    wasted = dataclasses.replace(m, trained=8000, dropped_stale=2000)
    assert allocator_model(wasted, job).caps(m.allocation)["reward"] == pytest.approx(48.0)


def allocator_model(m, job):
    from pipeline.control.allocator import _Model
    return _Model.measured(m, INV, job)


def test_pure_and_explained():
    m = metrics(rollout_gpu_s_per_traj=1.0, learner_wait_frac=0.45)
    a, b = plan(m, INV, [JOB]), plan(m, INV, [JOB])
    assert a == b
    rec = a.event(m)
    json.dumps(rec)
    assert rec["inputs"]["rollout_gpu_s_per_traj"] == 1.0
    assert {"allocation", "reason", "expected_gain", "transition_cost", "signals"} <= rec.keys()


def test_multiple_jobs_not_planned_yet():
    with pytest.raises(ValueError, match="one job"):
        plan(metrics(), INV, [JOB, JOB])
