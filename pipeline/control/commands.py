"""``libra-ctl scale``, ``drain`` and ``events``: how an operator steers and reads the controller.

Each handler connects to the job's Redis and talks to the controller through
it (the allocation record, ``CONTROLLER_WAKE``, the drain requests); with no
controller running, ``drain`` asks the agent directly. A worker started
outside the agents (``libra-ctl worker``) is asked directly, through
``JobKeys.external_drain``, which it watches.

Several jobs may share the Redis and the controller: ``scale`` and ``drain``
act on one job (``--job``, needed when more than one runs), and touch no
other job's records; ``events`` shows every job's decisions, merged by
time, unless ``--job`` names one.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import NamedTuple

import redis

from pipeline import argtypes
from pipeline.config import BadInput
from pipeline.control import actions
from pipeline.control.allocation import (allocation_status, counts_of, external_counts, external_workers,
                                         get_allocation, live_agents, pin, read_placement, unpin)
from pipeline.control.placement import agents_share, learner_to_one_node
from pipeline.control.events import merged_events
from pipeline.dataplane.keys import CONTROLLER_LEASE, CONTROLLER_WAKE, JOBS, JobKeys
from pipeline.dataplane.redisconn import connect, find_redis_url
from pipeline.dataplane.keys import ROLES


def all_jobs(r: redis.Redis) -> list[str]:
    return sorted(n.decode() for n in r.smembers(JOBS))


def known_job(r: redis.Redis, job: str) -> str:
    """``job`` if it has run on this Redis; else exit naming the jobs that have (a typo pins nothing)."""
    if not r.sismember(JOBS, job):
        names = all_jobs(r)
        raise BadInput(f"libra-ctl: no job {job!r} on this Redis"
                         + (f"; its jobs: {', '.join(names)}" if names else " (it has no jobs)"))
    return job


def running_jobs(r: redis.Redis) -> list[str]:
    """The jobs on this Redis whose phase is running or trained (the controller's), sorted.

    More than one: ``scale`` and ``drain`` need ``--job``, so a view that
    prints one of their command lines (``libra-ctl doctor``) names the job.
    """
    return [n for n in all_jobs(r) if r.hget(JobKeys(n).state, "phase") in (b"running", b"trained")]


def pick_job(r: redis.Redis, job: str | None) -> str:
    """The named job, else the one job that runs on this Redis."""
    if job:
        return known_job(r, job)
    running = running_jobs(r)
    if len(running) != 1:
        raise BadInput(f"libra-ctl: {'no job runs' if not running else 'several jobs run: ' + ', '.join(running)}"
                         "; name one with --job J")
    return running[0]


def parse_counts(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        role, sep, n = item.partition("=")
        if not sep or role not in ROLES or not n.isdigit():
            raise BadInput(f"{item!r}: write role=N with role in {', '.join(ROLES)}, "
                             "e.g. rollout=2 learner=1")
        out[role] = int(n)
    return out


def cmd_scale(args) -> int:
    r = connect(find_redis_url(args.redis))
    job = pick_job(r, args.job)
    if args.auto == bool(args.counts):
        print("libra-ctl scale: give role=N counts to pin, or --auto to hand back to the allocator", file=sys.stderr)
        return 2
    if args.auto:
        unpin(r, job)
        print(f"{job}: allocation is automatic again (the allocator decides on the next tick)")
        return 0
    try:
        pin(r, job, parse_counts(args.counts))
    except ValueError as exc:
        print(f"libra-ctl scale: {exc}", file=sys.stderr)
        return 2
    pinned = get_allocation(r, job)["pinned"]
    print(f"{job}: pinned " + " ".join(f"{k}={v}" for k, v in sorted(pinned.items())))
    room = room_for(r, job, pinned)
    if room.need > room.room:
        print(f"libra-ctl scale: note: these counts need {room.need} agent slots and the live agents offer {job} "
              f"{room.room} ({room.room + room.held} in all, {room.held} held by other jobs): the controller fits "
              "the counts to the slots there are (libra-ctl status shows what runs) until more agents join",
              file=sys.stderr)
    if 0 < room.most < room.learner:   # with no room at all, the note above says it
        print(f"libra-ctl scale: note: learner={room.learner} runs on one node (its ranks share one process group), "
              f"and the live agent with the most room offers {job} {room.most} slot(s): the controller cuts the "
              f"learner to {room.most} and gives the rest to rollout", file=sys.stderr)
    if args.wait:   # for the counts the controller will run (the learner cut to one node), not the asked ones
        return _wait_for_counts(r, job, fitted_to_one_node(r, job, pinned, room), args.wait)
    return 0


class Room(NamedTuple):
    """What a pin asks of the live agents' slots, as the controller counts them."""

    need: int      # agent slots the pin needs (the job's external workers hold their own)
    room: int      # slots the live agents offer the job
    held: int      # slots other jobs hold on them
    learner: int   # learner slots the agents run of the pin (none where an external learner is the job's)
    most: int      # the most slots one live agent offers the job (the learner's are all on one node)


def room_for(r: redis.Redis, job: str, pinned: dict) -> Room:
    """``Room`` of ``pinned``; reward holds slots only with ``control.reward_on_slots``."""
    from pipeline.control.job import load_job

    info = load_job(r, job)
    on_slots = bool(info and info.control.reward_on_slots)
    # as the controller counts them: the external workers it counts, the slots of live agents
    share = agents_share(pinned, external_counts(external_workers(r, job)))
    live = live_agents(r)
    held = Counter(rec.get("node") for other in running_jobs(r) if other != job
                   for rec in read_placement(r, other).values() if rec.get("node") in live
                   for _s in rec.get("slots", []))
    total = sum(len(rec["slots"]) for rec in live.values())
    return Room(need=sum(counts_of(share, on_slots).values()), room=max(total - held.total(), 0),
                held=held.total(), learner=share.get("learner", 0),
                most=max((len(rec["slots"]) - held[node] for node, rec in live.items()), default=0))


def fitted_to_one_node(r: redis.Redis, job: str, pinned: dict, room: Room) -> dict:
    """``pinned`` as the controller runs it when the learner asked for exceeds the most slots one node offers."""
    from pipeline.control.job import load_job, role_bounds

    info = load_job(r, job)
    if info is None or not 0 < room.most < room.learner:
        return pinned
    return learner_to_one_node(pinned, room.most, role_bounds(info.control, info.backend))


def _wait_for_counts(r: redis.Redis, job: str, want: dict, timeout_s: float) -> int:
    """0 once the pinned counts run; 1 at the timeout, or as soon as the job has trained its last step
    (its workers are ending: the counts will not come)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = allocation_status(r, job)["roles"]
        if all(running.get(k, 0) == v for k, v in want.items()):
            print(f"{job}: running " + " ".join(f"{k}={v}" for k, v in sorted(running.items())))
            return 0
        phase = (r.hget(JobKeys(job).state, "phase") or b"").decode()
        if phase in ("trained", "stopping", "done", "stopped"):
            print(f"{job}: the job ended (phase {phase}) before the counts were running: {running}", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print(f"{job}: not all counts running after {timeout_s:g}s: {allocation_status(r, job)['roles']}",
          file=sys.stderr)
    return 1


def cmd_drain(args) -> int:
    r = connect(find_redis_url(args.redis))
    job = pick_job(r, args.job)
    rec = read_placement(r, job).get(args.worker)
    if rec is None and args.worker in external_workers(r, job):
        r.sadd(JobKeys(job).external_drain, args.worker)
        print(f"{job}: asked the external worker {args.worker} to drain (it finishes the batch in hand, then "
              "waits for the job's end; the agents replace it if the allocation still needs it)")
        return 0
    if rec is None:
        print(f"libra-ctl drain: {job} has no worker {args.worker!r} in its placement or among its external "
              "workers", file=sys.stderr)
        return 2
    if r.exists(CONTROLLER_LEASE):
        r.sadd(JobKeys(job).drain_requests, args.worker)
        r.lpush(CONTROLLER_WAKE, f"drain:{job}")
        print(f"{job}: {args.worker} will be drained by the controller (a replacement takes another slot if the "
              "allocation still needs it)")
    else:
        actions.drain(r, rec["node"], job, args.worker)
        print(f"{job}: no controller acts; asked the agent on {rec['node']} to drain {args.worker}")
    return 0


def cmd_events(args) -> int:
    """The named job's decisions, else every job's merged by time; each line names its job."""
    r = connect(find_redis_url(args.redis))
    jobs = [known_job(r, args.job)] if args.job else all_jobs(r)
    if not jobs:
        print("[]" if args.json else "no jobs on this Redis")
        return 0
    events = merged_events(r, jobs, args.last)
    if args.json:
        print(json.dumps(events, indent=2))
        return 0
    width = max(len(j) for j in jobs)
    for e in events:
        print(format_event(e, width))
    return 0


def format_event(e: dict, job_width: int = 0) -> str:
    """One line of ``libra-ctl events``: time, job (padded to ``job_width``), kind, what was decided, actions."""
    when = time.strftime("%H:%M:%S", time.localtime(e["at"]))
    acts = ", ".join(f"{a['action']} {a['worker']}@{a['node']}" for a in e.get("actions", []))
    what = e.get("summary") or f"{e.get('reason', e['kind'])}: {e.get('to', '')}"
    return f"{when}  {e['job']:<{job_width}}  {e['kind']:<8} {what}" + (f"  [{acts}]" if acts else "")


def add_commands(sub) -> None:
    s = sub.add_parser("scale", help="pin worker counts (role=N ...) or hand back to the allocator (--auto)")
    s.add_argument("counts", nargs="*", metavar="ROLE=N")
    s.add_argument("--auto", action="store_true", help="return control to the allocator")
    s.add_argument("--job", help="the job to pin; no other job's allocation changes (needed when several run)")
    s.add_argument("--wait", type=argtypes.seconds_or_none, default=0.0, metavar="S",
                   help="wait up to S seconds for the counts to run (exit 1 if they do not, or once the job "
                        "has trained its last step)")
    s.add_argument("--redis")
    s.set_defaults(func=cmd_scale)

    d = sub.add_parser("drain", help="drain one worker: it finishes the batch in hand and exits")
    d.add_argument("worker")
    d.add_argument("--job", help="the worker's job (needed when several run)")
    d.add_argument("--redis")
    d.set_defaults(func=cmd_drain)

    e = sub.add_parser("events", help="the controller's decisions: inputs, expected gain, actions")
    e.add_argument("--job", help="only this job's (default: every job's, merged by time)")
    e.add_argument("--json", action="store_true")
    e.add_argument("-n", "--last", type=argtypes.count, default=50)
    e.add_argument("--redis")
    e.set_defaults(func=cmd_events)
