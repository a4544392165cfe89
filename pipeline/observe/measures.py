"""Pure measurements: rates, learner-step aggregates, tool statistics, and the JSONL records they live in.

No Redis and no processes: the metrics sampler (``observe.metrics``), the
doctor, the report and the learner (``tool_stats``) call these, and the tests
exercise them on plain data. Importing this module loads nothing of the
control plane, so a worker process can use it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable


def rise(values: Iterable[float]) -> float:
    """How much a count rose over successive readings: its falls are not subtracted.

    A learner that restores its checkpoint sets ``trained`` and the drops back to the
    checkpoint's, and a replay takes entries off the dead-letter stream; what was done
    between the readings is what rose.
    """
    values = list(values)
    return sum(max(0, b - a) for a, b in zip(values, values[1:]))


def rates(prev: dict, now: dict, dt_s: float) -> dict:
    """Throughput from two counter snapshots ``dt_s`` apart.

    ``rollout_tokens_per_s`` is None until the rollout workers count tokens
    (counter ``rollout_tokens``).
    """
    def per_s(name: str) -> float:
        return max(0, now.get(name, 0) - prev.get(name, 0)) / dt_s if dt_s > 0 else 0.0

    return {
        "rollout_tokens_per_s": per_s("rollout_tokens") if "rollout_tokens" in now else None,
        "trajectories_per_min": per_s("generated") * 60.0,
        "scored_per_s": per_s("scored"),
        "learner_samples_per_s": per_s("trained"),
        "dropped_stale_per_s": per_s("dropped_stale"),
        "dead_lettered_per_s": per_s("dead_lettered"),
    }


def _weighted_mean(pairs: Iterable[tuple[float | None, float]]) -> float | None:
    num = den = 0.0
    for value, weight in pairs:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue   # a step skipped for a non-finite loss or gradient says nothing of the window
        num += value * weight
        den += weight
    return num / den if den > 0 else None


def aggregate_steps(steps: list[dict]) -> dict:
    """Quality and learner-side queue figures over the learner steps of one window.

    Means are weighted by trajectories where a step's figure is a per-trajectory
    mean (reward, success, staleness); the diversity figures are those of the
    newest step that computed them. All values are None for an empty window.
    """
    traj = [max(s.get("trajectories", 0), 0) for s in steps]
    hist: dict[str, int] = {}
    for s in steps:
        for k, v in (s.get("staleness_hist") or {}).items():
            hist[str(int(k))] = hist.get(str(int(k)), 0) + int(v)
    groups = sum(s.get("groups", 0) for s in steps)
    wait = sum(s.get("wait_s", 0.0) for s in steps)
    busy = sum(s.get("train_s", 0.0) for s in steps)
    calls = sum(s.get("tool_calls", 0) for s in steps)
    div = next((s for s in reversed(steps) if s.get("diversity_groups")), {})
    p95 = [(s["tool_latency_p95_s"], max(s.get("tool_calls", 0), 1)) for s in steps
           if s.get("tool_latency_p95_s") is not None]
    return {
        "steps": len(steps),
        "step": steps[-1].get("step") if steps else None,
        "loss": _weighted_mean((s.get("loss"), 1.0) for s in steps),
        "reward_mean": _weighted_mean((s.get("reward_mean"), w) for s, w in zip(steps, traj)),
        "reward_std": _weighted_mean((s.get("reward_std"), w) for s, w in zip(steps, traj)),
        "success_rate": _weighted_mean((s.get("success_rate"), w) for s, w in zip(steps, traj)),
        "entropy": _weighted_mean((s.get("entropy"), 1.0) for s in steps),
        "grad_norm": _weighted_mean((s.get("grad_norm"), 1.0) for s in steps),
        "staleness_mean": _weighted_mean((s.get("staleness_mean"), w) for s, w in zip(steps, traj)),
        "staleness_max": max((s.get("staleness_max", 0) for s in steps), default=None),
        "staleness_hist": hist,
        "trained": sum(traj),
        "dropped_stale": sum(s.get("dropped_stale", 0) for s in steps),
        "zero_signal_share": (sum(s.get("zero_signal_groups", 0) for s in steps) / groups) if groups else None,
        "diversity_distinct_rate": div.get("diversity_distinct_rate"),
        "diversity_similarity": div.get("diversity_similarity"),
        "diversity_equal_reward_share": div.get("diversity_equal_reward_share"),
        # learner-side queue figures
        "wait_s": wait, "train_s": busy,
        "wait_ratio": wait / (wait + busy) if wait + busy > 0 else None,
        "tool_calls": calls,
        "tool_timeouts": sum(s.get("tool_timeouts", 0) for s in steps),
        "tool_latency_mean_s": _weighted_mean((s.get("tool_latency_mean_s"), s.get("tool_calls", 0))
                                              for s in steps),
        "tool_latency_p95_s": weighted_p95(p95),
    }


def weighted_p95(values: list[tuple[float, int]]) -> float | None:
    """A window's p95 from its steps' ``(p95, calls)``: the nearest-rank 95th percentile of the steps' p95s,
    each counted as many times as its step made calls. The steps' calls themselves are not kept; this is the
    closest figure their p95s give (one step's lone slow call no longer becomes the window's p95)."""
    if not values:
        return None
    total, seen = sum(n for _v, n in values), 0
    rank = math.ceil(0.95 * total)
    for value, n in sorted(values):
        seen += n
        if seen >= rank:
            return value
    return max(v for v, _n in values)


def tool_stats(groups) -> dict:
    """Tool-call figures of a learner step's groups (``messages.Group``); the learner merges them in."""
    lat = sorted(x for g in groups for t in g.trajectories for x in t.tool_latency_s)
    calls = sum(t.tool_calls for g in groups for t in g.trajectories)
    return {
        "tool_calls": calls,
        "tool_timeouts": sum(t.tool_timeouts for g in groups for t in g.trajectories),
        "tool_latency_mean_s": sum(lat) / len(lat) if lat else None,
        "tool_latency_p95_s": lat[max(0, math.ceil(0.95 * len(lat)) - 1)] if lat else None,   # nearest rank
    }


