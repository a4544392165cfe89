import threading
import time

import numpy as np
import pytest
import redis

from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_LEARNER, GROUP_REWARD, JobKeys
from pipeline.dataplane.streams import (ClaimPolicy, Dedup, Reject, ensure_groups, group_pending, read,
                                        read_own_pending, reclaim, replay_own, run_stage, stream_lag,
                                        take_over_pending)


def unscored_group(pid: str) -> m.Group:
    ts = tuple(m.Trajectory(sample_idx=i, completion=np.array([1], np.int32), mask=np.array([1], np.uint8),
                            logprobs=np.array([-0.1], np.float32), text="x", finish="answer", turns=1,
                            tool_calls=0, tool_latency_s=(), tool_timeouts=0) for i in range(2))
    return m.Group(prompt_id=pid, prompt="Q", answer=1, prompt_tokens=np.array([1], np.int32), version=0,
                   worker="w", generated_at=0.0, gen_s=0.0, trajectories=ts)


def test_stage_writes_acks_and_dead_letters(r):
    keys = JobKeys("t")
    ensure_groups(r, keys)
    ensure_groups(r, keys)  # idempotent
    for pid in ("a", "b", "c"):
        r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(pid))})
    r.xadd(keys.rollouts, {m.FIELD: b"\xc1garbage"})
    assert stream_lag(r, keys.rollouts, GROUP_REWARD) == 4

    rounds = []

    def handle(groups):
        return [Reject("verifier exploded") if g.prompt_id == "b" else g.with_rewards([1.0, 0.0], 1.0)
                for g in groups]

    def stop():
        rounds.append(1)
        return len(rounds) > 2

    run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
              handle=handle, count=10, block_ms=50, max_bytes=1 << 20, stop=stop, counter="scored",
              claims=ClaimPolicy(min_idle_ms=60_000, max_deliveries=3))
    assert r.xlen(keys.scored) == 2
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0
    assert stream_lag(r, keys.rollouts, GROUP_REWARD) == 0
    dlq = r.xrange(keys.dead_letters)
    reasons = sorted(f[b"reason"].decode() for _i, f in dlq)
    assert reasons[0].startswith("malformed msgpack") and reasons[1] == "verifier exploded"
    assert all(f[b"stream"].decode() == keys.rollouts for _i, f in dlq)
    assert int(r.hget(keys.counters, "scored")) == 4
    scored = [m.decode(f[m.FIELD], 1 << 20) for _i, f in r.xrange(keys.scored)]
    assert [g.rewards for g in scored] == [[1.0, 0.0], [1.0, 0.0]]


def age(r, stream: str, group: str, consumer: str, entry_id: bytes, idle_ms: int) -> None:
    """Make an entry look idle for ``idle_ms`` without waiting: XCLAIM ... IDLE JUSTID by its holder sets its
    idle time and counts no delivery, so a test drives claim times instead of racing a short min_idle."""
    r.xclaim(stream, group, consumer, 0, [entry_id], idle=idle_ms, justid=True)


