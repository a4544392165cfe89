"""``libra-ctl status``: jobs, stages and workers, read from Redis.

Called by the CLI in any process that can reach the job's Redis. The JSON
shape is the one in the design's "Shared interfaces"; documented in the README.
Each worker also says who manages it (``managed``): ``agent`` (a node agent
started it), ``external`` (``libra-ctl worker``: a Procfile pool or by hand;
never started or stopped by Libra) or ``run`` (a child of ``libra-ctl run``,
the feeder, or a process started directly).

Several jobs may share one Redis, one controller and the agents' slots:
``status`` shows every job in ``JOBS``, each with its pool settings
(``pool``: ``control.min_slots``, ``max_slots``, ``priority``), unless
``--job`` names one.
"""

from __future__ import annotations

import json
import time

import redis

from pipeline.config import ConfigError
from pipeline.control.allocation import allocation_status, format_allocation
from pipeline.control.job import load_job
from pipeline.dataplane.keys import JOBS, JobKeys
from pipeline.dataplane.streams import group_pending, stream_lag
from pipeline.dataplane.worker import EXTERNAL, record_alive

ROLE_OF_STAGE = {"rollout": "rollout", "reward": "reward", "learner": "learner"}

# The trajectory counters every job has, as `libra-ctl audit` accounts them (the hash holds each once counted).
COUNTERS = ("issued", "generated", "scored", "trained", "dropped_stale", "dead_lettered", "dead_lettered_replayed")


def pool_settings(r: redis.Redis, job: str) -> dict | None:
    """The job's claim on the shared slots, from its manifest's ``[control]``; None where it cannot be read.

    ``{"min_slots", "max_slots" (0: the whole pool), "priority"}``. The
    manifest lives in the run directory, which a machine other than the
    run's may not see; a manifest written before these keys existed reads
    as their defaults.
    """
    try:
        info = load_job(r, job)
    except (ConfigError, KeyError):
        return None   # a manifest this version cannot read: the other views still work
    if info is None:
        return None
    ctl = info.control
    return {"min_slots": ctl.min_slots, "max_slots": ctl.max_slots, "priority": ctl.priority}


def format_pool(pool: dict | None, mode: str = "auto") -> str:
    """``pool_settings`` for a terminal or a page: ``min_slots 2  max_slots the pool  priority 1``.

    A pinned job (``mode`` "pinned") is outside the pool: the controller
    takes the slots it holds out before sharing the rest, and its settings
    count again only once it is handed back to the allocator.
    """
    if pool is None:
        return "unknown (the job's manifest is not readable here)"
    most = pool["max_slots"] or "the pool"
    settings = f"min_slots {pool['min_slots']}  max_slots {most}  priority {pool['priority']:g}"
    if mode == "pinned":
        return f"none while pinned (it holds its slots outside the pool; {settings} once back on auto)"
    return settings


def format_slots(jobs: list[dict]) -> str | None:
    """One line for several jobs: the live agents' slots, what pinned jobs hold, and the pool the others share.

    ``jobs`` are ``job_status`` records; every one carries the same nodes.
    As the controller counts it (``Controller.plan_pool``), the pool is the
    live slots less the pinned jobs' (the auto jobs' external workers add to
    it; they hold no agent slot, so they are not counted here). None for a
    single job, whose pool is every slot.
    """
    running = [j for j in jobs if j["phase"] in ("running", "trained")]
    if len(jobs) < 2 or not running:
        return None
    live = [slot for n in jobs[0]["allocation"]["nodes"] if n["alive"] for slot in n["slots"]]
    pinned = [j["name"] for j in running if j["allocation"]["mode"] == "pinned"]
    auto = [j["name"] for j in running if j["allocation"]["mode"] != "pinned"]
    held = sum(1 for slot in live if slot["job"] in pinned)
    line = f"slots {len(live)} on live agents"
    if pinned:
        line += f"; pinned {', '.join(pinned)} hold{'s' if len(pinned) == 1 else ''} {held}, outside the pool"
    return line + (f"; the pool of {len(live) - held} is shared by {', '.join(auto)}" if auto else "; no auto job")