# --- slot busy share, from the workers' cost reports --------------------------------------------------

SLOT_ROLES = ("rollout", "learner")   # roles that always hold slots; reward does with control.reward_on_slots


def _units(role: str, rec: dict, slots: int) -> int:
    """How many seconds of ``busy_s`` one second of a worker's life can hold.

    ``CostMeter.busy_s`` is in the worker's own units: engine-seconds for a
    rollout worker (one engine, whatever its tensor-parallel width),
    scorer-seconds for a reward process (``lanes`` scorers), rank-seconds for
    the learner (one rank per slot it holds).
    """
    if role == "reward":
        return max(int(rec.get("lanes", 1) or 1), 1)
    if role == "learner":
        return max(slots, 1)
    return 1


def slot_busy(prev: dict, now: dict, workers: list[dict], t0: float, t1: float) -> dict:
    """Busy share of the slots the workers held between ``t0`` and ``t1`` (unix s), from their cost reports.

    ``prev`` and ``now``: worker id -> ``CostMeter`` record at ``t0`` and at
    ``t1`` (``JobKeys.worker_costs``); ``workers``: ``job_status``'s worker
    rows (role, state, slots). A worker's share is its busy seconds in the
    window over its time alive in it; a role's share, and ``frac``, the share
    of all slots, weight each worker by the slots it holds (a rollout or
    learner worker outside the agents, with no slot recorded, counts as one).
    Reward workers beside the slots appear in ``by_role`` only. Work is
    reported when it ends, so a window can hold a call that began before it:
    shares are capped at 1. ``frac`` is None where no slot was held.
    """
    rows = {w["id"]: w for w in workers}
    roles: dict[str, dict] = {}
    for wid, rec in now.items():
        row = rows.get(wid, {})
        role = rec.get("role") or row.get("role", "?")
        before = prev.get(wid) or {}
        if before.get("since") != rec.get("since"):
            before = {}   # a new process under this id: its meter starts from zero
        live = row.get("state") not in (None, "exited", "lost")
        end = t1 if live else min(t1, rec.get("at", t1))
        alive = end - max(t0, rec.get("since", t0))
        if alive <= 0:
            continue
        slots = len(row.get("slots") or []) or (1 if role in SLOT_ROLES else 0)
        busy = max(0.0, rec.get("busy_s", 0.0) - before.get("busy_s", 0.0))
        share = min(1.0, busy / (alive * _units(role, rec, slots)))
        acc = roles.setdefault(role, {"busy_s": 0.0, "slot_s": 0.0, "slots": 0})
        weight = slots or 1   # by_role of a role beside the slots: per worker
        acc["busy_s"] += share * alive * weight
        acc["slot_s"] += alive * weight
        acc["slots"] += slots
    for acc in roles.values():
        acc["frac"] = round(acc["busy_s"] / acc["slot_s"], 4) if acc["slot_s"] > 0 else None
    held = [acc for acc in roles.values() if acc["slots"]]
    busy_s, slot_s = sum(a["busy_s"] for a in held), sum(a["slot_s"] for a in held)
    for acc in roles.values():
        acc["busy_s"], acc["slot_s"] = round(acc["busy_s"], 3), round(acc["slot_s"], 3)
    return {"frac": round(busy_s / slot_s, 4) if slot_s > 0 else None, "busy_s": round(busy_s, 3),
            "slot_s": round(slot_s, 3), "by_role": roles}


# --- resources of this node -----------------------------------------------------------------------


def append_line(path: Path, line: str) -> None:
    """Append one line with a single O_APPEND write, so lines of concurrent writers never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def write_json(path: Path, doc) -> None:
    """Write ``doc`` as ``path`` whole or not at all: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)


def success_text(rate: float | None, judged: int | None) -> str:
    """A held-out success rate, or what it is when the reward judged none of the episodes (not a 0%)."""
    if judged == 0 or rate is None:
        return "none judged (the reward could not judge an episode: see the rollout workers' logs)"
    return f"{rate:.1%}"


def read_jsonl(path: Path | str, kind: str | None = None) -> list[dict]:
    """Lines of a JSONL file (``metrics.jsonl``, ``events.jsonl``), optionally of one kind; bad lines skipped."""
    out = []
    try:
        # damaged bytes become U+FFFD: their line fails to parse and is skipped, the file is still read
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = _after_cut(line)   # a line cut short by a crash, maybe with the next writer's after it
                if isinstance(row, dict) and (kind is None or row.get("kind") == kind):
                    out.append(row)
    except FileNotFoundError:
        return []
    return out


def _after_cut(line: str) -> dict | None:
    """The whole record that ends ``line`` after a cut one (a writer that died mid-line leaves no newline,
    and the next writer's line follows it), else None."""
    decoder, last = json.JSONDecoder(), len(line.rstrip())
    at = line.find("{", 1)
    while at > 0:
        try:
            row, end = decoder.raw_decode(line, at)
            if end == last and isinstance(row, dict):   # the rest of the line, whole
                return row
        except json.JSONDecodeError:
            pass
        at = line.find("{", at + 1)   # a nested object of the cut record ends before the line does
    return None
