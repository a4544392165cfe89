"""The fluid cost model: the ideal bound, the static split and the static-best search.

Called by ``pipeline.sim.bench_allocator`` (``libra-ctl bench policy``, in the
CLI process) for the ``ideal`` mode and for the splits the ``static`` and
``static-best`` modes run from, and by ``pipeline.sim.bench_live`` for the same
splits and the expected step time. A split's fluid rate is what its stages
sustain at once with no bubbles and no sync cost (the README's ideal-bound
formulas); ``search_static_best`` then scores splits by full simulated runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.control.allocator import Allocation
from pipeline.sim.result import ModeResult
from pipeline.sim.workload import Phase, Workload


@dataclass(frozen=True)
class PhaseCost:
    """Per-trajectory costs of a phase, from the README's ideal-bound formulas."""

    rollout_gpu_s: float     # prompt/prefill + (response/decode + tool waits)/concurrency
    tokens: float            # prompt + mean response, what the learner trains on
    reward_s: float          # reward worker seconds


def phase_cost(wl: Workload, ph: Phase) -> PhaseCost:
    """Mean per-trajectory costs of phase ``ph`` on the workload's rollout and reward settings."""
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


def gpus_needed(wl: Workload, ph: Phase, rate):
    """Real-valued GPUs the stages of phase ``ph`` need to sustain ``rate`` trajectories/s (scalar or array)."""
    c = phase_cost(wl, ph)
    le = wl.learner
    learner = (np.asarray(rate, dtype=float) * c.tokens / le.train_tokens_per_s) ** (1 / le.scaling_exponent)
    reward = rate * c.reward_s if wl.reward.gpu else 0.0
    return rate * c.rollout_gpu_s + learner + reward


def cpu_reward_cap(wl: Workload, ph: Phase) -> float:
    """Trajectories/s a CPU reward pool scores at most (inf when reward is on GPU or free)."""
    c = phase_cost(wl, ph)
    return wl.reward.cpu_workers / c.reward_s if not wl.reward.gpu and c.reward_s > 0 else np.inf


def ideal_phase_rate(wl: Workload, ph: Phase) -> float:
    """Best real-valued split of the phase: the highest rate every stage sustains at once.

    With a learner that scales better than linearly (``scaling_exponent`` > 1)
    no split is best: the learner is cheapest per trajectory on the whole
    pool, so stages taking turns on every GPU beat any split (``turns_rate``),
    and the bound is that rate.
    """
    lo, hi = 0.0, 1.0
    while gpus_needed(wl, ph, hi) <= wl.cluster.gpus:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gpus_needed(wl, ph, mid) <= wl.cluster.gpus else (lo, mid)
    if wl.learner.scaling_exponent > 1:
        lo = max(lo, turns_rate(wl, ph, wl.cluster.gpus))
    return min(lo, cpu_reward_cap(wl, ph))


def turns_rate(wl: Workload, ph: Phase, gpus: int) -> float:
    """The rate of every GPU doing each stage in turn: ``gpus`` over the GPU-seconds of one trajectory, the
    learner's on all ``gpus`` at once (the cheapest it gets when ``scaling_exponent`` > 1)."""
    return gpus / trajectory_gpu_s(wl, ph, gpus)


def trajectory_gpu_s(wl: Workload, ph: Phase, learner_gpus: int) -> float:
    """GPU-seconds of one trajectory of phase ``ph``, every stage at its cheapest: rollout, reward when on GPU,
    and the learner at its one-GPU rate, or on ``learner_gpus`` when more GPUs cost less
    (``scaling_exponent`` > 1: n GPUs spend n ** (1 - exponent) of one GPU's time per token)."""
    c, le = phase_cost(wl, ph), wl.learner
    learner = c.tokens / le.train_tokens_per_s * (learner_gpus ** (1 - le.scaling_exponent)
                                                   if le.scaling_exponent > 1 else 1.0)
    return c.rollout_gpu_s + (c.reward_s if wl.reward.gpu else 0.0) + learner


def ideal_rate(wl: Workload) -> float:
    """Total trajectories / sum over phases of (phase trajectories / ideal phase rate)."""
    job = wl.job
    n = job.phase_trajectories()
    return sum(n) / sum(k / ideal_phase_rate(wl, ph) for k, ph in zip(n, job.phases))


