"""``libra-ctl audit`` and ``libra-ctl dlq``: account for every trajectory; inspect dead letters.

Called by the CLI in any process that reaches the job's Redis and its run
directory. Trained and stale-dropped ids come from the records each learner
checkpoint writes beside itself (``consumed.txt``, ``dropped.txt``), not from
Redis deduplication state; in-flight work is measured from the streams
(entries not yet delivered plus entries pending), never computed as a
remainder. Every stream entry stands for one GRPO group of ``group_size``
trajectories; a dead letter for what its record says it carried, the
number the dead-lettering stage gave back to the feeder's in-flight count.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import redis

from pipeline.dataplane import messages
from pipeline.dataplane.keys import JobKeys, check_path
from pipeline.dataplane.streams import group_pending, stream_lag


def job_run_dir(r: redis.Redis, keys: JobKeys, run_dir: str | None) -> Path:
    path = run_dir or (r.hget(keys.state, "run_dir") or b"").decode()
    if not path:
        raise SystemExit(f"job {keys.job!r} has no run directory in this Redis; pass --run RUN_DIR")
    return Path(path)


def checkpoint_records(run_dir: Path, name: str) -> Counter:
    """How often each trajectory id appears in the checkpoints' ``name`` records."""
    seen: Counter = Counter()
    for ckpt in sorted((run_dir / "checkpoints").glob("step-*")):
        if ckpt.name.endswith(".tmp") or not (ckpt / "state.json").exists():
            continue
        seen.update((ckpt / name).read_text().split()) if (ckpt / name).exists() else None
    return seen


def dead_letter_counts(r: redis.Redis, keys: JobKeys, group_size: int) -> tuple[int, int]:
    """(trajectories of the dead-lettered entries, entries that never decoded).

    Each record's ``trajectories`` is what the stage added to the
    ``dead_lettered`` counter: a group's trajectories, else one group
    (``streams.trajectories_of``), undecodable entries included. A record
    that says 0 was written without a known group size (before the feeder
    issued, or by an older build): an undecodable entry then counts none,
    anything else one group.
    """
    carried = malformed = 0
    for _id, f in r.xrange(keys.dead_letters):
        reason = f.get(b"reason", b"").decode()
        undecodable = reason.startswith(("malformed", "unknown schema", "oversized"))
        malformed += undecodable
        recorded = int(f.get(b"trajectories", 0))
        carried += recorded or (0 if undecodable else group_size)
    return carried, malformed


def in_flight(r: redis.Redis, keys: JobKeys, group_size: int) -> dict[str, int]:
    out = {}
    for stage, stream, group in keys.stages:
        entries = (stream_lag(r, stream, group, cap=10**9) + group_pending(r, stream, group)
                   if r.exists(stream) else 0)
        out[stage] = entries * group_size
    return out


def audit(r: redis.Redis, job: str, run_dir: str | None = None) -> dict:
    keys = JobKeys(job)
    rd = job_run_dir(r, keys, check_path("--run", run_dir) if run_dir else None)
    g = json.loads((rd / "manifest.json").read_text())["config"]["rollout"]["group_size"]
    c = {k.decode(): int(v) for k, v in r.hgetall(keys.counters).items()}
    trained = checkpoint_records(rd, "consumed.txt")
    dropped = checkpoint_records(rd, "dropped.txt")
    dead, malformed = dead_letter_counts(r, keys, g)
    flight = in_flight(r, keys, g)
    result = {
        "issued": c.get("issued_prompts", 0) * g,
        "generated": c.get("generated", 0),
        "scored": c.get("scored", 0),
        "trained": len(trained),
        "dropped_stale": len(dropped),
        "dead_lettered": dead,
        "in_flight": sum(flight.values()),
        "duplicates_trained": sum(n - 1 for n in trained.values() if n > 1),
    }
    accounted = result["trained"] + result["dropped_stale"] + result["dead_lettered"] + result["in_flight"]
    problems = []
    if result["duplicates_trained"]:
        problems.append(f"{result['duplicates_trained']} trajectories trained more than once")
    if accounted != result["issued"]:
        problems.append(f"issued {result['issued']} != trained + dropped_stale + dead_lettered + in_flight "
                        f"= {accounted}")
    result.update(ok=not problems, problems=problems, in_flight_by_stage=flight,
                  dead_lettered_malformed=malformed, run_dir=str(rd),
                  duplicates_skipped={k[len("duplicates_dropped_"):]: v for k, v in c.items()
                                      if k.startswith("duplicates_dropped_")})
    return result


