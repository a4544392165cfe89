"""A job's allocation in Redis: the mode (auto or pinned), the target and pinned counts, the placement.

Written by ``libra-ctl scale`` (``pin``/``unpin``) and the reconcile loop;
read by the loop, ``libra-ctl status`` (``allocation_status``) and the live
benchmark. ``live_agents`` is the inventory: the agents whose heartbeat is fresh;
``external_workers`` are the workers started outside the agents (``libra-ctl
worker``), which the loop counts but never starts or stops.
"""

from __future__ import annotations

import json
import time

import redis

from pipeline.dataplane.keys import AGENTS, CONTROLLER_WAKE, JobKeys, agent_procs
from pipeline.dataplane.keys import ROLES
from pipeline.dataplane.worker import EXTERNAL, HOLDS_PLACE, record_alive

AGENT_DEAD_S = 10.0      # an agent silent this long is gone: its slots leave the inventory

def get_allocation(r: redis.Redis, job: str) -> dict:
    raw = {k.decode(): v.decode() for k, v in r.hgetall(JobKeys(job).allocation).items()}
    return {"mode": raw.get("mode"), "pinned": json.loads(raw.get("pinned", "{}")),
            "target": json.loads(raw.get("target", "{}")), "changed_at": float(raw.get("changed_at", 0)),
            "changed_from": json.loads(raw["changed_from"]) if raw.get("changed_from") else None}


def pin(r: redis.Redis, job: str, roles: dict[str, int]) -> None:
    """Pin counts (other roles keep their current target); the controller applies them on its next tick."""
    bad = {k: v for k, v in roles.items() if k not in ROLES or not isinstance(v, int) or v < 0}
    if bad:
        raise ValueError(f"bad counts {bad}: give role=N with role in {', '.join(ROLES)} and N >= 0")
    for role in ROLES:
        if roles.get(role, 1) < 1:
            raise ValueError(f"{role}={roles[role]}: the pipeline needs at least one {role} worker")
    key = JobKeys(job).allocation
    with r.pipeline() as pipe:
        while True:   # read and write as one: a target the controller commits in between is the one kept
            try:
                pipe.watch(key)
                cur = get_allocation(pipe, job)
                # an earlier pin handed back (--auto) no longer counts: the roles not named keep the current target
                pinned = {**cur["target"], **(cur["pinned"] if cur["mode"] == "pinned" else {}), **roles}
                pipe.multi()
                pipe.hset(key, mapping={"mode": "pinned", "pinned": json.dumps(pinned)})
                pipe.execute()
                break
            except redis.WatchError:
                continue
    r.lpush(CONTROLLER_WAKE, f"scale:{job}")


def unpin(r: redis.Redis, job: str) -> None:
    """Hand the job back to the allocator."""
    r.hset(JobKeys(job).allocation, "mode", "auto")
    r.lpush(CONTROLLER_WAKE, f"auto:{job}")


# --- inventory --------------------------------------------------------------------------------------------


def live_agents(r: redis.Redis, now: float | None = None) -> dict[str, dict]:
    """Agents whose heartbeat is fresh: node -> record (slots, host, pid, heartbeat)."""
    now = time.time() if now is None else now
    out = {}
    for node, raw in r.hgetall(AGENTS).items():
        rec = json.loads(raw)
        if now - rec["heartbeat"] <= AGENT_DEAD_S:
            out[node.decode()] = rec
    return out


def external_workers(r: redis.Redis, job: str, now: float | None = None) -> dict[str, dict]:
    """The job's live workers started outside the agents: id -> their record in the worker table.

    ``draining``: asked to drain (``JobKeys.external_drain``) and not yet
    stopped; ``counted``: holding its place in the allocation (at work, about
    to be, a learner queued for ``learner-0``, or one done with its steps),
    neither drained nor asked to.
    """
    now = time.time() if now is None else now
    keys = JobKeys(job)
    asked = {w.decode() for w in r.smembers(keys.external_drain)}
    out = {}
    for wid, raw in r.hgetall(keys.workers).items():
        rec = json.loads(raw)
        if rec.get("managed") != EXTERNAL or not record_alive(rec, now):
            continue
        draining = wid.decode() in asked and rec["state"] in HOLDS_PLACE
        out[wid.decode()] = {**rec, "draining": draining, "counted": rec["state"] in HOLDS_PLACE and not draining}
    return out


def external_counts(workers: dict[str, dict]) -> dict[str, int]:
    """Counted external workers per role (what the agents need not run)."""
    out: dict[str, int] = {}
    for rec in workers.values():
        if rec["counted"] and rec["role"] in ROLES:
            out[rec["role"]] = out.get(rec["role"], 0) + 1
    return out


