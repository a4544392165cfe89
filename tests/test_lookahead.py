"""The learner's read-ahead (``pipeline.dataplane.lookahead``): which groups in hand it consumes, in what order,
how far it reads, and the backlog it reports; and the des engine's learner, which takes its queue the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.lookahead import COUNTER, InHand, admission_order, limit_groups
from pipeline.dataplane.streams import downstream_backlog, ensure_groups, learner_backlog
from pipeline.sim import des, fluid
from pipeline.sim.workload import load_workload

BENCH = Path(__file__).resolve().parents[1] / "examples" / "bench"


def test_the_last_chances_come_first_then_arrival_order_and_the_stale_apart():
    # bound 2: staleness 2 is the last step that may take a group; 3, or a version the learner cannot place, never
    order, stale = admission_order([0, 2, None, 1, 3, 2, 0], bound=2)
    assert order == [1, 5, 0, 3, 6]
    assert stale == [2, 4]


def test_groups_in_hand_consume_the_stale_and_the_duplicates_before_any_admission():
    hand = InHand(limit=8)
    for i in range(5):
        hand.add(f"{i}-0".encode(), f"g{i}", b"")
    order, must = hand.order([0, 1, 3, 1, 0], [False, False, False, False, True], bound=1)
    assert order == [2, 4, 1, 3, 0] and must == 2     # stale 2, duplicate 4; then last chances 1, 3; then 0
    assert [g for _i, g, _p in hand.take([2, 4, 1])] == ["g2", "g4", "g1"]
    assert [g for _i, g, _p in hand.items] == ["g0", "g3"]     # the rest keep their arrival order


def test_without_read_ahead_the_groups_go_in_arrival_order_and_reads_ask_for_what_the_batch_wants():
    hand = InHand(limit=0)
    assert hand.read_count(want=7, run_wants=70) == 7
    for i in range(3):
        hand.add(str(i).encode(), i, b"")
    # every group read is consumed, whether or not the batch is full (a dynamic-sampling step may end at its cap)
    assert hand.order([2, 5, 0], [False, True, False], bound=2) == ([0, 1, 2], 3)
    assert hand.read_count(want=7, run_wants=70) == 4


def test_read_ahead_reaches_the_batch_and_the_backlog_the_feeder_allows():
    # 256 trajectories a batch in groups of 8, the feeder holding at 1.25 batches: 2.25 batches of groups
    assert limit_groups(256, 8, 1.25, 2, True) == 72
    assert limit_groups(256, 8, 1.25, 2, False) == 0
    assert limit_groups(256, 8, 1.25, 0, True) == 0    # synchronous: every admitted group is at its last chance
    hand = InHand(limit=72)
    for i in range(70):
        hand.add(str(i).encode(), i, b"")
    assert hand.read_count(want=1, run_wants=1000) == 2 and hand.read_count(want=5, run_wants=1000) == 2
    # the last batches: no more in hand than the run will take; none to read while the hand fills the batch
    assert hand.read_count(want=32, run_wants=71) == 1 and hand.read_count(want=32, run_wants=64) == 0
    assert hand.read_count(want=75, run_wants=75) == 5


def test_the_learners_backlog_counts_the_groups_it_holds_in_hand(r):
    keys = JobKeys("ahead")
    ensure_groups(r, keys)
    for i in range(3):
        r.xadd(keys.scored, {"m": str(i)})
    assert learner_backlog(r, keys) == 3
    r.xreadgroup("learner", "learner-0", {keys.scored: ">"}, count=2)   # read ahead: no longer lag
    r.hset(keys.counters, COUNTER, 2)
    assert learner_backlog(r, keys) == 3 and downstream_backlog(r, keys) == 3


@pytest.mark.slow
def test_the_des_learner_taking_last_chances_first_drops_fewer_on_drift():
    # drift, default seed: in arrival order 2,416 trajectories go stale (0.49% of trained), most at the turns
    # of phase, where long groups of the old phase finish behind fresh ones; taking the groups at their last
    # step first and dropping the stale ones in hand at once: 2,104 (0.43%), and the rate no lower
    wl = load_workload(BENCH / "drift.toml")

    def run(lookahead: bool):
        sim = des.AsyncSim(wl, fluid.static_split(wl), wl.job.seed, des.LIBRA_CONTROL)
        if not lookahead:
            sim.lookahead = 0
        return sim.run()

    ahead, in_order = run(True), run(False)
    assert ahead.dropped_stale < 0.9 * in_order.dropped_stale
    assert ahead.trajectories_per_s >= in_order.trajectories_per_s
    assert ahead.staleness_p99 <= wl.job.max_staleness
