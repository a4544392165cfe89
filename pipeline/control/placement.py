"""Placement, pure: which worker runs on which node and slot for a job's target counts.

Called by the reconcile loop (``pipeline.control.loop``) after the allocator
has chosen counts; no Redis, no processes, unit-tested on plain dicts.
"""

from __future__ import annotations

from pipeline.control.allocator import Allocation, RoleBounds
from pipeline.dataplane.keys import LEARNER
from pipeline.dataplane.keys import ROLES

def place(target: dict[str, int], current: dict[str, dict], nodes: dict[str, list[int]],
          taken: set[tuple[str, int]] = frozenset(), reward_on_slots: bool = False,
          avoid: set[str] = frozenset()) -> dict[str, dict]:
    """Which worker runs on which node and slots: worker id -> {role, node, slots}.

    Keeps the workers that can stay, shrinks before it grows (so freed slots
    serve the growing roles), never puts two workers on one slot, and keeps
    the learner's slots on one node. ``taken``: slots of other jobs. A role
    that cannot get all its slots gets what is free. ``avoid``: ids a new
    worker must not take (drained ones; a slot worker's id names its slot,
    which ``taken`` keeps from it already).
    """
    slot_roles = ["rollout"] + (["reward"] if reward_on_slots else [])
    cur = _still_there(current, nodes)
    learner = cur.get(LEARNER)
    want_l = target.get("learner", 0)
    grow_on = learner["node"] if learner and want_l > len(learner["slots"]) else None
    out: dict[str, dict] = {}
    for role in slot_roles:   # shrink first: keep the lowest slots, freeing on the learner's node first
        mine = sorted((w for w, rec in cur.items() if rec["role"] == role),
                      key=lambda w: (cur[w]["node"] != grow_on, cur[w]["node"], cur[w]["slots"]))
        keep = mine[len(mine) - min(len(mine), target.get(role, 0)):]
        out.update({w: cur[w] for w in keep})
    if learner and want_l:
        out[LEARNER] = {**learner, "slots": sorted(learner["slots"])[:want_l]}
    used = taken | {(rec["node"], s) for rec in out.values() for s in rec["slots"]}
    free = {n: [s for s in sorted(slots) if (n, s) not in used] for n, slots in nodes.items()}
    if want_l:
        out[LEARNER] = _grow_learner(out.get(LEARNER), want_l, free)
        if out[LEARNER] is None:
            del out[LEARNER]
        else:
            for s in out[LEARNER]["slots"]:
                if s in free[out[LEARNER]["node"]]:
                    free[out[LEARNER]["node"]].remove(s)
    for role in slot_roles:
        have = sum(1 for rec in out.values() if rec["role"] == role)
        for node, slot in _take(free, target.get(role, 0) - have):
            out[f"{role}-{node}-{slot}"] = {"role": role, "node": node, "slots": [slot]}
    if not reward_on_slots:
        out.update(_cpu_workers("reward", target.get("reward", 0), cur, sorted(nodes), avoid))
    return out


def _still_there(current: dict[str, dict], nodes: dict[str, list[int]]) -> dict[str, dict]:
    """The current workers whose node and slots are still offered; the learner keeps the slots that are.

    An agent back under its node's name with fewer slots (a GPU gone) no longer offers the rest.
    """
    out = {}
    for w, rec in current.items():
        have = set(nodes.get(rec["node"], ()))
        if rec["node"] not in nodes:
            continue
        if rec["role"] == "learner":
            kept = [s for s in rec["slots"] if s in have]
            if kept:
                out[w] = {**rec, "slots": kept}
        elif all(s in have for s in rec["slots"]):
            out[w] = rec
    return out


def _grow_learner(cur: dict | None, want: int, free: dict[str, list[int]]) -> dict | None:
    """The learner with ``want`` slots on one node: grown in place if its node has room, else moved."""
    if cur is not None and len(cur["slots"]) >= want:
        return cur
    if cur is not None and len(cur["slots"]) + len(free[cur["node"]]) >= want:
        extra = free[cur["node"]][:want - len(cur["slots"])]
        return {**cur, "slots": sorted(cur["slots"] + extra)}
    # move to the node with the most room (its own slots count there too)
    room = {n: len(f) + (len(cur["slots"]) if cur and cur["node"] == n else 0) for n, f in free.items()}
    if not room:
        return cur
    node = max(sorted(room), key=room.get)
    own = cur["slots"] if cur and cur["node"] == node else []
    slots = sorted(own + free[node])[:want]
    if cur is not None and len(slots) <= len(cur["slots"]):
        return cur        # nowhere better: keep what it has
    return {"role": "learner", "node": node, "slots": slots} if slots else None


