"""What the feeder counts in flight and what the dead letters say, at a learner's edges: the groups held read
ahead when a learner drains, a group without signal dead-lettered out of its batch, a job name claimed by two
runs at once, and the delivery count of a dead letter for an entry deleted while pending.

Against a real Redis server, with the learner in-process (``tests.test_learner_recovery``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pipeline.dataplane import messages
from pipeline.dataplane.jobs import JobRunning, reset_job
from pipeline.dataplane.keys import GROUP_LEARNER, LEARNER, JobKeys
from pipeline.dataplane.lookahead import COUNTER as AHEAD_COUNTER
from pipeline.dataplane.streams import ClaimPolicy, counted_in_flight, ensure_groups, learner_backlog, reclaim
from tests.test_learner_recovery import G, feed, in_process_learner, policy_dir, scored_groups, setup_run
from workers import feeder

__all__ = ["policy_dir"]   # the module-scoped fixture, imported so pytest finds it here


def _with_rewards(group: messages.Group, rewards: list[float]) -> messages.Group:
    return group.with_rewards(rewards, scored_at=time.time())


# --- 1. the read-ahead count after a learner drain ------------------------------------------------------


def test_a_learner_drained_with_groups_read_ahead_keeps_them_in_the_backlog(tmp_path, r, redis_url, policy_dir):
    """Groups the learner read ahead of its batch stay pending at learner-0 (not in the scored stream's lag)
    when it drains before training, so ``learner_ahead`` keeps counting them until the next learner replays
    them, and the feeder's backlog hold (``learner_behind``) stays on. Before, ``let_go_of_batch`` wrote
    ``learner_ahead = 0``: the backlog read 0, and the feeder let new prompts in for as long as no learner
    ran (a restart, a move to other slots)."""
    # batch 4 groups, backlog_batches 1: the learner reads 8 groups, takes 4 and holds 4 ahead
    run_dir, cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                             extra=("job.steps=2", "streams.backlog_batches=1", "learner.prefetch=false",
                                    "learner.max_staleness=2"))
    keys = JobKeys("rec")
    feed(r, scored_groups(policy_dir, 8), issued=8, at_once=True)
    learner = in_process_learner(run_dir, r)
    read = learner.read_entries

    def drained_while_reading(count, block_ms, held):   # SIGTERM arrives while the batch's groups come in
        out = read(count, block_ms, held)
        learner.ctx.stop_event.set()
        return out

    learner.read_entries = drained_while_reading
    learner.run()
    assert learner.step == 0 and len(learner.ahead) == 4
    pending = r.xpending(keys.scored, GROUP_LEARNER)["pending"]
    assert pending == 8                               # batch and read-ahead groups: all still waiting for a learner
    # the 4 groups held ahead would be lag without the read-ahead: the backlog must still count them
    assert learner_backlog(r, keys) >= 4, r.hget(keys.counters, AHEAD_COUNTER)
    assert feeder.learner_behind(learner.ctx)         # 4 groups x 4 >= backlog_batches (1) x batch_size (16)


# --- 3. a no-signal group dead-lettered from the batch ---------------------------------------------------


def test_a_no_signal_group_dead_lettered_before_training_is_not_counted_twice_in_flight(
        tmp_path, r, redis_url, policy_dir):
    """With dynamic sampling a group without signal is counted at once as ``filtered_held``; dead-lettered
    out of the batch (here: its training attempts are spent), it is counted once, by ``dead_lettered``: while
    the step trains, in flight is the 4 groups with signal. Before, ``dead_letter_entries`` took the group out
    of ``batch.groups`` but not out of ``batch.no_signal``: counted twice until the step's commit, the feeder
    over-issued by a group, and ``filtered_no_signal`` kept it for good."""
    run_dir, cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                             extra=("job.steps=1", "learner.dynamic_sampling=true", "learner.prefetch=false",
                                    "learner.max_train_attempts=2"))
    keys = JobKeys("rec")
    gs = scored_groups(policy_dir, 5)
    signal = [_with_rewards(g, [1.0, 0.0, 1.0, 0.0]) for g in gs[:4]]
    flat = _with_rewards(gs[4], [1.0] * G)            # all rewards equal: no signal
    ids = [r.xadd(keys.scored, {messages.FIELD: messages.encode(g)}) for g in [flat, *signal]]
    r.hincrby(keys.counters, "issued", 5 * G)
    r.hincrby(keys.counters, "issued_prompts", 5)
    r.sadd(keys.issued, *[g.prompt_id for g in gs])
    # a predecessor's training raised on it twice: dead-lettered before this step trains
    r.hset(keys.learner_attempts, ids[0], json.dumps({"n": 2, "error": "RuntimeError: boom"}))
    learner = in_process_learner(run_dir, r)
    seen = {}

    class Stop(BaseException):   # past train_contained's handler of training errors
        pass

    def train(batch):
        c = {k.decode(): int(v) for k, v in r.hgetall(keys.counters).items()}
        seen.update(counters=c, groups=len(batch.groups))
        raise Stop

    learner.train = train
    try:
        learner.run()
    except Stop:
        pass
    c = seen["counters"]
    assert seen["groups"] == 4 and c["dead_lettered"] == G        # the flat group went to the dead letters
    assert counted_in_flight(c) == 4 * G, c                        # the 4 groups with signal, in training


# --- 4. reset_job: check, then delete -------------------------------------------------------------------


def test_reset_job_does_not_delete_the_keys_of_a_run_that_claims_the_job_between_its_check_and_its_delete(
        r, monkeypatch):
    """``reset_job`` deletes a job's keys only if no live run owns the job at the moment of the delete (one
    transaction, WATCH on the state): a run that wrote its state (phase running, a live pid) after the check
    makes it retry and raise JobRunning. Before, it read the state, then SCANned and deleted in separate
    commands: the other run's state, policy and streams were deleted under it."""
    import redis

    keys = JobKeys("race")
    real_hgetall = redis.commands.core.HashCommands.hgetall
    claimed = []

    def other_run_claims():   # the other run of the job name: its state, policy and consumer groups
        claimed.append(True)
        r.hset(keys.state, mapping={"phase": "running", "pid": os.getpid(), "host": socket.gethostname(),
                                    "run_dir": "/other"})
        r.hset(keys.policy, mapping={"version": 0, "path": "/p", "step": 0})
        ensure_groups(r, keys)

    def hgetall(self, name):   # on a client or a pipeline under WATCH: the claim lands right after our read
        out = real_hgetall(self, name)
        if name == keys.state and not claimed:
            other_run_claims()
        return out

    monkeypatch.setattr(redis.commands.core.HashCommands, "hgetall", hgetall)
    try:
        reset_job(r, keys)
    except JobRunning:
        pass
    monkeypatch.undo()
    if not claimed:   # a reset with no read to interleave with (one script): the other run claims after it
        other_run_claims()
    assert r.hget(keys.state, "run_dir") == b"/other"     # the live run's state survives
    assert r.exists(keys.policy) and r.exists(keys.scored)


