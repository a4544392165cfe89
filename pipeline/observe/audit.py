"""``libra-ctl audit`` and ``libra-ctl dlq``: account for every trajectory; inspect dead letters.

Called by the CLI in any process that reaches the job's Redis and its run
directory. The audit checks by id, not by the counters the audited code keeps
itself, wherever there is an id to check:

- **ids**: every trajectory id the feeder issued (its record, ``JobKeys.issued``)
  is accounted exactly once: trained or dropped (the records each learner
  checkpoint writes beside itself, ``consumed.txt``, ``dropped.txt``),
  dead-lettered (the id read from the dead letter's payload), or in flight
  (read from the stream entries not yet delivered or still pending). The ids
  that are not, and those accounted twice, are named. Only what cannot be
  read (an undecodable entry) is counted instead of named.
- **pending**: nothing stays pending forever. While the job runs, an entry
  pending longer than its stage's reclaim idle time plus a step is stuck
  (a live consumer refreshes its claim, and a dead one's entries are
  reclaimed within that time); once the learner has checkpointed its last
  step, nothing may be pending at the learner. Each is named with its
  stream, consumer (and whether that worker is alive) and idle time.
- **feeder**: what the feeder believes is in flight (``workers.feeder.in_flight``,
  from counters) matches the streams. It may be lower only by what the
  learner holds for its next checkpoint (counted trained, still pending);
  never higher (room leaked: the feeder stops for good).

Every stream entry stands for one GRPO group of ``group_size`` trajectories;
a dead letter that cannot be read for what its record says it carried.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis

from pipeline.dataplane import messages
from pipeline.dataplane.keys import JobKeys, check_path
from pipeline.dataplane.streams import counted_in_flight
from pipeline.dataplane.worker import record_alive

NAMED_MAX = 50  # ids named per finding (the counts are always whole)
PAGE = 1000  # entries per XRANGE / XPENDING call
STEP_FALLBACK_S = 60.0  # a learner step's length when none has been measured yet
WATCH_TRIES = 50  # transactions of a dead-letter command retried while the dead-letter stream changes


def job_run_dir(r: redis.Redis, keys: JobKeys, run_dir: str | None, own: bool = False) -> Path:
    """The run directory to audit (``run_dir``, else the one Redis records); SystemExit when it cannot be read.
    ``own``: the Redis is ``run_dir``'s own (its embedded server), so its job is that run's, renamed or not."""
    recorded = (r.hget(keys.state, "run_dir") or b"").decode()
    if run_dir and recorded and not own and Path(recorded).name != Path(run_dir).resolve().name:
        # a copied or moved run keeps its name
        raise SystemExit(f"job {keys.job!r} in this Redis belongs to run {recorded}, not {run_dir}: pass the "
                         "Redis of that run (--redis URL), or leave --redis out to use the one it recorded")
    path = run_dir or recorded
    if not path:
        raise SystemExit(f"job {keys.job!r} has no run directory in this Redis; pass --run RUN_DIR")
    if not (Path(path) / "manifest.json").is_file():
        raise SystemExit(f"job {keys.job!r}: no manifest.json in its run directory {path} (not mounted on this "
                         "machine?); pass --run RUN_DIR")
    return Path(path)


def _checkpoints(run_dir: Path) -> list[Path]:
    """The finished checkpoints by step (a seventh digit would sort ``step-1000000`` first by name)."""
    done = [c for c in (run_dir / "checkpoints").glob("step-*")
            if c.name[len("step-"):].isdigit() and (c / "state.json").exists()]
    return sorted(done, key=lambda c: int(c.name[len("step-"):]))


def checkpoint_records(run_dir: Path, name: str) -> Counter:
    """How often each trajectory id appears in the checkpoints' ``name`` records."""
    seen: Counter = Counter()
    for ckpt in _checkpoints(run_dir):
        if (ckpt / name).exists():
            seen.update((ckpt / name).read_text().split())
    return seen


