"""The controller's reconcile loop: shares the slots among jobs and moves them to each job's bottleneck.

One controller acts at a time: it holds ``CONTROLLER_LEASE`` (SET NX PX,
renewed with a token check; each lease taken increments ``CONTROLLER_EPOCH``,
which fences the actions of a controller that lost it). Every
``interval_s``, or as soon as ``libra-ctl scale`` / ``drain`` pushes to
``CONTROLLER_WAKE``, it reconciles each running job:

1. observe: a snapshot of the job's counters, queues, the workers' reported
   costs (``CostMeter``) and the learner's step records, kept over a window
   (``control.observer``), mapped onto ``allocator.Metrics``;
2. decide: the pinned counts (``libra-ctl scale``), or, for the auto jobs
   together, ``allocator.plan()`` on their metrics, the live slots of the
   agents less what pinned jobs hold (``Inventory``) and each job's config
   (``JobSpec``: its role bounds, ``min_slots``, ``max_slots``, ``priority``):
   each job's share of the pool and its split (jobs that shrink are acted on
   before jobs that grow);
3. place: which worker on which node and slot (``control.placement``, pure): keep what
   runs, shrink before growing, reuse the freed slots (an agent starts the
   new worker only once the old one has exited);
4. act: the difference between that placement and the agents' desired state
   goes out as control jobs (``control.actions``); an action that did
   not take is sent again after ``RESEND_S``, so a lost one is repaired;
   workers started outside the agents (``libra-ctl worker``) count toward
   the target, so the agents run the rest; the loop never starts or stops
   one, but asks those a pinned count leaves over, or a finished job's, to
   drain (``JobKeys.external_drain``);
5. record: an event with the inputs, the decision, its expected gain and the
   actions, in ``control_events`` (``libra-ctl events``) and
   ``runs/<id>/events.jsonl``.

Run by ``libra-ctl controller`` (``pipeline.cli``), in its own process.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field, replace

import redis
import structlog

from pipeline.control import actions, allocator
from pipeline.control.actions import STATE_RUN, worker_key
from pipeline.control.allocation import (counts_of, external_counts, external_workers, get_allocation, live_agents,
                                         read_placement, drain_requests)
from pipeline.control.allocator import Allocation
from pipeline.control.events import new_event_id, record_event
from pipeline.control.job import JobInfo, load_job, plan_config, role_bounds
from pipeline.control.lease import Lease
from pipeline.control.observer import Observer
from pipeline.control.placement import agents_share, external_floor, fit, learner_to_one_node, place
from pipeline.dataplane.cadence import read_cadence, write_cadence
from pipeline.dataplane.keys import (AGENTS, CONTROLLER_EPOCH, CONTROLLER_LEASE, CONTROLLER_WAKE, JOBS, LEARNER,
                                     JobKeys, agent_desired, agent_procs)
from pipeline.dataplane.keys import ROLES
from pipeline.dataplane.redisconn import UNAVAILABLE, Outage
from pipeline.dataplane.streams import redis_full
from pipeline.dataplane.worker import record_alive

# Redis 6.2 (the embedded server) truncates a BLPOP timeout to whole milliseconds and reads 0 as "block
# forever": a wait with less than this left returns instead of hanging until the socket timeout (15 s)
MIN_BLOCK_S = 0.01
RESEND_S = 15.0          # an action not reflected in the agent's desired state after this is sent again


class LeaseLost(ValueError):
    """The lease lapsed or went to another controller during a tick: nothing more is sent or written."""


@dataclass
class JobControl:
    """The controller's memory of one job between ticks."""

    info: JobInfo
    observer: Observer
    sent: dict = field(default_factory=dict)     # (node, worker) -> (the last action's digest, when it was sent)
    last_reason: str = ""
    finished: bool = False
    unwritten: list = field(default_factory=list)   # events acted on whose write failed: written first next time