def test_a_second_run_of_a_job_name_is_refused_from_the_first_ones_reset_on(r, redis_url):
    """``reset_job`` claims the job for its process (phase ``starting``) in the transaction that clears it: a
    second run of the name, started before the first writes its running state (seconds later, after the
    manifest and the policy), is refused, and the first one's keys stay. Before, both passed the check and
    the second cleared the first's keys. A process may reset its own claim again (a retry)."""
    keys = JobKeys("twice")
    reset_job(r, keys)
    r.hset(keys.policy, mapping={"version": 0, "path": "/p", "step": 0})
    reset_job(r, keys)   # ours: allowed
    r.hset(keys.policy, mapping={"version": 0, "path": "/p", "step": 0})
    code = ("import sys; from pipeline.dataplane.jobs import JobRunning, reset_job; "
            "from pipeline.dataplane.keys import JobKeys; from pipeline.dataplane.redisconn import connect\n"
            "try:\n    reset_job(connect(sys.argv[1]), JobKeys('twice'))\n"
            "except JobRunning as exc:\n    print(exc); sys.exit(3)\n")
    other = subprocess.run([sys.executable, "-c", code, redis_url], capture_output=True, text=True, timeout=60,
                           cwd=Path(__file__).resolve().parents[1])
    assert other.returncode == 3, other.stdout + other.stderr
    assert "belongs to a live run (phase starting" in other.stdout
    assert r.hget(keys.state, "phase") == b"starting" and r.exists(keys.policy)


# --- 5. deliveries of a dead letter for an entry deleted while pending ----------------------------------


def _delivered_three_times_then_deleted(r, keys: JobKeys, stream: str, group: str, consumer: str) -> bytes:
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", G)
    entry = r.xadd(stream, {messages.FIELD: b"x"})
    r.xreadgroup(group, consumer, {stream: ">"}, count=1)        # delivery 1
    r.xreadgroup(group, consumer, {stream: "0"}, count=1)        # 2 (read from the consumer's history)
    r.xreadgroup(group, consumer, {stream: "0"}, count=1)        # 3
    [info] = r.xpending_range(stream, group, min="-", max="+", count=10)
    assert info["times_delivered"] == 3
    r.xdel(stream, entry)
    return entry


def test_a_reclaimed_entry_deleted_while_pending_is_dead_lettered_with_its_real_delivery_count(r):
    """The dead letter of a pending entry deleted from its stream records how many times it was delivered
    (XPENDING still reports it: 3 here), as every other dead letter does. Before, the reclaim's script wrote
    ``deliveries`` 1 whatever the count."""
    keys = JobKeys("dlq5")
    entry = _delivered_three_times_then_deleted(r, keys, keys.rollouts, "reward", "reward-a")
    got, _cursor = reclaim(r, keys, keys.rollouts, "reward", "reward-b", ClaimPolicy(min_idle_ms=0, max_deliveries=10),
                           count=10, cursor="0-0")
    assert got == []
    [(_id, dead)] = r.xrange(keys.dead_letters)
    assert dead[b"id"] == entry and dead[b"reason"] == b"deleted from the stream while pending"
    assert int(dead[b"deliveries"]) == 3


def test_the_learners_replay_dead_letters_an_entry_deleted_while_pending_with_its_real_delivery_count(
        tmp_path, r, redis_url, policy_dir):
    """As above, on the learner's replay of its pending entries. Before, its dead letter said 1."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True)
    keys = JobKeys("rec")
    entry = _delivered_three_times_then_deleted(r, keys, keys.scored, GROUP_LEARNER, LEARNER)
    learner = in_process_learner(run_dir, r)
    assert learner.replay_unheld(10, set()) == []
    [(_id, dead)] = r.xrange(keys.dead_letters)
    assert dead[b"id"] == entry and dead[b"reason"] == b"deleted from the stream while pending"
    assert int(dead[b"deliveries"]) == 3
