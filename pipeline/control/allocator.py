"""The allocator: a pure ``plan(metrics, inventory, jobs) -> Decision``.

Called every control interval by the live controller's reconcile loop (which
reads the metrics from Redis) and by the throughput simulator
(``pipeline.sim.des``, which measures them inside the simulation), so a
benchmark of the allocator is a benchmark of the product. No Redis, no processes,
no clock reads: everything it knows arrives in its arguments, and everything it
knows is observable on a live job (measured rates, queue lengths, wait
fractions), never a workload's cost-model parameters.

How it decides, in order:

1. cooldown: no move within ``cooldown_s`` of the last one (against flapping,
   and so that the metrics window sees the new allocation), nor while the
   window (stretched to hold ``MIN_STEPS`` learner steps) still reaches back
   past it: such a window mixes two splits and the move's own transient;
2. warm-up: no move until every stage has a measured service rate;
3. model: from the measured per-worker service rates, each stage's capacity as
   a function of its GPU count (the learner with its scaling exponent); the
   best split maximises the slowest stage's capacity within each role's bounds;
4. candidates: for several target rates between the current and the best, the
   split that reaches it with the fewest GPUs moved;
5. gain versus cost: a candidate is worth it only when the throughput gained
   over ``horizon_s`` exceeds what the move loses: production forgone while the
   moved GPUs switch (``switch_cost_s``) and in-flight rollouts thrown away;
6. signals (field guide): a learner waiting more than 20% of the window means
   rollout is short, a backlog rising by more than a batch means the learner is
   short, staleness at the bound means rollout already over-produces; a
   candidate that moves against a signal is vetoed. A learner that waits while
   rollout slots stand empty means neither stage is the limit: the staleness
   window is (too little work may be in flight), and no move is made;
7. hysteresis: undoing the previous move needs a larger predicted gain;
8. shift: a move the window asks for while the last control interval's costs
   per trajectory stand apart from the window's (the workload is shifting
   under it) is planned again on that interval, and made there when that
   goes further the same way.

Beside the split, ``plan_publish`` chooses the learner's publish cadence:
fewer published versions (fewer weight loads and publishes) while the data
trained has room under ``max_staleness``, and back when stale drops pass a
budget or the split moves.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

from pipeline.dataplane.keys import ROLES

T = TypeVar("T")


@dataclass(frozen=True)
class Allocation:
    """GPUs per role for one job (reward is 0 when reward runs on CPU workers)."""

    rollout: int
    learner: int
    reward: int = 0

    @property
    def total(self) -> int:
        return self.rollout + self.learner + self.reward

    def get(self, role: str) -> int:
        return getattr(self, role)

    def as_dict(self) -> dict[str, int]:
        return {"rollout": self.rollout, "reward": self.reward, "learner": self.learner}

    def moved(self, other: "Allocation") -> int:
        """GPUs that change role going from self to other."""
        return sum(max(0, other.get(r) - self.get(r)) for r in ROLES)


@dataclass(frozen=True)
class RoleBounds:
    """Fewest and most GPUs a role may hold."""

    min: int = 1
    max: int = 1 << 30


@dataclass(frozen=True)
class Inventory:
    """The GPU pool the controller allocates (from the node agents' slots)."""

    gpus: int                 # GPU slots in the pool
    switch_cost_s: float      # seconds a GPU yields nothing while changing role (drain, start, weight load)


@dataclass(frozen=True)
class JobSpec:
    """What the controller knows of a job from its config (not from a cost model)."""

    name: str
    batch_size: int                  # trajectories per learner step
    max_staleness: int               # versions; older groups are dropped
    reward_on_gpu: bool              # reward workers hold GPUs from the pool
    learner_scaling_exponent: float  # n learner GPUs train at n**e x one (config, or fitted from step times)
    publish_every: int = 1           # learner steps per published version: rollout GPUs load one per so many batches
    # the most steps per version the controller may stretch the cadence to (plan_publish); at most max_staleness
    publish_every_max: int = 1
    bounds: dict[str, RoleBounds] = field(default_factory=dict)   # per role; missing: min 1 (0 for reward on CPU)
    # in a pool of several jobs (see plan_pool)
    min_slots: int = 0                # guaranteed slots; raised to the smallest split the job runs on
    max_slots: int = 0                # most slots it may hold (0: the whole pool)
    priority: float = 1.0             # weight of its gains (throughput relative to its demand) against others'

    def bound(self, role: str) -> RoleBounds:
        if role in self.bounds:
            return self.bounds[role]
        if role == "reward" and not self.reward_on_gpu:
            return RoleBounds(0, 0)
        return RoleBounds()


@dataclass(frozen=True)
class Metrics:
    """What the controller measured over its last window, all of it observable on a live job.

    A rate of 0 means "not measured yet" (no trajectory finished, no learner step done).
    """

    window_s: float                   # length of the measurement window
    allocation: Allocation            # current (or already ordered) allocation
    since_change_s: float             # seconds since the last allocation change was ordered
    changed_from: Allocation | None   # the allocation before that change (None: never changed)
    # rollout: per-trajectory costs reported by the workers
    rollout_gpu_s_per_traj: float     # GPU-seconds a finished trajectory cost: prefill + (decode + tool wait) / concurrency
    rollout_pause_frac: float         # share of rollout GPU time lost to weight loads
    rollout_inflight: int             # trajectories being generated now (lost work if their GPU leaves)
    rollout_queue: int                # admitted prompts' trajectories not yet started
    rollout_idle_frac: float          # share of rollout decode slots left empty (nothing admitted to run)
    # reward
    reward_s_per_traj: float          # seconds a reward worker spends per trajectory
    reward_cpu_workers: int           # CPU reward workers (when reward is not on GPU)
    # learner
    traj_tokens: float                # mean prompt + response tokens of the trajectories finished in the window
    learner_tokens_per_s: float       # training speed measured at learner_gpus_measured GPUs
    learner_gpus_measured: int
    learner_publish_s: float          # seconds per step spent publishing weights
    learner_wait_frac: float          # share of the window the learner waited for data
    # queues and freshness
    backlog: int                      # scored trajectories waiting for the learner
    backlog_trend_per_s: float        # change of backlog per second over the window
    trained: int                      # trajectories trained in the window
    staleness_p50: float              # of the trajectories trained in the window
    dropped_stale: int                # trajectories dropped as stale in the window (rollout work wasted)
    # trajectories the job has still to train; 0: none left, or not known. When any job of a pool reports
    # its remaining work, the pool is shared to bring the last finish nearest (see plan_pool)
    remaining: int = 0
    # seconds a rollout GPU spends on one weight load, the mean over the window's loads; 0: none seen
    rollout_load_s: float = 0.0
    # the learner's publish cadence now (steps per published version) and how long it has run at it
    publish_every: int = 1
    publish_since_s: float = math.inf
    publish_reason: str = ""          # why it was last set (a PublishDecision's reason; "": never)
    # share of the trajectories trained exactly max_staleness versions old (one version older and they would
    # have been dropped), over the learner steps since the split and the cadence were last set, the last
    # bound_share_steps of them (the window's steps when none came since): the share is a few groups in a
    # thousand, and a window of two steps reads it from a handful of them
    staleness_at_bound_frac: float = 0.0
    # share of the trajectories trained or dropped over those same steps that were dropped as stale; None when
    # they hold no more than the window (see drop_share_since)
    dropped_since_frac: float | None = None
    learner_steps: int = 0            # learner steps the job has made (0: none, or not known)
    # the highest staleness among the trajectories trained over those same steps (-1: none trained)
    staleness_max: int = -1
    # rollout_gpu_s_per_traj and traj_tokens over the last control interval alone (0: nothing finished in it):
    # where they stand apart from the window's, the workload is shifting (see _shifted)
    rollout_gpu_s_per_traj_last: float = 0.0
    traj_tokens_last: float = 0.0


# --- what the metrics are made of: one definition for the live observer and the simulator ------------------

MIN_STEPS = 2            # learner steps the metrics window holds at least (it stretches for them) ...
MAX_WINDOW_FACTOR = 10   # ... up to this many control.window_s


def ratio(a: float, b: float) -> float:
    """a / b, or 0 ("not measured") when nothing was counted."""
    return a / b if b else 0.0


def learner_speed(steps: Iterable[tuple[float, float, int]], n_now: int, exponent: float) -> float:
    """Training units/s over learner steps given as (units, train_s, gpus), brought to ``n_now`` GPUs.

    A step that ran on g GPUs took ``train_s``; on ``n_now`` it would take
    ``train_s * (g / n_now) ** exponent``. Units are tokens, or trajectories
    when the workers report no tokens.
    """
    steps = list(steps)
    train = sum(t * (g / max(n_now, 1)) ** exponent for _u, t, g in steps)
    return sum(u for u, _t, _g in steps) / train if steps and train > 0 else 0.0


def median_of_counts(counts: Mapping[int, int]) -> float:
    """The (lower) median of a histogram {value: count}; 0 when it is empty."""
    total = sum(counts.values())
    acc = 0
    for v in sorted(counts):
        acc += counts[v]
        if acc >= total / 2:
            return float(v)
    return 0.0


EARLY_CADENCE_STEPS = 3   # steps past the stalest data trained before the cadence may stretch early (_staleness_known)


def bound_share_steps(max_staleness: int) -> int:
    """Learner steps ``Metrics.staleness_at_bound_frac`` is measured over, at most: the data of two bounds."""
    return 2 * (max_staleness + 1)


def steps_since(steps: Iterable[tuple[float, T]], now: float, since_change_s: float, publish_since_s: float,
                max_staleness: int) -> list[T]:
    """The learner steps ``Metrics.staleness_at_bound_frac`` is measured over, oldest first.

    ``steps`` are (when the engine began to look for them, step), oldest
    first: a step counts when that time is no earlier than the last change
    of the split or the cadence, ``now - min(since_change_s, publish_since_s)``.
    Empty when none came since.
    """
    cutoff = now - min(since_change_s, publish_since_s)
    return [s for after, s in steps if after >= cutoff][-bound_share_steps(max_staleness):]


def drop_share_since(since: Sequence[tuple[T, int]], trajectories: Callable[[T], int], dropped_now: int,
                     window_trained: int) -> float | None:
    """``Metrics.dropped_since_frac`` over ``since`` (``steps_since`` of (step, trajectories dropped as stale
    before it)), with ``dropped_now`` dropped so far: None when none came since or they trained no more than
    the window's ``window_trained`` (the window's share stands)."""
    if not since:
        return None
    trained = sum(trajectories(s) for s, _ in since)
    dropped = max(0, dropped_now - since[0][1])     # a learner's restore sets the live counters back
    return dropped / (trained + dropped) if trained > window_trained else None


# Field guide: a learner idle more than 20% of the time means rollout is short. The policy's signal,
# and the line that libra-ctl doctor, libra top, the Prometheus help and report.html use.
LEARNER_WAIT_THRESHOLD = 0.2


@dataclass(frozen=True)
class PlanConfig:
    """Knobs of the allocator (the controller's config)."""

    horizon_s: float = 900.0            # a move must pay for itself within this time
    cooldown_s: float = 150.0           # no move sooner than this after the previous one
    min_gain_frac: float = 0.02         # ignore predicted gains below this share of the current rate
    reverse_gain_frac: float = 0.05     # ... and below this one for a move that undoes the previous move
    # a move that put a longer publish cadence back is not undone for this many windows while the cadence is
    # still the one it reset: the imbalance read then is the lost cadence's, which plan_publish restores
    cadence_settle_windows: float = 3.0
    pool_gain_frac: float = 0.05        # a paced move between jobs: the finish it is judged by comes this much nearer
    learner_wait_threshold: float = LEARNER_WAIT_THRESHOLD  # learner idle above this: rollout is short
    idle_slots_threshold: float = 0.2     # rollout slots this empty while the learner waits: window-bound
    # rollout slots this empty (the learner not waiting): rollout has no work to run, so it is not short, and
    # the trajectories the window saw finish are the tails of earlier work, not what work costs now
    rollout_idle_threshold: float = 0.5
    backlog_batches: float = 1.0        # a backlog above this many batches and rising means learner short
    candidates: int = 12                # target rates tried between current and best
    stale_drop_budget: float = 0.005    # share of trajectories dropped as stale the publish cadence may cost
    publish_drop_margin: float = 0.5    # ... a longer cadence is tried only when predicted within this share of it
    # ... and when the split in place gains at least this much from it: staler data costs the learning something
    # the throughput model does not see
    publish_min_saving: float = 0.01
    # the last control interval's cost (or tokens) per trajectory this far from the window's: the workload is
    # shifting under the window, and a move the window asks for is sized on that interval where it goes further
    shift_frac: float = 0.25


@dataclass(frozen=True)
class Decision:
    """The planned allocation and why; ``event()`` is the record the controller logs."""

    allocation: Allocation
    changed: bool
    reason: str                        # short snake_case
    current_rate: float                # predicted trajectories/s of the current allocation
    predicted_rate: float              # predicted trajectories/s of the returned allocation
    best_rate: float                   # best the model sees within bounds
    bottleneck: str                    # stage limiting the current allocation ("" if unknown)
    expected_gain: float               # trajectories gained over the horizon
    transition_cost: float             # trajectories lost to the move
    moved: int                         # GPUs changing role
    signals: tuple[str, ...] = ()

    def event(self, metrics: Metrics | None = None) -> dict:
        """A JSON-able event record: the decision and, if given, the inputs it saw."""
        rec = asdict(self)
        rec["allocation"] = self.allocation.as_dict()
        rec["signals"] = list(self.signals)
        if metrics is not None:
            rec["inputs"] = asdict(metrics)
            rec["inputs"]["allocation"] = metrics.allocation.as_dict()
        return rec


def plan(metrics: "Metrics | Mapping[str, Metrics]", inventory: Inventory, jobs: Sequence[JobSpec],
         config: PlanConfig = PlanConfig()) -> "Decision | PoolDecision":
    """Decide the allocation for the next control interval (pure; see the module docstring).

    One job and its ``Metrics``: that job's split of ``inventory`` (a
    ``Decision``). A mapping {job name: Metrics} over several jobs (or one):
    the pool's shares and each job's split (a ``PoolDecision``, see
    ``plan_pool``).
    """
    if isinstance(metrics, Mapping):
        return plan_pool(metrics, inventory, jobs, config)
    if len(jobs) != 1:
        raise ValueError(f"plan() of one Metrics takes one job, got {len(jobs)}: pass {{job name: Metrics}}")
    return _plan_job(metrics, inventory, jobs[0], config)


def _plan_job(metrics: Metrics, inventory: Inventory, job: JobSpec, config: PlanConfig) -> Decision:
    """One job's split of ``inventory.gpus`` slots: the window's plan, sized further while the workload shifts.

    A window that spans a shift of the workload (responses grow, prompts
    lengthen) averages the old costs with the new ones and undersizes the
    move. When the last control interval's cost or tokens per trajectory
    stand ``shift_frac`` apart from the window's, the move the window asks
    for is planned again on that interval's costs, and taken where it moves
    every role the same way and further (one move in place of two, each a
    learner restart). The interval alone never starts a move: its few
    trajectories are noisy, and a move is made only when the window sees it.
    """
    d = _plan_window(metrics, inventory, job, config)
    shifted = _shifted(metrics, config)
    if d.changed and shifted is not None:
        further = _plan_window(shifted, inventory, job, config)
        if further.changed and _goes_further(metrics.allocation, d.allocation, further.allocation):
            return replace(further, signals=further.signals + ("shifting",))
    return d


def _shifted(m: Metrics, cfg: PlanConfig) -> Metrics | None:
    """The window with the last interval's costs per trajectory, when they stand ``shift_frac`` apart; else None."""
    last = (m.rollout_gpu_s_per_traj_last, m.traj_tokens_last)
    window = (m.rollout_gpu_s_per_traj, m.traj_tokens)
    if min(last + window) <= 0 or all(abs(a / b - 1) < cfg.shift_frac for a, b in zip(last, window)):
        return None
    return replace(m, rollout_gpu_s_per_traj=last[0], traj_tokens=last[1])


def _goes_further(cur: Allocation, a: Allocation, b: Allocation) -> bool:
    """Whether split ``b`` moves every role from ``cur`` the way ``a`` does, at least as far, and is not ``a``."""
    return b != a and all((b.get(r) - cur.get(r)) * (a.get(r) - cur.get(r)) >= 0
                          and abs(b.get(r) - cur.get(r)) >= abs(a.get(r) - cur.get(r)) for r in ROLES)


def _plan_window(metrics: Metrics, inventory: Inventory, job: JobSpec, config: PlanConfig) -> Decision:
    """One job's split as the window's metrics ask for it (the steps of the module docstring)."""
    cur = metrics.allocation
    signals = _signals(metrics, job, config)
    if _cooling(metrics, config):
        return _keep(cur, "cooldown", signals)
    if "window_bound" in signals:
        return _keep(cur, "window_bound", signals)
    model = _Model.measured(metrics, inventory, job)
    if model is None:
        return _keep(cur, "warming_up", signals)
    r0 = model.rate(cur)
    best = model.best(cur)
    if best is None:
        return _keep(cur, "no_feasible_split", signals, r0, r0, model.bottleneck(cur))
    r_best = model.rate(best)
    if metrics.remaining and r0 > 0:
        # a move pays back only while the job still runs: no gain is counted past its projected end
        config = replace(config, horizon_s=min(config.horizon_s, metrics.remaining / r0))
    base = dict(current_rate=r0, best_rate=r_best, bottleneck=model.bottleneck(cur), signals=signals)
    if r_best <= r0 * (1 + config.min_gain_frac):
        return Decision(cur, False, "balanced", predicted_rate=r0, expected_gain=0.0,
                        transition_cost=0.0, moved=0, **base)
    scored = [(c,) + _net_gain(model, cur, c, metrics, inventory, config)
              for c in model.candidates(cur, r0, r_best, config.candidates)]
    allowed = [s for s in scored if not _vetoed(cur, s[0], signals)]
    if not allowed:
        return Decision(cur, False, "vetoed_by_signals", predicted_rate=r0, expected_gain=0.0,
                        transition_cost=0.0, moved=0, **base)
    target, gain, cost = max(allowed, key=lambda s: s[1] - s[2])
    # measured rates are noisy near balance: undoing the last move needs a clearer gain (no flapping)
    reverses = _reverses(metrics.changed_from, cur, target)
    if reverses and _cadence_settling(metrics, config):
        return Decision(cur, False, "cadence_settling", predicted_rate=r0, expected_gain=gain,
                        transition_cost=cost, moved=0, **base)
    need = config.reverse_gain_frac if reverses else config.min_gain_frac
    if gain - cost <= 0 or model.rate(target) < r0 * (1 + need):
        return Decision(cur, False, "gain_below_cost", predicted_rate=r0, expected_gain=gain,
                        transition_cost=cost, moved=0, **base)
    return Decision(target, True, f"rebalance_{base['bottleneck']}_short", predicted_rate=model.rate(target),
                    expected_gain=gain, transition_cost=cost, moved=cur.moved(target), **base)


def _cooling(m: Metrics, cfg: PlanConfig) -> bool:
    """Too soon after the last change: within the cooldown, or the window still reaches back past it."""
    return m.since_change_s < max(cfg.cooldown_s, m.window_s)


def _keep(cur: Allocation, reason: str, signals: tuple[str, ...], r0: float = 0.0, rb: float = 0.0,
          bottleneck: str = "") -> Decision:
    return Decision(cur, False, reason, current_rate=r0, predicted_rate=r0, best_rate=rb,
                    bottleneck=bottleneck, expected_gain=0.0, transition_cost=0.0, moved=0, signals=signals)


def _signals(m: Metrics, job: JobSpec, cfg: PlanConfig) -> tuple[str, ...]:
    """The field guide's symptoms, read from queues and waits rather than from the rate model."""
    out = []
    if m.learner_wait_frac > cfg.learner_wait_threshold and m.rollout_idle_frac > cfg.idle_slots_threshold:
        # both sides idle: the staleness window (in-flight bound) limits, not the split
        out.append("window_bound")
    elif m.learner_wait_frac > cfg.learner_wait_threshold:
        out.append("rollout_short")      # learner idle > 20% of the window
    elif m.rollout_idle_frac > cfg.rollout_idle_threshold:
        out.append("rollout_idle")       # most decode slots empty: rollout has nothing more to run
    if m.backlog > cfg.backlog_batches * job.batch_size and m.backlog_trend_per_s > 0:
        out.append("learner_short")      # scored data piling up
    # (synchronous, max_staleness 0: all data is as old as allowed by construction, which says nothing)
    if m.trained and job.max_staleness > 0 and m.staleness_p50 >= job.max_staleness:
        out.append("at_staleness_bound")   # half the data trained is as old as allowed: rollout runs ahead
    return tuple(out)


def _vetoed(cur: Allocation, target: Allocation, signals: tuple[str, ...]) -> bool:
    """A move against an observed symptom is not made, whatever the model says."""
    if "rollout_short" in signals and target.learner > cur.learner:
        return True     # the learner idles for want of data: it must not grow at upstream's expense
    if "learner_short" in signals and target.learner < cur.learner:
        return True     # scored data piles up: the learner must not shrink
    if "at_staleness_bound" in signals and target.rollout > cur.rollout and "rollout_short" not in signals:
        return True     # more rollout would only make staler data
    if "rollout_idle" in signals and target.rollout > cur.rollout:
        return True     # rollout leaves most of its slots empty: more of it would idle too
    return False


def _cadence_settling(m: Metrics, cfg: PlanConfig) -> bool:
    """Whether the last move put a longer publish cadence back, and the cadence has not moved since.

    Each published version costs every rollout GPU a weight load, so a
    stretched cadence leaves rollout more capacity: the split balanced at
    two steps per version is rollout-short at one. A move made at the longer
    cadence puts it back (``plan_publish``, ``split_changed``), and the next
    window reads rollout short. Undoing the move then would undo it for the
    cadence's sake, and the cadence comes back a window later: on
    ``sweep-s1-030`` the split went back and forth four times, each move a
    learner restart. The hold ends once the cadence has moved again or
    ``cadence_settle_windows`` windows have passed (where staleness keeps
    it at one, the imbalance is the split's). A move that found the cadence
    already at one reset nothing, and is not held: the controller writes the
    cadence and the split at the same tick, so the cadence was put back by
    the last move only if it was set no earlier than that move.
    """
    return (m.publish_reason == "split_changed" and m.publish_since_s <= m.since_change_s
            and m.publish_since_s < cfg.cadence_settle_windows * m.window_s)


def _reverses(before: Allocation | None, cur: Allocation, target: Allocation) -> bool:
    """Whether going to target moves GPUs back against the direction of the last change."""
    if before is None:
        return False
    return any((cur.get(r) - before.get(r)) * (target.get(r) - cur.get(r)) < 0 for r in ROLES)


def _net_gain(model: "_Model", cur: Allocation, target: Allocation, m: Metrics, inv: Inventory,
              cfg: PlanConfig) -> tuple[float, float]:
    """(gain, cost) in trajectories over the horizon of moving from cur to target.

    gain: (rate(target) - rate(cur)) x horizon. cost: while the moved GPUs switch
    the sources have lost them and the destinations lack them, so the pipeline
    runs at rate(mid) instead of rate(target) for switch_cost_s; a learner of
    another size trains nothing meanwhile (it is one process over its slots,
    restarted on its new ones); and a rollout GPU that leaves throws away its
    in-flight trajectories, half done on average.
    """
    r0, r1 = model.rate(cur), model.rate(target)
    mid = Allocation(**{r: min(cur.get(r), target.get(r)) for r in ROLES})
    if target.learner != cur.learner:
        mid = replace(mid, learner=0)
    switch = inv.switch_cost_s
    leaving = max(0, cur.rollout - target.rollout)
    per_gpu_inflight = m.rollout_inflight / cur.rollout if cur.rollout else 0.0
    lost = leaving * per_gpu_inflight / 2
    return (r1 - r0) * cfg.horizon_s, (r1 - model.rate(mid)) * switch + lost


@dataclass(frozen=True)
class _Model:
    """Stage capacities (trajectories/s) as functions of GPU counts, from measured rates."""

    gpus: int
    rollout_gps: float        # GPU-seconds of generation per trained trajectory, stale drops included
    # seconds each rollout GPU spends loading weights per trajectory trained: every GPU loads every published
    # version, so the share of rollout time lost to loads grows with the rate and with the rollout GPUs
    load_s_per_traj: float
    reward_s: float           # reward-worker seconds per trained trajectory, stale drops included
    reward_cpu: int
    reward_on_gpu: bool
    learner_step_train_1: float   # train seconds of one batch of recent trajectories on one GPU
    publish_s: float
    batch: int
    exponent: float
    bounds: dict

    @classmethod
    def measured(cls, m: Metrics, inv: Inventory, job: JobSpec) -> "_Model | None":
        """The model, or None while a stage has no measured rate yet."""
        if m.rollout_gpu_s_per_traj <= 0 or m.learner_tokens_per_s <= 0 or m.learner_gpus_measured <= 0 \
                or m.traj_tokens <= 0:
            return None
        if job.reward_on_gpu and m.reward_s_per_traj <= 0:
            return None
        pause = min(max(m.rollout_pause_frac, 0.0), 0.9)
        # a dropped group was generated and scored for nothing: it costs rollout and reward time, not learner
        # time (a reward stage that looked 15% short of saturation on the trained rate may be saturated)
        waste = min(m.dropped_stale / (m.dropped_stale + m.trained), 0.9) if m.trained else 0.0
        gps = m.rollout_gpu_s_per_traj / (1 - waste)
        if m.rollout_load_s > 0:
            # every rollout GPU loads every published version: per trajectory trained, a load over the
            # trajectories between two versions. Not the window's pause share, which swings with whether it
            # holds one version's loads or two
            load = m.rollout_load_s / (job.batch_size * max(m.publish_every, 1))
        else:
            gps, load = gps / (1 - pause), 0.0
        e = job.learner_scaling_exponent
        return cls(gpus=inv.gpus, rollout_gps=gps, load_s_per_traj=load,
                   reward_s=m.reward_s_per_traj / (1 - waste), reward_cpu=m.reward_cpu_workers,
                   reward_on_gpu=job.reward_on_gpu,
                   # sized from what rollout finishes now, so a change of lengths shows up before
                   # the learner trains on it
                   learner_step_train_1=(job.batch_size * m.traj_tokens / m.learner_tokens_per_s
                                         * m.learner_gpus_measured ** e),
                   publish_s=m.learner_publish_s, batch=job.batch_size, exponent=e,
                   bounds={r: job.bound(r) for r in ROLES})

    def caps(self, a: Allocation) -> dict[str, float]:
        # at rate x each of the n GPUs generates for x * gps / n and loads for x * load_s_per_traj of every second
        rollout = a.rollout / (self.rollout_gps + a.rollout * self.load_s_per_traj)
        workers = a.reward if self.reward_on_gpu else self.reward_cpu
        reward = math.inf if self.reward_s <= 0 else workers / self.reward_s
        learner = 0.0
        if a.learner > 0:
            learner = self.batch / (self.learner_step_train_1 / a.learner ** self.exponent + self.publish_s)
        return {"rollout": rollout, "reward": reward, "learner": learner}

    def rate(self, a: Allocation) -> float:
        return min(self.caps(a).values())

    def bottleneck(self, a: Allocation) -> str:
        caps = self.caps(a)
        return min(caps, key=caps.get)

    def needs(self, rate: float) -> dict[str, float] | None:
        """Fewest GPUs per role to sustain ``rate`` (bounds applied), or None if impossible."""
        if rate * self.load_s_per_traj >= 1:
            return None       # every rollout GPU would spend all its time loading weights
        n = {"rollout": math.ceil(rate * self.rollout_gps / (1 - rate * self.load_s_per_traj) - 1e-9)}
        if self.reward_on_gpu:
            n["reward"] = math.ceil(rate * self.reward_s - 1e-9)
        else:
            if self.reward_s > 0 and rate > self.reward_cpu / self.reward_s * (1 + 1e-9):
                return None
            n["reward"] = 0
        per_step = self.batch / rate - self.publish_s if rate > 0 else math.inf
        if per_step <= 0:
            return None
        n["learner"] = math.ceil((self.learner_step_train_1 / per_step) ** (1 / self.exponent) - 1e-9)
        for r in ROLES:
            b = self.bounds[r]
            n[r] = max(n[r], b.min)
            if n[r] > b.max:
                return None
        return n if sum(n.values()) <= self.gpus else None

    def max_rate(self) -> float:
        """Highest rate whose needs fit the pool (bisection: needs grow with the rate)."""
        lo, hi = 0.0, 1.0
        while self.needs(hi) is not None and hi < 1e9:
            lo, hi = hi, hi * 2
        for _ in range(60):
            mid = (lo + hi) / 2
            if self.needs(mid) is not None:
                lo = mid
            else:
                hi = mid
        return lo

    def reach(self, cur: Allocation, rate: float) -> Allocation | None:
        """The split sustaining ``rate`` that moves the fewest GPUs from ``cur``."""
        need = self.needs(rate)
        if need is None:
            return None
        out = cur.as_dict()
        deficit = sum(max(0, need[r] - out[r]) for r in ROLES)
        for r in ROLES:
            out[r] = max(out[r], need[r])
        # take the deficit from the roles with the most GPUs to spare above their need
        while deficit > 0:
            donor = max(ROLES, key=lambda r: out[r] - need[r])
            if out[donor] - need[donor] <= 0:
                return None
            take = min(deficit, out[donor] - need[donor])
            out[donor] -= take
            deficit -= take
        return Allocation(**out)

    def best(self, cur: Allocation) -> Allocation | None:
        return self.reach(cur, self.max_rate())

    def candidates(self, cur: Allocation, r0: float, r_best: float, k: int) -> list[Allocation]:
        """Fewest-move splits for target rates spread between the current rate and the best."""
        out = []
        for i in range(1, k + 1):
            a = self.reach(cur, r0 + (r_best - r0) * i / k)
            if a is not None and a != cur and a not in out:
                out.append(a)
        return out

# --- the publish cadence -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishDecision:
    """Learner steps per published version from now on, and why; ``event()`` is the controller's record."""

    publish_every: int
    changed: bool
    reason: str                  # short snake_case
    drop_frac: float = 0.0       # share of the window's trajectories dropped as stale
    predicted_drop_frac: float = 0.0   # ... predicted one step per version longer
    saved_frac: float = 0.0      # relative rate a longer cadence gains on the split in place (fewer loads, publishes)
    cost_frac: float = 0.0       # ... and what its predicted drops take back (rollout time wasted)

    def event(self) -> dict:
        return {**asdict(self), "summary": self.summary()}

    def summary(self) -> str:
        """One line for ``libra-ctl events``."""
        return (f"publish every {self.publish_every} step{'s' if self.publish_every > 1 else ''} ({self.reason}: "
                f"{self.drop_frac:.2%} dropped as stale, {self.predicted_drop_frac:.2%} predicted one step longer, "
                f"{self.saved_frac:+.1%} rate from fewer versions, {-self.cost_frac:+.1%} from those drops)")


def plan_publish(m: Metrics, job: JobSpec, config: PlanConfig = PlanConfig(), moving: bool = False) -> PublishDecision:
    """How many learner steps per published version (pure): fewer weight loads while staleness has room.

    Every published version pauses each rollout GPU for a weight load and the
    learner for a publish. Publishing every c + 1 steps instead of every c
    leaves a (c + 1)-th of them out; the price is age: a trajectory is
    generated by weights up to c steps behind the learner instead of c - 1.
    Its lag behind the learner, uniform over 0..c - 1 steps, becomes uniform
    over 0..c, whatever it was: one trained exactly at ``max_staleness``
    with lag l goes over the bound when its new lag is longer, (c - l) in
    c + 1, which over l averages one in two (not one in c + 1: every lag
    but the longest can grow). Half of those at the bound would then be
    dropped. The gain is the one the split in place would see: the rate of
    the allocator's own model of the stages (``_Model``) with the loads and
    publishes of the longer cadence, and the predicted drops charged to
    rollout as waste, over its rate now.
    Only the slower stage's saving counts: a learner-bound pipeline gains
    only the publishes, whatever rollout's loads. So the cadence grows by
    one when the window's drops plus the predicted ones stay within
    ``publish_drop_margin`` of ``stale_drop_budget`` and the net gain is at
    least ``publish_min_saving`` (data a version older costs the learning
    something no throughput figure shows, so a cadence that gains next to
    nothing is not worth it). Above ``job.publish_every``, while data is at
    the bound, it grows only once the data trained is the present cadence's
    (``_aged_out``): before, the share at the bound is the shorter cadence's,
    lower than this one's (on ``sweep-s3-002`` a step from 3 to 4 went
    through on 0.46% at the bound, measured on the data of 2, and 1.19% of
    the run was dropped). At ``job.publish_every`` the data is its own or a
    longer cadence's, whose share reads higher. It comes back by one when
    the drops measured at it exceed the budget, and is not tried again on
    the same split, unless the drops over the steps since it was set (those
    the share at the bound is read over) are within it: a window of two steps
    sees a burst of a few groups as 0.6% (steady's seeds 2-4 came back for
    one and made 0.948-0.950 of ideal, 0.961 kept at two); while
    the data generated at the longer cadence is still being trained (up to
    ``max_staleness + 1`` steps, then a window: ``_aged_out``), the drops
    measured are that cadence's, and it does not come back further. It
    moves only between ``job.publish_every`` and
    ``job.publish_every_max`` (at most ``max_staleness``), on a window that
    began after the cadence and the split were last set, once the learner
    has made enough steps (``2 * (max_staleness + 1)``) for its data to have
    reached the bound, or earlier while the stalest data trained stands two
    steps clear of it (``_staleness_known``). A move of the split, under way
    (within the window) or ordered at this tick (``moving``), puts it back at
    ``job.publish_every``:
    the rates it was sized for are gone, and a learner restart or a new
    bottleneck ages the in-flight work.
    """
    c = m.publish_every
    lo = max(1, job.publish_every)
    hi = max(lo, min(job.publish_every_max, job.max_staleness))
    if not lo <= c <= hi:
        target = min(max(c, lo), hi)
        return PublishDecision(target, target != c, "out_of_bounds")
    if lo == hi:
        return PublishDecision(c, False, "fixed")
    if moving or m.since_change_s < m.window_s:
        return PublishDecision(lo, c != lo, "split_changed")
    inv = Inventory(gpus=m.allocation.total, switch_cost_s=0.0)
    now = _Model.measured(m, inv, job)
    if now is None or m.trained <= 0 or m.dropped_stale < 0 or m.publish_since_s < m.window_s \
            or not _staleness_known(m, job, c, lo):
        return PublishDecision(c, False, "measuring")
    consumed = m.trained + m.dropped_stale
    drop = m.dropped_stale / consumed
    if drop > config.stale_drop_budget and c > lo:
        if m.publish_reason == "drops_over_budget" and not _aged_out(m, job):
            # the drops of the cadence it just came back from: one more step back would be for nothing
            return PublishDecision(c, False, "aging_out", drop_frac=drop)
        if m.dropped_since_frac is not None and m.dropped_since_frac <= config.stale_drop_budget:
            # a burst: over the steps since the cadence was set the drops are within the budget
            return PublishDecision(c, False, "drops_within_budget_since", drop_frac=drop)
        return PublishDecision(c - 1, True, "drops_over_budget", drop_frac=drop)
    if c >= hi:
        return PublishDecision(c, False, "at_most", drop_frac=drop)
    if m.publish_reason == "drops_over_budget" and m.publish_since_s < m.since_change_s:
        # tried on this split and dropped too much: the prediction missed here, so no second try on it
        return PublishDecision(c, False, "dropped_too_many_here", drop_frac=drop)
    predicted = drop + m.staleness_at_bound_frac / 2
    # the window as the longer cadence would measure it: learner_publish_s is the mean over steps, of which
    # one in c + 1 would publish; drops as predicted
    longer = replace(m, publish_every=c + 1, learner_publish_s=m.learner_publish_s * c / (c + 1))
    lean = _Model.measured(longer, inv, job)
    aged = _Model.measured(replace(longer, dropped_stale=round(predicted * consumed),
                                   trained=consumed - round(predicted * consumed)), inv, job)
    r0 = now.rate(m.allocation)
    saved = lean.rate(m.allocation) / r0 - 1
    net = aged.rate(m.allocation) / r0 - 1
    base = dict(drop_frac=drop, predicted_drop_frac=predicted, saved_frac=saved, cost_frac=saved - net)
    if predicted > config.publish_drop_margin * config.stale_drop_budget:
        return PublishDecision(c, False, "staleness_headroom_short", **base)
    if net < config.publish_min_saving:
        return PublishDecision(c, False, "saving_below_cost", **base)
    if c > lo and m.staleness_at_bound_frac > 0 and not _aged_out(m, job):
        # the data at the bound is still the shorter cadence's: this one's share is higher, and not known yet
        # (at lo the data is lo's or a longer cadence's: its share reads high, not low)
        return PublishDecision(c, False, "bound_share_unsettled", **base)
    return PublishDecision(c + 1, True, "publish_less_often", **base)


def _staleness_known(m: Metrics, job: JobSpec, c: int, lo: int) -> bool:
    """Whether the staleness a longer cadence risks can be read off the data trained so far.

    After ``bound_share_steps`` learner steps the data has had time to reach
    the bound, and its share there is measured. Before, it can be enough
    that the stalest data trained is far from the bound: a cadence one step
    longer makes no trajectory more than one step older, so data at most
    ``max_staleness - 2`` old stays a step clear of it. That holds once the
    learner has made ``EARLY_CADENCE_STEPS`` more steps than that staleness
    (data up to that much older could have come in, and none did) and, above
    ``lo``, once the data trained is the present cadence's (``_aged_out``).
    On the sweeps of seeds 1-3 this lets a bound of 4 or 8 stretch the
    cadence a median of 11 steps earlier (docs/bench.md, "publish cadence").
    """
    if m.learner_steps >= bound_share_steps(job.max_staleness):
        return True
    return (0 <= m.staleness_max <= job.max_staleness - 2
            and m.learner_steps >= m.staleness_max + EARLY_CADENCE_STEPS
            and (c == lo or _aged_out(m, job)))


def _aged_out(m: Metrics, job: JobSpec) -> bool:
    """Whether the window began after the data of the cadence before this one was trained or dropped.

    A trajectory is trained at most ``max_staleness`` steps after the version
    it was generated with, so ``max_staleness + 1`` steps (at the window's
    pace) after the cadence changed, the data trained is this cadence's.
    """
    step_s = m.window_s * job.batch_size / m.trained
    return m.publish_since_s >= (job.max_staleness + 1) * step_s + m.window_s


# --- several jobs on one pool -----------------------------------------------------------------------


class AdmissionError(ValueError):
    """A job cannot be given its minimum (alone, or beside the jobs already admitted)."""


def min_share(job: JobSpec) -> int:
    """Slots ``job`` is guaranteed: its ``min_slots``, and at least the smallest split it runs on."""
    return max(job.min_slots, sum(job.bound(r).min for r in ROLES))


def max_share(job: JobSpec, gpus: int) -> int:
    """Most slots ``job`` may hold in a pool of ``gpus``: its ``max_slots`` (0: the pool), its roles' bounds."""
    return min(gpus, job.max_slots or gpus, sum(min(job.bound(r).max, gpus) for r in ROLES))


def admit(inventory: Inventory, jobs: Sequence[JobSpec]) -> None:
    """Raise AdmissionError unless the pool holds every job's minimum at once (checked when a job is submitted)."""
    for j in jobs:
        if max_share(j, inventory.gpus) < min_share(j):
            raise AdmissionError(f"job {j.name!r} needs at least {min_share(j)} slots (min_slots and its roles' "
                                 f"minimums) but may hold at most {max_share(j, inventory.gpus)} (max_slots, "
                                 f"its roles' maximums, a pool of {inventory.gpus})")
    need = sum(min_share(j) for j in jobs)
    if need > inventory.gpus:
        mins = ", ".join(f"{j.name}={min_share(j)}" for j in jobs)
        raise AdmissionError(f"the jobs' minimums ({mins}) add up to {need} slots; the pool has {inventory.gpus}")


@dataclass(frozen=True)
class PoolDecision:
    """Slots per job from now on, each job's split of its share, and why."""

    shares: dict[str, int]
    decisions: dict[str, Decision]     # decisions[j].allocation.total == shares[j]
    reason: str                        # what moved slots between jobs: fit, guarantee, spare, rebalance_jobs; or kept
    moved_between_jobs: int            # slots that change job
    expected_gain: float = 0.0         # of a rebalance: weighted throughput gained over the horizon
    transition_cost: float = 0.0       # ... and what the move costs, in the same units
    below_min: tuple[str, ...] = ()    # jobs left under their minimum (only when the pool cannot hold them all)

    @property
    def changed(self) -> bool:
        return any(d.changed for d in self.decisions.values())

    def event(self, metrics: Mapping[str, Metrics] | None = None) -> dict:
        return {"reason": self.reason, "shares": dict(self.shares), "moved_between_jobs": self.moved_between_jobs,
                "expected_gain": self.expected_gain, "transition_cost": self.transition_cost,
                "below_min": list(self.below_min),
                "jobs": {j: d.event(metrics.get(j) if metrics else None) for j, d in self.decisions.items()}}


class _Member:
    """One job in the pool planner: its bounds, what it holds, and its value as a function of its slots.

    A measured job's value of n slots is ``priority * rate(n) / demand``:
    its best rate on n slots relative to its rate on its most slots, so that
    jobs with different trajectory sizes compare. An unmeasured job (nothing
    finished yet) has no rate model; it is given slots by fair share.

    A measured job that knows its remaining work is also ``paced``: its
    ``time_to_go(n)`` is that work over its best rate on n slots. (Scaling the
    rate by the share of it the job achieved over the last window made shares
    swing: a window holds few learner steps.)
    """

    def __init__(self, job: JobSpec, m: Metrics | None, inv: Inventory):
        self.job, self.m = job, m
        self.held = m.allocation.total if m is not None else 0
        self.lo, self.hi = min_share(job), max(min_share(job), max_share(job, inv.gpus))
        model = _Model.measured(m, inv, job) if m is not None else None
        self.model = replace(model, gpus=self.hi) if model is not None else None
        self._rates: dict[int, float] = {}
        self.demand = self.rate(self.hi) if self.model is not None else 0.0
        if self.demand <= 0:
            self.model = None
        self.left = m.remaining if m is not None and self.model is not None else 0

    @property
    def paced(self) -> bool:
        return self.left > 0

    def time_to_go(self, n: int, lost: float = 0.0, switch_s: float = 0.0) -> float:
        """Seconds to train what is left (plus ``lost`` trajectories) on ``n`` slots.

        ``switch_s``: the share changes to ``n``, its moved slots switching that
        long, over the better of two splits (``split_for``): the best split of
        ``n``, or the split that keeps the learner it has.
        """
        if not switch_s:
            rate = self.rate(n)
            return (self.left + lost) / rate if rate > 0 else math.inf
        return min((self._finish(a, lost, switch_s) for a in self._options(n)), default=math.inf)

    def split_for(self, n: int, switch_s: float) -> Allocation:
        """The split a new share of ``n`` slots gets: of ``_options``, the one that finishes first."""
        return min(self._options(n), key=lambda a: self._finish(a, 0.0, switch_s), default=_best_split(self, n))

    def _options(self, n: int) -> list[Allocation]:
        """The best split of ``n`` slots, and the split of ``n`` that keeps the learner as it is (if any)."""
        if self.rate(n) <= 0:
            return []                  # below its smallest split: no split of n runs
        out = [_best_split(self, n)]
        kept = self._kept(n)
        if kept is not None and kept != out[0]:
            out.append(kept)
        return out

    def _kept(self, n: int) -> Allocation | None:
        """The split of ``n`` slots with the learner the job has now, rollout (and reward on GPU) taking the change."""
        cur, b = self.m.allocation, self.job.bound
        rest = n - cur.learner
        if cur.learner <= 0 or rest <= 0:
            return None
        rewards = range(b("reward").min, min(b("reward").max, rest) + 1) if self.job.reward_on_gpu else (0,)
        splits = [Allocation(rollout=rest - w, reward=w, learner=cur.learner) for w in rewards
                  if b("rollout").min <= rest - w <= b("rollout").max]
        return max(splits, key=self.model.rate, default=None)

    def _finish(self, a: Allocation, lost: float, switch_s: float) -> float:
        """Seconds to train what is left on split ``a``, ordered now from the current split.

        While the moved slots switch the job runs on what both splits share, without
        a learner when its size changes (it restarts on its new slots); then at ``a``'s rate.
        """
        cur, rate = self.m.allocation, self.model.rate(a)
        if rate <= 0:
            return math.inf
        mid = Allocation(**{r: min(cur.get(r), a.get(r)) for r in ROLES})
        during = 0.0 if a.learner != cur.learner else self.model.rate(mid)
        return switch_s + max(0.0, self.left + lost - during * switch_s) / rate

    def inflight_lost(self, k: int) -> float:
        """Trajectories thrown away when ``k`` slots leave it: their rollouts' in-flight work, half done on average."""
        a = self.m.allocation
        return self.m.rollout_inflight / a.rollout * min(k, a.rollout) / 2 if a.rollout else 0.0

    def fair_weight(self, others: "Sequence[_Member]") -> float:
        """Its weight in a fair share among ``others``: its priority, times the trajectories it has left to
        train when every one of them reports that (its work's size, before its cost is measured)."""
        left = [o.m.remaining if o.m is not None else 0 for o in others]
        if all(n > 0 for n in left) and self.m is not None:
            return self.job.priority * self.m.remaining / (sum(left) / len(left))
        return self.job.priority

    def need(self, n: int) -> tuple[float, float]:
        """How much the job needs slots on ``n``, for ordering: its priority first, then its time to go."""
        return (self.job.priority, self.time_to_go(n))

    @property
    def measured(self) -> bool:
        return self.model is not None

    def rate(self, n: int) -> float:
        """Best trajectories/s on ``n`` slots (0 below the smallest split)."""
        if n not in self._rates:
            self._rates[n] = replace(self.model, gpus=n).max_rate() if n > 0 else 0.0   # 0 below its smallest split
        return self._rates[n]

    def value(self, n: int) -> float:
        return self.job.priority * self.rate(n) / self.demand if self.measured else 0.0

    def gain(self, n: int, k: int) -> float:
        """Value gained going from n to n + k slots."""
        return self.value(n + k) - self.value(n)

    def settled(self, cfg: PlanConfig) -> bool:
        """Measured and out of its cooldown (its window all after its last change): its share may be moved."""
        return self.measured and not _cooling(self.m, cfg)


def plan_pool(metrics: Mapping[str, Metrics], inventory: Inventory, jobs: Sequence[JobSpec],
              config: PlanConfig = PlanConfig()) -> PoolDecision:
    """Shares of the pool for several jobs, then each job's split of its share (pure).

    In order:

    1. fit: shares that overrun the pool (an agent left, or a new job's
       configured counts do not fit beside the others) are cut, from the jobs
       above their minimum first, lowest priority and least value lost first;
    2. guarantee: a job below its minimum gets it at once (no cooldown, no
       cost test), from free slots, then from the others down to (never
       below) their minimums, lowest priority and least value lost first;
    3. spare: free slots go where the priority-weighted gain per slot is
       highest (measured jobs), then by priority-weighted fair share;
    4. rebalance: one move of slots from a measured job to another, when the
       weighted gain over ``horizon_s`` pays the switch cost (neither job
       trains while the slots switch: both splits change and their learners
       restart; the donor's in-flight rollouts lost), and both are out of
       their cooldown;

       when the jobs report their remaining work (``Metrics.remaining``),
       steps 3 and 4 aim instead at the jobs' finishes: spare slots go by
       priority, then to the job with the longest time to go, when they
       bring its end nearer despite the switch; a job of higher priority
       takes slots from a lower one (down to its minimum) when that brings
       its own end nearer, and between jobs of one priority a move is made
       when it brings the later of the two finishes nearer, switch and lost
       rollouts counted. A rate-per-slot value ignores the work left: the
       job with the most to do ends alone, on its cap, with the others'
       slots idle;
    5. split: a job whose share is unchanged is planned as a single job on
       it; one whose share changed gets the best split of its new share (from
       its model, or its current split grown at rollout and shrunk from the
       largest role when it has none).
    """
    members = {j.name: _Member(j, metrics.get(j.name), inventory) for j in jobs}
    target = {n: min(m.held, m.hi) for n, m in members.items()}
    reasons: list[str] = []
    if _fit_pool(members, target, inventory.gpus):
        reasons.append("fit")
    before = dict(target)
    below = _guarantee(members, target, inventory.gpus)
    if target != before:
        reasons.append("guarantee")
    paced = any(m.paced for m in members.values())
    free = inventory.gpus - sum(target.values())
    if free > 0 and _spread(members, target, free, paced, inventory.switch_cost_s):
        reasons.append("spare")
    gain = cost = 0.0
    if not reasons:
        move = (_rebalance_paced if paced else _rebalance)(members, target, inventory, config)
        if move is not None:
            (donor, receiver, k), gain, cost = move
            target[donor] -= k
            target[receiver] += k
            reasons.append("rebalance_jobs")
    moved = sum(max(0, target[n] - m.held) for n, m in members.items())
    decisions = {n: _split(m, target[n], inventory, config) for n, m in members.items()}
    return PoolDecision(shares=target, decisions=decisions, reason="+".join(reasons) or "kept",
                        moved_between_jobs=moved, expected_gain=gain, transition_cost=cost, below_min=below)


def _loss_order(m: _Member, n: int) -> tuple:
    """Which job gives a slot first: lowest priority, then least value lost (unmeasured: most slots)."""
    lost = m.value(n) - m.value(n - 1) if m.measured else -n
    return (m.job.priority, lost)


def _runnable(job: JobSpec) -> int:
    """The smallest split a job runs on (a share of fewer slots is no share: the job waits with 0)."""
    return sum(job.bound(r).min for r in ROLES)


def _fit_pool(members: dict[str, _Member], target: dict[str, int], gpus: int) -> bool:
    """Cut shares that overrun the pool: down to the minimums, then whole jobs pause (lowest priority first)."""
    over = sum(target.values()) - gpus
    if over <= 0:
        return False
    while over > 0:
        able = [n for n, m in members.items() if target[n] > m.lo]
        if not able:
            break
        n = min(able, key=lambda x: _loss_order(members[x], target[x]))
        target[n] -= 1
        over -= 1
    for n in sorted(members, key=lambda x: members[x].job.priority):   # a pool too small for every minimum
        if over <= 0:
            break
        over -= target[n]
        target[n] = 0
    return True


def _guarantee(members: dict[str, _Member], target: dict[str, int], gpus: int) -> tuple[str, ...]:
    """Bring every job up to its minimum, highest priority first; the jobs that could not be (pool too small).

    A job that cannot reach even its smallest runnable split is left with 0 slots (it waits).
    """
    free = gpus - sum(target.values())
    short = []
    for n in sorted(members, key=lambda x: -members[x].job.priority):
        m = members[n]
        while target[n] < m.lo:
            if free > 0:
                free -= 1
            else:
                donors = [d for d in members if d != n and target[d] > members[d].lo]
                if not donors:
                    break
                d = min(donors, key=lambda x: _loss_order(members[x], target[x]))
                target[d] -= 1
            target[n] += 1
        if target[n] < m.lo:
            short.append(n)
            if target[n] < _runnable(m.job):
                free += target[n]
                target[n] = 0
    return tuple(short)


def _spread(members: dict[str, _Member], target: dict[str, int], free: int, paced: bool = False,
            switch_s: float = 0.0) -> bool:
    """Hand out ``free`` slots: best weighted gain per slot first, then priority-weighted fair share.

    ``paced`` (the measured jobs report their remaining work): those with
    work left take slots by priority, then by the longest time to go, each
    the fewest slots that bring its end nearer although its split changes
    (``switch_s`` without training), while any can use them.
    """
    given = False
    while paced and free > 0:
        best = None
        for n, m in members.items():
            if not m.paced:
                continue
            k = next((k for k in range(1, min(free, m.hi - target[n]) + 1)
                      if m.time_to_go(target[n] + k, switch_s=switch_s) < m.time_to_go(target[n])), None)
            if k is not None and (best is None or m.need(target[n]) > best[2]):
                best = (n, k, m.need(target[n]))
        if best is None:
            break
        target[best[0]] += best[1]
        free -= best[1]
        given = True
    while not paced and free > 0:
        best, best_per = None, 0.0
        for n, m in members.items():
            if not m.measured:
                continue
            room = min(free, m.hi - target[n])
            for k in _steps(room):
                per = m.gain(target[n], k) / k
                if per > best_per * (1 + 1e-9):
                    best, best_per = (n, k), per
        if best is None:
            break
        target[best[0]] += best[1]
        free -= best[1]
        given = True
    while free > 0:
        # a job with no share starts only with its smallest runnable split; a paced job took what pays above
        # (more would only restart its learner for nothing)
        open_ = [n for n, m in members.items() if target[n] < m.hi and (target[n] or free >= _runnable(m.job))
                 and not (paced and m.paced)]
        if not open_:
            break
        open_members = [members[x] for x in open_]
        n = min(open_, key=lambda x: (target[x] / members[x].fair_weight(open_members), x))
        k = 1 if target[n] else _runnable(members[n].job)
        target[n] += k
        free -= k
        given = True
    return given


def _steps(room: int) -> list[int]:
    """Slot counts a move tries: 1, 2, 3, then doubling up to ``room`` (and ``room`` itself)."""
    out, k = [], 1
    while k <= room:
        out.append(k)
        k = k + 1 if k < 4 else k * 2
    if room > 0 and room not in out:
        out.append(room)
    return out


def _rebalance(members: dict[str, _Member], target: dict[str, int], inv: Inventory,
               cfg: PlanConfig) -> tuple[tuple[str, str, int], float, float] | None:
    """The best single move of k slots between two settled jobs that pays for itself, or None.

    Net over the horizon: (receiver's gain - donor's loss) x horizon, minus
    the receiver's gain forgone while the slots switch and the donor's
    in-flight rollouts thrown away (half done on average, as within a job).
    """
    settled = [n for n, m in members.items() if m.settled(cfg)]
    total = sum(members[n].value(target[n]) for n in settled)
    best = None
    for d in settled:
        md = members[d]
        for r in settled:
            mr = members[r]
            if r == d:
                continue
            for k in _steps(min(target[d] - md.lo, mr.hi - target[r])):
                up = mr.gain(target[r], k)
                delta = up - (md.value(target[d]) - md.value(target[d] - k))
                if delta <= cfg.min_gain_frac * total:
                    continue
                lost = md.job.priority * md.inflight_lost(k) / md.demand
                # both splits change: their learners restart, and neither job trains while the slots switch
                cost = (mr.value(target[r] + k) + md.value(target[d] - k)) * inv.switch_cost_s + lost
                net = delta * cfg.horizon_s - cost
                if net > 0 and (best is None or net > best[1] - best[2]):
                    best = ((d, r, k), delta * cfg.horizon_s, cost)
    return best


def _rebalance_paced(members: dict[str, _Member], target: dict[str, int], inv: Inventory,
                     cfg: PlanConfig) -> tuple[tuple[str, str, int], float, float] | None:
    """The best single move of k slots between two settled paced jobs that brings a finish nearer, or None.

    A receiver of higher priority than its donor takes slots (down to the
    donor's minimum) when its own time to go shrinks by more than
    ``min_gain_frac`` of it; between jobs of one priority, a move to the one
    due to finish later pays when the later of their two finishes comes
    nearer by as much. ``reverse_gain_frac`` replaces ``min_gain_frac`` when
    the move turns back either job's last change of share. Both jobs train
    nothing for ``switch_cost_s`` (their splits change, their learners
    restart), and the donor redoes its in-flight rollouts thrown away (half
    done on average). Returned gain and cost are in seconds: what the move
    brings the finish it is judged by nearer before the switch, and what the
    switch takes back.
    """
    settled = [n for n, m in members.items() if m.settled(cfg)]
    best = None
    for d in settled:
        md = members[d]
        for r in settled:
            mr = members[r]
            before = mr.time_to_go(target[r])
            pre_empts = mr.job.priority > md.job.priority
            if r == d or mr.job.priority < md.job.priority or (not pre_empts and before <= md.time_to_go(target[d])):
                continue
            for k in _steps(min(target[d] - md.lo, mr.hi - target[r])):
                lost = md.inflight_lost(k)
                free_run = mr.time_to_go(target[r] + k)
                after = mr.time_to_go(target[r] + k, switch_s=inv.switch_cost_s)
                if not pre_empts:
                    free_run = max(free_run, md.time_to_go(target[d] - k))
                    after = max(after, md.time_to_go(target[d] - k, lost=lost, switch_s=inv.switch_cost_s))
                frac = max(cfg.pool_gain_frac, cfg.reverse_gain_frac if _undoes(md, mr) else cfg.min_gain_frac)
                if before - after > frac * before and (best is None or before - after > best[1] - best[2]):
                    best = ((d, r, k), before - free_run, after - free_run)
    return best


def _undoes(donor: _Member, receiver: _Member) -> bool:
    """Whether slots moving from ``donor`` to ``receiver`` turn back the last change of either one's share."""
    def last_change(m: _Member) -> int:
        before = m.m.changed_from
        return 0 if before is None else m.m.allocation.total - before.total
    return last_change(donor) > 0 or last_change(receiver) < 0


def _split(m: _Member, share: int, inv: Inventory, cfg: PlanConfig) -> Decision:
    """The job's split of ``share`` slots: its own plan when the share is what it holds, else a resize."""
    cur = m.m.allocation if m.m is not None else Allocation(0, 0, 0)
    if share == cur.total and share > 0 and m.m is not None:
        return _plan_job(m.m, replace(inv, gpus=share), m.job, cfg)
    if share == 0:
        return _keep(cur, "no_share", ()) if cur.total == 0 else Decision(
            Allocation(0, 0, 0), True, "share_withdrawn", current_rate=0.0, predicted_rate=0.0, best_rate=0.0,
            bottleneck="", expected_gain=0.0, transition_cost=0.0, moved=0)
    if m.paced:
        alloc = m.split_for(share, inv.switch_cost_s)
    else:
        alloc = _best_split(m, share) if m.measured else _resized(m.job, cur, share)
    rate = m.rate(share) if m.measured else 0.0
    reason = "share_grown" if share > cur.total else "share_shrunk"
    return Decision(alloc, alloc != cur, reason, current_rate=m.rate(cur.total) if m.measured else 0.0,
                    predicted_rate=rate, best_rate=rate, bottleneck="", expected_gain=0.0, transition_cost=0.0,
                    moved=cur.moved(alloc))


def _best_split(m: _Member, share: int) -> Allocation:
    """The split of ``share`` slots at the model's best rate; slots left over go to the scarcest stage."""
    model = replace(m.model, gpus=share)
    need = model.needs(model.max_rate()) or {r: m.job.bound(r).min for r in ROLES}
    out = dict(need)
    for _ in range(share - sum(out.values())):
        caps = model.caps(Allocation(**out))
        open_ = [r for r in ROLES if out[r] < m.job.bound(r).max and (r != "reward" or m.job.reward_on_gpu)]
        if not open_:
            break
        out[min(open_, key=lambda r: caps[r])] += 1
    return Allocation(**out)


def _resized(job: JobSpec, cur: Allocation, share: int) -> Allocation:
    """Without a model: from the current split (or the smallest one), grow rollout first, shrink the largest role."""
    out = cur.as_dict() if cur.total else {r: job.bound(r).min for r in ROLES}
    order = ["rollout", "learner"] + (["reward"] if job.reward_on_gpu else [])
    while sum(out.values()) < share:
        room = [r for r in order if out[r] < job.bound(r).max]
        if not room:
            break
        out[room[0]] += 1
    while sum(out.values()) > share:
        spare = [r for r in order if out[r] > job.bound(r).min]
        if not spare:
            break
        out[max(spare, key=lambda r: (out[r], r == "rollout"))] -= 1
    return Allocation(**out)


def explain(decision: Decision) -> str:
    """One line for logs and the benchmark timeline."""
    a = decision.allocation
    return (f"{decision.reason}: rollout={a.rollout} reward={a.reward} learner={a.learner} "
            f"rate {decision.current_rate:.2f}->{decision.predicted_rate:.2f}/s "
            f"gain {decision.expected_gain:.0f} cost {decision.transition_cost:.0f} traj"
            + (f" signals={','.join(decision.signals)}" if decision.signals else ""))


__all__ = ["AdmissionError", "Allocation", "Decision", "Inventory", "JobSpec", "Metrics", "PlanConfig",
           "PoolDecision", "RoleBounds", "admit", "explain", "max_share", "min_share", "plan", "plan_pool"]