def allocation_status(r: redis.Redis, job: str) -> dict:
    """The job's allocation for ``libra-ctl status``: mode, counts per role, and every node's slots.

    ``{"mode": "auto"|"pinned", "roles": {role: count running}, "target": {role: count},
    "pinned": {role: count}, "nodes": [{"node", "host", "alive", "heartbeat_age_s",
    "slots": [{"index", "device", "job", "worker", "role", "pid", "state"}]}],
    "workers": {worker: {"node", "slots", "pid", "state"}},
    "external": {worker: {"node", "role", "pid", "state"}}}``; a slot without a
    worker has ``worker: None``, a worker without slots (reward on CPU) appears
    under ``workers`` only; a lost node (heartbeat older than ``AGENT_DEAD_S``) keeps its last slots
    but adds nothing to ``workers`` or ``roles``. ``roles`` counts the live agents' running workers (the
    learner by its slots, as ``target`` and ``pinned`` do: a learner of 2 ranks is learner=2) and the
    counted external ones (``external``: started by ``libra-ctl worker``, on no slot).
    """
    alloc = get_allocation(r, job)
    now = time.time()
    nodes, workers, roles = [], {}, {}
    for node, raw in sorted(r.hgetall(AGENTS).items()):
        rec, node = json.loads(raw), node.decode()
        procs = {k.decode(): json.loads(v) for k, v in r.hgetall(agent_procs(node)).items()}
        by_slot = {s: p for p in procs.values() for s in p["slots"]}
        slots = []
        for s in rec["slots"]:
            p = by_slot.get(s["index"])
            slots.append({"index": s["index"], "device": s["device"], "job": p["job"] if p else None,
                          "worker": p["worker"] if p else None, "role": p["role"] if p else None,
                          "pid": p["pid"] if p else None, "state": p["state"] if p else "free"})
        alive = now - rec["heartbeat"] <= AGENT_DEAD_S
        for p in procs.values():
            # a lost node's table is what its agent last wrote: its workers are not the job's (the
            # controller has placed them elsewhere, perhaps under the same name, as learner-0)
            if p["job"] == job and alive:
                workers[p["worker"]] = {"node": node, "slots": p["slots"], "pid": p["pid"], "state": p["state"],
                                        "role": p["role"]}
                if p["state"] == "running" and p["role"] in ROLES:
                    # as targets and pins count: a worker's slots (a learner's ranks), one for a worker on none
                    roles[p["role"]] = roles.get(p["role"], 0) + (len(p["slots"]) or 1)
        nodes.append({"node": node, "host": rec["host"], "alive": alive,
                      "heartbeat_age_s": round(now - rec["heartbeat"], 1), "slots": slots})
    ext = external_workers(r, job, now)
    for role, n in external_counts(ext).items():
        roles[role] = roles.get(role, 0) + n
    external = {w: {"node": rec["node"], "role": rec["role"], "pid": rec["pid"],
                    "state": "draining" if rec["draining"] else rec["state"]} for w, rec in sorted(ext.items())}
    return {"mode": alloc["mode"] or "auto", "roles": roles, "target": alloc["target"], "pinned": alloc["pinned"],
            "nodes": nodes, "workers": workers, "external": external}


def format_allocation(a: dict, job: str | None = None) -> str:
    """Lines for a terminal: one per node, each slot as index:worker; then the external workers.

    The nodes' slots are shared by every job on the Redis, and worker names
    repeat across jobs (each has a ``learner-0``): a slot held by a job other
    than ``job`` shows as index:otherjob/worker.
    """
    pinned = " ".join(f"{k}={v}" for k, v in sorted(a["pinned"].items())) if a["mode"] == "pinned" else ""
    lines = [f"allocation {a['mode']}{' ' + pinned if pinned else ''}  running "
             + " ".join(f"{k}={v}" for k, v in sorted(a["roles"].items()))]
    for n in a["nodes"]:
        slots = "  ".join(f"{s['index']}:{_slot_holder(s, job)}" for s in n["slots"])
        lines.append(f"  node {n['node']}{'' if n['alive'] else ' (lost)'}  {slots}")
    if a.get("external"):
        lines.append("  external  " + "  ".join(f"{w} ({e['state']})" for w, e in a["external"].items()))
    return "\n".join(lines)


def _slot_holder(slot: dict, job: str | None) -> str:
    if slot["worker"] is None:
        return "-"
    return slot["worker"] if job is None or slot["job"] == job else f"{slot['job']}/{slot['worker']}"


def counts_of(roles: dict, reward_on_slots: bool) -> dict:
    """Slots per role of worker counts (reward on CPU holds none)."""
    return {r: roles.get(r, 0) if r != "reward" or reward_on_slots else 0 for r in ROLES}


def read_placement(r: redis.Redis, job: str) -> dict[str, dict]:
    return {w.decode(): json.loads(v) for w, v in r.hgetall(JobKeys(job).placement).items()}


def drain_requests(r: redis.Redis, job: str) -> list[str]:
    """The workers ``libra-ctl drain`` asked the controller to drain; it removes them once it has acted
    (``Controller.commit``): a reconcile that fails half way leaves them for the next tick."""
    return sorted(w.decode() for w in r.smembers(JobKeys(job).drain_requests))