def last_checkpoint_state(run_dir: Path) -> dict:
    """The newest finished checkpoint's ``state.json`` ({} before the first): what a restore starts from."""
    done = _checkpoints(run_dir)
    return json.loads((done[-1] / "state.json").read_text()) if done else {}


def last_checkpoint_step(run_dir: Path) -> int:
    return last_checkpoint_state(run_dir).get("step", 0)


# --- reading ids out of entries ------------------------------------------------------------------


def ids_of_payload(payload: bytes, group_size: int) -> list[str] | None:
    """Trajectory ids an entry stands for: a prompt's group to be, or a group's; None if it does not decode."""
    try:
        msg = messages.decode(payload, 1 << 30)
    except messages.BadMessage:
        return None
    if isinstance(msg, messages.Group):
        return msg.trajectory_ids()
    return prompt_ids(msg.prompt_id, group_size)


def prompt_ids(prompt_id: str, group_size: int) -> list[str]:
    """The trajectory ids a prompt's group will have (``messages.Group.trajectory_ids``)."""
    return [f"{prompt_id}/{i}" for i in range(group_size)]


class RedisFull(RuntimeError):
    """A dead-letter command's transaction refused whole by a full Redis (maxmemory, noeviction)."""


@dataclass
class Tally:
    """Ids read from entries (each as often as it was seen), and what could not be read."""

    ids: Counter = field(default_factory=Counter)
    unnamed: int = 0  # trajectories of entries that do not decode
    short: list = field(default_factory=list)  # dead letters whose record says less than the ids they carry

    def add(self, payload: bytes, group_size: int, carried: int | None = None) -> None:
        ids = ids_of_payload(payload, group_size)
        if ids is None:
            self.unnamed += group_size if carried is None else carried
        else:
            self.ids.update(ids)

    @property
    def trajectories(self) -> int:
        return sum(self.ids.values()) + self.unnamed


def dead_letter_tally(r: redis.Redis, keys: JobKeys, group_size: int) -> tuple[Tally, int]:
    """Ids of the dead letters, and how many never decoded.

    A record without its payload is looked up on its source stream by its
    source id (it is there until trimmed). One that still cannot be read
    counts what its record says it carried (``trajectories``, the number the
    stage gave back to the feeder); a record that says 0 was written without
    a known group size: an undecodable entry then counts none, anything else
    one group.
    """
    tally, malformed = Tally(), 0
    for _id, f in r.xrange(keys.dead_letters_purged):   # purged by the operator: dead letters still
        if b"ids" in f:
            tally.ids.update(json.loads(f[b"ids"]))
        elif b"prompt" in f:
            tally.ids.update(prompt_ids(f[b"prompt"].decode(), group_size))
        else:
            malformed += _undecodable(f)
            tally.unnamed += int(f.get(b"trajectories", 0)) or (0 if _undecodable(f) else group_size)
    for _id, f in r.xrange(keys.dead_letters):
        undecodable = _undecodable(f)
        malformed += undecodable
        payload = dead_letter_payload(r, f)
        recorded = int(f.get(b"trajectories", 0))
        tally.add(payload, group_size, recorded or (0 if undecodable else group_size))
        ids = ids_of_payload(payload, group_size)
        if ids is not None and recorded < len(ids):  # gave the feeder back less than it carried
            tally.short.append({"dead_letter": _text(_id), "source_id": _text(f.get(b"id", b"")),
                                "recorded": recorded, "carried": len(ids), "ids": ids[:NAMED_MAX]})
    return tally, malformed


def _undecodable(f: dict) -> bool:
    return f.get(b"reason", b"").decode().startswith(("malformed", "unknown schema", "oversized"))


def dead_letter_payload(r: redis.Redis, f: dict) -> bytes:
    """A dead letter's payload; one written without it is looked up on its source stream (there until trimmed)."""
    payload = f.get(b"payload", b"")
    if not payload and f.get(b"stream") and f.get(b"id"):
        found = r.xrange(f[b"stream"].decode(), min=f[b"id"].decode(), max=f[b"id"].decode())
        payload = found[0][1].get(messages.FIELD, b"") if found else b""
    return payload


