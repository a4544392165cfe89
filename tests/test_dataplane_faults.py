"""The data plane's bookkeeping at its edges: a pending entry deleted from its stream, the sim learner's trim, and
a job name reused while its previous run is still stopping. Nothing stays in flight or pending for good, no
stream keeps what every group acknowledged, and no run's keys are cleared under its workers.

Against the suite's Redis.
"""

from __future__ import annotations

import os
import socket
import time


from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_REWARD, JobKeys
from pipeline.dataplane.streams import (ClaimPolicy, counted_in_flight, ensure_groups, group_pending, read,
                                        reclaim, trim_point)
from tests.test_streams import unscored_group


def _counters(r, keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(keys.counters).items()}


# --- a pending entry deleted from the stream pins the trim point and the in-flight count for ever ------------


def test_stage_reclaim_of_an_entry_deleted_while_pending_dead_letters_it(r):
    """A stage's reclaim dead-letters (and acknowledges) a pending entry that is gone from the stream, as the
    learner does: it leaves the pending list, the trim point passes it, and its group leaves the in-flight
    count. Before, Redis 6.2's nil answer was filtered out: the entry stayed pending for good (its delivery
    count climbing on every scan), the stream was never trimmed past it, and the feeder lost a group of
    admission room for good."""
    keys = JobKeys("t")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    r.hset(keys.counters, mapping={"issued": 6, "generated": 6})   # three groups of 2 reached the reward stage
    ids = [r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(str(i)))}) for i in range(3)]
    read(r, keys.rollouts, GROUP_REWARD, "reward-0", 3, 10)        # reward-0 holds all three, then dies
    r.xdel(keys.rollouts, ids[0])                                  # an operator deletes one of them
    time.sleep(0.05)
    policy = ClaimPolicy(min_idle_ms=10, max_deliveries=2)
    for _ in range(8):                      # reward-1 scans for idle entries, well past max_deliveries
        time.sleep(0.02)
        cursor = "0-0"
        while True:
            got, cursor = reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-1", policy, 1, cursor)
            for entry_id, _payload in got:  # handled: acknowledged (its output is not the point here)
                r.xack(keys.rollouts, GROUP_REWARD, entry_id)
            if cursor == "0-0":
                break
    pending = [p["message_id"] for p in r.xpending_range(keys.rollouts, GROUP_REWARD, "-", "+", 10)]
    assert ids[0] not in pending, "the deleted entry is still pending after 8 scans"
    assert [f[b"id"] for _i, f in r.xrange(keys.dead_letters)] == [ids[0]]
    assert counted_in_flight(_counters(r, keys)) == 4   # 6 issued, 2 dead-lettered; the other 4 still in flight
    point = trim_point(r, keys.rollouts)
    assert point is not None and point != ids[0].decode()


# --- the sim backend's learner never trims the scored stream ---------------------------------------------------


def test_the_sim_learner_trims_the_scored_stream_it_acknowledged(r, redis_url, tmp_path):
    """The sim learner trims ``scored`` after each step's acks, as the real learner does after its checkpoint
    (design.md, Trimming). Before, it never trimmed: a sim run (the live benches) kept every group ever
    scored."""
    from tests.test_sim_workers import _scored, sim_job, start, stop_all, wait_for

    run_dir = sim_job(r, redis_url, tmp_path, time_scale=20.0,
                      job={"steps": 3, "batch_size": 8, "max_staleness": 2})
    keys = JobKeys("simtest")
    for i in range(6):   # two groups of 4 per step, all of version 0 (at most 2 updates old by step 3)
        r.xadd(keys.scored, {m.FIELD: m.encode(_scored(f"p{i}@0", 0))})
    p = start("learner", run_dir, "learner-0", redis_url)
    try:
        wait_for(lambda: r.hget(keys.state, "phase") == b"trained", 60, "three steps from the six groups")
        assert p.wait(timeout=30) == 0
    finally:
        stop_all([p])
    assert int(r.hget(keys.counters, "trained")) == 24
    assert group_pending(r, keys.scored, "learner") == 0          # every entry acknowledged ...
    assert r.xlen(keys.scored) <= 1, f"{r.xlen(keys.scored)} acknowledged entries left in the scored stream"


# --- reset_job clears a job whose run is still stopping ----------------------------------------------------------


def test_reset_job_refuses_a_run_that_is_still_stopping_its_workers(r):
    """A run writes the phase ``stopping`` while it stops its workers (up to STOP_GRACE_S and more: the
    learner's drain checkpoint and acks), and a second ``libra-ctl run`` of the job name is refused then.
    Before, the phase went to "stopped" first, and reset_job cleared the live run's streams, counters and
    pending entries under its still-running workers."""
    from types import SimpleNamespace

    from pipeline.dataplane.jobs import JobRunning, reset_job
    from pipeline.run import _stop

    keys = JobKeys("j")
    # what Orchestrator.run records for a live run (pid and host of the orchestrator: this process)
    r.hset(keys.state, mapping={"phase": "running", "pid": os.getpid(), "host": socket.gethostname(),
                                "run_dir": "/tmp/some-run"})
    r.xadd(keys.scored, {m.FIELD: b"x"})
    seen = {}

    def stop_children():   # the workers still drain; another `libra-ctl run -o job.name=j` starts now
        try:
            reset_job(r, keys)
            seen["reset"] = "cleared"
        except JobRunning:
            seen["reset"] = "refused"
        seen["scored_kept"] = bool(r.exists(keys.scored))

    _stop(SimpleNamespace(r=r, keys=keys, stop_children=stop_children, written=None, tracker=None), None)
    assert seen == {"reset": "refused", "scored_kept": True}
