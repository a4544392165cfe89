"""``libra-ctl controller``: the reconcile loop that moves slots to the bottleneck; scale, drain, events.

One controller acts at a time: it holds ``CONTROLLER_LEASE`` (SET NX PX,
renewed with a token check; each lease taken increments ``CONTROLLER_EPOCH``,
which fences the actions of a controller that lost it). Every
``interval_s``, or as soon as ``libra-ctl scale`` / ``drain`` pushes to
``CONTROLLER_WAKE``, it reconciles each running job:

1. observe: a snapshot of the job's counters, queues, the workers' reported
   costs (``CostMeter``) and the learner's step records, kept over a window
   (``Observer``), mapped onto ``policy.Metrics``;
2. decide: the pinned counts (``libra-ctl scale``), or ``policy.plan()`` on
   those metrics, the live slots of the agents (``Inventory``) and the job's
   config (``JobSpec``);
3. place: which worker on which node and slot (``place``, pure): keep what
   runs, shrink before growing, reuse the freed slots (an agent starts the
   new worker only once the old one has exited);
4. act: the difference between that placement and the agents' desired state
   goes out as control jobs (``pipeline.control_jobs``); an action that did
   not take is sent again after ``RESEND_S``, so a lost one is repaired;
5. record: an event with the inputs, the decision, its expected gain and the
   actions, in ``control_events`` (``libra-ctl events``) and
   ``runs/<id>/events.jsonl``.

It also hosts what the rest of the system calls: ``CostMeter`` (worker
processes report their busy time through it), ``allocation_status`` (for
``libra-ctl status``) and ``start_local_control`` (for ``libra-ctl run``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import redis
import structlog

from pipeline import control_jobs, policy
from pipeline.control_jobs import STATE_RUN, worker_key
from pipeline.keys import (AGENTS, CONTROLLER_EPOCH, CONTROLLER_LEASE, CONTROLLER_WAKE, GROUP_LEARNER,
                           GROUP_ROLLOUT, JOBS, JobKeys, agent_desired, agent_procs)
from pipeline.policy import ROLES, Allocation
from pipeline.redisconn import ENV_URL, connect
from pipeline.streams import group_pending, stream_lag

MIN_STEPS = 2            # learner steps the metrics window holds at least (it stretches for them) ...
MAX_WINDOW_FACTOR = 10   # ... up to this many control.window_s
AGENT_DEAD_S = 10.0      # an agent silent this long is gone: its slots leave the inventory
RESEND_S = 15.0          # an action not reflected in the agent's desired state after this is sent again
EVENTS_MAXLEN = 10_000
LEARNER = "learner-0"    # the one learner worker of a job; its consumer name is stable across restarts


# --- what workers report -------------------------------------------------------------------------------


class CostMeter:
    """A worker's cumulative costs, in wall seconds, in ``JobKeys.worker_costs``; read by the controller.

    ``busy_s``: seconds of slot time spent on work (for a reward process of
    several scorers, scorer-seconds); ``pause_s``: weight loads; ``items``:
    trajectories done; ``tokens``: their prompt + response tokens; ``lanes``:
    scorers in the process; ``since``: when the meter started. Idle time is
    what is left of the time alive.
    """

    def __init__(self, r: redis.Redis, keys: JobKeys, worker: str, role: str):
        self.r, self.keys, self.worker = r, keys, worker
        self.rec = {"role": role, "since": time.time(), "at": time.time(), "busy_s": 0.0, "pause_s": 0.0,
                    "items": 0, "tokens": 0.0, "lanes": 1}
        self.publish()

    def add(self, **deltas) -> None:
        for k, v in deltas.items():
            self.rec[k] += v
        self.publish()

    def set(self, **values) -> None:
        self.rec.update(values)
        self.publish()

    def publish(self) -> None:
        self.rec["at"] = time.time()
        self.r.hset(self.keys.worker_costs, self.worker, json.dumps(self.rec))


# --- config ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControlConfig:
    """A job's control settings: its config's ``[control]`` table (or the manifest's ``control``) over these."""

    mode: str = "auto"                  # initial mode: auto (the policy) or pinned (the config's counts)
    interval_s: float = 10.0            # the controller's period (start_local_control; a running one has --interval)
    window_s: float = 60.0              # metrics window the policy sees
    cooldown_s: float = 150.0           # no move sooner than this after the previous one
    horizon_s: float = 900.0            # a move must pay for itself within this time
    switch_cost_s: float = 40.0         # seconds a slot yields nothing while it changes role
    learner_scaling_exponent: float = 0.9   # n learner slots train at n**e x one
    reward_on_slots: bool = False       # reward workers hold slots (else CPU workers beside the slots)
    min_rollout: int = 1
    max_rollout: int = 1 << 30
    min_learner: int = 1
    max_learner: int = 1 << 30          # the vllm backend's learner is single-process: capped to 1 there
    min_reward: int = 1
    max_reward: int = 1 << 30
    metrics_port: int = 9464            # the controller's Prometheus /metrics (0: off)

    @classmethod
    def from_dict(cls, raw: dict | None) -> "ControlConfig":
        raw = raw or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown key control.{unknown[0]}; known keys: {', '.join(sorted(known))}")
        cfg = cls(**raw)
        if cfg.mode not in ("auto", "pinned"):
            raise ValueError(f"control.mode = {cfg.mode!r}: use auto or pinned")
        return cfg

    def plan_config(self) -> policy.PlanConfig:
        return policy.PlanConfig(horizon_s=self.horizon_s, cooldown_s=self.cooldown_s)

    def bounds(self, backend: str) -> dict[str, policy.RoleBounds]:
        out = {r: policy.RoleBounds(getattr(self, f"min_{r}"), getattr(self, f"max_{r}")) for r in ROLES}
        if backend != "sim":
            out["learner"] = policy.RoleBounds(1, 1)   # workers.learner runs one process (world size 1)
        if not self.reward_on_slots:
            out["reward"] = policy.RoleBounds(0, 0)
        return out


@dataclass(frozen=True)
class JobInfo:
    """What the controller knows of a job from its Redis state and manifest."""

    name: str
    run_dir: str
    backend: str                 # vllm | sim
    batch_size: int
    group_size: int
    max_staleness: int
    initial: dict                # role -> count from the config
    control: ControlConfig

    def spec(self) -> policy.JobSpec:
        return policy.JobSpec(name=self.name, batch_size=self.batch_size, max_staleness=self.max_staleness,
                              reward_on_gpu=self.control.reward_on_slots,
                              learner_scaling_exponent=self.control.learner_scaling_exponent,
                              bounds=self.control.bounds(self.backend))


def load_job(r: redis.Redis, job: str) -> JobInfo | None:
    """The job's run directory and config (from its manifest); None while it has no run directory."""
    raw = r.hget(JobKeys(job).state, "run_dir")
    if not raw:
        return None
    run_dir = raw.decode()
    try:
        manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = manifest["config"]
    backend = "sim" if manifest.get("sim") else cfg.get("rollout", {}).get("backend", "vllm")
    return JobInfo(name=job, run_dir=run_dir, backend=backend, batch_size=cfg["learner"]["batch_size"],
                   group_size=cfg["rollout"]["group_size"], max_staleness=cfg["learner"]["max_staleness"],
                   initial={"rollout": cfg["rollout"]["workers"], "reward": cfg["reward"]["workers"],
                            "learner": cfg["learner"]["workers"]},
                   control=ControlConfig.from_dict(manifest.get("control") or cfg.get("control")))


# --- the lease -----------------------------------------------------------------------------------------

_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Lease:
    """A Redis lease: SET NX PX to take it, renew and release only while our token is the value.

    With ``epoch_key`` each acquisition takes the next number from that
    counter and puts it in the token, so actions can carry it as a fence.
    """

    def __init__(self, r: redis.Redis, key: str, ttl_s: float, epoch_key: str | None = None):
        self.r, self.key, self.ttl_ms, self.epoch_key = r, key, int(ttl_s * 1000), epoch_key
        self.token: str | None = None
        self.epoch = 0

    def acquire(self) -> bool:
        epoch = int(self.r.incr(self.epoch_key)) if self.epoch_key and self.r.get(self.key) is None else 0
        token = f"{epoch}:{os.getpid()}:{uuid.uuid4().hex}"
        if self.r.set(self.key, token, nx=True, px=self.ttl_ms):
            self.token, self.epoch = token, epoch
            return True
        return False

    def renew(self) -> bool:
        """Extend the lease; False (and forgotten) if it expired or another holder has it."""
        if self.token is None:
            return False
        if self.r.eval(_RENEW, 1, self.key, self.token, self.ttl_ms):
            return True
        self.token, self.epoch = None, 0
        return False

    def release(self) -> None:
        if self.token is not None:
            self.r.eval(_RELEASE, 1, self.key, self.token)
        self.token, self.epoch = None, 0

    @property
    def held(self) -> bool:
        return self.token is not None


# --- the allocation: pinned or automatic -------------------------------------------------------------------


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
    for role in ("rollout", "learner"):
        if roles.get(role, 1) < 1:
            raise ValueError(f"{role}={roles[role]}: the pipeline needs at least one {role} worker")
    cur = get_allocation(r, job)
    pinned = {**cur["target"], **cur["pinned"], **roles}
    r.hset(JobKeys(job).allocation, mapping={"mode": "pinned", "pinned": json.dumps(pinned)})
    r.lpush(CONTROLLER_WAKE, f"scale:{job}")


def unpin(r: redis.Redis, job: str) -> None:
    """Hand the job back to the policy."""
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


# --- observation: live metrics -> policy.Metrics -----------------------------------------------------------


@dataclass
class Snapshot:
    """What the controller reads of a job at one tick."""

    t: float
    counters: dict
    costs: dict                 # worker -> CostMeter record
    steps: list                 # learner step records that appeared since the previous tick
    backlog: int                # scored trajectories not yet delivered to the learner
    inflight: int               # prompts' trajectories being generated (pending at rollout)
    queue: int                  # prompts' trajectories not yet delivered to rollout
    learner_waiting: bool


class Observer:
    """A job's snapshots over the metrics window, and their mapping onto ``policy.Metrics``."""

    def __init__(self, job: JobInfo):
        self.job = job
        self.keys = JobKeys(job.name)
        self.ticks: deque[Snapshot] = deque()
        self.steps_cursor = "0-0"

    def tick(self, r: redis.Redis, now: float) -> Snapshot:
        k, gs = self.keys, self.job.group_size
        steps = []
        for entry_id, f in r.xrange(k.metrics, min=f"({self.steps_cursor}", count=10_000):
            self.steps_cursor = entry_id.decode()
            if f.get(b"kind") == b"learner_step":
                steps.append(json.loads(f[b"data"]))
        learner = r.hget(k.workers, LEARNER)
        snap = Snapshot(
            t=now, counters={a.decode(): int(b) for a, b in r.hgetall(k.counters).items()},
            costs={a.decode(): json.loads(b) for a, b in r.hgetall(k.worker_costs).items()}, steps=steps,
            backlog=stream_lag(r, k.scored, GROUP_LEARNER) * gs,
            inflight=group_pending(r, k.prompts, GROUP_ROLLOUT) * gs,
            queue=stream_lag(r, k.prompts, GROUP_ROLLOUT) * gs,
            learner_waiting=bool(learner) and json.loads(learner).get("state") == "waiting")
        self.ticks.append(snap)
        while len(self.ticks) > 2 and self._droppable(now):
            self.ticks.popleft()
        return snap

    def _droppable(self, now: float) -> bool:
        """Whether the oldest tick can go: the rest still spans the window and holds MIN_STEPS learner steps.

        A window shorter than a learner step would never see the learner's
        speed, so it stretches (up to MAX_WINDOW_FACTOR windows) until it does.
        """
        span = now - self.ticks[1].t
        if span < self.job.control.window_s:
            return False
        if span >= MAX_WINDOW_FACTOR * self.job.control.window_s:
            return True
        return sum(len(t.steps) for t in list(self.ticks)[2:]) >= MIN_STEPS

    def metrics(self, alloc: Allocation, since_change_s: float, changed_from: Allocation | None,
                learner_slots: int) -> policy.Metrics:
        first, last = self.ticks[0], self.ticks[-1]
        span = max(last.t - first.t, 1e-9)
        ro = self._role_costs("rollout", first, last)
        rw = self._role_costs("reward", first, last)
        steps = [s for snap in list(self.ticks)[1:] for s in snap.steps]
        by_tokens = bool(steps) and ro["tokens"] > 0 and all("tokens" in s for s in steps)
        unit = (lambda s: s["tokens"]) if by_tokens else (lambda s: s["trajectories"])
        delta = {c: last.counters.get(c, 0) - first.counters.get(c, 0) for c in ("trained", "dropped_stale",
                                                                                  "generated", "scored")}
        if ro["items"] == 0 and delta["generated"]:      # workers that do not report costs: all time is busy
            ro.update(busy=alloc.rollout * span, elapsed=alloc.rollout * span, items=delta["generated"])
        if rw["items"] == 0 and delta["scored"]:
            rw.update(busy=max(rw["lanes"], 1) * span, items=delta["scored"])
        return policy.Metrics(
            window_s=span, allocation=alloc, since_change_s=since_change_s, changed_from=changed_from,
            rollout_gpu_s_per_traj=_ratio(ro["busy"], ro["items"]),
            rollout_pause_frac=_ratio(ro["pause"], ro["elapsed"]),
            rollout_inflight=last.inflight, rollout_queue=last.queue,
            rollout_idle_frac=max(0.0, 1 - _ratio(ro["busy"] + ro["pause"], ro["elapsed"])) if ro["elapsed"] else 0.0,
            reward_s_per_traj=_ratio(rw["busy"], rw["items"]), reward_cpu_workers=max(rw["lanes"], 1),
            traj_tokens=_ratio(ro["tokens"], ro["items"]) if by_tokens else 1.0,
            learner_tokens_per_s=_learner_speed(steps, unit, learner_slots, self.job.control.learner_scaling_exponent),
            learner_gpus_measured=learner_slots if steps else 0,
            learner_publish_s=sum(s.get("publish_s", 0.0) for s in steps) / len(steps) if steps else 0.0,
            learner_wait_frac=self._wait_frac(steps, first, last, span),
            backlog=last.backlog, backlog_trend_per_s=(last.backlog - first.backlog) / span,
            trained=delta["trained"], staleness_p50=_hist_p50(steps), dropped_stale=delta["dropped_stale"])

    @staticmethod
    def _role_costs(role: str, first: Snapshot, last: Snapshot) -> dict:
        """Summed busy/pause/time alive/items/tokens of a role's workers over the window."""
        out = {"busy": 0.0, "pause": 0.0, "elapsed": 0.0, "items": 0, "tokens": 0.0, "lanes": 0}
        for w, now in last.costs.items():
            if now["role"] != role:
                continue
            before = first.costs.get(w)
            if before is None or before["since"] != now["since"]:   # started within the window
                before = {"busy_s": 0.0, "pause_s": 0.0, "items": 0, "tokens": 0.0, "since": now["since"]}
            out["busy"] += now["busy_s"] - before["busy_s"]
            out["pause"] += now["pause_s"] - before["pause_s"]
            out["items"] += now["items"] - before["items"]
            out["tokens"] += now["tokens"] - before["tokens"]
            # time alive in the window, up to its last report (a worker that stopped before it has none)
            out["elapsed"] += max(0.0, now["at"] - max(now["since"], first.t))
            if last.t - now["at"] < AGENT_DEAD_S:          # still reporting: its scorers count
                out["lanes"] += now.get("lanes", 1)
        return out

    def _wait_frac(self, steps: list, first: Snapshot, last: Snapshot, span: float) -> float:
        """Share of the window the learner waited for data, a wait still going on included."""
        wait = sum(min(s.get("wait_s", 0.0), max(0.0, s.get("at", last.t) - first.t)) for s in steps)
        if last.learner_waiting:
            ended = max([s.get("at", 0.0) for s in steps] + [first.t])
            wait += max(0.0, last.t - ended)
        return min(1.0, wait / span)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _learner_speed(steps: list, unit, n_now: int, exponent: float) -> float:
    """Training units/s over the steps, brought to ``n_now`` slots (as ``sim_des`` does)."""
    train = sum(s["train_s"] * (s.get("gpus", n_now) / max(n_now, 1)) ** exponent for s in steps)
    return sum(unit(s) for s in steps) / train if steps and train > 0 else 0.0


def _hist_p50(steps: list) -> float:
    hist: dict[int, int] = {}
    for s in steps:
        for v, c in (s.get("staleness_hist") or {}).items():
            hist[int(v)] = hist.get(int(v), 0) + int(c)
    total = sum(hist.values())
    acc = 0
    for v in sorted(hist):
        acc += hist[v]
        if acc >= total / 2:
            return float(v)
    return 0.0


# --- placement (pure) --------------------------------------------------------------------------------------------


def place(target: dict[str, int], current: dict[str, dict], nodes: dict[str, list[int]],
          taken: set[tuple[str, int]] = frozenset(), reward_on_slots: bool = False) -> dict[str, dict]:
    """Which worker runs on which node and slots: worker id -> {role, node, slots}.

    Keeps the workers that can stay, shrinks before it grows (so freed slots
    serve the growing roles), never puts two workers on one slot, and keeps
    the learner's slots on one node. ``taken``: slots of other jobs. A role
    that cannot get all its slots gets what is free.
    """
    slot_roles = ["rollout"] + (["reward"] if reward_on_slots else [])
    cur = {w: rec for w, rec in current.items() if rec["node"] in nodes}
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
        out.update(_cpu_workers("reward", target.get("reward", 0), cur, sorted(nodes)))
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


def _cpu_workers(role: str, n: int, cur: dict[str, dict], nodes: list[str]) -> dict[str, dict]:
    """Workers without slots (reward on CPU): keep existing ones, add round-robin over nodes."""
    mine = sorted(w for w, rec in cur.items() if rec["role"] == role and not rec["slots"])
    out = {w: cur[w] for w in mine[:n]}
    i = 0
    while len(out) < n and nodes:
        node = nodes[i % len(nodes)]
        w = f"{role}-{node}-c{i}"
        if w not in out:
            out[w] = {"role": role, "node": node, "slots": []}
        i += 1
    return out


def counts(placement: dict[str, dict], reward_on_slots: bool) -> Allocation:
    """The allocation (slots per role) a placement makes."""
    n = {r: 0 for r in ROLES}
    for rec in placement.values():
        n[rec["role"]] += len(rec["slots"]) if rec["role"] != "reward" or reward_on_slots else 0
    return Allocation(**n)


def fit(target: dict[str, int], slots: int, bounds: dict[str, policy.RoleBounds],
        reward_on_slots: bool) -> dict[str, int]:
    """Trim a target that needs more slots than there are: the role most above its minimum gives first."""
    out = dict(target)
    slot_roles = [r for r in ROLES if r != "reward" or reward_on_slots]
    while sum(out[r] for r in slot_roles) > slots:
        role = max(slot_roles, key=lambda r: (out[r] - bounds[r].min, out[r]))
        if out[role] <= max(bounds[role].min, 1):
            break
        out[role] -= 1
    return out


# --- events --------------------------------------------------------------------------------------------------


def record_event(r: redis.Redis, job: JobInfo | str, event: dict) -> None:
    """Append a decision event to the job's stream and, where this host sees it, ``runs/<id>/events.jsonl``."""
    name = job.name if isinstance(job, JobInfo) else job
    event = {"at": time.time(), "job": name, **event}
    line = json.dumps(event, default=_json_default)
    r.xadd(JobKeys(name).control_events, {"data": line}, maxlen=EVENTS_MAXLEN, approximate=True)
    if isinstance(job, JobInfo) and job.run_dir:
        try:
            with open(Path(job.run_dir) / "events.jsonl", "a") as f:
                f.write(line + "\n")
        except OSError:
            pass   # the run directory lives on another machine


def _json_default(o):
    if isinstance(o, float) and math.isinf(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_events(r: redis.Redis, job: str, last: int = 50) -> list[dict]:
    entries = r.xrevrange(JobKeys(job).control_events, count=last)
    return [json.loads(f[b"data"]) for _id, f in reversed(entries)]


# --- the reconcile loop ----------------------------------------------------------------------------------------


@dataclass
class JobControl:
    """The controller's memory of one job between ticks."""

    info: JobInfo
    observer: Observer
    sent: dict = field(default_factory=dict)     # (node, key, action digest) -> when it was sent
    last_reason: str = ""
    finished: bool = False


class Controller:
    """The reconcile loop; ``tick()`` is one pass over the jobs (when the lease is held)."""

    def __init__(self, r: redis.Redis, interval_s: float = 10.0, log=None):
        self.r, self.interval_s = r, interval_s
        self.log = log or structlog.get_logger("controller")
        self.lease = Lease(r, CONTROLLER_LEASE, ttl_s=max(3 * interval_s, 5.0), epoch_key=CONTROLLER_EPOCH)
        self.jobs: dict[str, JobControl] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                try:
                    self.tick()
                    self.wait()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # Redis away or stalled: nothing is decided; the lease may lapse to another controller
                    self.log.warning("redis_unavailable", error=str(exc))
                    self.stop_event.wait(1.0)
        finally:
            try:
                self.lease.release()
            except (redis.ConnectionError, redis.TimeoutError):
                pass   # it expires

    def wait(self) -> None:
        """Sleep one interval, or less if ``scale``/``drain`` pushed a wake-up."""
        deadline = time.monotonic() + self.interval_s
        while not self.stop_event.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.r.blpop([CONTROLLER_WAKE], timeout=min(left, 1.0)):
                self.r.delete(CONTROLLER_WAKE)
                return

    def tick(self) -> bool:
        """Reconcile every job if we hold (or can take) the lease; returns whether we acted."""
        if not (self.lease.renew() or self.lease.acquire()):
            if self.jobs:
                self.log.warning("lease_lost")
                self.jobs.clear()   # another controller acts; start afresh if we get it back
            return False
        nodes = live_agents(self.r)
        names = sorted(n.decode() for n in self.r.smembers(JOBS))
        placements = {j: _read_placement(self.r, j) for j in names}
        for name in names:
            try:
                self.reconcile(name, nodes, placements)
            except (redis.ResponseError, ValueError, KeyError) as exc:
                self.log.error("reconcile_failed", job=name, error=str(exc))
        return True

    def reconcile(self, name: str, nodes: dict[str, dict], placements: dict[str, dict]) -> None:
        phase = (self.r.hget(JobKeys(name).state, "phase") or b"").decode()
        jc = self.jobs.get(name)
        if jc is None or jc.info.run_dir != (self.r.hget(JobKeys(name).state, "run_dir") or b"").decode():
            info = load_job(self.r, name)
            if info is None:
                return
            jc = self.jobs[name] = JobControl(info, Observer(info))
        if phase not in ("running", "trained"):
            if not jc.finished:
                self.finish(jc, nodes)
            return
        jc.finished = False
        now = time.time()
        slot_map = {n: [s["index"] for s in rec["slots"]] for n, rec in nodes.items()}
        taken = {(rec["node"], s) for j, p in placements.items() if j != name for rec in p.values()
                 for s in rec["slots"]}
        free = sum(1 for n, ss in slot_map.items() for s in ss if (n, s) not in taken)
        alloc = self.ensure_allocation(jc, free)
        cur = placements.get(name, {})
        drained = take_drain_requests(self.r, name)
        # a drained worker leaves its slot empty for this tick, so a replacement goes elsewhere if it can
        taken |= {(cur[w]["node"], s) for w in drained if w in cur for s in cur[w]["slots"]}
        cur = {w: rec for w, rec in cur.items() if w not in drained}
        jc.observer.tick(self.r, now)
        target, event = self.decide(jc, alloc, cur, free, now)
        new = place(target, cur, slot_map, taken, jc.info.control.reward_on_slots)
        actions = self.act(jc, new, nodes)
        placements[name] = new
        self.commit(jc, alloc, cur, new, target, now)
        if event is not None or actions or drained:
            record_event(self.r, jc.info, {**(event or {"kind": "drain" if drained else "repair"}),
                                           "epoch": self.lease.epoch, "actions": actions, "drained": drained})

    def ensure_allocation(self, jc: JobControl, slots: int) -> dict:
        """The job's allocation record, created from its config on first sight.

        In auto mode, slots the config's counts leave empty start as rollout:
        the policy can only rebalance what it measures, and an empty slot measures nothing.
        """
        alloc = get_allocation(self.r, jc.info.name)
        if alloc["mode"] is None:
            initial = dict(jc.info.initial)
            if jc.info.control.mode == "auto":
                used = sum(counts_of(initial, jc.info.control.reward_on_slots).values())
                initial["rollout"] += max(0, slots - used)
            self.r.hset(JobKeys(jc.info.name).allocation, mapping={
                "mode": jc.info.control.mode, "target": json.dumps(initial), "changed_at": time.time(),
                **({"pinned": json.dumps(initial)} if jc.info.control.mode == "pinned" else {})})
            alloc = get_allocation(self.r, jc.info.name)
        return alloc

    def decide(self, jc: JobControl, alloc: dict, cur: dict, slots: int, now: float) -> tuple[dict, dict | None]:
        """The target counts, and the event to record (None when nothing new was decided)."""
        info, ctl = jc.info, jc.info.control
        bounds = ctl.bounds(info.backend)
        base = {**info.initial, **alloc["target"]}
        if alloc["mode"] == "pinned":
            target = fit({**base, **alloc["pinned"]}, slots, bounds, ctl.reward_on_slots)
            reason = "pinned"
            event = {"kind": "pinned", "mode": "pinned", "reason": reason, "from": alloc["target"], "to": target}
        else:
            now_alloc = Allocation(**counts_of(base, ctl.reward_on_slots))
            since = now - alloc["changed_at"]
            before = Allocation(**alloc["changed_from"]) if alloc["changed_from"] else None
            learner = cur.get(LEARNER)
            m = jc.observer.metrics(now_alloc, since, before,
                                    learner_slots=len(learner["slots"]) if learner else max(base["learner"], 1))
            d = policy.plan(m, policy.Inventory(gpus=slots, switch_cost_s=ctl.switch_cost_s), [info.spec()],
                            ctl.plan_config())
            target = fit({**base, **{r: d.allocation.get(r) for r in ROLES if r != "reward" or ctl.reward_on_slots}},
                         slots, bounds, ctl.reward_on_slots)
            reason = d.reason
            event = {"kind": "decision", "mode": "auto", **d.event(m), "from": base, "to": target,
                     "summary": policy.explain(d)}
        changed = target != alloc["target"]
        if not changed and reason == jc.last_reason:
            return target, None
        jc.last_reason = reason
        return target, event

    def act(self, jc: JobControl, new: dict[str, dict], nodes: dict[str, dict]) -> list[dict]:
        """Send the control jobs that bring the agents' desired state to ``new``."""
        info, actions, now = jc.info, [], time.monotonic()
        desired = {n: {k.decode(): json.loads(v) for k, v in self.r.hgetall(agent_desired(n)).items()}
                   for n in nodes}
        for worker, rec in sorted(new.items()):
            spec = {"job": info.name, "worker": worker, "role": rec["role"], "slots": rec["slots"],
                    "run_dir": info.run_dir, "backend": info.backend}
            have = desired.get(rec["node"], {}).get(worker_key(info.name, worker))
            if have and have["state"] == STATE_RUN and all(have.get(f) == spec[f] for f in spec):
                continue
            if self._send(jc, rec["node"], "ensure", spec, now):
                actions.append({"action": "ensure", "node": rec["node"], "worker": worker, "role": rec["role"],
                                "slots": rec["slots"]})
        for node, recs in desired.items():
            for key, d in sorted(recs.items()):
                if d["job"] != info.name or d["state"] != STATE_RUN or d["role"] not in ROLES:
                    continue
                if new.get(d["worker"], {}).get("node") == node:
                    continue
                if self._send(jc, node, "drain", d["worker"], now):
                    actions.append({"action": "drain", "node": node, "worker": d["worker"], "role": d["role"]})
        return actions

    def _send(self, jc: JobControl, node: str, action: str, what, now: float) -> bool:
        """Enqueue one action unless the same was sent less than RESEND_S ago."""
        digest = (node, action, json.dumps(what, sort_keys=True))
        if now - jc.sent.get(digest, -math.inf) < RESEND_S:
            return False
        if not self.lease.renew():
            raise ValueError("lost the controller lease while acting")
        if action == "ensure":
            control_jobs.ensure(self.r, node, what, epoch=self.lease.epoch)
        else:
            control_jobs.drain(self.r, node, jc.info.name, what, epoch=self.lease.epoch)
        jc.sent[digest] = now
        return True

    def commit(self, jc: JobControl, alloc: dict, cur: dict, new: dict, target: dict, now: float) -> None:
        """Write the placement and, if the target moved, when and from what (the policy's cooldown)."""
        k = JobKeys(jc.info.name)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(k.placement)
        if new:
            pipe.hset(k.placement, mapping={w: json.dumps(rec) for w, rec in new.items()})
        if target != alloc["target"]:
            pipe.hset(k.allocation, mapping={"target": json.dumps(target), "changed_at": now,
                                             "changed_from": json.dumps(_slot_counts(alloc["target"], jc))})
        pipe.execute()

    def finish(self, jc: JobControl, nodes: dict[str, dict]) -> None:
        """A job that is done: drain every worker of it on every agent, feeder included."""
        sent = []
        for node in nodes:
            for key, raw in self.r.hgetall(agent_desired(node)).items():
                d = json.loads(raw)
                if d["job"] == jc.info.name and d["state"] == STATE_RUN:
                    control_jobs.drain(self.r, node, jc.info.name, d["worker"], epoch=self.lease.epoch)
                    sent.append({"action": "drain", "node": node, "worker": d["worker"], "role": d["role"]})
        self.r.delete(JobKeys(jc.info.name).placement)
        if sent:   # a restarted controller finds finished jobs with nothing left to drain: no event
            record_event(self.r, jc.info, {"kind": "job_done", "epoch": self.lease.epoch, "actions": sent})
        jc.finished = True


def counts_of(roles: dict, reward_on_slots: bool) -> dict:
    """Slots per role of worker counts (reward on CPU holds none)."""
    return {r: roles.get(r, 0) if r != "reward" or reward_on_slots else 0 for r in ROLES}


def _slot_counts(target: dict, jc: JobControl) -> dict:
    return counts_of({**jc.info.initial, **target}, jc.info.control.reward_on_slots)


def _read_placement(r: redis.Redis, job: str) -> dict[str, dict]:
    return {w.decode(): json.loads(v) for w, v in r.hgetall(JobKeys(job).placement).items()}


def take_drain_requests(r: redis.Redis, job: str) -> list[str]:
    k = JobKeys(job)
    out = []
    while True:
        w = r.spop(k.drain_requests)
        if w is None:
            return out
        out.append(w.decode())


# --- what libra-ctl status shows ---------------------------------------------------------------------------


def allocation_status(r: redis.Redis, job: str) -> dict:
    """The job's allocation for ``libra-ctl status``: mode, counts per role, and every node's slots.

    ``{"mode": "auto"|"pinned", "roles": {role: workers running}, "target": {role: count},
    "pinned": {role: count}, "nodes": [{"node", "host", "alive", "heartbeat_age_s",
    "slots": [{"index", "device", "job", "worker", "role", "pid", "state"}]}],
    "workers": {worker: {"node", "slots", "pid", "state"}}}``; a slot without a
    worker has ``worker: None``, a worker without slots (reward on CPU) appears
    under ``workers`` only.
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
        for p in procs.values():
            if p["job"] == job:
                workers[p["worker"]] = {"node": node, "slots": p["slots"], "pid": p["pid"], "state": p["state"],
                                        "role": p["role"]}
                if p["state"] == "running" and p["role"] in ROLES:
                    roles[p["role"]] = roles.get(p["role"], 0) + 1
        nodes.append({"node": node, "host": rec["host"], "alive": now - rec["heartbeat"] <= AGENT_DEAD_S,
                      "heartbeat_age_s": round(now - rec["heartbeat"], 1), "slots": slots})
    return {"mode": alloc["mode"] or "auto", "roles": roles, "target": alloc["target"], "pinned": alloc["pinned"],
            "nodes": nodes, "workers": workers}


def format_allocation(a: dict) -> str:
    """Lines for a terminal: one per node, each slot as index:worker."""
    pinned = " ".join(f"{k}={v}" for k, v in sorted(a["pinned"].items())) if a["mode"] == "pinned" else ""
    lines = [f"allocation {a['mode']}{' ' + pinned if pinned else ''}  running "
             + " ".join(f"{k}={v}" for k, v in sorted(a["roles"].items()))]
    for n in a["nodes"]:
        slots = "  ".join(f"{s['index']}:{s['worker'] or '-'}" for s in n["slots"])
        lines.append(f"  node {n['node']}{'' if n['alive'] else ' (lost)'}  {slots}")
    return "\n".join(lines)


# --- libra-ctl run: a controller and a local agent ----------------------------------------------------------


class LocalControl:
    """The controller and one agent as child processes of ``libra-ctl run``; ``stop()`` ends both."""

    def __init__(self, procs: list[tuple[str, subprocess.Popen]], run_dir: Path):
        self.procs, self.run_dir = procs, run_dir

    def check(self) -> None:
        """Raise RuntimeError naming the process if the controller or the agent died."""
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode}; see {self.run_dir / 'logs' / name}.out")

    def stop(self, timeout_s: float = 60.0) -> None:
        """The controller first (no more actions), then the agent, which drains its workers."""
        for _name, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_local_control(cfg, run_dir: Path, redis_url: str, *, slots: int | None = None,
                        node: str | None = None, interval_s: float | None = None) -> LocalControl:
    """Start ``libra-ctl controller`` and ``libra-ctl agent`` for a local run; returns their handle.

    ``slots``: CPU slots for the agent; None: the GPUs it finds (``LIBRA_GPUS``
    or NVML), or, with none, one CPU slot per rollout and learner worker of
    ``cfg``. The job's state hash must already name ``run_dir`` (the
    controller reads the manifest from there); the controller then starts the
    stage workers through the agent, from the config's counts.
    """
    from pipeline.agent import SlotError, detect_slots

    if interval_s is None:
        interval_s = ControlConfig.from_dict(getattr(cfg, "control", None) and asdict(cfg.control)).interval_s
    if slots is None:
        try:
            detect_slots(None)
        except SlotError:
            slots = cfg.rollout.workers + cfg.learner.workers
    env = dict(os.environ, **{ENV_URL: redis_url, "PYTHONUNBUFFERED": "1"})
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    agent_argv = ["agent"] + (["--slots", str(slots)] if slots else []) + (["--node", node] if node else [])
    procs = []
    port = getattr(getattr(cfg, "control", None), "metrics_port", 0)
    controller_argv = ["controller", "--interval", str(interval_s), "--metrics-port", str(port)]
    for name, argv in (("controller", controller_argv), ("agent", agent_argv)):
        with open(logs / f"{name}.out", "ab") as out:
            procs.append((name, subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv], env=env,
                                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)))
    return LocalControl(procs, Path(run_dir))


# --- command line ------------------------------------------------------------------------------------------


def _url(args) -> str:
    from pipeline.cli import find_redis_url

    return find_redis_url(args.redis)


def pick_job(r: redis.Redis, job: str | None) -> str:
    """The named job, else the one job that runs on this Redis."""
    if job:
        return job
    running = [n.decode() for n in sorted(r.smembers(JOBS))
               if (r.hget(JobKeys(n.decode()).state, "phase") or b"").decode() in ("running", "trained")]
    if len(running) != 1:
        raise SystemExit(f"libra-ctl: {'no job runs' if not running else 'several jobs run: ' + ', '.join(running)}"
                         "; name one with --job")
    return running[0]


def cmd_controller(args) -> int:
    from pipeline import logs

    structlog.contextvars.bind_contextvars(role="controller")
    log = logs.configure(None, "controller")
    ctl = Controller(connect(_url(args)), interval_s=args.interval, log=log)

    def on_signal(signum, _frame):
        log.info("stop_requested", signal=signal.Signals(signum).name)
        ctl.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.once:
        return 0 if ctl.tick() else 1
    metrics = serve_metrics(ctl.r, args.metrics_port, log)
    log.info("controller_started", interval_s=args.interval, metrics_port=args.metrics_port)
    try:
        ctl.run()
    finally:
        if metrics is not None:
            metrics.stop()
    return 0


def serve_metrics(r: redis.Redis, port: int, log):
    """Prometheus /metrics for every job on this Redis; a taken port is logged, not fatal."""
    if not port:
        return None
    from pipeline.prometheus import serve

    try:
        server = serve(r, port, host="0.0.0.0")
    except OSError as exc:
        log.warning("metrics_port_unavailable", port=port, error=str(exc))
        return None
    log.info("metrics_serving", url=f"http://0.0.0.0:{port}/metrics")
    return server


def parse_counts(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        role, sep, n = item.partition("=")
        if not sep or role not in ROLES or not n.isdigit():
            raise SystemExit(f"libra-ctl scale: {item!r}: write role=N with role in {', '.join(ROLES)}, "
                             "e.g. rollout=2 learner=1")
        out[role] = int(n)
    return out


def cmd_scale(args) -> int:
    r = connect(_url(args))
    job = pick_job(r, args.job)
    if args.auto == bool(args.counts):
        print("libra-ctl scale: give role=N counts to pin, or --auto to hand back to the policy", file=sys.stderr)
        return 2
    if args.auto:
        unpin(r, job)
        print(f"{job}: allocation is automatic again (the policy decides on the next tick)")
        return 0
    try:
        pin(r, job, parse_counts(args.counts))
    except ValueError as exc:
        print(f"libra-ctl scale: {exc}", file=sys.stderr)
        return 2
    pinned = get_allocation(r, job)["pinned"]
    print(f"{job}: pinned " + " ".join(f"{k}={v}" for k, v in sorted(pinned.items())))
    if args.wait:
        return _wait_for_counts(r, job, pinned, args.wait)
    return 0


def _wait_for_counts(r: redis.Redis, job: str, want: dict, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = allocation_status(r, job)["roles"]
        if all(running.get(k, 0) == v for k, v in want.items()):
            print(f"{job}: running " + " ".join(f"{k}={v}" for k, v in sorted(running.items())))
            return 0
        time.sleep(0.2)
    print(f"{job}: not all counts running after {timeout_s:g}s: {allocation_status(r, job)['roles']}",
          file=sys.stderr)
    return 1


def cmd_drain(args) -> int:
    r = connect(_url(args))
    job = pick_job(r, args.job)
    rec = _read_placement(r, job).get(args.worker)
    if rec is None:
        print(f"libra-ctl drain: {job} has no worker {args.worker!r} in its placement", file=sys.stderr)
        return 2
    if r.exists(CONTROLLER_LEASE):
        r.sadd(JobKeys(job).drain_requests, args.worker)
        r.lpush(CONTROLLER_WAKE, f"drain:{job}")
        print(f"{job}: {args.worker} will be drained by the controller (a replacement takes another slot if the "
              "allocation still needs it)")
    else:
        control_jobs.drain(r, rec["node"], job, args.worker)
        print(f"{job}: no controller acts; asked the agent on {rec['node']} to drain {args.worker}")
    return 0


def cmd_events(args) -> int:
    r = connect(_url(args))
    job = pick_job(r, args.job) if args.job or r.scard(JOBS) else None
    if job is None:
        print("no jobs on this Redis")
        return 0
    events = read_events(r, job, args.last)
    if args.json:
        print(json.dumps(events, indent=2))
        return 0
    for e in events:
        when = time.strftime("%H:%M:%S", time.localtime(e["at"]))
        acts = ", ".join(f"{a['action']} {a['worker']}@{a['node']}" for a in e.get("actions", []))
        what = e.get("summary") or f"{e.get('reason', e['kind'])}: {e.get('to', '')}"
        print(f"{when}  {e['kind']:<8} {what}" + (f"  [{acts}]" if acts else ""))
    return 0


def cmd_sim_job(args) -> int:
    from workers.sim import run_sim_job

    pinned = parse_counts(args.counts) if args.counts else None
    control = json.loads(args.control) if args.control else None
    run_dir = run_sim_job(_url(args), args.workload, runs_dir=args.runs_dir, job=args.job, time_scale=args.time_scale,
                          steps=args.steps, node=args.node, pinned=pinned, control=control)
    print(f"done: {run_dir} (libra-ctl events --job {args.job}; libra-ctl audit --job {args.job})")
    return 0


def add_commands(sub) -> None:
    j = sub.add_parser("sim-job", help="run a bench workload on the live agents with sim workers (virtual time)")
    j.add_argument("workload", help="workload TOML (bench/README.md format), e.g. examples/bench/steady.toml")
    j.add_argument("counts", nargs="*", metavar="ROLE=N", help="pin these counts (default: the policy decides)")
    j.add_argument("--job", default="sim")
    j.add_argument("--time-scale", type=float, default=50.0, help="simulated seconds per wall second")
    j.add_argument("--steps", type=int, help="stop after this many learner steps (default: the workload's)")
    j.add_argument("--node", help="the agent that starts the feeder (default: the first live one)")
    j.add_argument("--control", help='the job\'s control settings as JSON, e.g. \'{"cooldown_s": 5}\'')
    j.add_argument("--runs-dir", default="runs")
    j.add_argument("--redis")
    j.set_defaults(func=cmd_sim_job)

    c = sub.add_parser("controller", help="the reconcile loop: moves slots between stages (one acts at a time)")
    c.add_argument("--interval", type=float, default=10.0, help="seconds between reconciles (control.interval_s)")
    c.add_argument("--once", action="store_true", help="one reconcile, then exit")
    c.add_argument("--metrics-port", type=int, default=9464,
                   help="serve Prometheus /metrics on this port (0: off; control.metrics_port)")
    c.add_argument("--redis", help=f"Redis URL (default: ${ENV_URL})")
    c.set_defaults(func=cmd_controller)

    s = sub.add_parser("scale", help="pin worker counts (role=N ...) or hand back to the policy (--auto)")
    s.add_argument("counts", nargs="*", metavar="ROLE=N")
    s.add_argument("--auto", action="store_true", help="return control to the policy")
    s.add_argument("--job")
    s.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for the counts")
    s.add_argument("--redis")
    s.set_defaults(func=cmd_scale)

    d = sub.add_parser("drain", help="drain one worker: it finishes the batch in hand and exits")
    d.add_argument("worker")
    d.add_argument("--job")
    d.add_argument("--redis")
    d.set_defaults(func=cmd_drain)

    e = sub.add_parser("events", help="the controller's decisions: inputs, expected gain, actions")
    e.add_argument("--job")
    e.add_argument("--json", action="store_true")
    e.add_argument("-n", "--last", type=int, default=50)
    e.add_argument("--redis")
    e.set_defaults(func=cmd_events)
