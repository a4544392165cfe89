"""Stream adapters: the read -> process -> write -> ack loop, written once.

A stage is a function from decoded input messages to output messages (or
``Reject``s); ``run_stage`` wraps it between two Redis streams. Output and the
acknowledgement of its input go in one atomic step (a Lua script, or a
MULTI/EXEC transaction in a round that dead-letters), so a crash leaves
either both or neither. Messages that fail to decode, and inputs the
stage rejects, go to the job's dead-letter stream with the reason. Called by
the rollout and reward worker processes; the learner uses ``read`` and
``dead_letter`` but defers its acks to its checkpoints.

Redis blips: every transaction here runs once even when its EXEC reply is
lost (the connection dropped after the server ran it): it writes a mark
(``keys.txn_mark``) and checks it before each try (inside the script, or
under WATCH), so a retry finds the mark and stops. While Redis is unreachable a write waits
(``redisconn.Outage``) with its outputs in hand, and ``run_stage`` retries the
round, then reads its own pending entries first: those whose XREADGROUP
reply was lost are delivered to it and would otherwise wait for a reclaim
(so does a stage at its start: a worker restarted under its stable name
takes its predecessor's batch back at once).
"""

from __future__ import annotations

import ctypes
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable

import redis

from pipeline.dataplane import messages
from pipeline.dataplane.keys import GROUP_LEARNER, GROUP_REWARD, JobKeys, txn_mark
from pipeline.dataplane.lookahead import COUNTER as AHEAD_COUNTER
from pipeline.dataplane.redisconn import UNAVAILABLE, Outage, outage_limit_s

Entry = tuple[bytes, bytes]  # (stream id, payload)
TRIM_EVERY = 20  # rounds of a stage between trims of its source stream
PENDING_SLACK = 1000  # a claim keeper lists this many more of its consumer's pending entries than it holds


def txn_mark_ttl_s() -> int:
    """How long a transaction's mark lives: longer than any retry of it (an outage, then a retry)."""
    return int(max(300.0, 2 * outage_limit_s() + 60))


@dataclass(frozen=True)
class Reject:
    """A stage's verdict that an input cannot be processed; it is dead-lettered with ``reason``."""

    reason: str


# glibc's mallopt parameters, and the values run_stage sets (see tune_allocator).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling: a read of 16 groups (~2.4 MB) and an 8 MB message stay below
_TRIM_THRESHOLD = 128 << 20
_allocator_tuned = False


def tune_allocator() -> bool:
    """Keep freed payload-sized buffers in the process instead of handing them back to the OS.

    A stage allocates and frees buffers of 100 KB to a few MB per message
    (socket reads, msgpack bytes, encoded outputs). glibc serves those with
    mmap, or trims them off the heap on free, so the next message faults
    every page in again: a third of a stage's CPU at 16 KB trajectories.
    Raising the mmap and trim thresholds keeps them (at most
    ``_TRIM_THRESHOLD`` of free memory per process). Once per process; a
    no-op off glibc. Returns whether it applied.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    _allocator_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _allocator_tuned


def ensure_groups(r: redis.Redis, keys: JobKeys) -> None:
    """Create each stage's consumer group (and its stream) if missing; safe to call from every process."""
    for _stage, stream, group in keys.stages:
        try:
            r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def read(r: redis.Redis, stream: str, group: str, consumer: str, count: int, block_ms: int | None) -> list[Entry]:
    """New entries for this consumer (at most ``count``), waiting up to ``block_ms`` (None: not at all)."""
    reply = r.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
    return _entries(reply)


def read_own_pending(r: redis.Redis, stream: str, group: str, consumer: str, count: int,
                     after: str = "0") -> list[Entry]:
    """Entries delivered to this consumer and not acknowledged, after id ``after``.

    Each read counts a delivery: Redis (6.2 and 7 alike) raises a pending
    entry's delivery count when its consumer reads it from its history. Use
    ``replay_own`` in a stage, which holds the replay to ``max_deliveries``.
    """
    return _entries(r.xreadgroup(group, consumer, {stream: after}, count=count))


def _entries(reply) -> list[Entry]:
    out = []
    for _name, entries in reply or ():
        for entry_id, fields in entries:
            out.append((entry_id, fields.get(messages.FIELD, b"")))
    return out


def decode_entries(entries: Iterable[Entry], max_bytes: int):
    """Split entries into ``(id, message)`` and ``(id, payload, reason)`` for the bad ones."""
    good, bad = [], []
    for entry_id, payload in entries:
        try:
            good.append((entry_id, messages.decode(payload, max_bytes)))
        except messages.BadMessage as exc:
            bad.append((entry_id, payload, exc.reason))
    return good, bad