# --- what is in the streams ------------------------------------------------------------------------


@dataclass
class Pending:
    """One entry pending in a consumer group."""

    stream: str
    group: str
    id: str
    consumer: str
    idle_s: float
    deliveries: int


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def pending_entries(r: redis.Redis, stream: str, group: str) -> list[Pending]:
    out: list[Pending] = []
    start = "-"
    while True:
        page = r.xpending_range(stream, group, min=start, max="+", count=PAGE)
        out += [Pending(stream, group, _text(p["message_id"]), _text(p["consumer"]),
                        p["time_since_delivered"] / 1000, int(p["times_delivered"])) for p in page]
        if len(page) < PAGE:
            return out
        start = "(" + out[-1].id


def stream_in_flight(r: redis.Redis, stream: str, group: str, group_size: int
                     ) -> tuple[Tally, list[Pending], list[Pending]]:
    """The group's entries not yet delivered plus those pending: their ids; its pending entries; and
    the pending entries gone from the stream (deleted while pending: their ids cannot be read)."""
    tally = Tally()
    if not r.exists(stream):
        return tally, [], []
    info = next((g for g in r.xinfo_groups(stream) if _text(g["name"]) == group), None)
    if info is None:
        return tally, [], []
    last = _id_key(_text(info["last-delivered-id"]))
    pending = pending_entries(r, stream, group)
    waiting = {p.id for p in pending}
    start = "-"
    while True:
        page = r.xrange(stream, min=start, max="+", count=PAGE)
        for entry_id, f in page:
            eid = _text(entry_id)
            if _id_key(eid) > last or eid in waiting:
                tally.add(f.get(messages.FIELD, b""), group_size)
                waiting.discard(eid)
        if len(page) < PAGE:
            break
        start = "(" + _text(page[-1][0])
    return tally, pending, [p for p in pending if p.id in waiting]


# --- the checks -------------------------------------------------------------------------------------


def issued_ids(r: redis.Redis, keys: JobKeys, group_size: int) -> set[str] | None:
    """Every trajectory id the feeder issued, from its record; None for a job fed without one."""
    prompts = [_text(p) for p in r.sscan_iter(keys.issued, count=PAGE)]
    return {f"{p}/{i}" for p in prompts for i in range(group_size)} if prompts else None


def id_check(issued: set[str] | None, trained: Counter, dropped: Counter, dead: Tally, flight: Tally) -> dict:
    """Each issued id exactly once: trained, dropped, dead-lettered, or in flight; the others named.

    In flight and a final state at once is allowed: the learner's entries stay
    pending until the checkpoint that holds them is durable, and a duplicate
    copy still in a stream is skipped when it arrives. Ids that nothing could
    read (undecodable entries) excuse as many unaccounted ids and no more.
    """
    final = trained + dropped + dead.ids
    twice = sorted(i for i, n in final.items() if n > 1)
    seen = set(final) | set(flight.ids)
    missing = sorted(issued - seen) if issued is not None else []
    unknown = sorted(seen - issued) if issued is not None else []
    unnamed = dead.unnamed + flight.unnamed
    return {"ok": not twice and not unknown and len(missing) <= unnamed, "checked": issued is not None,
            "unaccounted": len(missing), "unaccounted_ids": missing[:NAMED_MAX],
            "accounted_twice": len(twice), "accounted_twice_ids": twice[:NAMED_MAX],
            "not_issued": len(unknown), "not_issued_ids": unknown[:NAMED_MAX], "unnamed": unnamed}


def step_seconds(r: redis.Redis, keys: JobKeys) -> float:
    """The learner's last step, end to end (waiting, training, publishing); a fallback before the first."""
    stats = {k.decode(): json.loads(v) for k, v in r.hgetall(keys.learner_stats).items()}
    spent = sum(float(stats.get(k) or 0.0) for k in ("wait_s", "train_s", "publish_s"))
    return spent or STEP_FALLBACK_S