def test_idle_entries_are_reclaimed_then_dead_lettered_after_max_deliveries(r):
    from pipeline.dataplane.streams import ClaimKeeper, delivery_counts, read, reclaim

    keys = JobKeys("t")
    ensure_groups(r, keys)
    eid = r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("a"))})
    policy = ClaimPolicy(min_idle_ms=60_000, max_deliveries=2)
    idle = 2 * policy.min_idle_ms
    assert [i for i, _p in read(r, keys.rollouts, GROUP_REWARD, "reward-0", 10, 10)] == [eid]  # delivery 1
    # Held by a live handler: the keeper's XCLAIM JUSTID keeps it from idling and counts no delivery.
    keeper = ClaimKeeper(r, keys.rollouts, GROUP_REWARD, "reward-0", policy.min_idle_ms)
    age(r, keys.rollouts, GROUP_REWARD, "reward-0", eid, idle)
    keeper([eid]).refresh()
    assert reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-1", policy, 10, "0-0")[0] == []
    assert delivery_counts(r, keys.rollouts, GROUP_REWARD, [eid]) == {eid: 1}
    age(r, keys.rollouts, GROUP_REWARD, "reward-0", eid, idle)   # its holder died
    got, _cursor = reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-1", policy, 10, "0-0")  # delivery 2
    assert [i for i, _p in got] == [eid]
    assert reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-2", policy, 10, "0-0")[0] == []  # just claimed
    age(r, keys.rollouts, GROUP_REWARD, "reward-1", eid, idle)
    got, _cursor = reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-2", policy, 10, "0-0")  # delivery 3
    assert got == []
    (dl_id, dl), = r.xrange(keys.dead_letters)
    assert dl[b"reason"].startswith(b"exceeded max_deliveries (2)") and int(dl[b"deliveries"]) == 3
    assert dl[b"id"] == eid and int(dl[b"trajectories"]) == 2
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0


def test_a_group_written_twice_has_its_effect_once(r):
    from pipeline.dataplane.streams import Dedup, decode_entries, read, write_and_ack

    keys = JobKeys("t")
    ensure_groups(r, keys)
    for _ in range(2):  # the same group delivered twice, e.g. regenerated after a stolen claim
        r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("a"))})
    entries = read(r, keys.rollouts, GROUP_REWARD, "reward-0", 10, 10)
    good, bad = decode_entries(entries, 1 << 20)
    outputs = [g.with_rewards([1.0, 0.0], 1.0) for _i, g in good]
    write_and_ack(r, keys, keys.rollouts, GROUP_REWARD, keys.scored, good, outputs, bad, "scored", None,
                  lambda: False, Dedup("reward", 60))
    assert r.xlen(keys.scored) == 1
    assert int(r.hget(keys.counters, "scored")) == 2
    assert int(r.hget(keys.counters, "duplicates_dropped_reward")) == 2
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0
    assert 0 < r.ttl(keys.seen("reward", "a")) <= 60


def _deliver_and_write(r, keys, pid: str, dedup, client=None, rejected: str | None = None) -> None:
    """One delivery of group ``pid`` to the reward stage, scored and written by ``write_and_ack``; with
    ``rejected``, a second group in the same round that the stage rejects (a dead letter)."""
    from pipeline.dataplane.streams import Reject, decode_entries, read, write_and_ack

    for p in (pid, rejected) if rejected else (pid,):
        r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(p))})
    good, bad = decode_entries(read(r, keys.rollouts, GROUP_REWARD, "reward-0", 10, 10), 1 << 20)
    outputs = [Reject("unscorable") if g.prompt_id == rejected else g.with_rewards([1.0, 0.0], 1.0)
               for _i, g in good]
    write_and_ack(client or r, keys, keys.rollouts, GROUP_REWARD, keys.scored, good, outputs, bad, "scored", None,
                  lambda: False, dedup)


def test_a_dedup_mark_outlives_every_redelivery_and_then_expires(r):
    """docs/guarantees.md: the marks expire after (max_deliveries + 1) x min_idle + 60 s, the longest a
    redelivery can take. Time is the mark's PTTL: set to where the clock would stand, never slept through."""
    from pipeline import config as config_mod
    from pipeline.dataplane.worker import dedup_for

    cfg = config_mod.load(None, ["streams.reward_min_idle_s=30", "streams.max_deliveries=2"])
    dedup = dedup_for(cfg, "reward")
    window_ms = (2 + 1) * 30 * 1000                 # the last redelivery comes at most this long after the first
    keys = JobKeys("t")
    ensure_groups(r, keys)
    mark = keys.seen("reward", "a")
    _deliver_and_write(r, keys, "a", dedup)
    assert r.xlen(keys.scored) == 1
    assert window_ms < r.pttl(mark) <= window_ms + 60_000     # the documented lifetime, not forever (-1)

    r.pexpire(mark, 1_000)                          # one second before it expires: it still protects
    _deliver_and_write(r, keys, "a", dedup)
    assert r.xlen(keys.scored) == 1 and int(r.hget(keys.counters, "duplicates_dropped_reward")) == 2

    r.pexpire(mark, 0)                              # its lifetime is over: gone, and a copy would go through
    assert r.exists(mark) == 0
    _deliver_and_write(r, keys, "a", dedup)
    assert r.xlen(keys.scored) == 2
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0