def dead_letter(pipe, keys: JobKeys, source: str, entry_id: bytes, reason: str,
                payload: bytes = b"", deliveries: int = 1, trajectories: int = 0) -> None:
    """Queue a dead-letter record on ``pipe`` (a transaction the caller executes).

    ``trajectories`` is what the entry stood for (``trajectories_of``): the
    feeder's in-flight count falls by it, and the audit counts it, so a
    dead letter that says 0 leaks admission room for good. ``payload`` is
    the entry's raw bytes, whole (not a summary and not a re-encoding):
    ``libra-ctl dlq replay`` puts exactly these bytes back on ``source``.
    """
    pipe.xadd(keys.dead_letters, {
        "reason": reason, "stream": source, "id": entry_id, "deliveries": deliveries,
        "trajectories": trajectories, "payload": payload, "at": time.time(),
    })
    pipe.hincrby(keys.counters, "dead_lettered", trajectories)
    pipe.hincrby(keys.counters, "dead_letter_messages", 1)


def redis_full(exc: redis.ResponseError) -> bool:
    """Whether Redis refused a write because it is at ``maxmemory`` (``noeviction``).

    redis-py 5 and later raise ``OutOfMemoryError`` and strip the ``OOM``
    error code from the message; older ones raise a ResponseError whose
    message starts with it.
    """
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or str(exc).startswith("OOM")


def execute_with_backpressure(build: Callable[[], "redis.client.Pipeline"], log=None,
                              stop: Callable[[], bool] = lambda: False) -> list | None:
    """Run a transaction once, waiting while Redis is full or unreachable.

    A full Redis (``noeviction`` refuses writes with OOM) is backpressure,
    never a crash or a drop: the same transaction is rebuilt and retried
    until it goes through. So is an unreachable Redis, up to the outage limit.
    ``build()`` returns a transaction pipeline with its writes queued; its
    first command's key gives the hash tag of the mark that makes a retry
    after a lost EXEC reply a no-op (then the result is None).
    """
    wait, outage = FullRedisWait(log, stop), Outage(log, stop=stop)
    mark = None

    def attempt():
        nonlocal mark
        pipe = build()
        stack, pipe.command_stack = pipe.command_stack, []
        if mark is None:
            mark = txn_mark(_first_key(stack), uuid.uuid4().hex)
        try:
            pipe.watch(mark)
            if pipe.exists(mark):
                return None   # an earlier try ran; its reply was lost
            pipe.multi()
            pipe.command_stack.extend(stack)
            pipe.set(mark, 1, ex=txn_mark_ttl_s())
            return pipe.execute()[:-1]
        except redis.WatchError:
            return _AGAIN
        finally:
            pipe.reset()

    while (out := _waiting_out_redis(attempt, wait, outage)) is _AGAIN:
        pass
    return out


def _first_key(stack) -> str:
    for args, _options in stack:
        if len(args) > 1:
            key = args[1]
            return key.decode() if isinstance(key, bytes) else str(key)
    return ""


class FullRedisWait:
    """The wait between tries of a write that a full Redis refused: doubling, up to 5 s."""

    def __init__(self, log=None, stop: Callable[[], bool] = lambda: False):
        self.log, self.stop, self.delay = log, stop, 0.1

    def after(self, exc: redis.ResponseError) -> None:
        """Sleep before the next try; re-raise anything that is not a full Redis, or when stopping."""
        if not redis_full(exc) or self.stop():
            raise exc
        if self.log:
            self.log.warning("redis_full_waiting", delay_s=self.delay)
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 5.0)


_AGAIN = object()   # an attempt a concurrent writer aborted: try again


def _waiting_out_redis(attempt: Callable[[], object], wait: FullRedisWait, outage: Outage):
    """``attempt()``'s result, tried again while Redis is unreachable (up to the outage limit) or full."""
    while True:
        try:
            result = attempt()
        except UNAVAILABLE as exc:
            outage.wait(exc)
        except redis.ResponseError as exc:
            wait.after(exc)
        else:
            outage.ok()
            return result


# Counts the entries of KEYS[1] after id ARGV[1] (exclusive), at most ARGV[2], in pages, inside the
# server: the payloads never cross the wire. Only for Redis 6.2, whose XINFO GROUPS has no lag.
_COUNT_AFTER = """
local n, start, cap = 0, '(' .. ARGV[1], tonumber(ARGV[2])
while n < cap do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', math.min(100, cap - n))
  if #page == 0 then break end
  n = n + #page
  start = '(' .. page[#page][1]
end
return n
"""


