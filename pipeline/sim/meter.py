"""What libra's controller would read from Redis, measured inside the des engine.

Owned by ``pipeline.sim.des.AsyncSim`` (one per run, in the CLI process of
``libra-ctl bench policy``): the engine adds to the current tick's counters as
it runs; in libra mode, at every control tick it closes the tick and asks
``metrics`` for the ``allocator.Metrics`` over the window, which it hands to
``allocator.plan``. Counters are summed over ticks; what the engine is doing
right now (in-flight work, queue, allocation) comes in as ``Gauges``.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from pipeline.control import allocator
from pipeline.control.allocator import (MAX_WINDOW_FACTOR, MIN_STEPS, Allocation, bound_share_steps, drop_share_since,
                                        learner_speed, median_of_counts, ratio, steps_since)
from pipeline.sim.workload import Workload

_COUNTERS = ("n_done", "cost", "tokens", "rollout_gpu_s", "pause_gpu_s", "loads", "idle_slot_s", "dropped")


class StepSample(NamedTuple):
    """One learner step as the learner reports it."""

    train_s: float
    publish_s: float
    trajectories: int
    gpus: int
    tokens: float
    staleness: np.ndarray     # per group trained


class Gauges(NamedTuple):
    """The engine's state at a control tick, read as it is (not summed over ticks)."""

    allocation: Allocation             # the allocation ordered (switches included)
    changed_from: Allocation | None
    since_change_s: float
    inflight: int                      # trajectories on rollout slots
    queue: int                         # trajectories that may start now
    learner_gpus: int                  # learner GPUs that take part in the next step
    learner_idle_since: float | None   # when the learner became free, None while it trains
    remaining: int                     # trajectories the job has still to train
    publish_every: int = 1             # the learner's publish cadence (steps per version) ...
    publish_since_s: float = float("inf")   # ... and how long it has run at it
    publish_reason: str = ""           # ... and why it was set
    learner_steps: int = 0             # learner steps made