def test_a_concurrent_writer_of_the_group_leaves_ours_a_duplicate(r, redis_url):
    """Two reward workers write the same group: the other one writes it after our read and before our
    write; our round (one script, atomic) finds its mark, writes nothing and acknowledges its input.

    The race is made, not waited for: the other writer runs from a hook just before our script."""
    import redis

    from pipeline.dataplane.redisconn import connect
    from pipeline.dataplane.streams import Dedup

    keys = JobKeys("t")
    ensure_groups(r, keys)
    dedup = Dedup("reward", 600)
    calls: list[str] = []

    class Raced(redis.Redis):
        def eval(self, *args):
            if not calls:
                _deliver_and_write(connect(redis_url), keys, "a", dedup)
            calls.append("script")
            return super().eval(*args)

    raced = Raced(connection_pool=connect(redis_url).connection_pool)
    _deliver_and_write(r, keys, "a", dedup, client=raced)
    assert calls == ["script"]                                            # one round trip, no retry
    assert r.xlen(keys.scored) == 1                                       # the other writer's copy only
    assert int(r.hget(keys.counters, "scored")) == 2                      # one group of 2 trajectories
    assert int(r.hget(keys.counters, "duplicates_dropped_reward")) == 2   # ours, counted as a duplicate
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0             # both deliveries acknowledged


def test_a_concurrent_writer_aborts_the_exec_of_a_round_with_a_dead_letter_and_it_is_redone(r, redis_url):
    """A round that dead-letters goes through WATCH / MULTI / EXEC: the other writer sets the mark we WATCH
    between our WATCH (and MGET of the marks) and our EXEC, our EXEC gets a WatchError, the round is redone,
    finds the mark, writes the dead letter and acknowledges both inputs."""
    import redis

    from pipeline.dataplane.redisconn import connect
    from pipeline.dataplane.streams import Dedup

    keys = JobKeys("t")
    ensure_groups(r, keys)
    dedup = Dedup("reward", 600)
    tries: list[str] = []

    class RacedPipeline(redis.client.Pipeline):
        def execute(self, raise_on_error=True):
            if self.watching and not tries:
                _deliver_and_write(connect(redis_url), keys, "a", dedup)
            try:
                out = super().execute(raise_on_error)
            except redis.WatchError:
                tries.append("aborted")
                raise
            tries.append("executed")
            return out

    class Raced(redis.Redis):
        def pipeline(self, transaction=True, shard_hint=None):
            return RacedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    raced = Raced(connection_pool=connect(redis_url).connection_pool)
    _deliver_and_write(r, keys, "a", dedup, client=raced, rejected="b")
    assert tries == ["aborted", "executed"]
    assert r.xlen(keys.scored) == 1                                       # the other writer's copy only
    assert int(r.hget(keys.counters, "scored")) == 2
    assert int(r.hget(keys.counters, "duplicates_dropped_reward")) == 2
    assert [f[b"reason"] for _i, f in r.xrange(keys.dead_letters)] == [b"unscorable"]
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0