def pending_bounds(cfg: dict, step_s: float) -> dict[str, float]:
    """Per stage, how long an entry may stay pending while the job runs: its reclaim idle time plus a step.

    A live consumer refreshes its claim while it works (XCLAIM JUSTID; the
    learner at every step for what it holds until its checkpoint), and the
    entries of a consumer that died are reclaimed by the next reclaim pass
    after the idle time: one step later at the most.
    """
    st = cfg["streams"]
    return {stage: float(st[f"{stage}_min_idle_s"]) + step_s + st["block_ms"] / 1000
            for stage in ("rollout", "reward", "learner")}


def pending_check(r: redis.Redis, keys: JobKeys, cfg: dict, run_dir: Path,
                  pending: dict[str, list[Pending]], deleted: list[Pending]) -> dict:
    """Entries stuck pending, each named with its stream, consumer (alive or not) and idle time.

    While the job runs: pending longer than the stage's bound. Once the
    learner has checkpointed its last step: anything pending at the learner
    (it acknowledges all it consumed with that checkpoint). Always: an
    entry pending but deleted from its stream (no one can ever read it).
    """
    phase = _text(r.hget(keys.state, "phase") or b"running")
    live = phase in ("running", "trained")
    learner_done = last_checkpoint_step(run_dir) >= cfg["job"]["steps"]
    bounds = pending_bounds(cfg, step_seconds(r, keys))
    now = time.time()
    alive = {_text(w) for w, rec in r.hgetall(keys.workers).items() if record_alive(json.loads(rec), now)}
    stuck = []
    for stage, entries in pending.items():
        for p in entries:
            if stage == "learner" and learner_done:
                why = "pending at the learner after its last checkpoint"
            elif live and p.idle_s > bounds[stage]:
                why = f"idle {p.idle_s:.0f}s > {bounds[stage]:.0f}s (reclaim idle + a step)"
            else:
                continue
            stuck.append({**p.__dict__, "idle_s": round(p.idle_s, 1), "consumer_alive": p.consumer in alive,
                          "why": why})
    stuck += [{**p.__dict__, "idle_s": round(p.idle_s, 1), "consumer_alive": p.consumer in alive,
               "why": "pending, but deleted from the stream"} for p in deleted]
    return {"ok": not stuck, "stuck": stuck[:NAMED_MAX], "stuck_count": len(stuck),
            "bounds_s": {k: round(v, 1) for k, v in bounds.items()}, "phase": phase}


def feeder_check(r: redis.Redis, keys: JobKeys, c: dict[str, int], group_size: int, measured: int,
                 learner_held: int, issued_record: set[str] | None, dead: Tally) -> dict:
    """What the feeder believes is in flight against what the streams hold; its counters against its record.

    The belief is ``workers.feeder.in_flight``'s formula over the counters.
    The learner counts a step trained when it trains it and acknowledges its
    entries only with the next checkpoint, so the belief may fall short of
    the streams by what the learner holds pending, never more, and never
    exceed them: room the feeder would hold back for good. A leak names the
    dead letters whose record gave back less than their entry carried.
    """
    believes = counted_in_flight(c)
    problems = []
    if believes > measured:
        named = "".join(f"; dead letter {d['dead_letter']} gave back {d['recorded']} of {d['carried']} "
                        f"({', '.join(d['ids'][:2])}, ...)" for d in dead.short[:5])
        problems.append(f"the feeder counts {believes} trajectories in flight, the streams hold {measured}: "
                        f"{believes - measured} leaked{named}")
    if believes < measured - learner_held:
        problems.append(f"the feeder counts {believes} trajectories in flight, the streams hold {measured} "
                        f"(of which the learner holds {learner_held}): it over-issues")
    issued_prompts = c.get("issued_prompts", 0)
    if c.get("issued", 0) != issued_prompts * group_size:
        problems.append(f"issued {c.get('issued', 0)} != issued_prompts {issued_prompts} x {group_size}")
    if issued_record is not None and len(issued_record) != issued_prompts * group_size:
        problems.append(f"the feeder's record names {len(issued_record) // group_size} prompts, "
                        f"its counter {issued_prompts}")
    cursor = r.hget(keys.feeder, "cursor")
    if cursor is not None and int(cursor) != issued_prompts:
        problems.append(f"the feeder's cursor {int(cursor)} != issued_prompts {issued_prompts}")
    return {"ok": not problems, "believes_in_flight": believes, "measured_in_flight": measured,
            "learner_held": learner_held, "short_dead_letters": dead.short[:NAMED_MAX], "problems": problems}


