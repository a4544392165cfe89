"""The controller's view of a running job: snapshots over a window, mapped onto ``allocator.Metrics``.

``Observer.tick`` reads the job's counters, queues, the workers' reported
costs (``dataplane.worker.CostMeter``) and the learner's step records;
``Observer.metrics`` turns the window into what ``allocator.plan`` takes.
Called by the reconcile loop (``pipeline.control.loop``) in the controller process.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass

import redis

from pipeline.control import allocator
from pipeline.control.allocation import AGENT_DEAD_S
from pipeline.control.allocator import (MAX_WINDOW_FACTOR, MIN_STEPS, Allocation, bound_share_steps, drop_share_since,
                                        learner_speed, median_of_counts, ratio, steps_since)
from pipeline.control.job import JobInfo
from pipeline.dataplane.cadence import parse_cadence
from pipeline.dataplane.keys import GROUP_ROLLOUT, LEARNER, JobKeys
from pipeline.dataplane.streams import group_pending, learner_backlog, stream_lag

STEPS_PAGE = 10_000   # learner step records read per call
STEPS_KEPT = 10_000   # of the records a tick reads, the newest it keeps (a first tick on a long history)


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
    publish_every: int = 1      # the learner's publish cadence (pipeline.dataplane.cadence) ...
    publish_at: float | None = None   # ... and when the controller set it (None: never, the config's)
    publish_reason: str = ""    # ... and why


class Observer:
    """A job's snapshots over the metrics window, and their mapping onto ``allocator.Metrics``."""

    def __init__(self, job: JobInfo):
        self.job = job
        self.keys = JobKeys(job.name)
        self.ticks: deque[Snapshot] = deque()
        self.steps_cursor = "0-0"
        # the latest learner step records, each with the time of the tick before the one that read it and the
        # job's trajectories dropped as stale then (the tick that read it, for the first)
        self.recent: deque[tuple[float, tuple[dict, int]]] = deque(maxlen=bound_share_steps(job.max_staleness))
        self.costs: dict = {}
        self.step = 0            # the job's latest learner step

    def tick(self, r: redis.Redis, now: float) -> Snapshot:
        k, gs = self.keys, self.job.group_size
        # all of them, a page at a time (a controller started on a long history reads it whole, keeping the
        # newest): a step left unread would come back at the next tick as one that appeared since this one
        steps: deque[dict] = deque(maxlen=STEPS_KEPT)
        while True:
            page = r.xrange(k.metrics, min=f"({self.steps_cursor}", count=STEPS_PAGE)
            for entry_id, f in page:
                self.steps_cursor = entry_id.decode()
                if f.get(b"kind") == b"learner_step":
                    steps.append(json.loads(f[b"data"]))
                    # the newest record's: a learner restore trains steps again from its checkpoint's
                    self.step = int(steps[-1].get("step", 0))
            if len(page) < STEPS_PAGE:
                break
        steps = list(steps)
        learner = r.hget(k.workers, LEARNER)
        snap = Snapshot(
            t=now, counters={a.decode(): int(b) for a, b in r.hgetall(k.counters).items()},
            costs={a.decode(): json.loads(b) for a, b in r.hgetall(k.worker_costs).items()}, steps=steps,
            backlog=learner_backlog(r, k) * gs,
            inflight=group_pending(r, k.prompts, GROUP_ROLLOUT) * gs,
            queue=stream_lag(r, k.prompts, GROUP_ROLLOUT) * gs,
            learner_waiting=bool(learner) and json.loads(learner).get("state") == "waiting")
        after, before = (self.ticks[-1].t, self.ticks[-1]) if self.ticks else (-math.inf, snap)
        self.recent.extend((after, (s, before.counters.get("dropped_stale", 0))) for s in steps)
        cadence = r.hgetall(k.publish)
        snap.publish_every, snap.publish_at = parse_cadence(cadence, self.job.publish_every, self.job.max_staleness)
        snap.publish_reason = cadence.get(b"reason", b"").decode() if snap.publish_at is not None else ""
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
                learner_slots: int) -> allocator.Metrics:
        first, last = self.ticks[0], self.ticks[-1]
        span = max(last.t - first.t, 1e-9)
        ro = self._role_costs("rollout", first, last)
        # the last interval alone: where its costs per trajectory stand apart from the window's, the workload shifts
        ro_last = self._role_costs("rollout", self.ticks[-2] if len(self.ticks) > 1 else last, last)
        rw = self._role_costs("reward", first, last)
        # what the workers measured over the window, for the decision's event (libra-ctl events)
        self.costs = {"rollout": _rounded(ro), "reward": _rounded(rw),
                      "learner": _rounded(self._role_costs("learner", first, last))}
        steps = [s for snap in list(self.ticks)[1:] for s in snap.steps]
        by_tokens = bool(steps) and ro["tokens"] > 0 and all("tokens" in s for s in steps)
        unit = (lambda s: s["tokens"]) if by_tokens else (lambda s: s["trajectories"])
        # a learner's restore sets its counters back to its checkpoint's: no negative counts
        delta = {c: max(0, last.counters.get(c, 0) - first.counters.get(c, 0))
                 for c in ("trained", "dropped_stale", "generated", "scored")}
        if ro["items"] == 0 and delta["generated"]:      # workers that do not report costs: all time is busy
            ro.update(busy=alloc.rollout * span, elapsed=alloc.rollout * span, items=delta["generated"])
        if rw["items"] == 0 and delta["scored"]:
            rw.update(busy=max(rw["lanes"], 1) * span, items=delta["scored"])
        publish_since_s = last.t - last.publish_at if last.publish_at is not None else math.inf
        since = steps_since(self.recent, last.t, since_change_s, publish_since_s, self.job.max_staleness)
        settled = [s for s, _ in since] or steps
        settled_hist = staleness_counts(settled)
        dropped_since = drop_share_since(since, lambda s: s.get("trajectories", 0),
                                         last.counters.get("dropped_stale", 0), delta["trained"])
        return allocator.Metrics(
            window_s=span, allocation=alloc, since_change_s=since_change_s, changed_from=changed_from,
            rollout_gpu_s_per_traj=ratio(ro["busy"], ro["items"]),
            rollout_pause_frac=ratio(ro["pause"], ro["elapsed"]),
            rollout_inflight=last.inflight, rollout_queue=last.queue,
            rollout_idle_frac=max(0.0, 1 - ratio(ro["busy"] + ro["pause"], ro["elapsed"])) if ro["elapsed"] else 0.0,
            reward_s_per_traj=ratio(rw["busy"], rw["items"]), reward_cpu_workers=max(rw["lanes"], 1),
            traj_tokens=ratio(ro["tokens"], ro["items"]) if by_tokens else 1.0,
            learner_tokens_per_s=learner_speed(((unit(s), s["train_s"], s.get("gpus", learner_slots)) for s in steps),
                                               learner_slots, self.job.control.learner_scaling_exponent),
            learner_gpus_measured=learner_slots if steps else 0,
            learner_publish_s=sum(s.get("publish_s", 0.0) for s in steps) / len(steps) if steps else 0.0,
            learner_wait_frac=self._wait_frac(steps, first, last, span),
            backlog=last.backlog, backlog_trend_per_s=(last.backlog - first.backlog) / span,
            trained=delta["trained"], staleness_p50=staleness_median(steps), dropped_stale=delta["dropped_stale"],
            remaining=max(0, self.job.steps - self.step) * self.job.batch_size,
            rollout_load_s=ratio(ro["reload"], ro["reloads"]),
            publish_every=last.publish_every,
            publish_since_s=publish_since_s, publish_reason=last.publish_reason,
            staleness_at_bound_frac=ratio(settled_hist.get(self.job.max_staleness, 0), sum(settled_hist.values())),
            staleness_max=max((v for v, n in settled_hist.items() if n > 0), default=-1),
            dropped_since_frac=dropped_since, learner_steps=self.step,
            rollout_gpu_s_per_traj_last=ratio(ro_last["busy"], ro_last["items"]),
            traj_tokens_last=ratio(ro_last["tokens"], ro_last["items"]) if by_tokens else 1.0)

    @staticmethod
    def _role_costs(role: str, first: Snapshot, last: Snapshot) -> dict:
        """Summed busy/pause/time alive/items/tokens of a role's workers over the window."""
        out = {"busy": 0.0, "pause": 0.0, "wait": 0.0, "blocked": 0.0, "elapsed": 0.0, "items": 0, "tokens": 0.0,
               "lanes": 0, "reload": 0.0, "reloads": 0}
        for w, now in last.costs.items():
            if now["role"] != role:
                continue
            before = first.costs.get(w)
            if before is None or before["since"] != now["since"]:   # started within the window
                before = {"busy_s": 0.0, "pause_s": 0.0, "items": 0, "tokens": 0.0, "since": now["since"]}
            out["busy"] += now["busy_s"] - before["busy_s"]
            out["pause"] += now["pause_s"] - before["pause_s"]
            out["wait"] += now.get("wait_s", 0.0) - before.get("wait_s", 0.0)
            out["blocked"] += now.get("blocked_s", 0.0) - before.get("blocked_s", 0.0)
            out["reload"] += now.get("reload_s", 0.0) - before.get("reload_s", 0.0)
            out["reloads"] += now.get("reloads", 0) - before.get("reloads", 0)
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


def staleness_counts(steps: list) -> dict[int, int]:
    """{staleness: trajectories} over the learner's step records."""
    hist: dict[int, int] = {}
    for s in steps:
        for v, c in (s.get("staleness_hist") or {}).items():
            hist[int(v)] = hist.get(int(v), 0) + int(c)
    return hist


def staleness_median(steps: list) -> float:
    """Median staleness of the trajectories the learner's step records count."""
    return median_of_counts(staleness_counts(steps))



def _rounded(costs: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in costs.items()}