def transact(r: redis.Redis, queue: Callable[["redis.client.Pipeline"], None], log=None,
             stop: Callable[[], bool] = lambda: False) -> list:
    """Queue writes with ``queue(pipe)`` and run them as one transaction, waiting while Redis is full."""
    def build():
        pipe = r.pipeline(transaction=True)
        queue(pipe)
        return pipe

    return execute_with_backpressure(build, log, stop)


def stream_lag(r: redis.Redis, stream: str, group: str, cap: int = 10_000) -> int:
    """Entries not yet delivered to ``group`` (at most ``cap``).

    Redis 7 reports it (XINFO GROUPS ``lag``). Redis 6.2 (the embedded
    server) does not, so there the entries after the group's last-delivered
    id are counted by a server-side script: a round trip, not the payloads.
    """
    last = b"0-0"
    for info in r.xinfo_groups(stream):
        if info["name"] in (group, group.encode()):
            if info.get("lag") is not None:
                return min(int(info["lag"]), cap)
            last = info["last-delivered-id"]
            break
    last = last.decode() if isinstance(last, bytes) else last
    return int(r.eval(_COUNT_AFTER, 1, stream, last, cap))


def _id_key(entry_id) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def trim_point(r: redis.Redis, stream: str) -> str | None:
    """The oldest entry any consumer group still needs, or None when there is no group.

    That is the minimum over groups of the oldest pending id and the
    last-delivered id: everything before it has been delivered to and
    acknowledged by every group. Never MAXLEN, which drops unacknowledged data.
    """
    needed = []
    for info in r.xinfo_groups(stream):
        needed.append(info["last-delivered-id"])
        if int(info["pending"]):
            # a separate call: the group may have acknowledged everything since XINFO (then min is None)
            oldest_pending = r.xpending(stream, info["name"])["min"]
            if oldest_pending is not None:
                needed.append(oldest_pending)
    if not needed:
        return None
    oldest = min(needed, key=_id_key)
    return oldest.decode() if isinstance(oldest, bytes) else oldest


def trim(r: redis.Redis, stream: str) -> int:
    """Drop the entries no group needs any more (XTRIM MINID); returns how many went."""
    point = trim_point(r, stream)
    if point is None or point == "0-0":
        return 0
    return int(r.xtrim(stream, minid=point, approximate=False))


def take_over_pending(r: redis.Redis, stream: str, group: str, consumer: str) -> int:
    """XCLAIM every entry pending at another consumer of ``group`` for ``consumer``.

    Used by a learner whose group has one rank (world size 1): whatever older
    ranks held unacknowledged is replayed by it before it reads new entries.
    """
    taken = 0
    for info in r.xinfo_consumers(stream, group):
        name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
        if name == consumer or not int(info["pending"]):
            continue
        for item in r.xpending_range(stream, group, min="-", max="+", count=int(info["pending"]),
                                     consumername=name):
            r.xclaim(stream, group, consumer, 0, [item["message_id"]], justid=True)
            taken += 1
    return taken


def group_pending(r: redis.Redis, stream: str, group: str) -> int:
    for info in r.xinfo_groups(stream):
        if info["name"] in (group, group.encode()):
            return int(info["pending"])
    return 0


def downstream_backlog(r: redis.Redis, keys: JobKeys) -> int:
    """Groups generated and not yet taken by the learner: what rollout backpressure counts.

    Entries the learner has read stay pending until its next checkpoint
    although they are trained already, so only the scored stream's lag and
    what the learner holds read ahead count there (``learner_backlog``); at
    the reward stage pending entries are real work.
    """
    return (stream_lag(r, keys.rollouts, GROUP_REWARD) + group_pending(r, keys.rollouts, GROUP_REWARD)
            + learner_backlog(r, keys))


def learner_backlog(r: redis.Redis, keys: JobKeys) -> int:
    """Scored groups waiting for the learner: the scored stream's lag, and the groups the learner holds
    read ahead of its batch (``pipeline.dataplane.lookahead``)."""
    return stream_lag(r, keys.scored, GROUP_LEARNER) + int(r.hget(keys.counters, AHEAD_COUNTER) or 0)


@dataclass(frozen=True)
class ClaimPolicy:
    """How a stage takes over work: reclaim idle entries, dead-letter after too many deliveries."""

    min_idle_ms: int  # longer than the stage's slowest handler (and, for the learner, a checkpoint)
    max_deliveries: int

    @property
    def scan_every_s(self) -> float:
        """Between two scans for idle entries that found none: an entry turns idle at ``min_idle_ms``, so
        a scan every round finds nothing more than one every quarter of it (at most every second) would,
        and costs a round trip and a walk of the pending list each time. It delays a takeover by at most
        this much."""
        return min(1.0, self.min_idle_ms / 4000)