# --- the audit ----------------------------------------------------------------------------------------


def audit(r: redis.Redis, job: str, run_dir: str | None = None, own: bool = False) -> dict:
    """Account for every trajectory of ``job`` (docs/guarantees.md); ``own``: as for ``job_run_dir``."""
    keys = JobKeys(job)
    rd = job_run_dir(r, keys, check_path("--run", run_dir) if run_dir else None, own)
    cfg = json.loads((rd / "manifest.json").read_text())["config"]
    g = cfg["rollout"]["group_size"]
    c = {k.decode(): int(v) for k, v in r.hgetall(keys.counters).items()}
    trained, dropped = checkpoint_records(rd, "consumed.txt"), checkpoint_records(rd, "dropped.txt")
    dead, malformed = dead_letter_tally(r, keys, g)
    flight, by_stage, pending, deleted = Tally(), {}, {}, []
    for stage, stream, group in keys.stages:
        tally, pending[stage], gone = stream_in_flight(r, stream, group, g)
        flight.ids.update(tally.ids)
        flight.unnamed += tally.unnamed
        by_stage[stage], deleted = tally.trajectories, deleted + gone
    issued = issued_ids(r, keys, g)
    result = {
        "issued": len(issued) if issued is not None else c.get("issued_prompts", 0) * g,
        "generated": c.get("generated", 0),
        "scored": c.get("scored", 0),
        "trained": len(trained),
        "dropped_stale": len(dropped),
        "dead_lettered": dead.trajectories,
        "in_flight": flight.trajectories,
        "duplicates_trained": sum(n - 1 for n in trained.values() if n > 1),
        "dropped_branch": len(checkpoint_records(rd, "dropped_branch.txt")),
    }
    checks = {"ids": id_check(issued, trained, dropped, dead, flight),
              "pending": pending_check(r, keys, cfg, rd, pending, deleted),
              "feeder": feeder_check(r, keys, c, g, flight.trajectories, len(pending["learner"]) * g, issued,
                                     dead)}
    result.update(ok=False, problems=problems_of(result, checks), checks=checks, in_flight_by_stage=by_stage,
                  dead_lettered_malformed=malformed, run_dir=str(rd),
                  dead_letters_purged=r.xlen(keys.dead_letters_purged),   # counted in dead_lettered too
                  duplicates_skipped={k[len("duplicates_dropped_"):]: v for k, v in c.items()
                                      if k.startswith("duplicates_dropped_")})
    result["ok"] = not result["problems"]
    return result