@dataclass
class JobView:
    """One running job as a tick sees it, between observing it and acting on it."""

    jc: JobControl
    alloc: dict                      # its allocation record (mode, target, pinned, changed_at, changed_from)
    ext: dict                        # its external workers (``libra-ctl worker``)
    ext_n: dict[str, int]            # ... counted per role
    bounds: dict                     # role bounds (an auto job's raised to what its external workers hold)
    metrics: allocator.Metrics | None = None   # auto mode only: what the allocator sees


def _pin_slots(view: JobView) -> int:
    """Agent slots a pinned job's pin asks for (its external workers hold their own)."""
    ctl = view.jc.info.control
    pinned = {**view.jc.info.initial, **view.alloc["target"], **view.alloc["pinned"]}
    return sum(counts_of(agents_share(pinned, view.ext_n), ctl.reward_on_slots).values())


def _growth(view: JobView, pool: allocator.PoolDecision | None) -> int:
    """How many slots the job gains this tick (negative: gives up); pinned jobs count as 0."""
    if pool is None or view.metrics is None:
        return 0
    return pool.shares[view.jc.info.name] - view.metrics.allocation.total


# Refusals of a write that pass (a failover, a failing save, a long script, a server loading): an event kept
# through them is written later; any other refusal of an event (WRONGTYPE) is for good.
# (redis-py raises its own class for some, the code stripped from the message; the rest keep their code)
PASSING_REFUSALS = {"READONLY", "MISCONF", "BUSY", "NOREPLICAS", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "LOADING"}
PASSING_ERRORS = (redis.exceptions.ReadOnlyError, redis.exceptions.BusyLoadingError, redis.exceptions.TryAgainError,
                  redis.exceptions.ClusterDownError, redis.exceptions.MasterDownError)