def reclaim(r: redis.Redis, keys: JobKeys, source: str, group: str, consumer: str, policy: ClaimPolicy,
            count: int, cursor: str, log=None, stop: Callable[[], bool] = lambda: False) -> tuple[list[Entry], str]:
    """Claim up to ``count`` entries idle longer than ``min_idle_ms`` from any consumer of ``group``.

    The idle entries are found with XPENDING ... IDLE, which counts no
    delivery, and only those are claimed (XCLAIM with the same idle bound,
    so a concurrent reclaimer takes each at most once): ``run_stage`` claims
    one per round, so that an entry's delivery count goes up only when it is
    handled, alone. Entries delivered more than ``max_deliveries`` times are
    dead-lettered with their delivery count instead of being handed out
    again. Returns the entries to process and the cursor to continue from
    (``"0-0"``: the scan reached the end of the pending list).
    """
    start = "-" if cursor == "0-0" else cursor
    idle = r.xpending_range(source, group, min=start, max="+", count=count, idle=policy.min_idle_ms)
    if not idle:
        return [], "0-0"
    ids = [_as_bytes(info["message_id"]) for info in idle]
    next_cursor = "(" + ids[-1].decode() if len(ids) == count else "0-0"
    delivered = {_as_bytes(info["message_id"]): int(info["times_delivered"]) for info in idle}
    ids = _dead_letter_deleted(r, keys, source, group, ids, log, stop, delivered)
    claimed = r.xclaim(source, group, consumer, policy.min_idle_ms, ids) if ids else []
    got = [(i, (f or {}).get(messages.FIELD, b"")) for i, f in claimed if i is not None and f is not None]
    if not got:
        return [], next_cursor
    keep = _within_deliveries(r, keys, source, group, consumer, policy, got, log, stop)
    if keep and log:
        log.info("reclaimed", entries=len(keep))
    return keep, next_cursor


def _dead_letter_deleted(r: redis.Redis, keys: JobKeys, source: str, group: str, ids: list[bytes], log,
                         stop: Callable[[], bool], delivered: dict[bytes, int]) -> list[bytes]:
    """Of the idle pending ``ids`` a reclaim is about to claim, the ones still in the stream; those gone from it
    (an XDEL while pending) are dead-lettered, before any XCLAIM.

    Redis 6.2's XCLAIM answers nil for such an entry and leaves it pending,
    so the stream's trim point stops at it; 7's drops it from the pending
    list without a word. On either, the group it stood for would stay in
    flight for good: it is dead-lettered (no payload), as the learner does,
    with the deliveries XPENDING counted (``delivered``). One script per entry acknowledges it and, only if that XACK removed it,
    writes the dead letter: two reclaimers never count it twice, and a write
    that cannot happen (Redis full while stopping, a kill) leaves it pending,
    for a later reclaim, never acknowledged without its dead letter.
    """
    gone = [i for i in ids if not r.xrange(source, i, i)]
    if not gone:
        return ids
    group_size = job_group_size(r, keys)
    wait, outage = FullRedisWait(log, stop), Outage(log, stop=stop)
    written = 0
    for entry_id in gone:
        written += _waiting_out_redis(lambda e=entry_id: r.eval(
            _DEAD_LETTER_DELETED, 3, source, keys.dead_letters, keys.counters, group, e,
            "deleted from the stream while pending", group_size, time.time(), delivered.get(e, 1)), wait, outage)
    if written and log:
        log.warning("dead_lettered_deleted", entries=written)
    return [i for i in ids if i not in gone]


# KEYS: the source stream, the dead letters, the counters; ARGV: group, entry id, reason, trajectories, time,
# deliveries. The fields of ``dead_letter``'s record, written only by the XACK that removed the entry (safe to run
# again).
_DEAD_LETTER_DELETED = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', 'reason', ARGV[3], 'stream', KEYS[1], 'id', ARGV[2], 'deliveries', ARGV[6],
           'trajectories', ARGV[4], 'payload', '', 'at', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'dead_lettered', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'dead_letter_messages', 1)
