"""Stream adapters: the read -> process -> write -> ack loop, written once.

A stage is a function from decoded input messages to output messages (or
``Reject``s); ``run_stage`` wraps it between two Redis streams. Output and the
acknowledgement of its input go in one MULTI/EXEC transaction, so a crash
leaves either both or neither. Messages that fail to decode, and inputs the
stage rejects, go to the job's dead-letter stream with the reason. Called by
the rollout and reward worker processes; the learner uses ``read`` and
``dead_letter`` but defers its acks to its checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import redis

from pipeline import messages
from pipeline.keys import JobKeys

Entry = tuple[bytes, bytes]  # (stream id, payload)


@dataclass(frozen=True)
class Reject:
    """A stage's verdict that an input cannot be processed; it is dead-lettered with ``reason``."""

    reason: str


def ensure_groups(r: redis.Redis, keys: JobKeys) -> None:
    """Create each stage's consumer group (and its stream) if missing; safe to call from every process."""
    for _stage, stream, group in keys.stages:
        try:
            r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def read(r: redis.Redis, stream: str, group: str, consumer: str, count: int, block_ms: int) -> list[Entry]:
    """New entries for this consumer (at most ``count``), waiting up to ``block_ms``."""
    reply = r.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
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
    """Queue a dead-letter record on ``pipe`` (a transaction the caller executes)."""
    pipe.xadd(keys.dead_letters, {
        "reason": reason, "stream": source, "id": entry_id, "deliveries": deliveries,
        "trajectories": trajectories, "payload": payload[:65536], "at": time.time(),
    })
    pipe.hincrby(keys.counters, "dead_lettered", trajectories)
    pipe.hincrby(keys.counters, "dead_letter_messages", 1)


def execute_with_backpressure(build: Callable[[], "redis.client.Pipeline"], log=None,
                              stop: Callable[[], bool] = lambda: False) -> list:
    """Run a transaction, waiting while Redis is full (``noeviction`` refuses writes with OOM).

    A full Redis is backpressure, never a crash or a drop: the same
    transaction is rebuilt and retried until it goes through.
    """
    delay = 0.1
    while True:
        pipe = build()
        try:
            return pipe.execute()
        except redis.ResponseError as exc:
            if not str(exc).startswith("OOM") or stop():
                raise
            if log:
                log.warning("redis_full_waiting", delay_s=delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def stream_lag(r: redis.Redis, stream: str, group: str, cap: int = 10_000) -> int:
    """Entries not yet delivered to ``group`` (at most ``cap``).

    Redis 6.2 (the embedded server) has no ``lag`` in XINFO GROUPS, so this
    counts the entries after the group's last-delivered id.
    """
    last = b"0-0"
    for info in r.xinfo_groups(stream):
        if info["name"] in (group, group.encode()):
            last = info["last-delivered-id"]
            break
    last = last.decode() if isinstance(last, bytes) else last
    return len(r.xrange(stream, min="(" + last, max="+", count=cap))


def group_pending(r: redis.Redis, stream: str, group: str) -> int:
    for info in r.xinfo_groups(stream):
        if info["name"] in (group, group.encode()):
            return int(info["pending"])
    return 0


def backlog_groups(r: redis.Redis, streams_groups: Sequence[tuple[str, str]]) -> int:
    """Messages (groups) waiting in or being processed from the given streams."""
    return sum(stream_lag(r, s, g) + group_pending(r, s, g) for s, g in streams_groups)


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
    stop: Callable[[], bool],
    before_read: Callable[[], bool] = lambda: True,
    on_done: Callable[[list, list], None] = lambda inputs, outputs: None,
    counter: str | None = None,
    log=None,
) -> None:
    """The loop every streaming stage runs until ``stop()``.

    ``before_read`` runs between batches (reloads, evaluations, backpressure)
    and returns False to skip reading this round. ``handle`` maps decoded
    messages to outputs in order: a message for ``sink`` or a ``Reject``.
    ``counter`` names the counter increased by the trajectories written.
    """
    while not stop():
        if not before_read():
            continue
        entries = read(r, source, group, consumer, count, block_ms)
        if not entries:
            continue
        good, bad = decode_entries(entries, max_bytes)
        outputs = handle([msg for _id, msg in good]) if good else []

        def build():
            pipe = r.pipeline(transaction=True)
            for entry_id, payload, reason in bad:
                dead_letter(pipe, keys, source, entry_id, reason, payload)
                pipe.xack(source, group, entry_id)
            written = 0
            for (entry_id, msg), out in zip(good, outputs):
                if isinstance(out, Reject):
                    dead_letter(pipe, keys, source, entry_id, out.reason, messages.encode(msg),
                                trajectories=_size(msg))
                else:
                    pipe.xadd(sink, {messages.FIELD: messages.encode(out)})
                    written += _size(out)
                pipe.xack(source, group, entry_id)
            if counter and written:
                pipe.hincrby(keys.counters, counter, written)
            return pipe

        execute_with_backpressure(build, log, stop)
        for _id, _payload, reason in bad:
            if log:
                log.warning("dead_lettered", reason=reason)
        on_done([m for _i, m in good], outputs)


def _size(msg) -> int:
    """Trajectories a message stands for (a prompt stands for none yet)."""
    return len(msg.trajectories) if isinstance(msg, messages.Group) else 0