class Meter:
    """Counters per control tick, kept for the last 64 ticks, summed over a window."""

    def __init__(self, wl: Workload, concurrency: int):
        self.wl, self.C = wl, concurrency
        self.ticks: deque[dict] = deque(maxlen=64)   # a window of 5 ticks stretches to 50
        self.waits: deque[tuple[float, float]] = deque()   # learner waiting periods (start, end)
        # the latest learner steps, each with the start of the tick it came in and the trajectories dropped as
        # stale before that tick (the share at the staleness bound and of drops since the last change)
        self.recent: deque[tuple[float, tuple[StepSample, int]]] = deque(
            maxlen=bound_share_steps(wl.job.max_staleness))
        self.dropped_total = 0
        self._reset(0.0)

    def _reset(self, t: float) -> None:
        self.t0 = t
        self.n_done = 0                  # trajectories finished by rollout
        self.cost = 0.0                  # their GPU-seconds (prefill + slot time / concurrency)
        self.tokens = 0.0                # their prompt + response tokens
        self.steps: list[StepSample] = []
        self.rollout_gpu_s = self.pause_gpu_s = self.idle_slot_s = 0.0
        self.loads = 0                   # weight loads on rollout GPUs (all of pause_gpu_s is theirs)
        self.dropped = 0

    def add_rollout(self, cost: np.ndarray, tokens: np.ndarray) -> None:
        self.n_done += cost.size
        self.cost += float(cost.sum())
        self.tokens += float(tokens.sum())

    def add_wait(self, start: float, end: float) -> None:
        self.waits.append((start, end))

    def close_tick(self, t: float, backlog: int) -> None:
        """End the tick at t: keep its counters (and the backlog then), start the next one."""
        tick = {k: getattr(self, k) for k in ("t0", "steps") + _COUNTERS}
        tick["backlog"] = backlog
        self.ticks.append(tick)
        self.recent.extend((self.t0, (s, self.dropped_total)) for s in self.steps)
        self.dropped_total += self.dropped
        self._reset(t)

    def metrics(self, t: float, window: int, now: Gauges) -> allocator.Metrics:
        """The policy's inputs over the last ``window`` ticks, or more, as the live observer stretches it.

        A window that holds fewer than ``MIN_STEPS`` learner steps takes older ticks (up to
        ``MAX_WINDOW_FACTOR`` windows): shorter, it would not see the learner's speed.
        """
        ticks = list(self.ticks)
        n = window
        while n < len(ticks) and n < MAX_WINDOW_FACTOR * window \
                and sum(len(tk["steps"]) for tk in ticks[-n:]) < MIN_STEPS:
            n += 1
        # the backlog as the window began: the tick before it closed then (none before: the job's start, empty)
        backlog_at_start = ticks[-n - 1]["backlog"] if len(ticks) > n else 0
        ticks = ticks[-n:]
        span = max(t - ticks[0]["t0"], 1e-9)
        total = {k: sum(tk[k] for tk in ticks) for k in _COUNTERS}
        steps = [s for tk in ticks for s in tk["steps"]]
        stale = np.concatenate([s.staleness for s in steps]) if steps else np.zeros(0)
        bound = self.wl.job.max_staleness
        since = steps_since(self.recent, t, now.since_change_s, now.publish_since_s, bound)
        settled = [s for s, _ in since] or steps
        settled_stale = np.concatenate([s.staleness for s in settled]) if settled else np.zeros(0, dtype=int)
        at_bound = settled_stale == bound
        trained = sum(s.trajectories for s in steps)
        dropped_since = drop_share_since(since, lambda s: s.trajectories, self.dropped_total, trained)
        n_done, rollout_gpu_s = total["n_done"], total["rollout_gpu_s"]
        n_now = max(now.learner_gpus, 1)
        return allocator.Metrics(
            window_s=span, allocation=now.allocation, since_change_s=now.since_change_s,
            changed_from=now.changed_from,
            rollout_gpu_s_per_traj=ratio(total["cost"], n_done),
            rollout_pause_frac=ratio(total["pause_gpu_s"], rollout_gpu_s),
            rollout_inflight=now.inflight, rollout_queue=now.queue,
            rollout_idle_frac=ratio(total["idle_slot_s"], rollout_gpu_s * self.C),
            # every scoring takes exactly reward.seconds in this cost model, so that is its measured mean
            reward_s_per_traj=self.wl.reward.seconds, reward_cpu_workers=self.wl.reward.cpu_workers,
            traj_tokens=ratio(total["tokens"], n_done),
            learner_tokens_per_s=learner_speed(((s.tokens, s.train_s, s.gpus) for s in steps), n_now,
                                               self.wl.learner.scaling_exponent),
            learner_gpus_measured=n_now if steps else 0,
            learner_publish_s=sum(s.publish_s for s in steps) / len(steps) if steps else 0.0,
            learner_wait_frac=self._wait_in(ticks[0]["t0"], t, now.learner_idle_since) / span,
            backlog=ticks[-1]["backlog"],
            backlog_trend_per_s=(ticks[-1]["backlog"] - backlog_at_start) / span,
            trained=trained,
            staleness_p50=median_of_counts(dict(zip(*np.unique(stale, return_counts=True)))),
            dropped_stale=total["dropped"], remaining=now.remaining,
            rollout_load_s=ratio(total["pause_gpu_s"], total["loads"]),
            publish_every=now.publish_every, publish_since_s=now.publish_since_s, publish_reason=now.publish_reason,
            learner_steps=now.learner_steps,
            staleness_at_bound_frac=float(at_bound.mean()) if at_bound.size else 0.0,
            staleness_max=int(settled_stale.max()) if settled_stale.size else -1,
            dropped_since_frac=dropped_since,
            rollout_gpu_s_per_traj_last=ratio(ticks[-1]["cost"], ticks[-1]["n_done"]),
            traj_tokens_last=ratio(ticks[-1]["tokens"], ticks[-1]["n_done"]))

    def _wait_in(self, a: float, b: float, idle_since: float | None) -> float:
        """Seconds in [a, b] the learner spent waiting for data (a wait still going on counts up to b)."""
        total = 0.0
        periods = list(self.waits)
        if idle_since is not None:
            periods.append((idle_since, b))
        for s, e in periods:
            total += max(0.0, min(e, b) - max(s, a))
        while self.waits and self.waits[0][1] < a - 3600:
            self.waits.popleft()
        return total