return 1
"""


def replay_own(r: redis.Redis, keys: JobKeys, source: str, group: str, consumer: str, policy: ClaimPolicy,
               count: int, after: str, log=None,
               stop: Callable[[], bool] = lambda: False) -> tuple[list[Entry], str | None]:
    """This consumer's own pending entries after ``after`` (a restart under its name, or after an outage).

    The read counts a delivery, so entries past ``max_deliveries`` are
    dead-lettered as a reclaim's are: a message whose handling kills the
    worker is not replayed by every restart for ever. ``run_stage`` replays
    one entry per round: a batch read again whole would count a delivery of
    every entry each time the poison among them kills the worker, and take
    them all to the dead-letter stream with it. Returns the entries to
    process and where the replay goes on from (None: nothing more is pending).
    """
    entries = read_own_pending(r, source, group, consumer, count, after)
    if not entries:
        return [], None
    return _within_deliveries(r, keys, source, group, consumer, policy, entries, log, stop), entries[-1][0]


def _within_deliveries(r: redis.Redis, keys: JobKeys, source: str, group: str, consumer: str,
                       policy: ClaimPolicy, entries: list[Entry], log,
                       stop: Callable[[], bool] = lambda: False) -> list[Entry]:
    """``entries`` (all pending with ``consumer``) delivered at most ``max_deliveries`` times; the others are
    dead-lettered with their count and acknowledged (waiting while Redis is full, unless ``stop()``)."""
    counts = delivery_counts(r, source, group, [i for i, _p in entries], consumer)
    keep, over = [], []
    for entry_id, payload in entries:
        n = counts.get(entry_id, 1)
        (over if n > policy.max_deliveries else keep).append((entry_id, payload, n))
    if over:
        group_size = job_group_size(r, keys)

        def build():
            pipe = r.pipeline(transaction=True)
            for entry_id, payload, n in over:
                dead_letter(pipe, keys, source, entry_id, f"exceeded max_deliveries ({policy.max_deliveries}): "
                            f"delivered {n} times", payload, deliveries=n,
                            trajectories=payload_trajectories(payload, group_size))
                pipe.xack(source, group, entry_id)
            return pipe

        execute_with_backpressure(build, log, stop)
        if log:
            log.warning("dead_lettered_redelivered", entries=len(over))
    return [(i, p) for i, p, _n in keep]


def delivery_counts(r: redis.Redis, stream: str, group: str, ids: list[bytes],
                    consumer: str | None = None) -> dict[bytes, int]:
    """How many times each pending entry has been delivered.

    With ``consumer`` (the one that holds them all, as after a reclaim) one
    XPENDING over the ids' range answers for all of them; entries it misses
    (the range held more of that consumer's entries than it returned) are
    asked for one by one.
    """
    out: dict[bytes, int] = {}
    if consumer and len(ids) > 1:
        lo, hi = min(ids, key=_id_key), max(ids, key=_id_key)
        wanted = set(ids)
        for info in r.xpending_range(stream, group, min=lo, max=hi, count=4 * len(ids), consumername=consumer):
            mid = _as_bytes(info["message_id"])
            if mid in wanted:
                out[mid] = int(info["times_delivered"])
    for entry_id in ids:
        if entry_id in out:
            continue
        for info in r.xpending_range(stream, group, min=entry_id, max=entry_id, count=1):
            out[_as_bytes(info["message_id"])] = int(info["times_delivered"])
    return out


def _as_bytes(value) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class ClaimKeeper:
    """Refresh our claim on entries in hand during a long handler (XCLAIM ... JUSTID).

    JUSTID resets the idle time without counting a delivery, so another
    consumer's reclaim does not take entries we are still working on. Only
    entries still pending at us are refreshed: one another consumer reclaimed
    while we stalled is theirs, and is not taken back to be handled twice
    (the look and the claim are two commands, not a script: XCLAIM goes
    through a full Redis, a script does not; a reclaim in the millisecond
    between them is the one case left). One
    thread per stage, started with the first batch and kept until ``close``:
    starting a thread per batch costs more than a fast handler's whole batch
    on a loaded machine. It refreshes the ids in hand every ``interval_s``
    (a third of ``min_idle``); a refresh that races the batch's ack claims
    ids no longer pending, which XCLAIM ignores.
    """

    def __init__(self, r: redis.Redis, stream: str, group: str, consumer: str, min_idle_ms: int):
        self.r, self.stream, self.group, self.consumer = r, stream, group, consumer
        self.interval_s = max(0.05, min_idle_ms / 3000)
        self.ids: list[bytes] = []
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        ids = self.ids
        if not ids:
            return
        first, last = min(ids, key=_id_key), max(ids, key=_id_key)
        held = {_id_key(e["message_id"]) for e in self.r.xpending_range(
            self.stream, self.group, first, last, len(ids) + PENDING_SLACK, self.consumer)}
        ours = [i for i in ids if _id_key(i) in held]
        if ours:
            self.r.xclaim(self.stream, self.group, self.consumer, 0, ours, justid=True)

    def __call__(self, ids: list[bytes]) -> "ClaimKeeper":
        self.ids = list(ids)
        return self

    def __enter__(self) -> "ClaimKeeper":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="claim-keeper")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            try:
                self.refresh()
            except redis.RedisError:
                pass  # the next refresh or the reclaim after a restart covers it

    def __exit__(self, *exc) -> None:
        self.ids = []

    def close(self) -> None:
        self._closed.set()
        if self._thread:
            self._thread.join()
            self._thread = None


def run_stage(
    r: redis.Redis,
    keys: JobKeys,
    *,
    source: str,
    group: str,
    consumer: str,
    sink: str,
    handle: Callable[[list], list],
    count: int,
    block_ms: int,
    max_bytes: int,
    claims: ClaimPolicy,
    stop: Callable[[], bool],
    before_read: Callable[[], bool] = lambda: True,
    counter: str | None = None,
    dedup: Dedup | None = None,
    log=None,
) -> None:
    """The loop every streaming stage runs until ``stop()``.

    Each round: ``before_read`` (reloads, evaluations, backpressure; False
    skips the round), then an entry reclaimed from idle consumers (scanned for
    at most every ``claims.scan_every_s`` once a scan found none), else one of
    our own pending entries (at the start, after an outage), else new ones;
    ``handle`` maps decoded messages to outputs in order (a message for
    ``sink`` or a ``Reject``); outputs and acks go in one transaction.
    ``counter`` names the counter increased by the trajectories written.
    """
    tune_allocator()
    cursor = "0-0"
    keeper = ClaimKeeper(r, source, group, consumer, claims.min_idle_ms)
    outage = Outage(log, stop=stop)
    # Where the replay of our own pending entries has got to: at the start (a worker restarted under its
    # stable name takes its predecessor's batch back at once, not after min_idle) and after an outage.
    own: str | None = "0"
    rounds, next_scan = 0, 0.0
    try:
        while not stop():
            try:
                if not before_read():
                    continue
                rounds += 1
                if rounds % TRIM_EVERY == 0:
                    trim(r, source)
                entries = []
                # Entries delivered before (reclaimed, or our own replayed) are handled one per round: only
                # the one whose handling kills the worker is counted towards max_deliveries.
                if cursor != "0-0" or time.monotonic() >= next_scan:   # a scan in progress goes on
                    entries, cursor = reclaim(r, keys, source, group, consumer, claims, 1, cursor, log, stop)
                    if cursor == "0-0" and not entries:
                        next_scan = time.monotonic() + claims.scan_every_s
                if not entries and own is not None:
                    entries, own = replay_own(r, keys, source, group, consumer, claims, 1, own, log, stop)
                if not entries:
                    entries = read(r, source, group, consumer, count, block_ms)
                outage.ok()
            except UNAVAILABLE as exc:
                if stop():
                    break   # nothing in hand: what we hold pending is replayed
                outage.wait(exc)   # RedisUnavailable past the limit: the worker exits non-zero
                own = "0"
                continue
            except redis.ResponseError as exc:
                if stop() and redis_full(exc):
                    break   # stopping while a full Redis refuses the dead letters: they are replayed
                raise
            if not entries:
                continue
            good, bad = decode_entries(entries, max_bytes)
            # The claim is kept until the batch is acknowledged: through the write too, which waits out a
            # full Redis (XCLAIM still goes through one) for as long as it lasts.
            with keeper([i for i, _p in entries]):
                outputs = handle([msg for _id, msg in good]) if good else []
                try:
                    write_and_ack(r, keys, source, group, sink, good, outputs, bad, counter, log, stop, dedup,
                                  raw=dict(entries))
                except UNAVAILABLE:
                    if not stop():
                        raise
                    break   # stopping without Redis (our run is gone with it): the batch stays pending, replayed
                except redis.ResponseError as exc:
                    if not (stop() and redis_full(exc)):
                        raise
                    break   # stopping while Redis is full: the batch stays pending, replayed
    finally:
        keeper.close()


@dataclass(frozen=True)
class Dedup:
    """Exactly-once output: a stage writes a group's output at most once, keyed by the group id.

    The group id is the prompt id: a trajectory's id is (prompt_id, sample_idx)
    and groups travel whole, so this keys every trajectory's effect. The marks
    expire after ``ttl_s`` (longer than any redelivery can take), which keeps
    Redis memory bounded.
    """

    stage: str
    ttl_s: int


def write_and_ack(r, keys, source, group, sink, good, outputs, bad, counter, log, stop,
                  dedup: Dedup | None = None, raw: dict[bytes, bytes] | None = None) -> None:
    """Outputs, dead letters and the acks of their inputs, atomically: one script (``_write_scripted``)
    when the round has no dead letter, else one MULTI/EXEC transaction.

    ``raw`` maps each input's entry id to its payload as read: a rejected
    input is dead-lettered with those bytes (without it, re-encoded).

    With ``dedup``, the script skips an output whose mark is set and sets the marks of those it writes;
    the transaction WATCHes each output's mark, writes only
    the outputs whose group has none yet and sets their marks; a concurrent
    writer of the same group makes EXEC fail and the round is redone, so a
    redelivered or regenerated group has its effect once.
    """
    marks = [keys.seen(dedup.stage, out.prompt_id) if dedup and not isinstance(out, Reject) else None
             for out in outputs]
    rejects = any(isinstance(o, Reject) for o in outputs)
    wait, outage = FullRedisWait(log, stop), Outage(log, stop=stop)
    done = txn_mark(sink, uuid.uuid4().hex)   # this round's writes have run (a lost EXEC reply)
    if not bad and not rejects:
        _write_scripted(r, keys, source, group, sink, good, outputs, marks, counter, dedup, done, wait, outage)
        return
    # Only a dead letter needs the group size (a round trip): bad entries and rejects are rare.
    group_size = job_group_size(r, keys)

    def attempt() -> bool:
        """One try of the transaction; False when a concurrent writer aborted it."""
        with r.pipeline(transaction=True) as pipe:
            try:
                watched = [m for m in marks if m]
                pipe.watch(done, *watched)
                values = pipe.mget([done, *watched])
                if values[0] is not None:
                    return True
                already = {m for m, v in zip(watched, values[1:]) if v is not None}
                pipe.multi()
                _queue_writes(pipe, keys, source, group, sink, good, outputs, bad, counter, marks, already,
                              dedup, group_size, raw or {})
                pipe.set(done, 1, ex=txn_mark_ttl_s())
                pipe.execute()
                return True
            except redis.WatchError:
                return False

    while not _waiting_out_redis(attempt, wait, outage):
        pass   # a concurrent writer aborted it: redo the round
    for _id, _payload, reason in bad:
        if log:
            log.warning("dead_lettered", reason=reason)


# One round's outputs, their exactly-once marks and the acknowledgement of their inputs, atomically and
# in one round trip (the WATCH / MGET / MULTI...EXEC / UNWATCH of the general path are four).
# KEYS: the round's done mark, source, sink, counters, then the marks. ARGV: group, field, done TTL, mark
# TTL, counter, duplicates counter, n_acks, the acked ids, then per output: its mark's index in KEYS after
# the first four (0: none), its trajectories, its payload. Only the first write can meet a full Redis
# (once a script has written, Redis lets it finish), so an OOM error comes back before anything is written,
# as an error whose code is OOM (Redis 6.2 words a refused call inside a script otherwise).
_WRITE_AND_ACK = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local n_acks = tonumber(ARGV[7])
local written, dups, i = 0, 0, 8 + n_acks
while i <= #ARGV do
  local mark, size = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  if mark > 0 and redis.call('EXISTS', KEYS[4 + mark]) == 1 then
    dups = dups + size
  else
    local id = redis.pcall('XADD', KEYS[3], '*', ARGV[2], ARGV[i + 2])
    if type(id) == 'table' and id.err then
      if string.find(id.err, 'OOM', 1, true) then return redis.error_reply('OOM ' .. id.err) end
      return redis.error_reply(id.err)
    end
    if mark > 0 then redis.call('SET', KEYS[4 + mark], 1, 'EX', ARGV[4]) end
    written = written + size
  end
  i = i + 3
end
-- in chunks: Lua's unpack takes at most ~8,000 values, and an error here would leave the writes unacknowledged
for first = 8, 7 + n_acks, 1000 do
  redis.call('XACK', KEYS[2], ARGV[1], unpack(ARGV, first, math.min(first + 999, 7 + n_acks)))
end
if ARGV[5] ~= '' and written > 0 then redis.call('HINCRBY', KEYS[4], ARGV[5], written) end
if dups > 0 then redis.call('HINCRBY', KEYS[4], ARGV[6], dups) end
redis.call('SET', KEYS[1], 1, 'EX', ARGV[3])
return {written, dups}
"""


def _write_scripted(r, keys, source, group, sink, good, outputs, marks, counter, dedup, done, wait, outage):
    """``write_and_ack`` of a round with no dead letter: one script, run once even when its reply is lost."""
    script_keys, index = [done, source, sink, keys.counters], {}
    acked, tail = [], []
    # Only inputs with an output are acknowledged, as in _queue_writes.
    for (entry_id, _msg), out, mark in zip(good, outputs, marks):
        acked.append(entry_id)
        if mark and mark not in index:
            script_keys.append(mark)
            index[mark] = len(index) + 1
        tail += (index[mark] if mark else 0, _size(out), messages.encode(out))
    args = [group, messages.FIELD, txn_mark_ttl_s(), dedup.ttl_s if dedup else 0, counter or "",
            f"duplicates_dropped_{dedup.stage}" if dedup else "", len(acked), *acked, *tail]
    _waiting_out_redis(lambda: r.eval(_WRITE_AND_ACK, len(script_keys), *script_keys, *args), wait, outage)


def _queue_writes(pipe, keys, source, group, sink, good, outputs, bad, counter, marks, already, dedup,
                  group_size, raw: dict[bytes, bytes]) -> None:
    acked = []
    for entry_id, payload, reason in bad:
        dead_letter(pipe, keys, source, entry_id, reason, payload, trajectories=group_size)
        acked.append(entry_id)
    written = duplicates = 0
    # Only inputs with an output are acknowledged: were a handler to return fewer outputs than
    # inputs, the rest stay pending and come back through reclaim instead of being lost.
    for (entry_id, msg), out, mark in zip(good, outputs, marks):
        acked.append(entry_id)
        if isinstance(out, Reject):
            payload = raw.get(entry_id)
            if payload is None:
                payload = messages.encode(msg)
            dead_letter(pipe, keys, source, entry_id, out.reason, payload,
                        trajectories=trajectories_of(msg, group_size))
        elif mark in already:
            duplicates += _size(out)
        else:
            pipe.xadd(sink, {messages.FIELD: messages.encode(out)})
            if mark:
                pipe.set(mark, 1, ex=dedup.ttl_s)
                already.add(mark)  # a second copy in this very batch is a duplicate too
            written += _size(out)
    if acked:
        pipe.xack(source, group, *acked)  # in the same MULTI as the writes: both or neither
    if counter and written:
        pipe.hincrby(keys.counters, counter, written)
    if duplicates:
        pipe.hincrby(keys.counters, f"duplicates_dropped_{dedup.stage}", duplicates)


def job_group_size(r: redis.Redis, keys: JobKeys) -> int:
    """The job's group size as the feeder records it with every prompt it issues (0 before the first).

    A stage does not know the job's config; the feeder's record is the unit
    its ``issued`` counter is in, which is what a dead letter must give back.
    """
    return int(r.hget(keys.feeder, "group_size") or 0)


def counted_in_flight(c: dict[str, int]) -> int:
    """Trajectories issued and not yet accounted for downstream, from the job's counters.

    What the feeder admits against (``workers.feeder.in_flight``) and what the
    audit's feeder check compares with the streams. A dead letter counts what
    its entry stood for, and one replayed onto its stream is in flight again;
    the learner's stale drops count as soon as it judges them (``dropped_held``,
    moved into ``dropped_stale`` when its step commits), and so do the groups
    without signal that dynamic sampling leaves out of the batch's count
    (``filtered_held``, moved into ``trained`` when its step commits).
    """
    dead = c.get("dead_lettered", 0) - c.get("dead_lettered_replayed", 0)
    held = c.get("dropped_held", 0) + c.get("filtered_held", 0)
    return c.get("issued", 0) - (c.get("trained", 0) + c.get("dropped_stale", 0) + held + dead)


def trajectories_of(msg, group_size: int) -> int:
    """Trajectories a stream entry stands for: a decoded group's own count, else one group's worth.

    Every entry of the prompts, rollouts and scored streams is one issued
    GRPO group: a prompt is the group it is to become, and an entry that does
    not decode (or decodes to the wrong kind) stood for a group too. The
    audit measures entries in flight the same way (entries x group size).
    """
    return len(msg.trajectories) if isinstance(msg, messages.Group) else group_size


def payload_trajectories(payload: bytes, group_size: int) -> int:
    """``trajectories_of`` a raw payload, which may not decode."""
    try:
        return trajectories_of(messages.decode(payload, 1 << 30), group_size)
    except messages.BadMessage:
        return group_size


def _size(msg) -> int:
    """Trajectories a stage wrote (or skipped as a duplicate): a group's."""
    return len(msg.trajectories) if isinstance(msg, messages.Group) else 0
