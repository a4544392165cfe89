"""Discrete-event simulator of the RL pipeline on a workload's cost model (the ``des`` engine).

Called by ``pipeline.sim.bench_allocator.run_bench`` (``libra-ctl bench policy``), in
the CLI process, once per mode. Time is virtual; a run is deterministic for a
seed. What it models (see ``bench/README.md`` for the definitions):

- rollout GPUs with ``concurrency`` decode slots (continuous batching); a
  trajectory holds its slot for decode time plus its tool waits; its prefill is
  exclusive GPU time (every slot of that GPU stalls), and so is a weight load;
- reward workers (a CPU pool, or GPUs taken from the pool), FIFO, one
  trajectory at a time each, scoring trajectories as they arrive;
- a learner that trains whole GRPO groups, batch by batch, at
  ``train_tokens_per_s * n**scaling_exponent`` on n GPUs, then publishes;
- staleness: admission control lets trajectory i start only while it would be
  trained within ``max_staleness`` versions of the current one; groups that are
  staler all the same (they finished late) are dropped and counted;
- role changes: a GPU yields nothing for ``switch_cost_s``; a rollout GPU that
  leaves hands its in-flight trajectories back (they restart elsewhere, the
  work is lost); a learner GPU leaves at the end of the current step.

How it stays fast (1,024 GPUs, 2 M trajectories per mode in seconds): slots
are numpy arrays, and virtual time advances in windows of at most ``dt``
seconds that end at every global event (learner step end, role switch, control
tick). Inside a window every slot that finishes is handled at once, at its
exact finishing time; a GPU's exclusive pauses (prefill, weight load) are paid
at the start of the window after they are incurred. Reward and group
bookkeeping are exact: a FIFO pool with a constant service time has a closed
form, so a group's ready time is known the moment its last trajectory leaves
rollout.

Modes: ``sync`` and ``ideal`` are computed step by step and per phase
(``simulate_sync``, ``ideal_rate``); ``static``, ``static-best`` and ``libra``
run the asynchronous engine (``AsyncSim``), libra calling ``allocator.plan``
every control interval with metrics measured inside the simulation.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from pipeline.config import ControlConfig
from pipeline.control import allocator
from pipeline.control.allocator import Allocation, learner_speed, median_of_counts, ratio
from pipeline.control.job import plan_config
from pipeline.dataplane.worker import ROLES
from pipeline.sim.workload import Phase, Workload

ROLLOUT, LEARNER, REWARD, SWITCHING = 0, 1, 2, 3
_ROLE_CODE = {"rollout": ROLLOUT, "learner": LEARNER, "reward": REWARD}

Progress = Callable[[int, int, float], None]   # (steps done, steps, virtual seconds)


@dataclass
class ModeResult:
    """One mode's outcome; ``report()`` is its entry of the README's JSON."""

    trajectories_per_s: float
    gpu_busy_frac: float | None = None
    learner_wait_frac: float | None = None
    staleness_p50: float | None = None
    staleness_p99: float | None = None
    dropped_stale: int | None = None
    reconfigurations: int | None = None
    final_allocation: dict | None = None
    sim_time_s: float = 0.0
    timeline: list[dict] = field(default_factory=list)   # per learner step: t, allocation, rate
    events: list[dict] = field(default_factory=list)     # libra's decisions that moved GPUs

    def report(self) -> dict:
        """The README's per-mode keys, as plain JSON types (ideal has only its rate)."""
        out = {"trajectories_per_s": float(self.trajectories_per_s)}
        for k in ("gpu_busy_frac", "learner_wait_frac", "staleness_p50", "staleness_p99"):
            if getattr(self, k) is not None:
                out[k] = float(getattr(self, k))
        for k in ("dropped_stale", "reconfigurations"):
            if getattr(self, k) is not None:
                out[k] = int(getattr(self, k))
        if self.final_allocation is not None:
            out["final_allocation"] = {k: int(v) for k, v in self.final_allocation.items()}
        return out


# --- the fluid cost model: ideal bound and static splits ---------------------

@dataclass(frozen=True)
class PhaseCost:
    """Per-trajectory costs of a phase, from the README's ideal-bound formulas."""

    rollout_gpu_s: float     # prompt/prefill + (response/decode + tool waits)/concurrency
    tokens: float            # prompt + mean response, what the learner trains on
    reward_s: float          # reward worker seconds


def phase_cost(wl: Workload, ph: Phase) -> PhaseCost:
    ro = wl.rollout
    slot = ph.response_tokens.mean() / ro.decode_tokens_per_s + ph.tool_calls.mean_wait_s()
    return PhaseCost(ph.prompt_tokens / ro.prefill_tokens_per_s + slot / ro.concurrency,
                     ph.prompt_tokens + ph.response_tokens.mean(), wl.reward.seconds)