def problems_of(result: dict, checks: dict) -> list[str]:
    """One line per failed invariant, naming the check and (some of) the ids."""
    problems = []
    if result["duplicates_trained"]:
        problems.append(f"{result['duplicates_trained']} trajectories trained more than once")
    accounted = result["trained"] + result["dropped_stale"] + result["dead_lettered"] + result["in_flight"]
    if accounted != result["issued"]:
        problems.append(f"issued {result['issued']} != trained + dropped_stale + dead_lettered + in_flight "
                        f"= {accounted}")
    ids = checks["ids"]
    if ids["unaccounted"] > ids["unnamed"]:
        problems.append(f"ids: {ids['unaccounted']} issued ids neither trained, dropped, dead-lettered nor in "
                        f"flight: {', '.join(ids['unaccounted_ids'][:5])}")
    if ids["accounted_twice"]:
        problems.append(f"ids: {ids['accounted_twice']} ids accounted more than once: "
                        f"{', '.join(ids['accounted_twice_ids'][:5])}")
    if ids["not_issued"]:
        problems.append(f"ids: {ids['not_issued']} ids seen that the feeder never issued: "
                        f"{', '.join(ids['not_issued_ids'][:5])}")
    for p in checks["pending"]["stuck"][:5]:
        problems.append(f"pending: {p['id']} on {p['stream']} at {p['consumer']} "
                        f"({'alive' if p['consumer_alive'] else 'gone'}), idle {p['idle_s']}s: {p['why']}")
    if checks["pending"]["stuck_count"] > 5:
        problems.append(f"pending: {checks['pending']['stuck_count'] - 5} more entries stuck")
    problems += [f"feeder: {p}" for p in checks["feeder"]["problems"]]
    return problems


def format_audit(a: dict) -> str:
    lines = [f"{k:<20} {a[k]}" for k in ("issued", "generated", "scored", "trained", "dropped_stale",
                                          "dropped_branch", "dead_lettered", "in_flight", "duplicates_trained")]
    lines.append(f"{'in flight by stage':<20} {a['in_flight_by_stage']}")
    lines.append(f"{'checks':<20} " + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'}"
                                               for k, v in a["checks"].items()))
    lines.append("ok" if a["ok"] else "FAILED: " + "; ".join(a["problems"]))
    return "\n".join(lines)

# --- dead letters ------------------------------------------------------------------------------


def dlq_entries(r: redis.Redis, keys: JobKeys) -> list[dict]:
    out = []
    for entry_id, f in r.xrange(keys.dead_letters):
        out.append({"id": entry_id.decode(), "at": float(f.get(b"at", 0)),
                    "stream": f.get(b"stream", b"").decode(), "source_id": f.get(b"id", b"").decode(),
                    "deliveries": int(f.get(b"deliveries", 0)), "reason": f.get(b"reason", b"").decode(),
                    "trajectories": int(f.get(b"trajectories", 0))})
    return out


def dead_letter(r: redis.Redis, keys: JobKeys, entry_id: str) -> dict:
    """The fields of the dead letter ``entry_id``; SystemExit for an id that names none, or several.

    Redis reads a bare ``<ms>`` as every entry of that millisecond: the id
    of ``dlq list`` is asked for, so that a replay deletes the entry it copied.
    """
    try:
        found = r.xrange(keys.dead_letters, min=entry_id, max=entry_id)
    except redis.ResponseError:
        raise SystemExit(f"{entry_id!r} is not a stream id: give one as dlq list prints it (<ms>-<seq>)") from None
    if not found:
        raise SystemExit(f"no dead letter {entry_id} for job {keys.job!r}")
    if len(found) > 1 or found[0][0].decode() != entry_id:
        raise SystemExit(f"{entry_id!r} is not the whole id of a dead letter: give one of "
                         f"{', '.join(i.decode() for i, _f in found[:5])}")
    return found[0][1]


def dlq_show(r: redis.Redis, keys: JobKeys, entry_id: str) -> dict:
    f = dead_letter(r, keys, entry_id)
    rec = next(e for e in dlq_entries(r, keys) if e["id"] == entry_id)
    payload = f.get(b"payload", b"")
    try:
        msg = messages.decode(payload, 1 << 30)
        rec["message"] = {"kind": type(msg).__name__, "prompt_id": msg.prompt_id,
                          "version": getattr(msg, "version", None),
                          "texts": [t.text for t in getattr(msg, "trajectories", ())][:4]}
    except messages.BadMessage as exc:
        rec["message"] = {"undecodable": exc.reason, "head": payload[:64].hex()}
    return rec