def job_status(r: redis.Redis, job: str) -> dict:
    keys = JobKeys(job)
    alloc = allocation_status(r, job)
    workers = []
    for wid, raw in sorted(r.hgetall(keys.workers).items()):
        rec = json.loads(raw)
        placed = alloc["workers"].get(rec["id"], {})
        state = rec["state"]
        if state != "exited" and not record_alive(rec, time.time()):
            state = "lost"  # no heartbeat: the process is gone or stuck
        # the record says who started it; older records do not: their placement does
        managed = rec.get("managed") or ("agent" if placed else "run")
        if managed == EXTERNAL and rec["id"] in alloc["external"]:
            state = alloc["external"][rec["id"]]["state"]   # "draining" once asked to
        workers.append({"id": rec["id"], "role": rec["role"], "pid": rec["pid"],
                        "node": placed.get("node", rec["node"]), "slots": placed.get("slots", rec.get("slots", [])),
                        "state": state, "managed": managed,
                        # an exited worker's record keeps its last rate: it makes none now
                        "rate_per_s": 0.0 if state in ("exited", "lost") else rec.get("rate_per_s", 0.0),
                        "policy_version": rec.get("policy_version"),
                        **({"devices": rec["devices"]} if "devices" in rec else {}),    # its CUDA_VISIBLE_DEVICES
                        **({"failure": rec["failure"]} if rec.get("failure") else {})})   # e.g. oom (workers.oom)
    stages = []
    for stage, stream, group in keys.stages:
        live = [w for w in workers if w["role"] == ROLE_OF_STAGE[stage] and w["state"] not in ("exited", "lost")]
        exists = r.exists(stream)
        stages.append({
            "name": stage, "stream": stream, "group": group,
            "length": r.xlen(stream) if exists else 0,
            "pending": group_pending(r, stream, group) if exists else 0,
            "lag": stream_lag(r, stream, group) if exists else 0,
            "rate_per_s": round(sum(w["rate_per_s"] for w in live), 3),
        })
    if not alloc["roles"]:
        # Workers started by hand (not through an agent): count the live ones that registered.
        for w in workers:
            if w["state"] not in ("exited", "lost") and w["role"] in ROLE_OF_STAGE.values():
                alloc["roles"][w["role"]] = alloc["roles"].get(w["role"], 0) + 1
    version = r.hget(keys.policy, "version")
    phase = r.hget(keys.state, "phase")
    cadence = r.hgetall(keys.publish)
    try:
        every = int(cadence[b"every"]) if b"every" in cadence else None
    except ValueError:
        every = None      # not one the learner would apply either (pipeline.dataplane.cadence.read_cadence)
    return {
        "name": job, "phase": phase.decode() if phase else None,
        "policy_version": int(version) if version is not None else None,
        # the controller's publish cadence (pipeline.dataplane.cadence); None: the learner's config stands
        "publish_every": every,
        "publish_reason": cadence[b"reason"].decode() if b"reason" in cadence else None,
        "allocation": {k: alloc[k] for k in ("mode", "roles", "target", "pinned", "nodes", "external")},
        "pool": pool_settings(r, job),
        "stages": stages, "workers": workers,
        # every job's counters, 0 until counted (a script reading counters["trained"] works from the start)
        "counters": {**dict.fromkeys(COUNTERS, 0),
                     **{k.decode(): int(v) for k, v in r.hgetall(keys.counters).items()}},
    }


def status(r: redis.Redis, job: str | None = None) -> dict:
    names = sorted(n.decode() for n in r.smembers(JOBS))
    if job is not None:
        names = [n for n in names if n == job]
    return {"jobs": [job_status(r, n) for n in names]}


def format_status(st: dict) -> str:
    if not st["jobs"]:
        return "no jobs on this Redis"
    slots = format_slots(st["jobs"])
    out = [slots] if slots else []
    for j in st["jobs"]:
        cadence = (f"  published every {j['publish_every']} step{'s' if j['publish_every'] > 1 else ''} "
                   f"({j['publish_reason']})" if j.get("publish_every") else "")
        out.append(f"job {j['name']}  phase {j['phase']}  policy v{j['policy_version']}{cadence}")
        out.append("  pool " + format_pool(j["pool"], j["allocation"]["mode"]))
        out.append("  " + format_allocation(j["allocation"], j["name"]).replace("\n", "\n  "))
        out.append(f"  {'stage':<8} {'stream':<28} {'length':>7} {'pending':>8} {'lag':>6} {'rate/s':>8}")
        for s in j["stages"]:
            out.append(f"  {s['name']:<8} {s['stream']:<28} {s['length']:>7} {s['pending']:>8} "
                       f"{s['lag']:>6} {s['rate_per_s']:>8.2f}")
        out.append(f"  {'worker':<22} {'role':<8} {'pid':>7} {'state':<9} {'managed':<9} {'node'}")
        for w in j["workers"]:
            out.append(f"  {w['id']:<22} {w['role']:<8} {w['pid']:>7} {w['state']:<9} {w['managed']:<9} {w['node']}")
    return "\n".join(out)