def test_trim_keeps_everything_a_group_still_needs(r):
    from pipeline.dataplane.streams import read, trim, trim_point

    keys = JobKeys("t")
    ensure_groups(r, keys)
    ids = [r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(str(i)))}) for i in range(6)]
    assert trim(r, keys.rollouts) == 0  # nothing delivered yet
    got = read(r, keys.rollouts, GROUP_REWARD, "reward-0", 4, 10)  # 4 delivered, all pending
    assert trim_point(r, keys.rollouts) == ids[0].decode()
    r.xack(keys.rollouts, GROUP_REWARD, *[i for i, _p in got[:2]])  # oldest pending is now ids[2]
    assert trim(r, keys.rollouts) == 2
    assert [i for i, _f in r.xrange(keys.rollouts)] == ids[2:]
    assert stream_lag(r, keys.rollouts, GROUP_REWARD) == 2
    r.xack(keys.rollouts, GROUP_REWARD, *[i for i, _p in got[2:]])
    trim(r, keys.rollouts)
    # The last-delivered entry stays; the two never delivered are untouched.
    assert [i for i, _f in r.xrange(keys.rollouts)] == ids[3:]


def test_trim_point_when_the_group_acks_between_its_two_reads(r):
    """XINFO saw pending entries, and by XPENDING they were acknowledged: trim on, with no crash."""
    from pipeline.dataplane.streams import read, trim_point

    keys = JobKeys("t")
    ensure_groups(r, keys)
    for i in range(3):
        r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(str(i)))})
    got = read(r, keys.rollouts, GROUP_REWARD, "reward-0", 3, 10)
    info_then = r.xinfo_groups(keys.rollouts)                      # pending = 3 here
    r.xack(keys.rollouts, GROUP_REWARD, *[i for i, _p in got])     # ... and acknowledged before XPENDING

    class StaleInfo:
        def __getattr__(self, name):
            return getattr(r, name)

        def xinfo_groups(self, stream):
            return info_then

    assert trim_point(StaleInfo(), keys.rollouts) == got[-1][0].decode()


def _pending_at(r, stream: str, group: str) -> dict[str, int]:
    return {c["name"].decode(): int(c["pending"]) for c in r.xinfo_consumers(stream, group)}


def test_a_restart_replay_counts_a_delivery_and_dead_letters_past_the_limit(r):
    """A worker restarted under its name replays what it held; Redis counts each replay as a delivery, so
    an entry whose handling kills the worker is dead-lettered after max_deliveries, not replayed for ever."""
    keys = JobKeys("t")
    ensure_groups(r, keys)
    poison = m.encode(unscored_group("poison"))
    r.xadd(keys.rollouts, {m.FIELD: poison})
    policy = ClaimPolicy(min_idle_ms=60_000, max_deliveries=3)
    assert len(read(r, keys.rollouts, GROUP_REWARD, "reward-0", 10, 0)) == 1        # delivery 1: the worker dies
    for _restart in range(2):                                                      # deliveries 2 and 3
        entries, after = replay_own(r, keys, keys.rollouts, GROUP_REWARD, "reward-0", policy, 10, "0")
        assert [p for _i, p in entries] == [poison] and after is not None
    entries, after = replay_own(r, keys, keys.rollouts, GROUP_REWARD, "reward-0", policy, 10, "0")
    assert entries == [] and after is not None                                     # the 4th: dead-lettered
    [(_id, dead)] = r.xrange(keys.dead_letters)
    assert dead[b"reason"] == b"exceeded max_deliveries (3): delivered 4 times" and dead[b"payload"] == poison
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0
    assert replay_own(r, keys, keys.rollouts, GROUP_REWARD, "reward-0", policy, 10, "0") == ([], None)