def dlq_replay(r: redis.Redis, keys: JobKeys, ids: list[str]) -> int:
    """Put dead letters back on their source stream (and out of the dead-letter stream).

    Their trajectories are in flight again: ``dead_lettered_replayed`` (the
    counters stay monotonic) puts them back into the feeder's in-flight count.
    The payload goes back byte for byte, and only onto one of the job's own
    stage streams: a dead letter is data anyone who can write to Redis may
    have shaped, so its ``stream`` field is not trusted as a key.
    """
    streams = {stream for _stage, stream, _group in keys.stages}
    checked = []   # each checked before any goes back
    for entry_id in ids:
        f = dead_letter(r, keys, entry_id)
        stream, payload = f.get(b"stream", b"").decode(errors="replace"), f.get(b"payload", b"")
        if stream not in streams:
            raise SystemExit(f"dead letter {entry_id} names the stream {stream!r}, not one of job "
                             f"{keys.job!r}'s stage streams; nothing replayed")
        if not payload:
            raise SystemExit(f"dead letter {entry_id} holds no payload (its entry was deleted); nothing replayed")
        checked.append((entry_id, stream, payload, int(f.get(b"trajectories", 0))))
    n = 0
    for entry_id, stream, payload, trajectories in checked:

        def replay(pipe, stream=stream, payload=payload, trajectories=trajectories):
            pipe.xadd(stream, {messages.FIELD: payload})
            pipe.hincrby(keys.counters, "dead_lettered_replayed", trajectories)

        n += _take_dead_letter(r, keys, entry_id, replay)
    return n


def _take_dead_letter(r: redis.Redis, keys: JobKeys, entry_id: str, write) -> bool:
    """``write(pipe)`` and the dead letter's deletion in one transaction, if it is still there; whether it was.

    Two commands at once (two terminals, a script run again) read the same dead letter: WATCH makes the
    second one's transaction fail and find it gone, so it goes back, or leaves its purge record, once.
    A full Redis (noeviction) refuses the whole transaction: RedisFull, nothing written.
    """
    with r.pipeline(transaction=True) as pipe:
        for _ in range(WATCH_TRIES):
            try:
                pipe.watch(keys.dead_letters)
                if not pipe.xrange(keys.dead_letters, min=entry_id, max=entry_id):
                    print(f"dead letter {entry_id}: gone meanwhile (replayed or purged by another command)",
                          file=sys.stderr)
                    return False
                pipe.multi()
                write(pipe)
                pipe.xdel(keys.dead_letters, entry_id)
                pipe.execute()
                return True
            except redis.WatchError:
                continue   # the stream changed (a new dead letter, or this one taken): look again
            except redis.exceptions.OutOfMemoryError:
                raise RedisFull(f"Redis is full (maxmemory, noeviction): dead letter {entry_id} left as it "
                                f"was. Raise maxmemory (CONFIG SET maxmemory ...) and try again") from None
    raise SystemExit(f"dead letter {entry_id}: the dead-letter stream kept changing; try again")


def dlq_purge(r: redis.Redis, keys: JobKeys, ids: list[str]) -> int:
    """Drop dead letters. Each leaves a record without its payload on ``JobKeys.dead_letters_purged`` (in the
    same transaction) naming what it carried (a group's trajectory ids, or a prompt's id), so the audit still
    accounts for its trajectories as dead-lettered, not lost."""
    found = {entry_id: dead_letter(r, keys, entry_id) for entry_id in ids}   # each checked before any goes
    n = 0
    for entry_id, f in found.items():
        try:
            msg = messages.decode(dead_letter_payload(r, f), 1 << 30)
        except messages.BadMessage:
            msg = None   # the record's "trajectories" and "reason" count it, as for the dead letter itself
        rec = {k: v for k, v in f.items() if k != b"payload"}
        rec[b"dead_letter"] = entry_id
        if isinstance(msg, messages.Group):
            rec[b"ids"] = json.dumps(msg.trajectory_ids())
        elif msg is not None:
            rec[b"prompt"] = msg.prompt_id
        n += _take_dead_letter(r, keys, entry_id, lambda pipe, rec=rec: pipe.xadd(keys.dead_letters_purged, rec))
    return n