def fluid_rates(wl: Workload, ph: Phase, rollout, learner, reward=0, cpu_reward: bool = True):
    """Sustainable trajectories/s of splits (numpy arrays or scalars): no bubbles, no sync cost.

    ``cpu_reward=False`` leaves out a CPU reward pool's cap (to rank splits it makes equal).
    """
    c = phase_cost(wl, ph)
    le = wl.learner
    r = np.asarray(rollout, dtype=float) / c.rollout_gpu_s
    lr = le.train_tokens_per_s * np.asarray(learner, dtype=float) ** le.scaling_exponent / c.tokens
    workers = np.asarray(reward, dtype=float) if wl.reward.gpu else float(wl.reward.cpu_workers)
    rw = workers / c.reward_s if c.reward_s > 0 and (wl.reward.gpu or cpu_reward) else np.inf
    return np.minimum(np.minimum(r, lr), rw)


def ideal_phase_rate(wl: Workload, ph: Phase) -> float:
    """Best real-valued split of the phase: the highest rate every stage sustains at once."""
    c = phase_cost(wl, ph)
    le = wl.learner

    def gpus_needed(rate: float) -> float:
        learner = (rate * c.tokens / le.train_tokens_per_s) ** (1 / le.scaling_exponent)
        reward = rate * c.reward_s if wl.reward.gpu else 0.0
        return rate * c.rollout_gpu_s + learner + reward

    lo, hi = 0.0, 1.0
    while gpus_needed(hi) <= wl.cluster.gpus:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gpus_needed(mid) <= wl.cluster.gpus else (lo, mid)
    if not wl.reward.gpu and c.reward_s > 0:
        lo = min(lo, wl.reward.cpu_workers / c.reward_s)
    return lo


def ideal_rate(wl: Workload) -> float:
    """Total trajectories / sum over phases of (phase trajectories / ideal phase rate)."""
    job = wl.job
    n = job.phase_trajectories()
    return sum(n) / sum(k / ideal_phase_rate(wl, ph) for k, ph in zip(n, job.phases))


def _integer_splits(wl: Workload) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every split of the pool with at least one GPU per GPU stage: (rollout, learner, reward)."""
    g = wl.cluster.gpus
    if not wl.reward.gpu:
        x = np.arange(1, g)
        return x, g - x, np.zeros_like(x)
    x, z = np.meshgrid(np.arange(1, g), np.arange(1, g), indexing="ij")
    ok = x + z <= g - 1
    x, z = x[ok], z[ok]
    return x, g - x - z, z


def _as_alloc(x, y, z) -> Allocation:
    return Allocation(rollout=int(x), learner=int(y), reward=int(z))


def static_split(wl: Workload) -> Allocation:
    """The integer split that maximises the first phase's fluid rate (what a careful user picks)."""
    x, y, z = _integer_splits(wl)
    ph = wl.job.phases[0]
    i = _argmax_tie_balanced(fluid_rates(wl, ph, x, y, z), fluid_rates(wl, ph, x, y, z, cpu_reward=False))
    return _as_alloc(x[i], y[i], z[i])


def _argmax_tie_balanced(rate: np.ndarray, gpu_rate: np.ndarray) -> int:
    """Best rate; among equals (a CPU reward pool capping them all), the best-balanced GPU stages."""
    top = rate >= rate.max() * (1 - 1e-12)
    return int(np.argmax(np.where(top, gpu_rate, -np.inf)))


def run_fluid_rate(wl: Workload, x, y, z, cpu_reward: bool = True):
    """Whole-run fluid rate of splits: total / sum over phases of (trajectories / rate)."""
    job = wl.job
    n = job.phase_trajectories()
    with np.errstate(divide="ignore"):
        t = sum(k / fluid_rates(wl, ph, x, y, z, cpu_reward) for k, ph in zip(n, job.phases))
    return sum(n) / t


def fluid_best_split(wl: Workload) -> Allocation:
    """The integer split with the best whole-run fluid rate (where the static-best search starts)."""
    x, y, z = _integer_splits(wl)
    i = _argmax_tie_balanced(run_fluid_rate(wl, x, y, z), run_fluid_rate(wl, x, y, z, cpu_reward=False))
    return _as_alloc(x[i], y[i], z[i])


