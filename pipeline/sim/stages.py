"""The des engine's per-stage state: rollout slots, admission, the reward pool, the groups.

Owned by ``pipeline.sim.des.AsyncSim`` (one of each per run, in the CLI process
of ``libra-ctl bench policy``), which moves trajectories between them:
``Admission`` hands out trajectory ids, ``RolloutSlots`` runs them on the
rollout GPUs' decode slots, ``RewardPool`` scores the finished ones and
``Groups`` gathers them into GRPO groups, queued in the order they become
ready for the learner. Each is plain numpy bookkeeping with no clock of its
own: the engine passes the times in.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class Grow:
    """A numpy array that doubles when an index beyond its end is needed."""

    def __init__(self, n: int, dtype, fill):
        self.fill = fill
        self.a = np.full(n, fill, dtype=dtype)

    def ensure(self, n: int) -> np.ndarray:
        if n > len(self.a):
            new = np.full(max(n, 2 * len(self.a)), self.fill, dtype=self.a.dtype)
            new[:len(self.a)] = self.a
            self.a = new
        return self.a


class RolloutSlots:
    """Every GPU's ``concurrency`` decode slots, as flat arrays; only rollout GPUs advance.

    Slot s = c * G + g is slot c of GPU g, so filling slots in index order
    spreads work over GPUs. Time on a GPU is its decode progress: virtual time
    minus the exclusive pauses (prefill, weight load) it has paid.
    """

    def __init__(self, rollout: np.ndarray, concurrency: int):
        G, C = len(rollout), concurrency
        self.G, self.C = G, C
        self.rmask = rollout.astype(float)   # 1.0 on rollout GPUs: they advance
        self.prog = np.zeros(G)        # per GPU: seconds of decode progress (virtual time minus pauses)
        self.debt = np.zeros(G)        # per GPU: exclusive time owed (prefill, weight load), paid next window
        self.end = np.full(C * G, np.inf)          # progress time at which the slot's trajectory finishes
        self.end2d = self.end.reshape(C, G)
        self.traj = np.full(C * G, -1, dtype=np.int64)
        self.start = np.zeros(C * G)               # progress time at which it started
        self.cost = np.zeros(C * G)                # its GPU-seconds: prefill + slot time / concurrency
        self.n_idle = int(rollout.sum()) * C       # idle slots on rollout GPUs

    def progress(self, w: float) -> tuple[np.ndarray, np.ndarray]:
        """Run every rollout GPU for w seconds, owed pauses first: (pause paid, progress before) per GPU."""
        pay = np.minimum(self.debt, w) * self.rmask
        self.debt -= pay
        old = self.prog.copy()
        self.prog += (w - pay) * self.rmask
        return pay, old

    def finished(self) -> np.ndarray:
        return np.flatnonzero(self.end2d <= self.prog)

    def in_finishing_order(self, fin: np.ndarray, t0: float, pay: np.ndarray, old: np.ndarray):
        """Slots ``fin`` sorted by the virtual time their trajectory finished: (slots, GPUs, times)."""
        g = fin % self.G
        tc = t0 + pay[g] + (self.end[fin] - old[g])
        order = np.argsort(tc, kind="stable")
        return fin[order], g[order], tc[order]

    def assign(self, slots: np.ndarray, g: np.ndarray, ids: np.ndarray, at_prog: np.ndarray,
               slot_s: np.ndarray, prefill: float) -> None:
        """Trajectories ``ids`` start on ``slots`` (of GPUs ``g``) at progress times ``at_prog``."""
        self.traj[slots] = ids
        self.start[slots] = at_prog
        self.end[slots] = at_prog + slot_s
        self.cost[slots] = prefill + slot_s / self.C
        # prefill is exclusive: every slot of the GPU stalls while it runs
        self.debt += np.bincount(g, minlength=self.G) * prefill

    def ending_by_now(self, slots: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Those of ``slots`` whose trajectory already ends within the progress made."""
        return slots[self.end[slots] <= self.prog[g]]

    def set_idle(self, slots: np.ndarray) -> None:
        self.end[slots] = np.inf
        self.traj[slots] = -1
        self.n_idle += len(slots)

    def take_idle(self, k: int) -> np.ndarray:
        """Up to k idle slots of rollout GPUs, in slot order, counted busy from now."""
        idle = np.flatnonzero((self.traj < 0).reshape(self.C, self.G) & (self.rmask > 0))
        idle = idle[:k]
        self.n_idle -= len(idle)
        return idle

    def owe_all(self, seconds: float) -> None:
        """Every rollout GPU pauses ``seconds`` (a weight load), paid from the next window."""
        self.debt += self.rmask * seconds

    def inflight(self) -> int:
        return int((self.traj >= 0).sum())

    def work_per_gpu(self) -> np.ndarray:
        """Per GPU: the progress seconds its in-flight trajectories have run so far (lost if it leaves)."""
        busy = np.where(self.traj >= 0, self.prog[np.arange(len(self.end)) % self.G] - self.start, 0)
        return busy.reshape(self.C, self.G).sum(axis=0)

    def work_left(self) -> float:
        """Slot seconds the in-flight trajectories still need, summed over every GPU."""
        active = self.traj >= 0
        g = np.flatnonzero(active) % self.G
        return float((self.end[active] - self.prog[g]).clip(0).sum())

    def clear(self, gpu: int) -> tuple[np.ndarray, float]:
        """Empty the GPU's slots (it leaves rollout): its trajectory ids, and the slot seconds they still needed."""
        slots = np.arange(gpu, self.C * self.G, self.G)
        active = slots[self.traj[slots] >= 0]
        ids = self.traj[active].copy()
        left = float((self.end[active] - self.prog[gpu]).clip(0).sum()) if active.size else 0.0
        self.n_idle -= self.C - active.size
        self.end[slots] = np.inf
        self.traj[slots] = -1
        self.debt[gpu] = 0.0
        return ids, left

    def stop(self, gpu: int) -> None:
        self.rmask[gpu] = 0.0

    def join(self, gpu: int) -> None:
        """The GPU becomes a rollout GPU: its slots start empty, with the latest weights loaded."""
        self.rmask[gpu] = 1.0
        self.n_idle += self.C