def test_a_stage_restarted_under_its_name_stops_replaying_a_message_that_kills_it(r):
    """run_stage wiring: each 'process' dies (an exception run_stage does not catch) on the poison group;
    the fourth start under the same name dead-letters it and scores the group behind it."""
    keys = JobKeys("t")
    ensure_groups(r, keys)
    for pid in ("poison", "fine"):
        r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(pid))})

    class Died(BaseException):
        pass

    def handle(groups):
        if any(g.prompt_id == "poison" for g in groups):
            raise Died
        return [g.with_rewards([1.0, 0.0], 1.0) for g in groups]

    def start():
        rounds = []
        run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
                  handle=handle, count=1, block_ms=50, max_bytes=1 << 20,
                  stop=lambda: rounds.append(1) or len(rounds) > 4, counter="scored",
                  claims=ClaimPolicy(min_idle_ms=60_000, max_deliveries=3))

    for _life in range(3):
        with pytest.raises(Died):
            start()
    start()
    assert [f[b"reason"] for _i, f in r.xrange(keys.dead_letters)] == [b"exceeded max_deliveries (3): delivered 4 times"]
    assert [m.decode(f[m.FIELD], 1 << 20).prompt_id for _i, f in r.xrange(keys.scored)] == ["fine"]
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0


@pytest.mark.parametrize("taken_by", ["restart", "takeover"])
def test_a_message_that_kills_its_worker_is_dead_lettered_alone_not_with_the_good_ones_read_in_its_batch(
        r, taken_by):
    """A batch of three holds a poison group. Each worker that handles it dies; the batch comes back either
    to the worker restarted under its name (replay_own) or to another worker once idle (reclaim). Entries
    delivered before are handled one per round, so only the poison reaches max_deliveries: it alone is
    dead-lettered, and the two good groups of its batch are scored once."""
    keys = JobKeys("t")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    for pid in ("fine-a", "poison", "fine-b"):
        r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(pid))})
    policy = ClaimPolicy(min_idle_ms=60_000, max_deliveries=3)

    class Died(BaseException):   # the process dies (SIGKILL, OOM, a segfault in a native library...)
        pass

    def handle(groups):
        if any(g.prompt_id == "poison" for g in groups):
            raise Died
        return [g.with_rewards([1.0, 0.0], 1.0) for g in groups]

    def start(life: int):
        if taken_by == "takeover":   # the dead worker's entries turn idle, and a new worker takes them
            for info in r.xpending_range(keys.rollouts, GROUP_REWARD, min="-", max="+", count=10):
                age(r, keys.rollouts, GROUP_REWARD, info["consumer"], info["message_id"], 2 * policy.min_idle_ms)
        rounds = []
        run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD,
                  consumer="reward-0" if taken_by == "restart" else f"reward-{life}", sink=keys.scored,
                  handle=handle, count=16, block_ms=50, max_bytes=1 << 20,
                  stop=lambda: rounds.append(1) or len(rounds) > 4, counter="scored", claims=policy)

    for life in range(3):   # the first reads the batch whole; each dies on the poison
        with pytest.raises(Died):
            start(life)
    start(3)
    dead = [(m.decode(f[b"payload"], 1 << 20).prompt_id, f[b"reason"]) for _i, f in r.xrange(keys.dead_letters)]
    assert dead == [("poison", b"exceeded max_deliveries (3): delivered 4 times")]
    assert sorted(m.decode(f[m.FIELD], 1 << 20).prompt_id for _i, f in r.xrange(keys.scored)) == ["fine-a", "fine-b"]
    assert group_pending(r, keys.rollouts, GROUP_REWARD) == 0