def stale_floor(wl: Workload, seed: int = 0, groups: int = 100_000) -> dict:
    """Trajectories that go stale at the ideal pace whatever the allocation: long tails, not the policy.

    At the ideal rate a phase's learner step takes s = batch_size / rate. A
    group of version V is trained within the bound only in a step up to
    V + max_staleness, and a learner that prefetches (``learner.prefetch``)
    takes a group into that step's batch until the step ends, max_staleness
    + 1 steps after V was published; the group cannot start before a rollout
    engine has loaded V (``weight_sync_s``). A trajectory takes its prefill,
    then its decode and tool waits, which advance only while its GPU is not
    prefilling another sequence: at the ideal rate every rollout GPU the other
    stages leave (the most the pace allows) spends ``rate x prefill / GPUs``
    of its time prefilling, and slot time stretches by 1 / (1 - that share).
    A group whose slowest trajectory takes longer than (max_staleness + 1) * s
    - weight_sync_s is dropped by any allocation that keeps that pace (reward
    time, the group's own training and waiting for the learner only make it
    later). Sampled from the workload's distributions (``groups`` groups per
    phase); returns the fraction over the run and, per phase, the step time,
    the time a group has, the slot stretch and the share of groups doomed.
    """
    rng = np.random.default_rng(seed)
    job, ro = wl.job, wl.rollout
    phases = []
    for ph in job.phases:
        rate = ideal_phase_rate(wl, ph)
        step = job.batch_size / rate
        prefill = ph.prompt_tokens / ro.prefill_tokens_per_s
        rollout_gpus = wl.cluster.gpus - (gpus_needed(wl, ph, rate) - rate * phase_cost(wl, ph).rollout_gpu_s)
        busy = min(rate * prefill / max(rollout_gpus, 1e-9), 1.0 - 1e-9)
        size = (groups, job.group_size)
        slot = (ph.response_tokens.sample(rng, size) / ro.decode_tokens_per_s
                + ph.tool_calls.sample_wait_s(rng, groups * job.group_size).reshape(size))
        seconds = prefill + slot / (1 - busy)
        budget = (job.max_staleness + 1) * step - ro.weight_sync_s
        phases.append({"step_s": step, "budget_s": budget, "stretch": 1 / (1 - busy),
                       "doomed": float((seconds.max(axis=1) > budget).mean())})
    n = job.phase_trajectories()
    return {"fraction": sum(k * p["doomed"] for k, p in zip(n, phases)) / sum(n), "phases": phases}


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


def search_static_best(wl: Workload, run: Callable[[Allocation], ModeResult],
                       known: dict[Allocation, ModeResult] | None = None) -> tuple[Allocation, ModeResult]:
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
            rate(cur)   # a pool of one split has no neighbours: its rate was never run
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


# --- a pool of several jobs (docs/workloads.md, "Several jobs on one pool") -----------------------------------------

def job_work_gpu_s(wl: Workload, learner_gpus: int | None = None) -> float:
    """W: the job's work in GPU-seconds, every stage at its cheapest.

    Per trajectory: rollout (prompt/prefill + (response/decode + tool waits)/concurrency), reward
    ``seconds`` when reward is on GPU, learner (prompt + response tokens)/``train_tokens_per_s``: more
    learner GPUs only cost more per trajectory when scaling_exponent <= 1, so no allocation does it for
    less. Above 1 they cost less, and the learner is charged on ``learner_gpus`` (the most the job may
    hold; default the pool).
    """
    most = wl.cluster.gpus if learner_gpus is None else learner_gpus
    return sum(n * trajectory_gpu_s(wl, ph, most) for n, ph in zip(wl.job.phase_trajectories(), wl.job.phases))


def ideal_makespan(work_gpu_s: list[float], alone_s: list[float], gpus: int) -> float:
    """No allocation finishes every job sooner: the pool cannot do the work faster, nor a job its own part.

    ``alone_s``: each job's time alone on its largest share at its ideal rate.
    """
    return max(sum(work_gpu_s) / gpus, max(alone_s))