def _take(free: dict[str, list[int]], n: int) -> list[tuple[str, int]]:
    """``n`` free slots, spread over nodes in turn (each node's lowest first)."""
    out = []
    while n > 0 and any(free.values()):
        for node in sorted(free):
            if n > 0 and free[node]:
                out.append((node, free[node].pop(0)))
                n -= 1
    return out


def _cpu_workers(role: str, n: int, cur: dict[str, dict], nodes: list[str],
                 avoid: set[str] = frozenset()) -> dict[str, dict]:
    """Workers without slots (reward on CPU): keep existing ones, add round-robin over nodes, under ids not in
    ``avoid``."""
    mine = sorted(w for w, rec in cur.items() if rec["role"] == role and not rec["slots"])
    out = {w: cur[w] for w in mine[:n]}
    i = 0
    while len(out) < n and nodes:
        node = nodes[i % len(nodes)]
        w = f"{role}-{node}-c{i}"
        if w not in out and w not in avoid:
            out[w] = {"role": role, "node": node, "slots": []}
        i += 1
    return out


def counts(placement: dict[str, dict], reward_on_slots: bool) -> Allocation:
    """The allocation (slots per role) a placement makes."""
    n = {r: 0 for r in ROLES}
    for rec in placement.values():
        n[rec["role"]] += len(rec["slots"]) if rec["role"] != "reward" or reward_on_slots else 0
    return Allocation(**n)


def agents_share(target: dict[str, int], external: dict[str, int]) -> dict[str, int]:
    """What the agents run of a target when external workers (``libra-ctl worker``) run some of it."""
    return {r: max(0, n - external.get(r, 0)) for r, n in target.items()}


def external_floor(bounds: dict[str, RoleBounds], external: dict[str, int]) -> dict[str, RoleBounds]:
    """Bounds that keep what external workers hold: the controller cannot give their slots to another role.

    ``external``: slots per role held by external workers. An external learner
    is the job's one learner process, so it fixes the learner's slots.
    """
    out = dict(bounds)
    for role, n in external.items():
        if n:
            b = bounds[role]
            out[role] = RoleBounds(n, n) if role == "learner" else RoleBounds(max(b.min, n), max(b.max, n))
    return out


def learner_to_one_node(counts: dict[str, int], learner_room: int | None,
                        bounds: dict[str, RoleBounds]) -> dict[str, int]:
    """``counts`` with the learner cut to ``learner_room`` (the most slots one node has for the job: the
    learner is one process on one node) and the slots it cannot use given to rollout, up to rollout's max."""
    over = counts["learner"] - max(learner_room or 0, 1) if learner_room is not None else 0
    if over <= 0:
        return counts
    return {**counts, "learner": counts["learner"] - over,
            "rollout": min(counts["rollout"] + over, max(bounds["rollout"].max, counts["rollout"]))}


def fit(target: dict[str, int], slots: int, bounds: dict[str, RoleBounds],
        reward_on_slots: bool, learner_room: int | None = None) -> dict[str, int]:
    """Trim a target that needs more slots than there are: the role most above its minimum gives first.

    ``learner_room``: the most slots one node has for the job; the learner, one process on one
    node, is cut to it.
    """
    out = dict(target)
    if learner_room is not None and out.get("learner", 0) > max(learner_room, 1):
        out["learner"] = max(learner_room, 1)
    slot_roles = [r for r in ROLES if r != "reward" or reward_on_slots]
    while sum(out[r] for r in slot_roles) > slots:
        role = max(slot_roles, key=lambda r: (out[r] - bounds[r].min, out[r]))
        if out[role] <= max(bounds[role].min, 1):
            break
        out[role] -= 1
    return out