class Controller:
    """The reconcile loop; ``tick()`` is one pass over the jobs (when the lease is held)."""

    def __init__(self, r: redis.Redis, interval_s: float = 10.0, log=None):
        self.r, self.interval_s = r, interval_s
        self.log = log or structlog.get_logger("controller")
        self.lease = Lease(r, CONTROLLER_LEASE, ttl_s=max(3 * interval_s, 5.0), epoch_key=CONTROLLER_EPOCH)
        self.jobs: dict[str, JobControl] = {}
        # events of jobs whose memory went (a lease lost) before they could be written: (job, event), written
        # first by the next tick that reaches Redis, lease or not (each carries its own epoch and time)
        self.orphans: list[tuple[JobInfo, dict]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        # Redis away or stalled: nothing is decided (the lease may lapse to another controller), until the
        # outage limit ($LIBRA_REDIS_OUTAGE_S); then RedisUnavailable ends the process, non-zero
        outage = Outage(self.log, stop=self.stop_event.is_set)
        try:
            while not self.stop_event.is_set():
                try:
                    self.tick()
                    self.wait()
                    outage.ok()
                except UNAVAILABLE as exc:
                    if self.stop_event.is_set():
                        break
                    outage.wait(exc)
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
            if left < MIN_BLOCK_S:
                return
            if self.r.blpop([CONTROLLER_WAKE], timeout=min(left, 1.0)):
                self.r.delete(CONTROLLER_WAKE)
                return

    def forget_jobs(self) -> None:
        """Drop the jobs' memory, keeping the events it had not written yet (``orphans``)."""
        self.orphans += [(jc.info, e) for jc in self.jobs.values() for e in jc.unwritten]
        self.jobs.clear()

    def tick(self) -> bool:
        """Reconcile every job if we hold (or can take) the lease; returns whether we acted."""
        while self.orphans:   # what a tick did before its lease lapsed (an outage), said before anything new
            try:
                self._record(*self.orphans[0])
            except redis.ResponseError as exc:   # Redis full, or refusing for a while: kept for a later tick
                self.log.warning("events_waiting", events=len(self.orphans), error=str(exc))
                break
            self.orphans.pop(0)
        if not self.lease.renew():
            if self.jobs:   # lapsed, even if taken back at once: another controller may have acted meanwhile
                self.log.warning("lease_lost")
                self.forget_jobs()   # start afresh
            if not self.lease.acquire():
                return False
        nodes = live_agents(self.r)
        names = sorted(n.decode() for n in self.r.smembers(JOBS))
        placements = {j: read_placement(self.r, j) for j in names}
        now = time.time()
        views = []
        for name in names:
            try:
                view = self.observe(name, nodes, placements, now)
            except LeaseLost as exc:   # finishing a job drains with the lease: a lost one ends the tick
                self.log.warning("lease_lost", job=name, error=str(exc))
                self.forget_jobs()
                return False
            except (redis.ResponseError, ValueError, KeyError) as exc:
                self.log.error("reconcile_failed", job=name, error=str(exc))
                continue
            if view is not None:
                views.append(view)
        pool = self.plan_pool(views, nodes, placements)
        # jobs that shrink first: the slots they free are the ones growing jobs are placed on
        for view in sorted(views, key=lambda v: _growth(v, pool)):
            try:
                self.reconcile(view, nodes, placements, pool, now)
            except LeaseLost as exc:
                self.log.warning("lease_lost", job=view.jc.info.name, error=str(exc))
                self.forget_jobs()   # another controller may act now; start afresh if we get it back
                return False
            except (redis.ResponseError, ValueError, KeyError) as exc:
                self.log.error("reconcile_failed", job=view.jc.info.name, error=str(exc))
        return True

    def observe(self, name: str, nodes: dict[str, dict], placements: dict[str, dict],
                now: float) -> "JobView | None":
        """A running job's state for this tick (None for one not running: a finished one is drained here)."""
        phase = (self.r.hget(JobKeys(name).state, "phase") or b"").decode()
        jc = self.jobs.get(name)
        if jc is None or jc.info.run_dir != (self.r.hget(JobKeys(name).state, "run_dir") or b"").decode():
            if jc is not None:
                self.write_events(jc)   # the earlier run's, before its memory goes
            info = load_job(self.r, name)
            if info is None:
                return None
            jc = self.jobs[name] = JobControl(info, Observer(info))
        if phase not in ("running", "trained"):
            if not jc.finished:
                self.write_events(jc)   # what the last tick did, before the job's end
                self.finish(jc)
            return None
        if jc.finished:   # resumed after we saw it end: observed afresh, not across its stop; nothing sent yet
            self.write_events(jc)
            info = load_job(self.r, name)
            if info is None:
                return None
            jc = self.jobs[name] = JobControl(info, Observer(info))
        if not any(rec["slots"] for rec in nodes.values()):
            # No agent has registered a slot yet (a controller that starts before its agents): deciding now
            # would trim the job's target to the minimums and keep it there. Wait for an inventory.
            return None
        ext = external_workers(self.r, name, now)
        ext_n = external_counts(ext)
        ctl = jc.info.control
        alloc = self.ensure_allocation(jc)
        jc.observer.tick(self.r, now)
        view = JobView(jc, alloc, ext, ext_n, bounds=role_bounds(ctl, jc.info.backend))
        if alloc["mode"] == "auto":
            view.bounds = external_floor(view.bounds, counts_of(ext_n, ctl.reward_on_slots))
            base = {**jc.info.initial, **alloc["target"]}
            before = Allocation(**alloc["changed_from"]) if alloc["changed_from"] else None
            learner = placements.get(name, {}).get(LEARNER)
            view.metrics = jc.observer.metrics(
                Allocation(**counts_of(base, ctl.reward_on_slots)), now - alloc["changed_at"], before,
                learner_slots=len(learner["slots"]) if learner else max(base["learner"], 1))
        return view

    def plan_pool(self, views: list["JobView"], nodes: dict[str, dict],
                  placements: dict[str, dict]) -> allocator.PoolDecision | None:
        """Shares of the agents' slots for the auto jobs, and each one's split (``allocator.plan``).

        The pool is every live agent slot, less what pinned jobs hold or their
        pins ask for (an operator's scale-up comes out of the auto jobs'
        share, down to their minimums), plus the auto jobs' external workers
        of slot roles (each stands for a slot beside the agents'). None when
        no auto job runs.
        """
        auto = [v for v in views if v.metrics is not None]
        if not auto:
            return None
        held = sum(max(sum(len(rec["slots"]) for rec in placements.get(v.jc.info.name, {}).values()),
                       _pin_slots(v)) for v in views if v.metrics is None)
        ext = sum(sum(counts_of(v.ext_n, v.jc.info.control.reward_on_slots).values()) for v in auto)
        specs = [replace(v.jc.info.spec(), bounds=v.bounds) for v in auto]
        gpus = max(sum(len(rec["slots"]) for rec in nodes.values()) - held + ext,
                   sum(allocator.min_share(s) for s in specs))
        switch = max(v.jc.info.control.switch_cost_s for v in auto)
        return allocator.plan({v.jc.info.name: v.metrics for v in auto},
                              allocator.Inventory(gpus=gpus, switch_cost_s=switch), specs,
                              plan_config(auto[0].jc.info.control))

    def reconcile(self, view: "JobView", nodes: dict[str, dict], placements: dict[str, dict],
                  pool: allocator.PoolDecision | None, now: float) -> None:
        jc, name = view.jc, view.jc.info.name
        slot_map = {n: [s["index"] for s in rec["slots"]] for n, rec in nodes.items()}
        taken = {(rec["node"], s) for j, p in placements.items() if j != name for rec in p.values()
                 for s in rec["slots"]}
        room = {n: sum(1 for s in ss if (n, s) not in taken) for n, ss in slot_map.items()}
        free = sum(room.values())
        # an external worker of a slot role stands for one slot beside the agents' (it holds none of theirs)
        slots = free + sum(counts_of(view.ext_n, jc.info.control.reward_on_slots).values())
        cur = placements.get(name, {})
        drained = drain_requests(self.r, name)
        # a drained worker leaves its slot empty for this tick, so a replacement goes elsewhere if it can
        taken |= {(cur[w]["node"], s) for w in drained if w in cur for s in cur[w]["slots"]}
        cur = {w: rec for w, rec in cur.items() if w not in drained}
        target, event = self.decide(view, slots, pool, learner_room=max(room.values(), default=0))
        # a drained worker on no slot (reward on CPU) is replaced under another id, or it would be placed again
        new = place(agents_share(target, view.ext_n), cur, slot_map, taken, jc.info.control.reward_on_slots,
                    avoid=set(drained))
        orders = self.act(jc, new, nodes) + self.drain_external(jc, view.ext, target)
        placements[name] = new
        self.commit(jc, view.alloc, cur, new, target, now, drained)
        if event is not None or orders or drained:
            # "at": the decision's time, also when the write comes a tick late
            # "eid": one event, though its write may be sent again (``record_event``)
            jc.unwritten.append({"at": time.time(), "eid": new_event_id(),
                                 **(event or {"kind": "drain" if drained else "repair"}),
                                 "epoch": self.lease.epoch,
                                 "actions": orders, "drained": drained,
                                 **({"external": view.ext_n} if view.ext_n else {})})
        self.write_events(jc)
        self.adapt_publish(view, now, moving=target != {**jc.info.initial, **view.alloc["target"]})

    def write_events(self, jc: JobControl) -> None:
        """Write the job's events not yet written, oldest first: a tick that acted and then lost Redis before
        saying so is said on the next one (the target it committed leaves nothing new to decide)."""
        while jc.unwritten:
            self._record(jc.info, jc.unwritten[0])
            jc.unwritten.pop(0)

    def _record(self, info: JobInfo, event: dict) -> None:
        """``record_event``; an event Redis refuses for good (not an outage, which raises: written later) is
        logged and given up, so that it does not stop every tick after it."""
        try:
            record_event(self.r, info, event)
        except redis.ResponseError as exc:
            if redis_full(exc) or isinstance(exc, PASSING_ERRORS) or str(exc).split(" ", 1)[0] in PASSING_REFUSALS:
                raise   # backpressure, a failover, a save or script in the way: written on a later tick
            self.log.error("event_not_written", job=info.name, kind=event.get("kind"), error=str(exc))

    def adapt_publish(self, view: "JobView", now: float, moving: bool = False) -> None:
        """The job's publish cadence, written where its learner reads it: an auto job's from
        ``allocator.plan_publish`` (``moving``: this tick changes its split); a pinned job's is its config's."""
        info, keys = view.jc.info, JobKeys(view.jc.info.name)
        if view.metrics is None:
            if read_cadence(self.r, keys, info.publish_every, info.max_staleness)[0] == info.publish_every:
                return
            d = allocator.PublishDecision(info.publish_every, True, "pinned")
        else:
            d = allocator.plan_publish(view.metrics, info.spec(), plan_config(info.control), moving)
            if not d.changed:
                return
        write_cadence(self.r, keys, d.publish_every, d.reason, now)
        record_event(self.r, info, {"kind": "publish", **d.event(), "epoch": self.lease.epoch})
        self.log.info("publish_cadence", job=info.name, every=d.publish_every, reason=d.reason)

    def ensure_allocation(self, jc: JobControl) -> dict:
        """The job's allocation record, created from its config on first sight.

        In auto mode the pool plan then gives the job its share: slots the
        config's counts leave empty start as rollout (the allocator can only
        rebalance what it measures, and an empty slot measures nothing).
        """
        key = JobKeys(jc.info.name).allocation
        with self.r.pipeline() as pipe:
            while True:   # created only if absent, in one transaction: a `scale` pin made meanwhile is kept
                try:
                    pipe.watch(key)
                    if get_allocation(pipe, jc.info.name)["mode"] is not None:
                        pipe.unwatch()
                        break
                    initial = dict(jc.info.initial)
                    pipe.multi()
                    pipe.hset(key, mapping={
                        "mode": jc.info.control.mode, "target": json.dumps(initial), "changed_at": time.time(),
                        **({"pinned": json.dumps(initial)} if jc.info.control.mode == "pinned" else {})})
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return get_allocation(self.r, jc.info.name)

    def decide(self, view: "JobView", slots: int, pool: allocator.PoolDecision | None,
               learner_room: int | None = None) -> tuple[dict, dict | None]:
        """The target counts (external workers included), and the event to record (None when nothing new).

        ``learner_room``: the most slots one node has for the job (the learner is cut to it; in
        auto mode what it could not hold goes to rollout).

        ``view.ext_n``: counted external workers per role. A pinned count is the
        total, so it may leave external workers over (``drain_external``); the
        allocator never goes below them, since their slots cannot change role.
        """
        jc, alloc, ext = view.jc, view.alloc, view.ext_n
        info, ctl = jc.info, jc.info.control
        base = {**info.initial, **alloc["target"]}
        if alloc["mode"] == "pinned":   # else the job is an auto one, in the pool plan
            asked = {**base, **alloc["pinned"]}
            # an external learner is the job's one learner process: the pin's other roles fit beside it
            held = {"learner": ext["learner"]} if ext.get("learner") else {}
            wanted = {**asked, **held} if held else learner_to_one_node(asked, learner_room, view.bounds)
            target = fit(wanted, slots, view.bounds, ctl.reward_on_slots, learner_room)
            # counts the slots cannot hold are cut (fit): the event says what was asked
            reason = "pinned" if target == asked else "pinned_trimmed"
            event = {"kind": "pinned", "mode": "pinned", "reason": reason, "from": alloc["target"], "to": target,
                     **({"asked": asked, "slots": slots} if target != asked else {})}
        else:
            d = pool.decisions[info.name]
            planned = {**base, **{r: d.allocation.get(r) for r in ROLES if r != "reward" or ctl.reward_on_slots}}
            if not ext.get("learner"):   # the allocator counts slots, not nodes
                planned = learner_to_one_node(planned, learner_room, view.bounds)
            target = fit({r: max(n, ext.get(r, 0)) for r, n in planned.items()}, slots, view.bounds,
                         ctl.reward_on_slots, learner_room)
            reason = d.reason
            event = {"kind": "decision", "mode": "auto", **d.event(view.metrics), "from": base, "to": target,
                     "costs": jc.observer.costs, "summary": allocator.explain(d),
                     "pool": {"reason": pool.reason, "shares": pool.shares, "share": pool.shares[info.name],
                              "moved_between_jobs": pool.moved_between_jobs,
                              **({"below_min": list(pool.below_min)} if pool.below_min else {})}}
        if ext.get("learner"):
            target["learner"] = ext["learner"]   # the job's one learner process is an external one
        changed = target != alloc["target"]
        if not changed and reason == jc.last_reason:
            return target, None
        jc.last_reason = reason
        return target, event

    def act(self, jc: JobControl, new: dict[str, dict], nodes: dict[str, dict]) -> list[dict]:
        """Send the control jobs that bring the agents' desired state to ``new``."""
        info, orders, now = jc.info, [], time.monotonic()
        desired = {n: {k.decode(): json.loads(v) for k, v in self.r.hgetall(agent_desired(n)).items()}
                   for n in nodes}
        running = {n: {k.decode() for k in self.r.hkeys(agent_procs(n))} for n in nodes}
        # the job's workers whose process heartbeats, by node: a dead agent's workers run on (their own sessions),
        # and a pool learner asked to drain works under learner-0 until its batch is trained
        live_at, wall = {}, time.time()
        for w, raw in self.r.hgetall(JobKeys(info.name).workers).items():
            wrec = json.loads(raw)
            if record_alive(wrec, wall) and wrec.get("state") != "drained":   # drained gives its id way
                live_at[w.decode()] = wrec.get("node")
        for worker, rec in sorted(new.items()):
            spec = {"job": info.name, "worker": worker, "role": rec["role"], "slots": rec["slots"],
                    "run_dir": info.run_dir, "backend": info.backend}
            key = worker_key(info.name, worker)
            have = desired.get(rec["node"], {}).get(key)
            if have and have["state"] == STATE_RUN and all(have.get(f) == spec[f] for f in spec):
                continue
            if (any(key in running[n] or desired[n].get(key, {}).get("state") == STATE_RUN
                    for n in nodes if n != rec["node"])
                    or live_at.get(worker, rec["node"]) != rec["node"]):
                # a worker moving to another node (the learner, whose id names no node) starts there once its
                # process on the old one has exited: two processes of one consumer name would both claim its
                # pending entries (a batch trained twice) and the same checkpoint directory. A process started
                # under an id a live process holds elsewhere would also exit at once (``worker.register``), and its
                # agent would count that as a crash.
                continue
            if self._send(jc, rec["node"], "ensure", spec, now):
                orders.append({"action": "ensure", "node": rec["node"], "worker": worker, "role": rec["role"],
                                "slots": rec["slots"]})
        for node, recs in desired.items():
            for key, d in sorted(recs.items()):
                if d["job"] != info.name or d["state"] != STATE_RUN or d["role"] not in ROLES:
                    continue
                if new.get(d["worker"], {}).get("node") == node:
                    continue
                if self._send(jc, node, "drain", d["worker"], now):
                    orders.append({"action": "drain", "node": node, "worker": d["worker"], "role": d["role"]})
        return orders

    def drain_external(self, jc: JobControl, ext: dict[str, dict], target: dict) -> list[dict]:
        """Ask the external workers a role has beyond its target to drain (highest ids first).

        Only a pinned count can leave some over. The request is a member of
        ``JobKeys.external_drain``, which the worker watches; it finishes the
        batch in hand and stops working (it is never signalled).
        """
        orders = []
        for role in ROLES:
            mine = sorted((w for w, rec in ext.items() if rec["counted"] and rec["role"] == role), reverse=True)
            over = mine[:max(0, len(mine) - target.get(role, 0))]
            if over:
                self._ask_to_drain(jc.info.name, over)
                orders += [{"action": "drain_external", "node": ext[w]["node"], "worker": w, "role": role}
                           for w in over]
        return orders

    def _ask_to_drain(self, job: str, workers: list[str]) -> None:
        if not self.lease.renew():
            raise LeaseLost("lost the controller lease while acting")
        self.r.sadd(JobKeys(job).external_drain, *workers)

    def _send(self, jc: JobControl, node: str, action: str, what, now: float) -> bool:
        """Enqueue one action unless the same was the last sent for that worker, less than RESEND_S ago (a
        drain between two ensures of one worker makes the second a new action, sent at once)."""
        worker = what["worker"] if action == "ensure" else what
        digest = (action, json.dumps(what, sort_keys=True))
        last, at = jc.sent.get((node, worker), (None, -math.inf))
        if last == digest and now - at < RESEND_S:
            return False
        if not self.lease.renew():
            raise LeaseLost("lost the controller lease while acting")
        if action == "ensure":
            actions.ensure(self.r, node, what, epoch=self.lease.epoch)
        else:
            actions.drain(self.r, node, jc.info.name, what, epoch=self.lease.epoch)
        jc.sent[(node, worker)] = (digest, now)
        return True

    def commit(self, jc: JobControl, alloc: dict, cur: dict, new: dict, target: dict, now: float,
               drained: list[str] = ()) -> None:
        """Write the placement and, if the target moved, when and from what (the allocator's cooldown); the
        drain requests acted on go with it."""
        k = JobKeys(jc.info.name)

        def queue(pipe) -> None:
            pipe.delete(k.placement)
            if drained:
                pipe.srem(k.drain_requests, *drained)
            if new:
                pipe.hset(k.placement, mapping={w: json.dumps(rec) for w, rec in new.items()})
            if target != alloc["target"]:
                pipe.hset(k.allocation, mapping={"target": json.dumps(target), "changed_at": now,
                                                 "changed_from": json.dumps(_slot_counts(alloc["target"], jc))})

        if not self.lease.write(queue):
            raise LeaseLost(f"lost the controller lease before writing {jc.info.name}'s placement")

    def finish(self, jc: JobControl) -> None:
        """A job that is done: drain every worker of it on every agent, feeder included.

        Every agent on record (``AGENTS``), not only the live ones: one unseen for a moment
        (restarting, or waiting out a Redis outage with its workers running)
        runs the drains it finds queued when it is back. It would also drain
        them itself (``Agent.drive``); this keeps its desired state true.
        """
        sent = []
        for node in sorted(n.decode() for n in self.r.hkeys(AGENTS)):
            for key, raw in self.r.hgetall(agent_desired(node)).items():
                d = json.loads(raw)
                if d["job"] == jc.info.name and d["state"] == STATE_RUN:
                    actions.drain(self.r, node, jc.info.name, d["worker"], epoch=self.lease.epoch)
                    sent.append({"action": "drain", "node": node, "worker": d["worker"], "role": d["role"]})
        ext = {w: rec for w, rec in external_workers(self.r, jc.info.name).items() if rec["counted"]}
        if ext:
            self._ask_to_drain(jc.info.name, sorted(ext))
            sent += [{"action": "drain_external", "node": rec["node"], "worker": w, "role": rec["role"]}
                     for w, rec in sorted(ext.items())]
        self.r.delete(JobKeys(jc.info.name).placement)
        if sent:   # a restarted controller finds finished jobs with nothing left to drain: no event
            record_event(self.r, jc.info, {"kind": "job_done", "epoch": self.lease.epoch, "actions": sent})
        jc.finished = True


def _slot_counts(target: dict, jc: JobControl) -> dict:
    return counts_of({**jc.info.initial, **target}, jc.info.control.reward_on_slots)