# --- commands ------------------------------------------------------------------------------------


def _client(args):
    from pipeline.dataplane.redisconn import connect, find_redis_url

    return connect(find_redis_url(args.redis))


def _known(r: redis.Redis, job: str) -> None:
    """A mistyped ``--job`` (no key of it on this Redis) exits 2 naming the jobs, as ``events`` and ``scale``
    do; a job with a state or dead letters is known, whether or not a ``libra-ctl run`` listed it."""
    from pipeline.control.commands import known_job

    keys = JobKeys(job)
    if not r.exists(keys.state, keys.dead_letters):
        known_job(r, job)


def cmd_audit(args) -> int:
    from pipeline.dataplane.redisconn import redis_of_run

    with redis_of_run(args.redis, args.run) as (r, own):
        _known(r, args.job)
        a = audit(r, args.job, args.run, own)
    print(json.dumps(a, indent=2) if args.json else format_audit(a))
    return 0 if a["ok"] else 1


def cmd_dlq(args) -> int:
    r, keys = _client(args), JobKeys(args.job)
    _known(r, args.job)
    if args.action == "list":
        entries = dlq_entries(r, keys)
        if args.json:
            print(json.dumps(entries, indent=2))
        elif not entries:
            print(f"no dead letters for job {args.job!r}", file=sys.stderr)
        for e in [] if args.json else entries:
            stamp = time.strftime("%H:%M:%S", time.localtime(e["at"]))
            print(f"{e['id']}  {stamp}  {e['stream'].rsplit(':', 1)[-1]:<9} x{e['deliveries']}  {e['reason']}")
        return 0
    if args.action == "show":
        print(json.dumps(dlq_show(r, keys, _one(args)), indent=2))
        return 0
    ids = [e["id"] for e in dlq_entries(r, keys)] if args.all else args.ids
    if not ids:
        print("nothing to do: give dead-letter ids or --all", file=sys.stderr)
        return 2
    if args.action != "replay" and not args.yes:
        print(f"purge deletes {len(ids)} dead letters for good; add --yes", file=sys.stderr)
        return 2
    try:
        if args.action == "replay":
            print(f"replayed {dlq_replay(r, keys, ids)} dead letters")
        else:
            print(f"purged {dlq_purge(r, keys, ids)} dead letters")
    except RedisFull as exc:
        print(f"libra-ctl dlq {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def _one(args) -> str:
    if len(args.ids) != 1:
        raise SystemExit("dlq show takes one dead-letter id")
    return args.ids[0]


class _IdsAnywhere(argparse.ArgumentParser):
    """``dlq``'s parser: the ids may also come after the options (``dlq show --job J 1-0``, as the README
    writes the command). argparse matches ``action`` and the ``ids`` list together, before the options, and
    would refuse a later id as an unrecognized argument."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        ns.ids = [*ns.ids, *(x for x in extra if not x.startswith("-"))]
        return ns, [x for x in extra if x.startswith("-")]


def add_commands(sub) -> None:
    a = sub.add_parser("audit", help="account for every trajectory of a job; exit 1 when invariants fail")
    a.add_argument("--job", required=True)
    a.add_argument("--run", help="run directory (default: the job's, as recorded in Redis); without --redis, its "
                                 "own Redis (a finished run's embedded one is served again from its data)")
    a.add_argument("--json", action="store_true")
    a.add_argument("--redis")
    a.set_defaults(func=cmd_audit)
    d = sub.add_parser("dlq", help="dead letters: list, show, replay, purge")
    d.__class__ = _IdsAnywhere
    d.add_argument("action", choices=["list", "show", "replay", "purge"])
    d.add_argument("ids", nargs="*")
    d.add_argument("--job", required=True)
    d.add_argument("--all", action="store_true", help="replay or purge every dead letter of the job")
    d.add_argument("--yes", action="store_true", help="confirm purge")
    d.add_argument("--json", action="store_true")
    d.add_argument("--redis")
    d.set_defaults(func=cmd_dlq)