def search_static_best(wl: Workload, run: Callable[[Allocation], "ModeResult"],
                       known: dict[Allocation, "ModeResult"] | None = None) -> tuple[Allocation, "ModeResult"]:
    """The hindsight oracle: hill-climb over integer splits, scoring each by a full simulated run.

    Starts at the fluid optimum and moves ``step`` GPUs between any two roles
    while that helps, halving the step down to one GPU; ``known`` holds runs
    already made (the static split's). Splits are scored with the same seed, so
    the search is deterministic.
    """
    cache = dict(known or {})

    def rate(a: Allocation) -> float:
        if a not in cache:
            cache[a] = run(a)
        return cache[a].trajectories_per_s

    cur = fluid_best_split(wl)
    step = max(1, round(wl.cluster.gpus * 0.04))
    while True:
        better = [a for a in _neighbours(wl, cur, step) if rate(a) > rate(cur)]
        if better:
            cur = max(better, key=rate)
        elif step == 1:
            return cur, cache[cur]
        else:
            step = max(1, step // 2)


def _neighbours(wl: Workload, a: Allocation, step: int) -> list[Allocation]:
    """Splits that move ``step`` GPUs from one GPU role to another, every GPU role keeping one."""
    roles = ("rollout", "learner") + (("reward",) if wl.reward.gpu else ())
    out = []
    for src in roles:
        for dst in roles:
            if src != dst and a.get(src) - step >= 1:
                d = a.as_dict()
                d[src] -= step
                d[dst] += step
                out.append(Allocation(**d))
    return out


# --- sync: colocated and synchronous ------------------------------------------

def simulate_sync(wl: Workload, seed: int, progress: Progress | None = None) -> ModeResult:
    """Every GPU generates the batch in waves, then rewards, then every GPU trains, then publish + load."""
    job, ro, le = wl.job, wl.rollout, wl.learner
    g, c = wl.cluster.gpus, ro.concurrency
    rng = np.random.default_rng(seed)
    reward_workers = g if wl.reward.gpu else wl.reward.cpu_workers
    t = busy = wait = 0.0
    timeline = []
    for step in range(job.steps):
        ph = job.phase_at(step)
        resp = ph.response_tokens.sample(rng, job.batch_size)
        slot = resp / ro.decode_tokens_per_s + ph.tool_calls.sample_wait_s(rng, job.batch_size)
        prefill = ph.prompt_tokens / ro.prefill_tokens_per_s
        gen = _sync_generation_s(slot, prefill, g, c)
        reward = math.ceil(job.batch_size / reward_workers) * wl.reward.seconds if wl.reward.seconds else 0.0
        train = (ph.prompt_tokens * job.batch_size + resp.sum()) / (le.train_tokens_per_s * g ** le.scaling_exponent)
        step_s = gen + reward + train + le.weight_publish_s + ro.weight_sync_s
        busy += job.batch_size * prefill + slot.sum() / c + g * (train + le.weight_publish_s)
        busy += job.batch_size * wl.reward.seconds if wl.reward.gpu else 0.0
        wait += gen + reward + ro.weight_sync_s
        t += step_s
        timeline.append({"t": t, "step": step + 1, "rollout": g, "learner": g, "reward": 0,
                         "switching": 0, "rate": job.batch_size / step_s})
        if progress:
            progress(step + 1, job.steps, t)
    return ModeResult(trajectories_per_s=job.steps * job.batch_size / t, gpu_busy_frac=busy / (g * t),
                      learner_wait_frac=wait / t, staleness_p50=0.0, staleness_p99=0.0, dropped_stale=0,
                      reconfigurations=0, final_allocation={"colocated": g}, sim_time_s=t, timeline=timeline)


def _sync_generation_s(slot: np.ndarray, prefill: float, gpus: int, concurrency: int) -> float:
    """Waves of gpus x concurrency sequences; a wave lasts until its slowest GPU is done.

    Sequence j of a wave runs on GPU j % gpus; a GPU first prefills its
    sequences (exclusive time), then its slowest one sets its finish.
    """
    wave = gpus * concurrency
    total = 0.0
    for w0 in range(0, len(slot), wave):
        s = slot[w0:w0 + wave]
        pad = (-len(s)) % gpus
        per_gpu = np.concatenate([s, np.full(pad, -np.inf)]).reshape(-1, gpus)
        count = (per_gpu > -np.inf).sum(axis=0)
        total += float(np.max(count * prefill + per_gpu.max(axis=0)))
    return total


# --- the asynchronous engine -------------------------------------------------

# How libra is driven inside the simulation: the controller's settings (the one ControlConfig) with a
# 30 s tick and a window of five ticks.
LIBRA_CONTROL = ControlConfig(interval_s=30.0, window_s=150.0)


def window_ticks(control: ControlConfig) -> int:
    """The metrics window in control ticks."""
    return max(1, round(control.window_s / control.interval_s))


class _Grow:
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


class AsyncSim:
    """Disaggregated asynchronous pipeline with a fixed split or with libra's policy.

    Built and run by ``simulate_async``; one instance per mode run.
    """

    def __init__(self, wl: Workload, alloc: Allocation, seed: int, control: ControlConfig | None = None,
                 dt: float | None = None, progress: Progress | None = None):
        self.wl, self.job = wl, wl.job
        self.G, self.C = wl.cluster.gpus, wl.rollout.concurrency
        self.B, self.gs, self.m = self.job.batch_size, self.job.group_size, self.job.max_staleness
        self.rng = np.random.default_rng(seed)
        self.control, self.progress = control, progress
        self.dt = dt if dt is not None else _default_dt(wl)
        self.t = 0.0
        self._init_gpus(alloc)
        self._init_queues()
        self._init_learner()
        self._init_stats()

    # -- state ------------------------------------------------------------------

    def _init_gpus(self, alloc: Allocation) -> None:
        G, C = self.G, self.C
        if alloc.total != G or min(alloc.rollout, alloc.learner) < 1:
            raise ValueError(f"allocation {alloc.as_dict()} does not fit {G} GPUs with >= 1 rollout and learner")
        self.role = np.full(G, ROLLOUT, dtype=np.int8)
        self.role[alloc.rollout:alloc.rollout + alloc.learner] = LEARNER
        self.role[alloc.rollout + alloc.learner:] = REWARD
        self.rmask = (self.role == ROLLOUT).astype(float)   # 1.0 on rollout GPUs: they advance
        self.prog = np.zeros(G)        # per GPU: seconds of decode progress (virtual time minus pauses)
        self.debt = np.zeros(G)        # per GPU: exclusive time owed (prefill, weight load), paid next window
        # slot s = c * G + g: slot c of GPU g, so filling slots in index order spreads work over GPUs
        self.end = np.full(C * G, np.inf)          # progress time at which the slot's trajectory finishes
        self.end2d = self.end.reshape(C, G)
        self.slot_traj = np.full(C * G, -1, dtype=np.int64)
        self.slot_start = np.zeros(C * G)          # progress time at which it started
        self.slot_cost = np.zeros(C * G)           # its GPU-seconds: prefill + slot time / concurrency
        self.n_idle = alloc.rollout * C            # idle slots on rollout GPUs
        self.n_learner = alloc.learner             # learner GPUs that take part in the next step
        self.learner_leaving: list[tuple[int, int]] = []   # (gpu, destination role) at the step's end
        self.target = alloc                        # the allocation ordered (switches included)
        self.events: list[tuple[float, int, str, tuple]] = []
        self._seq = 0

    def _init_queues(self) -> None:
        n = (self.job.steps + self.m + 2) * self.B
        self.tok = _Grow(n, np.float64, 0.0)       # per trajectory id: prompt + response tokens
        self.tver = _Grow(n, np.int32, 0)          # per trajectory id: policy version it started with
        self.gcount = _Grow(n // self.gs, np.int32, 0)
        self.gready = _Grow(n // self.gs, np.float64, 0.0)
        self.gver = _Grow(n // self.gs, np.int32, np.iinfo(np.int32).max)
        self.next_new = 0                          # next fresh trajectory id
        self.admit_limit = (self.m + 1) * self.B   # ids below it may start (staleness admission)
        self.requeue: deque[np.ndarray] = deque()   # handed-back ids, restarted first
        self.n_requeue = 0
        self.ready_gid = _Grow(n // self.gs, np.int64, 0)   # complete groups in ready-time order
        self.ready_t = _Grow(n // self.gs, np.float64, 0.0)
        self.ready_head = self.ready_tail = 0
        self.reward_w = max(self._reward_workers(), 1)
        self.lastd = np.zeros(self.reward_w)     # last departures of the reward pool, ascending

    def _init_learner(self) -> None:
        self.V = 0                   # latest published policy version
        self.k = 0                   # learner steps started
        self.steps_done = 0
        self.learner_busy = False
        self.free_at = 0.0           # when the learner last became free
        self.waits: deque[tuple[float, float]] = deque()   # learner waiting periods, for the meter
        self.wait_total = 0.0

    def _init_stats(self) -> None:
        self.busy = 0.0                                   # GPU-seconds of stage work
        self.stale_hist = np.zeros(self.m + 1, dtype=np.int64)
        self.dropped = 0
        self.reconfigs = 0
        self.timeline: list[dict] = []
        self.decisions: list[dict] = []
        self.meter = _Meter()
        self.last_change_t = -math.inf
        self.changed_from: Allocation | None = None
        self.last_step_end = 0.0

    def _reward_workers(self) -> int:
        if self.wl.reward.gpu:
            return int((self.role == REWARD).sum())
        return self.wl.reward.cpu_workers

    # -- main loop --------------------------------------------------------------

    def run(self) -> ModeResult:
        self._fill_idle()
        if self.control:
            self._push(self.control.interval_s, "control", ())
        while self.steps_done < self.job.steps:
            t_ev = self.events[0][0] if self.events else math.inf
            t1 = min(self.t + self.dt, t_ev)
            if t1 > self.t:
                self._advance(self.t, t1)
                self.t = t1
            while self.events and self.events[0][0] <= self.t:
                t_e, _, kind, payload = heapq.heappop(self.events)
                getattr(self, f"_on_{kind}")(t_e, *payload)
            self._try_start_step()
            self._fill_idle()
            if self.t > 1e9:
                raise RuntimeError("simulation made no progress (no rollout or learner capacity?)")
        return self._result()

    def _push(self, t: float, kind: str, payload: tuple) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    # -- rollout ----------------------------------------------------------------

    def _advance(self, t0: float, t1: float) -> None:
        """Run every rollout GPU from t0 to t1: pay owed pauses, then progress; handle finished slots."""
        w = t1 - t0
        pay = np.minimum(self.debt, w) * self.rmask
        self.debt -= pay
        old = self.prog.copy()
        self.prog += (w - pay) * self.rmask
        self.meter.rollout_gpu_s += w * self.target.rollout
        self.meter.idle_slot_s += w * self.n_idle
        fin = np.flatnonzero(self.end2d <= self.prog)
        done_ids, done_t = [], []
        while fin.size:
            g = fin % self.G
            tc = t0 + pay[g] + (self.end[fin] - old[g])
            order = np.argsort(tc, kind="stable")
            fin, g, tc = fin[order], g[order], tc[order]
            done_ids.append(self.slot_traj[fin])
            done_t.append(tc)
            self.meter.add_rollout(self.slot_cost[fin], self.tok.a[self.slot_traj[fin]])
            fin = self._restart_slots(fin, g)
        if done_ids:
            ids, tc = np.concatenate(done_ids), np.concatenate(done_t)
            order = np.argsort(tc, kind="stable")
            self._finished(ids[order], tc[order])

    def _restart_slots(self, fin: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Give freed slots (in finishing order) the next queued trajectories; the rest go idle.

        A new trajectory starts at the progress time its predecessor ended, so
        no slot time is lost inside a window. Returns the slots whose new
        trajectory already ends within this window.
        """
        k = min(len(fin), self._available())
        idle = fin[k:]
        self.end[idle] = np.inf
        self.slot_traj[idle] = -1
        self.n_idle += len(idle)
        if k == 0:
            return fin[:0]
        fin, g = fin[:k], g[:k]
        self._start(fin, g, self.end[fin])
        return fin[self.end[fin] <= self.prog[g]]

    def _fill_idle(self) -> None:
        """Start queued trajectories on idle rollout slots (after a publish, a drop or a GPU joining)."""
        if self.n_idle == 0 or self._available() == 0:
            return
        idle = np.flatnonzero((self.slot_traj < 0).reshape(self.C, self.G) & (self.rmask > 0))
        idle = idle[:self._available()]
        self.n_idle -= len(idle)
        g = idle % self.G
        self._start(idle, g, self.prog[g])

    def _available(self) -> int:
        return self.n_requeue + self.admit_limit - self.next_new

    def _take(self, k: int) -> np.ndarray:
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

    def _start(self, slots: np.ndarray, g: np.ndarray, at_prog: np.ndarray) -> None:
        """Sample and start trajectories on ``slots`` (of GPUs ``g``) at progress times ``at_prog``."""
        ids = self._take(len(slots))
        ph = self.job.phase_at(self.V)
        ro = self.wl.rollout
        resp = ph.response_tokens.sample(self.rng, len(ids))
        slot_s = resp / ro.decode_tokens_per_s + ph.tool_calls.sample_wait_s(self.rng, len(ids))
        prefill = ph.prompt_tokens / ro.prefill_tokens_per_s
        top = int(ids.max()) + 1
        self.tok.ensure(top)[ids] = ph.prompt_tokens + resp
        self.tver.ensure(top)[ids] = self.V
        self.slot_traj[slots] = ids
        self.slot_start[slots] = at_prog
        self.end[slots] = at_prog + slot_s
        self.slot_cost[slots] = prefill + slot_s / self.C
        # prefill is exclusive: every slot of the GPU stalls while it runs
        self.debt += np.bincount(g, minlength=self.G) * prefill
        self.busy += len(ids) * prefill + slot_s.sum() / self.C

    # -- reward and groups -------------------------------------------------------

    def _finished(self, ids: np.ndarray, arrive: np.ndarray) -> None:
        """Trajectories leave rollout at ``arrive`` (ascending): score them, complete their groups."""
        scored = self._score(arrive)
        gid = ids // self.gs
        top = int(gid.max()) + 1
        count, ready, ver = self.gcount.ensure(top), self.gready.ensure(top), self.gver.ensure(top)
        np.add.at(count, gid, 1)
        np.maximum.at(ready, gid, scored)
        np.minimum.at(ver, gid, self.tver.a[ids])
        u = np.unique(gid)
        done = u[count[u] == self.gs]
        if done.size:
            done = done[np.argsort(ready[done], kind="stable")]
            n = self.ready_tail + done.size
            self.ready_gid.ensure(n)[self.ready_tail:n] = done
            self.ready_t.ensure(n)[self.ready_tail:n] = ready[done]
            self.ready_tail = n

    def _score(self, arrive: np.ndarray) -> np.ndarray:
        """FIFO pool of W workers, constant service s: start_j = max(arrive_j, depart_{j-W}).

        Departures then come out in arrival order, so a later arrival never
        overtakes: the scored stream is sorted, and so is the groups' ready order.
        """
        s = self.wl.reward.seconds
        W = self.reward_w
        if s == 0:
            return arrive.copy()
        out = np.empty_like(arrive)
        for i in range(0, len(arrive), W):
            a = arrive[i:i + W]
            d = np.maximum(a, self.lastd[:len(a)]) + s
            out[i:i + len(a)] = d
            self.lastd = np.concatenate([self.lastd[len(a):], d])
        if self.wl.reward.gpu:
            self.busy += len(arrive) * s
        return out

    def _resize_reward(self, t: float, w: int) -> None:
        """GPU reward workers joined (free from t) or left (the earliest-free ones go)."""
        if w > len(self.lastd):
            self.lastd = np.sort(np.concatenate([self.lastd, np.full(w - len(self.lastd), t)]))
        elif w < len(self.lastd):
            self.lastd = self.lastd[len(self.lastd) - max(w, 1):]
        self.reward_w = max(w, 1)

    # -- learner ------------------------------------------------------------------

    def _try_start_step(self) -> None:
        """Start step k once B fresh trajectories are scored; drop staler groups on the way."""
        if self.learner_busy or self.k >= self.job.steps:
            return
        need = self.B // self.gs
        gids = self.ready_gid.a[self.ready_head:self.ready_tail]
        if not gids.size:
            return
        fresh = (self.k - self.gver.a[gids]) <= self.m
        cum = np.cumsum(fresh)
        if cum[-1] < need:
            self._drop_leading_stale(fresh)
            return
        last = int(np.searchsorted(cum, need))
        take, dropped = gids[:last + 1][fresh[:last + 1]], gids[:last + 1][~fresh[:last + 1]]
        start = max(self.free_at, float(self.ready_t.a[self.ready_head + last]))
        self.ready_head += last + 1
        self._drop(dropped)
        self._train(take, start)

    def _drop_leading_stale(self, fresh: np.ndarray) -> None:
        """Stale groups at the head will never be trained: drop them now so admission reopens."""
        n = int(np.argmax(fresh)) if fresh.any() else len(fresh)
        if n:
            self._drop(self.ready_gid.a[self.ready_head:self.ready_head + n])
            self.ready_head += n

    def _drop(self, gids: np.ndarray) -> None:
        if gids.size:
            n = gids.size * self.gs
            self.dropped += n
            self.meter.dropped += n
            self.admit_limit += n     # dropped trajectories do not count against the staleness window

    def _train(self, groups: np.ndarray, start: float) -> None:
        """Step k on ``groups`` from ``start``: train on their tokens, then publish."""
        le = self.wl.learner
        ids = groups[:, None] * self.gs + np.arange(self.gs)      # (groups, group_size) trajectory ids
        tokens = float(self.tok.a[ids].sum())
        train = tokens / (le.train_tokens_per_s * self.n_learner ** le.scaling_exponent)
        stale = self.k - self.gver.a[groups]
        self.stale_hist += np.bincount(stale, minlength=self.m + 1)[:self.m + 1] * self.gs
        self.meter.steps.append(_StepSample(train, le.weight_publish_s, self.B, self.n_learner, tokens, stale))
        if start > self.free_at:
            self.waits.append((self.free_at, start))
            self.wait_total += start - self.free_at
        self.busy += self.n_learner * (train + le.weight_publish_s)
        self.learner_busy = True
        self.k += 1
        self._push(start + train + le.weight_publish_s, "step_end", ())

    def _on_step_end(self, t: float) -> None:
        """Publish version k: rollout GPUs load it (a pause), admission moves on one batch."""
        self.steps_done += 1
        self.V = self.steps_done
        self.learner_busy = False
        self.free_at = t
        sync = self.wl.rollout.weight_sync_s
        self.debt += self.rmask * sync
        self.meter.pause_gpu_s += sync * self.target.rollout
        self.admit_limit += self.B
        for gpu, dest in self.learner_leaving:
            self.n_learner -= 1
            self._begin_switch(gpu, dest, t)
        self.learner_leaving = []
        self._record_step(t)
        if self.progress:
            self.progress(self.steps_done, self.job.steps, t)

    def _record_step(self, t: float) -> None:
        a = self.role
        self.timeline.append({"t": t, "step": self.steps_done, "rollout": int((a == ROLLOUT).sum()),
                              "learner": int((a == LEARNER).sum()), "reward": int((a == REWARD).sum()),
                              "switching": int((a == SWITCHING).sum()),
                              "rate": self.B / max(t - self.last_step_end, 1e-9)})
        self.last_step_end = t

    # -- control (libra) -------------------------------------------------------------

    def _on_control(self, t: float) -> None:
        cc = self.control
        self.meter.close_tick(t, self)
        m = self.meter.metrics(self, t, window_ticks(cc))
        inv = allocator.Inventory(gpus=self.G, switch_cost_s=self.wl.cluster.switch_cost_s)
        d = allocator.plan(m, inv, [self._job_spec()], plan_config(cc))
        if d.changed:
            self.decisions.append({"t": t, **d.event(m)})
            self._apply(d.allocation, t)
        self._push(t + cc.interval_s, "control", ())

    def _job_spec(self) -> allocator.JobSpec:
        rb = allocator.RoleBounds(1, self.G) if self.wl.reward.gpu else allocator.RoleBounds(0, 0)
        return allocator.JobSpec(name=self.wl.name, batch_size=self.B, max_staleness=self.m,
                              reward_on_gpu=self.wl.reward.gpu,
                              learner_scaling_exponent=self.wl.learner.scaling_exponent,
                              bounds={"reward": rb})

    def _apply(self, new: Allocation, t: float) -> None:
        """Move GPUs from roles above their new count to roles below it."""
        cur = self.target
        gaining = [r for r in ROLES for _ in range(max(0, new.get(r) - cur.get(r)))]
        leaving = []
        for r in ROLES:
            k = cur.get(r) - new.get(r)
            if k > 0:
                leaving += self._pick_leavers(r, k)
        for (gpu, src), dest in zip(leaving, gaining):
            self._leave(gpu, src, _ROLE_CODE[dest], t)
        self.changed_from, self.target = cur, new
        self.reconfigs += 1
        self.last_change_t = t

    def _pick_leavers(self, role: str, k: int) -> list[tuple[int, str]]:
        """Which GPUs leave ``role``: rollout GPUs with the least work in flight lose the least."""
        gpus = np.flatnonzero(self.role == _ROLE_CODE[role])
        if role == "learner":
            leaving = {g for g, _ in self.learner_leaving}
            gpus = np.array([g for g in gpus if g not in leaving], dtype=np.int64)
        if role == "rollout":
            busy = np.where(self.slot_traj >= 0, self.prog[np.arange(len(self.end)) % self.G] - self.slot_start, 0)
            work = busy.reshape(self.C, self.G).sum(axis=0)[gpus]
            gpus = gpus[np.argsort(work, kind="stable")]
        return [(int(g), role) for g in gpus[:k]]

    def _leave(self, gpu: int, src: str, dest: int, t: float) -> None:
        if src == "rollout":
            self._abort_rollout(gpu)
            self._begin_switch(gpu, dest, t)
        elif src == "learner":
            if self.learner_busy:
                self.learner_leaving.append((gpu, dest))    # it finishes the step first
            else:
                self.n_learner -= 1
                self._begin_switch(gpu, dest, t)
        else:
            self._begin_switch(gpu, dest, t)
            self._resize_reward(t, self._reward_workers())

    def _abort_rollout(self, gpu: int) -> None:
        """Hand the GPU's in-flight trajectories back; the work done on them is lost."""
        slots = np.arange(gpu, self.C * self.G, self.G)
        active = slots[self.slot_traj[slots] >= 0]
        if active.size:
            self.requeue.append(self.slot_traj[active].copy())
            self.n_requeue += active.size
            self.busy -= float((self.end[active] - self.prog[gpu]).clip(0).sum()) / self.C
        self.n_idle -= self.C - active.size
        self.end[slots] = np.inf
        self.slot_traj[slots] = -1
        self.debt[gpu] = 0.0

    def _begin_switch(self, gpu: int, dest: int, t: float) -> None:
        self.role[gpu] = SWITCHING
        self.rmask[gpu] = 0.0
        self._push(t + self.wl.cluster.switch_cost_s, "switch_done", (gpu, dest))

    def _on_switch_done(self, t: float, gpu: int, dest: int) -> None:
        self.role[gpu] = dest
        if dest == ROLLOUT:
            self.rmask[gpu] = 1.0
            self.n_idle += self.C       # its slots start empty, with the latest weights loaded
        elif dest == LEARNER:
            self.n_learner += 1         # takes part from the next step
        else:
            self._resize_reward(t, self._reward_workers())

    # -- result ---------------------------------------------------------------------

    def _result(self) -> ModeResult:
        T = self.free_at    # the last step's publish
        active = self.slot_traj >= 0
        g = np.flatnonzero(active) % self.G
        self.busy -= float((self.end[active] - self.prog[g]).clip(0).sum()) / self.C
        return ModeResult(
            trajectories_per_s=self.job.steps * self.B / T,
            gpu_busy_frac=self.busy / (self.G * T),
            learner_wait_frac=self.wait_total / T,
            staleness_p50=hist_quantile(self.stale_hist, 0.5),
            staleness_p99=hist_quantile(self.stale_hist, 0.99),
            dropped_stale=int(self.dropped),
            reconfigurations=self.reconfigs,
            final_allocation=self.target.as_dict(),
            sim_time_s=T, timeline=self.timeline, events=self.decisions)


def hist_quantile(hist: np.ndarray, q: float) -> float:
    """The q-quantile of integer values given their counts (lower value at a tie)."""
    total = hist.sum()
    if total == 0:
        return 0.0
    return float(np.searchsorted(np.cumsum(hist), q * total))


def _default_dt(wl: Workload) -> float:
    """Window length: a small share of the shortest mean slot time, within [0.05, 2] s."""
    ro = wl.rollout
    slot = min(ph.response_tokens.mean() / ro.decode_tokens_per_s + ph.tool_calls.mean_wait_s()
               for ph in wl.job.phases)
    return float(min(2.0, max(0.05, slot / 30)))


class _StepSample(NamedTuple):
    """One learner step as the learner reports it."""

    train_s: float
    publish_s: float
    trajectories: int
    gpus: int
    tokens: float
    staleness: np.ndarray     # per group trained


class _Meter:
    """What libra's controller would read from Redis: counters per control tick, summed over a window."""

    def __init__(self):
        self.ticks: deque[dict] = deque(maxlen=64)
        self._reset(0.0)

    def _reset(self, t: float) -> None:
        self.t0 = t
        self.n_done = 0                  # trajectories finished by rollout
        self.cost = 0.0                  # their GPU-seconds (prefill + slot time / concurrency)
        self.tokens = 0.0                # their prompt + response tokens
        self.steps: list[_StepSample] = []
        self.rollout_gpu_s = self.pause_gpu_s = self.idle_slot_s = 0.0
        self.dropped = 0

    def add_rollout(self, cost: np.ndarray, tokens: np.ndarray) -> None:
        self.n_done += cost.size
        self.cost += float(cost.sum())
        self.tokens += float(tokens.sum())

    def close_tick(self, t: float, sim: AsyncSim) -> None:
        """End the tick at t: keep its counters (and the backlog then), start the next one."""
        tick = {k: getattr(self, k) for k in ("t0", "n_done", "cost", "tokens", "steps", "rollout_gpu_s",
                                               "pause_gpu_s", "idle_slot_s", "dropped")}
        tick["backlog"] = (sim.ready_tail - sim.ready_head) * sim.gs
        self.ticks.append(tick)
        self._reset(t)

    def metrics(self, sim: AsyncSim, t: float, window: int) -> allocator.Metrics:
        """The policy's inputs over the last ``window`` ticks."""
        ticks = list(self.ticks)[-window:]
        span = max(t - ticks[0]["t0"], 1e-9)
        total = {k: sum(tk[k] for tk in ticks) for k in ("n_done", "cost", "tokens", "rollout_gpu_s",
                                                         "pause_gpu_s", "idle_slot_s", "dropped")}
        steps = [s for tk in ticks for s in tk["steps"]]
        stale = np.concatenate([s.staleness for s in steps]) if steps else np.zeros(0)
        n_done, rollout_gpu_s = total["n_done"], total["rollout_gpu_s"]
        n_now = max(sim.n_learner, 1)
        return allocator.Metrics(
            window_s=span, allocation=sim.target, since_change_s=t - sim.last_change_t,
            changed_from=sim.changed_from,
            rollout_gpu_s_per_traj=ratio(total["cost"], n_done),
            rollout_pause_frac=ratio(total["pause_gpu_s"], rollout_gpu_s),
            rollout_inflight=int((sim.slot_traj >= 0).sum()), rollout_queue=sim._available(),
            rollout_idle_frac=ratio(total["idle_slot_s"], rollout_gpu_s * sim.C),
            # every scoring takes exactly reward.seconds in this cost model, so that is its measured mean
            reward_s_per_traj=sim.wl.reward.seconds, reward_cpu_workers=sim.wl.reward.cpu_workers,
            traj_tokens=ratio(total["tokens"], n_done),
            learner_tokens_per_s=learner_speed(((s.tokens, s.train_s, s.gpus) for s in steps), n_now,
                                               sim.wl.learner.scaling_exponent),
            learner_gpus_measured=n_now if steps else 0,
            learner_publish_s=sum(s.publish_s for s in steps) / len(steps) if steps else 0.0,
            learner_wait_frac=_wait_in(sim, ticks[0]["t0"], t) / span,
            backlog=ticks[-1]["backlog"],
            backlog_trend_per_s=(ticks[-1]["backlog"] - ticks[0]["backlog"]) / span,
            trained=sum(s.trajectories for s in steps),
            staleness_p50=median_of_counts(dict(zip(*np.unique(stale, return_counts=True)))),
            dropped_stale=total["dropped"])


def _wait_in(sim: AsyncSim, a: float, b: float) -> float:
    """Seconds in [a, b] the learner spent waiting for data (a wait still going on counts up to b)."""
    total = 0.0
    periods = list(sim.waits)
    if not sim.learner_busy:
        periods.append((sim.free_at, b))
    for s, e in periods:
        total += max(0.0, min(e, b) - max(s, a))
    while sim.waits and sim.waits[0][1] < a - 3600:
        sim.waits.popleft()
    return total


def simulate_async(wl: Workload, alloc: Allocation, seed: int, control: ControlConfig | None = None,
                   dt: float | None = None, progress: Progress | None = None) -> ModeResult:
    """Run the asynchronous pipeline from ``alloc``; libra when ``control`` is given."""
    return AsyncSim(wl, alloc, seed, control, dt, progress).run()