def proportional_shares(work: dict[str, float], lo: dict[str, int], hi: dict[str, int],
                        gpus: int) -> dict[str, int]:
    """A fixed partition of ``gpus`` in proportion to each job's work, each within [lo, hi].

    The real-valued shares clamp(lam * W_j, lo_j, hi_j) sum to the pool for one lam (found by
    bisection; when every job sits at its hi the pool is not filled); then each job takes the floor
    of its share and the GPUs left go, one each, to the largest remainders still below their hi.
    """
    if sum(lo.values()) > gpus:
        raise ValueError(f"the minimums ({sum(lo.values())} GPUs) do not fit the pool of {gpus}")

    def shares(lam: float) -> dict[str, float]:
        return {j: min(max(lam * w, lo[j]), hi[j]) for j, w in work.items()}

    lam_lo, lam_hi = 0.0, gpus / max(min(work.values()), 1e-12)    # at lam_hi every job sits at its hi
    for _ in range(100):
        mid = (lam_lo + lam_hi) / 2
        lam_lo, lam_hi = (mid, lam_hi) if sum(shares(mid).values()) <= gpus else (lam_lo, mid)
    real = shares(lam_lo)
    out = {j: int(s + 1e-9) for j, s in real.items()}
    spare = gpus - sum(out.values())
    for j in sorted(real, key=lambda j: out[j] - real[j]):
        if spare <= 0:
            break
        if out[j] < hi[j]:
            out[j] += 1
            spare -= 1
    return out


def split_makespan(views: list[Workload], lo: list[int], hi: list[int], gpus: int, grid: int = 4000) -> float:
    """The best split of the pool among jobs and stages: a makespan no allocation beats, learner scaling counted.

    ``views``: each job's one-job workload; it holds between ``lo`` (its
    minimum, held while it runs) and ``hi`` GPUs. A job that runs a phase at
    rate r for its N trajectories holds max(lo, GPUs needed for r) for N / r
    seconds; the GPUs needed grow faster than the rate (the learner's
    ``scaling_exponent``), so a phase done at an even rate costs least for its
    time (Jensen). Job j's least GPU-time within a makespan T is C_j(T),
    found by pricing time (one price for all its phases); T is feasible when
    every job can finish within it and sum C_j(T) <= gpus * T. Returns the
    least feasible T (bisection).
    """
    tables = [_phase_tables(v, lo_j, hi_j, grid) for v, lo_j, hi_j in zip(views, lo, hi)]

    def least_gpu_time(phases, T: float) -> float:
        fastest = sum(t.min() for t, _ in phases)
        if fastest > T * (1 + 1e-12):
            return np.inf

        def pick(price: float) -> tuple[float, float]:
            idx = [int(np.argmin(c + price * t)) for t, c in phases]
            return (sum(t[i] for (t, _), i in zip(phases, idx)), sum(c[i] for (_, c), i in zip(phases, idx)))

        time0, cost0 = pick(0.0)
        if time0 <= T:
            return cost0
        lo_p, hi_p = 0.0, 1.0
        while pick(hi_p)[0] > T:
            hi_p *= 2
        for _ in range(60):
            mid = (lo_p + hi_p) / 2
            lo_p, hi_p = (mid, hi_p) if pick(mid)[0] > T else (lo_p, mid)
        return pick(hi_p)[1]

    def feasible(T: float) -> bool:
        return sum(least_gpu_time(p, T) for p in tables) <= gpus * T

    lo_t = max(sum(t.min() for t, _ in p) for p in tables)
    hi_t = lo_t * 2
    while not feasible(hi_t):
        hi_t *= 2
    for _ in range(60):
        mid = (lo_t + hi_t) / 2
        lo_t, hi_t = (lo_t, mid) if feasible(mid) else (mid, hi_t)
    return hi_t


def on_gpus(view: Workload, gpus: int) -> Workload:
    """The one-job view on a cluster of ``gpus`` (its share): for its static split and its ideal rate."""
    return dataclasses.replace(view, cluster=dataclasses.replace(view.cluster, gpus=gpus))


def _phase_tables(view: Workload, lo: int, hi: int, grid: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per phase of one job: (seconds, GPU-seconds held) for rates from its slowest useful one to its fastest."""
    out = []
    on_hi = on_gpus(view, hi)
    for n, ph in zip(view.job.phase_trajectories(), view.job.phases):
        fastest = ideal_phase_rate(on_hi, ph)
        # slower than the rate its minimum sustains, a phase only takes longer on the same GPUs
        slowest = fastest
        for _ in range(100):
            if gpus_needed(view, ph, slowest / 2) < lo:
                break
            slowest /= 2
        rate = np.linspace(slowest / 2, fastest, grid)
        held = np.maximum(lo, gpus_needed(view, ph, rate))
        out.append((n / rate, n / rate * held))
    return out