def format_audit(a: dict) -> str:
    lines = [f"{k:<20} {a[k]}" for k in ("issued", "generated", "scored", "trained", "dropped_stale",
                                          "dead_lettered", "in_flight", "duplicates_trained")]
    lines.append(f"{'in flight by stage':<20} {a['in_flight_by_stage']}")
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


def dlq_show(r: redis.Redis, keys: JobKeys, entry_id: str) -> dict:
    found = r.xrange(keys.dead_letters, min=entry_id, max=entry_id)
    if not found:
        raise SystemExit(f"no dead letter {entry_id} for job {keys.job!r}")
    rec = next(e for e in dlq_entries(r, keys) if e["id"] == entry_id)
    payload = found[0][1].get(b"payload", b"")
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
    n = 0
    for entry_id in ids:
        found = r.xrange(keys.dead_letters, min=entry_id, max=entry_id)
        if not found:
            raise SystemExit(f"no dead letter {entry_id}")
        f = found[0][1]
        stream, payload = f.get(b"stream", b"").decode(errors="replace"), f.get(b"payload", b"")
        if stream not in streams:
            raise SystemExit(f"dead letter {entry_id} names the stream {stream!r}, not one of job "
                             f"{keys.job!r}'s stage streams; not replayed")
        if not payload:
            raise SystemExit(f"dead letter {entry_id} holds no payload (its entry was deleted); nothing to replay")
        pipe = r.pipeline(transaction=True)
        pipe.xadd(stream, {messages.FIELD: payload})
        pipe.xdel(keys.dead_letters, entry_id)
        pipe.hincrby(keys.counters, "dead_lettered_replayed", int(f.get(b"trajectories", 0)))
        pipe.execute()
        n += 1
    return n


def dlq_purge(r: redis.Redis, keys: JobKeys, ids: list[str]) -> int:
    return int(r.xdel(keys.dead_letters, *ids)) if ids else 0


# --- commands ------------------------------------------------------------------------------------


def _client(args):
    from pipeline.dataplane.redisconn import find_redis_url
    from pipeline.dataplane.redisconn import connect

    return connect(find_redis_url(args.redis))


def cmd_audit(args) -> int:
    a = audit(_client(args), args.job, args.run)
    print(json.dumps(a, indent=2) if args.json else format_audit(a))
    return 0 if a["ok"] else 1


def cmd_dlq(args) -> int:
    r, keys = _client(args), JobKeys(args.job)
    if args.action == "list":
        entries = dlq_entries(r, keys)
        if args.json:
            print(json.dumps(entries, indent=2))
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
    if args.action == "replay":
        print(f"replayed {dlq_replay(r, keys, ids)} dead letters")
        return 0
    if not args.yes:
        print(f"purge deletes {len(ids)} dead letters for good; add --yes", file=sys.stderr)
        return 2
    print(f"purged {dlq_purge(r, keys, ids)} dead letters")
    return 0


def _one(args) -> str:
    if len(args.ids) != 1:
        raise SystemExit("dlq show takes one dead-letter id")
    return args.ids[0]


def add_commands(sub) -> None:
    a = sub.add_parser("audit", help="account for every trajectory of a job; exit 1 when invariants fail")
    a.add_argument("--job", required=True)
    a.add_argument("--run", help="run directory (default: the job's, as recorded in Redis)")
    a.add_argument("--json", action="store_true")
    a.add_argument("--redis")
    a.set_defaults(func=cmd_audit)
    d = sub.add_parser("dlq", help="dead letters: list, show, replay, purge")
    d.add_argument("action", choices=["list", "show", "replay", "purge"])
    d.add_argument("ids", nargs="*")
    d.add_argument("--job", required=True)
    d.add_argument("--all", action="store_true", help="replay or purge every dead letter of the job")
    d.add_argument("--yes", action="store_true", help="confirm purge")
    d.add_argument("--json", action="store_true")
    d.add_argument("--redis")
    d.set_defaults(func=cmd_dlq)