def test_take_over_pending_moves_a_dead_consumers_entries_to_a_new_name_once(r):
    """Two ranks of an old world (learner-0, learner-1) die holding entries; a learner under a new
    consumer name takes them over, reads each once from its own pending list, and acknowledges it."""
    keys = JobKeys("t")
    ensure_groups(r, keys)
    ids = [r.xadd(keys.scored, {m.FIELD: m.encode(unscored_group(f"g{i}"))}) for i in range(6)]
    r.xreadgroup(GROUP_LEARNER, "learner-0", {keys.scored: ">"}, count=3)
    r.xreadgroup(GROUP_LEARNER, "learner-1", {keys.scored: ">"}, count=2)
    r.xack(keys.scored, GROUP_LEARNER, ids[4])               # learner-1 finished one of its two
    assert take_over_pending(r, keys.scored, GROUP_LEARNER, "learner-new") == 4
    assert _pending_at(r, keys.scored, GROUP_LEARNER) == {"learner-0": 0, "learner-1": 0, "learner-new": 4}
    assert take_over_pending(r, keys.scored, GROUP_LEARNER, "learner-new") == 0   # its own are not taken again
    # the take-over is not a delivery: a poison entry's count stays what the dead consumer made it
    assert {int(p["times_delivered"]) for p in r.xpending_range(keys.scored, GROUP_LEARNER, "-", "+", 10)} == {1}
    mine = read_own_pending(r, keys.scored, GROUP_LEARNER, "learner-new", count=100)
    assert [i for i, _f in mine] == [ids[0], ids[1], ids[2], ids[3]]
    r.xack(keys.scored, GROUP_LEARNER, *[i for i, _f in mine])
    new = r.xreadgroup(GROUP_LEARNER, "learner-new", {keys.scored: ">"}, count=100)
    assert [i for i, _f in new[0][1]] == [ids[5]]           # then only what no one had read
    assert group_pending(r, keys.scored, GROUP_LEARNER) == 1


class _FullForScripts:
    """A client for one stage whose write+ack script meets a full Redis (noeviction: OOM) until ``freed``.
    Everything else (reads, XCLAIM, XACK: not refused by a full Redis, checked on 6.2) goes through."""

    def __init__(self, r: redis.Redis):
        self._r, self.freed, self.refused = r, threading.Event(), 0

    def eval(self, *args, **kwargs):
        if not self.freed.is_set():
            self.refused += 1
            raise redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
        return self._r.eval(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._r, name)


def test_a_worker_waiting_out_a_full_redis_keeps_its_claim_and_its_group_is_scored_once(r):
    """A full Redis is backpressure: the stage holds its batch while its write waits. The claim is kept
    through that wait (XCLAIM still goes through a full Redis), so another worker's reclaim finds nothing
    idle; were it taken, the reclaim past max_deliveries (1 here) would dead-letter the group while the
    holder's write scores it once memory frees: counted twice."""
    keys = JobKeys("full")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("g"))})
    policy = ClaimPolicy(min_idle_ms=1000, max_deliveries=1)
    full = _FullForScripts(r)
    stopping = threading.Event()
    holder = threading.Thread(target=run_stage, daemon=True, args=(full, keys), kwargs=dict(
        source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
        handle=lambda groups: [g.with_rewards([1.0, 0.0], 1.0) for g in groups], count=16, block_ms=20,
        max_bytes=1 << 20, claims=policy, stop=stopping.is_set, counter="scored", dedup=Dedup("reward", 600)))
    holder.start()
    try:
        deadline = time.monotonic() + 10
        while full.refused == 0 and time.monotonic() < deadline:   # reward-0 scored it, and waits to write
            time.sleep(0.02)
        assert full.refused > 0
        time.sleep(2.0)          # Redis stays full for 2 x min_idle; reward-0 is alive and waiting all along
        # another reward worker's round: its reclaim scan
        assert reclaim(r, keys, keys.rollouts, GROUP_REWARD, "reward-1", policy, 1, "0-0")[0] == []
        full.freed.set()         # memory frees; reward-0's write goes through
        deadline = time.monotonic() + 15
        while r.xlen(keys.scored) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        full.freed.set()
        stopping.set()
        holder.join(timeout=15)
    scored = [m.decode(f[m.FIELD], 1 << 20).prompt_id for _i, f in r.xrange(keys.scored)]
    dead = [f[b"reason"].decode() for _i, f in r.xrange(keys.dead_letters)]
    c = {k.decode(): int(v) for k, v in r.hgetall(keys.counters).items()}
    assert scored == ["g"] and dead == [] and c.get("scored") == 2 and "dead_lettered" not in c