class Admission:
    """Which trajectory ids may start: handed-back ones first, then fresh ones below the limit.

    The limit is the staleness window: id i may start only while it would be
    trained within ``max_staleness`` versions of the current one.
    """

    def __init__(self, limit: int):
        self.next_new = 0                          # next fresh trajectory id
        self.limit = limit                         # ids below it may start
        self.requeue: deque[np.ndarray] = deque()  # handed-back ids, restarted first
        self.n_requeue = 0

    def available(self) -> int:
        return self.n_requeue + self.limit - self.next_new

    def open(self, n: int) -> None:
        """n more fresh ids may start (a step published, or trajectories dropped)."""
        self.limit += n

    def hand_back(self, ids: np.ndarray) -> None:
        self.requeue.append(ids)
        self.n_requeue += ids.size

    def take(self, k: int) -> np.ndarray:
        """The next k trajectory ids: handed-back ones first, then fresh admitted ones."""
        parts, need = [], k
        while need and self.requeue:
            head = self.requeue[0]
            parts.append(head[:need])
            if len(head) > need:
                self.requeue[0] = head[need:]
            else:
                self.requeue.popleft()
            need -= len(parts[-1])
        self.n_requeue -= k - need
        if need:
            parts.append(np.arange(self.next_new, self.next_new + need))
            self.next_new += need
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class RewardPool:
    """FIFO pool of W workers with a constant service time s, in closed form."""

    def __init__(self, seconds: float, workers: int):
        self.s = seconds
        self.w = max(workers, 1)
        self.lastd = np.zeros(self.w)     # the workers' last departures, ascending

    def score(self, arrive: np.ndarray) -> np.ndarray:
        """Departure times of arrivals ``arrive`` (ascending): start_j = max(arrive_j, depart_{j-W}).

        Departures then come out in arrival order, so a later arrival never
        overtakes: the scored stream is sorted, and so is the groups' ready order.
        """
        s, W = self.s, self.w
        if s == 0:
            return arrive.copy()
        out = np.empty_like(arrive)
        for i in range(0, len(arrive), W):
            a = arrive[i:i + W]
            d = np.maximum(a, self.lastd[:len(a)]) + s
            out[i:i + len(a)] = d
            self.lastd = np.concatenate([self.lastd[len(a):], d])
        return out

    def resize(self, t: float, w: int) -> None:
        """Workers joined (free from t) or left (the earliest-free ones go)."""
        if w > len(self.lastd):
            self.lastd = np.sort(np.concatenate([self.lastd, np.full(w - len(self.lastd), t)]))
        elif w < len(self.lastd):
            self.lastd = self.lastd[len(self.lastd) - max(w, 1):]
        self.w = max(w, 1)


class Groups:
    """Scored trajectories gathered into GRPO groups; complete groups queue in ready order.

    Trajectory i belongs to group i // group_size. A group is ready when its
    last trajectory is scored; its version is the oldest policy version any of
    its trajectories started with.
    """

    def __init__(self, n_groups: int, group_size: int):
        self.gs = group_size
        self.count = Grow(n_groups, np.int32, 0)
        self.ready = Grow(n_groups, np.float64, 0.0)
        self.version = Grow(n_groups, np.int32, np.iinfo(np.int32).max)
        self.queue_gid = Grow(n_groups, np.int64, 0)    # complete groups in ready-time order
        self.queue_t = Grow(n_groups, np.float64, 0.0)
        self.head = self.tail = 0

    def add(self, ids: np.ndarray, scored: np.ndarray, versions: np.ndarray) -> None:
        """Trajectories ``ids`` were scored at ``scored``; queue the groups they complete."""
        gid = ids // self.gs
        top = int(gid.max()) + 1
        count, ready, ver = self.count.ensure(top), self.ready.ensure(top), self.version.ensure(top)
        np.add.at(count, gid, 1)
        np.maximum.at(ready, gid, scored)
        np.minimum.at(ver, gid, versions)
        u = np.unique(gid)
        done = u[count[u] == self.gs]
        if done.size:
            done = done[np.argsort(ready[done], kind="stable")]
            n = self.tail + done.size
            self.queue_gid.ensure(n)[self.tail:n] = done
            self.queue_t.ensure(n)[self.tail:n] = ready[done]
            self.tail = n

    def queued(self) -> np.ndarray:
        """Complete groups not yet trained or dropped, in ready order."""
        return self.queue_gid.a[self.head:self.tail]

    def ready_times(self, n: int) -> np.ndarray:
        """When the first n queued groups became ready."""
        return self.queue_t.a[self.head:self.head + n]

    def pop(self, n: int) -> None:
        self.head += n

    def backlog(self) -> int:
        """Trajectories in complete groups waiting for the learner."""
        return (self.tail - self.head) * self.gs
