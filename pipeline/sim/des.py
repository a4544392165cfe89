"""Discrete-event simulator of the RL pipeline on a workload's cost model (the ``des`` engine).

Called by ``pipeline.sim.bench_allocator.run_bench`` (``libra-ctl bench policy``), in
the CLI process, once per asynchronous mode and once per split static-best tries.
Time is virtual; a run is deterministic for a seed. What it models (see
``docs/workloads.md`` for the definitions):

- rollout GPUs with ``concurrency`` decode slots (continuous batching); a
  trajectory holds its slot for decode time plus its tool waits; its prefill is
  exclusive GPU time (every slot of that GPU stalls), and so is a weight load;
- reward workers (a CPU pool, or GPUs taken from the pool), FIFO, one
  trajectory at a time each, scoring trajectories as they arrive;
- a learner that trains whole GRPO groups, batch by batch, at
  ``train_tokens_per_s * n**scaling_exponent`` on n GPUs, then publishes:
  every step, or in libra mode at the cadence ``allocator.plan_publish``
  chooses (a step without a version costs no publish and no weight loads);
- staleness: admission control lets trajectory i start only while it would be
  trained within ``max_staleness`` versions of the current one, and no new
  trajectory while a learner batch of scored groups waits (the feeder's
  ``streams.backlog_batches``); groups that are staler all the same (they
  finished late) are dropped and counted; the learner takes the queued groups
  in the order they became ready, save that, as the learner reads ahead
  (``learner.last_chance_first``, ``pipeline.dataplane.lookahead``), a group
  this step is the last to take goes first;
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

The state of each stage lives in ``pipeline.sim.stages`` and what libra's
controller would measure in ``pipeline.sim.meter``; this module holds the
clock, the events and the moves between stages.

Modes: ``sync`` and ``ideal`` need no engine (``pipeline.sim.sync``,
``pipeline.sim.fluid``); ``static``, ``static-best`` and ``libra`` run this
one (``simulate_async``), libra calling ``allocator.plan`` every control
interval with metrics measured inside the simulation.

A multi-job workload runs one ``AsyncSim`` per job on one clock
(``pipeline.sim.pool``): each sees the whole pool, with the GPUs it does not
hold away; the pool steps them (``next_time``, ``advance_to``,
``handle_due_events``, ``settle``), measures them (``measure``), carries out
their new splits (``roles.moves``, ``leave``) and moves GPUs between them
(``hand_off``, ``join``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np

from pipeline.config import ControlConfig, LearnerConfig, StreamsConfig
from pipeline.control import allocator
from pipeline.control.allocator import Allocation
from pipeline.control.job import plan_config
from pipeline.dataplane.cadence import publishes
from pipeline.dataplane.lookahead import limit_groups
from pipeline.sim.meter import Gauges, Meter, StepSample
from pipeline.sim.result import ModeResult, Progress, hist_quantile
from pipeline.sim.roles import AWAY, LEARNER, ROLLOUT, SWITCHING, Roles
from pipeline.sim.stages import Admission, Groups, Grow, RewardPool, RolloutSlots
from pipeline.sim.workload import Workload

# How libra is driven inside the simulation: the controller's settings (the one ControlConfig) with a
# 30 s tick and a window of five ticks.
LIBRA_CONTROL = ControlConfig(interval_s=30.0, window_s=150.0)


def window_ticks(control: ControlConfig) -> int:
    """The metrics window in control ticks."""
    return max(1, round(control.window_s / control.interval_s))


def simulate_async(wl: Workload, alloc: Allocation, seed: int, control: ControlConfig | None = None,
                   dt: float | None = None, progress: Progress | None = None) -> ModeResult:
    """Run the asynchronous pipeline from ``alloc``; libra when ``control`` is given."""
    return AsyncSim(wl, alloc, seed, control, dt, progress).run()


def _default_dt(wl: Workload) -> float:
    """Window length: a small share of the shortest mean slot time, within [0.05, 2] s."""
    ro = wl.rollout
    slot = min(ph.response_tokens.mean() / ro.decode_tokens_per_s + ph.tool_calls.mean_wait_s()
               for ph in wl.job.phases)
    return float(min(2.0, max(0.05, slot / 30)))


def job_spec(wl: Workload, control: ControlConfig = LIBRA_CONTROL) -> allocator.JobSpec:
    """The job as libra's policy sees it: reward GPUs only when reward runs on GPUs; a learner that publishes
    every step, which the controller may stretch to ``control.publish_every_max``."""
    job = wl.job
    rb = allocator.RoleBounds(1, wl.cluster.gpus) if wl.reward.gpu else allocator.RoleBounds(0, 0)
    return allocator.JobSpec(name=wl.name, batch_size=job.batch_size, max_staleness=job.max_staleness,
                             reward_on_gpu=wl.reward.gpu, learner_scaling_exponent=wl.learner.scaling_exponent,
                             publish_every_max=control.publish_every_max, bounds={"reward": rb})


class AsyncSim:
    """Disaggregated asynchronous pipeline with a fixed split or with libra's policy.

    Built and run by ``simulate_async``; one instance per mode run.
    """

    def __init__(self, wl: Workload, alloc: Allocation, seed: int, control: ControlConfig | None = None,
                 dt: float | None = None, progress: Progress | None = None, held: np.ndarray | None = None):
        self.wl, self.job = wl, wl.job
        self.G, self.C = wl.cluster.gpus, wl.rollout.concurrency
        self.B, self.gs, self.m = self.job.batch_size, self.job.group_size, self.job.max_staleness
        self.rng = np.random.default_rng(seed)
        self.control, self.progress = control, progress
        self.dt = dt if dt is not None else _default_dt(wl)
        self.t = 0.0
        self.events: list[tuple[float, int, str, tuple]] = []   # a heap of (time, sequence, kind, payload)
        self._seq = 0
        self.roles = Roles(alloc, self.G, held)
        # called as hand_off(t, gpu) when a GPU has left the job (set by a pool; a lone job never gives one up)
        self.hand_off: Callable[[float, int], None] | None = None
        self.slots = RolloutSlots(self.roles.code == ROLLOUT, self.C)
        self._init_queues()
        self._init_learner()
        self._init_stats()

    # -- state ------------------------------------------------------------------

    def _init_queues(self) -> None:
        n = (self.job.steps + self.m + 2) * self.B
        self.tok = Grow(n, np.float64, 0.0)        # per trajectory id: prompt + response tokens
        self.tver = Grow(n, np.int32, 0)           # per trajectory id: policy version it started with
        self.admission = Admission((self.m + 1) * self.B)
        backlog = StreamsConfig().backlog_batches
        self.hold_backlog = backlog * self.B
        # groups the learner holds in hand, read ahead of its batch (0: it takes them in ready order)
        self.lookahead = limit_groups(self.B, self.gs, backlog, self.m, LearnerConfig().last_chance_first)
        self.groups = Groups(n // self.gs, self.gs)
        self.reward = RewardPool(self.wl.reward.seconds, self.roles.reward_workers(self.wl.reward))

    def _init_learner(self) -> None:
        self.V = 0                   # latest published policy version
        self.k = 0                   # learner steps started
        self.steps_done = 0
        self.learner_busy = False
        self.free_at = 0.0           # when the learner last became free
        self.restart_due = False     # its size changes: it restarts once the step in hand ends
        self.back_at = 0.0           # ... and starts no step before this time (its restart ends)
        self.wait_total = 0.0
        self.publish_every = 1       # learner steps per published version (libra may stretch it: plan_publish)
        self.publishing = False      # the step in hand ends with a published version
        self.cadence_t = 0.0         # ... since this time
        self.cadence_reason = ""     # ... and why

    def _init_stats(self) -> None:
        self.busy = 0.0                                   # GPU-seconds of stage work
        self.stale_hist = np.zeros(self.m + 1, dtype=np.int64)
        self.dropped = 0
        self.timeline: list[dict] = []
        self.decisions: list[dict] = []
        self.meter = Meter(self.wl, self.C)
        self.last_step_end = 0.0

    # -- main loop --------------------------------------------------------------

    def run(self) -> ModeResult:
        self._fill_idle()
        if self.control:
            self._push(self.control.interval_s, "control", ())
        while not self.done:
            self.advance_to(self.next_time())
            self.handle_due_events()
            self.settle()
        return self.result()

    @property
    def done(self) -> bool:
        return self.steps_done >= self.job.steps

    def next_time(self) -> float:
        """Where the next window ends: ``dt`` on, or the next event when that comes first."""
        t_ev = self.events[0][0] if self.events else math.inf
        return min(self.t + self.dt, t_ev)

    def advance_to(self, t1: float) -> None:
        """Move the clock on to t1 (at most ``next_time()``), running every rollout GPU."""
        if t1 > self.t:
            self._advance(self.t, t1)
            self.t = t1

    def settle(self) -> None:
        """After the events at the current time: start a learner step if a batch is ready, fill idle slots."""
        self._try_start_step()
        self._fill_idle()
        if self.t > 1e9:
            raise RuntimeError("simulation made no progress (no rollout or learner capacity?)")

    def handle_due_events(self) -> None:
        while self.events and self.events[0][0] <= self.t:
            t_e, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"_on_{kind}")(t_e, *payload)

    def _push(self, t: float, kind: str, payload: tuple) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    # -- rollout ----------------------------------------------------------------

    def _advance(self, t0: float, t1: float) -> None:
        """Run every rollout GPU from t0 to t1: pay owed pauses, then progress; handle finished slots."""
        w = t1 - t0
        pay, old = self.slots.progress(w)
        self.meter.rollout_gpu_s += w * self.roles.target.rollout
        self.meter.idle_slot_s += w * self.slots.n_idle
        self._complete_finished(t0, pay, old)

    def _complete_finished(self, t0: float, pay: np.ndarray, old: np.ndarray) -> None:
        """Hand every trajectory finished in the window on to reward, refilling its slot (maybe repeatedly)."""
        fin = self.slots.finished()
        done_ids, done_t = [], []
        while fin.size:
            fin, g, tc = self.slots.in_finishing_order(fin, t0, pay, old)
            done_ids.append(self.slots.traj[fin])
            done_t.append(tc)
            self.meter.add_rollout(self.slots.cost[fin], self.tok.a[self.slots.traj[fin]])
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
        k = min(len(fin), self._startable())
        self.slots.set_idle(fin[k:])
        if k == 0:
            return fin[:0]
        fin, g = fin[:k], g[:k]
        self._start(fin, g, self.slots.end[fin])
        return self.slots.ending_by_now(fin, g)

    def _fill_idle(self) -> None:
        """Start queued trajectories on idle rollout slots (after a publish, a drop or a GPU joining)."""
        startable = self._startable()
        if self.slots.n_idle == 0 or startable == 0:
            return
        idle = self.slots.take_idle(startable)
        g = idle % self.G
        self._start(idle, g, self.slots.prog[g])

    def _startable(self) -> int:
        """Trajectories that may start now: admitted ones, none new while the learner is a batch behind.

        As the feeder holds prompts (``workers.feeder.learner_behind``): while
        ``streams.backlog_batches`` batches of scored groups wait for the
        learner, only handed-back trajectories restart.
        """
        if self.hold_backlog and self.groups.backlog() >= self.hold_backlog:
            return min(self.admission.available(), self.admission.n_requeue)
        return self.admission.available()

    def _start(self, slots: np.ndarray, g: np.ndarray, at_prog: np.ndarray) -> None:
        """Sample and start trajectories on ``slots`` (of GPUs ``g``) at progress times ``at_prog``."""
        ids = self.admission.take(len(slots))
        ph = self.job.phase_at(self.V)
        ro = self.wl.rollout
        resp = ph.response_tokens.sample(self.rng, len(ids))
        slot_s = resp / ro.decode_tokens_per_s + ph.tool_calls.sample_wait_s(self.rng, len(ids))
        prefill = ph.prompt_tokens / ro.prefill_tokens_per_s
        top = int(ids.max()) + 1
        self.tok.ensure(top)[ids] = ph.prompt_tokens + resp
        self.tver.ensure(top)[ids] = self.V
        self.slots.assign(slots, g, ids, at_prog, slot_s, prefill)
        self.busy += len(ids) * prefill + slot_s.sum() / self.C

    def _finished(self, ids: np.ndarray, arrive: np.ndarray) -> None:
        """Trajectories leave rollout at ``arrive`` (ascending): score them, complete their groups."""
        scored = self.reward.score(arrive)
        if self.wl.reward.gpu:
            self.busy += len(arrive) * self.wl.reward.seconds
        self.groups.add(ids, scored, self.tver.a[ids])

    # -- learner ------------------------------------------------------------------

    def _try_start_step(self) -> None:
        """Start step k once B fresh trajectories are scored; drop staler groups on the way."""
        if self.learner_busy or self.k >= self.job.steps or self.t < self.back_at:
            return
        need = self.B // self.gs
        if self.lookahead:
            self._last_chances_first()
        gids = self.groups.queued()
        if not gids.size:
            return
        fresh = (self.k - self.groups.version.a[gids]) <= self.m
        cum = np.cumsum(fresh)
        if cum[-1] < need:
            self._drop_leading_stale(gids, fresh)
            return
        last = int(np.searchsorted(cum, need))
        take, dropped = gids[:last + 1][fresh[:last + 1]], gids[:last + 1][~fresh[:last + 1]]
        ready = self.groups.ready_times(last + 1)[fresh[:last + 1]]
        by_ready = np.argsort(ready, kind="stable")     # the learner trained them as they became ready
        take, ready = take[by_ready], ready[by_ready]
        self.groups.pop(last + 1)
        self._drop(dropped)
        self._train(take, ready)

    def _last_chances_first(self) -> None:
        """Order the groups in hand (the first ``lookahead`` queued) as the learner consumes them
        (``lookahead.InHand.order``): the stale ones, then those step k is the last to take, then the rest,
        each in ready order."""
        g = self.groups
        hand = min(self.lookahead, (self.job.steps - self.k) * (self.B // self.gs))   # never past the run's end
        seg = slice(g.head, min(g.tail, g.head + hand))
        age = self.k - g.version.a[g.queue_gid.a[seg]]
        order = np.argsort(np.where(age > self.m, 0, np.where(age == self.m, 1, 2)), kind="stable")
        g.queue_gid.a[seg] = g.queue_gid.a[seg][order]
        g.queue_t.a[seg] = g.queue_t.a[seg][order]

    def _drop_leading_stale(self, gids: np.ndarray, fresh: np.ndarray) -> None:
        """Stale groups at the head will never be trained: drop them now so admission reopens."""
        n = int(np.argmax(fresh)) if fresh.any() else len(fresh)
        if n:
            self._drop(gids[:n])
            self.groups.pop(n)

    def _drop(self, gids: np.ndarray) -> None:
        if gids.size:
            n = gids.size * self.gs
            self.dropped += n
            self.meter.dropped += n
            self.admission.open(n)    # dropped trajectories do not count against the staleness window

    def _train(self, groups: np.ndarray, ready: np.ndarray) -> None:
        """Step k on ``groups`` (scored at ``ready``, ascending), trained as they arrive, then published.

        As the learner prefetches (``workers.update.Prefetch``): from the
        moment it is free it accumulates each group's gradient once the group
        is scored, and steps the optimizer when the batch is whole. The step
        ends at the later of its start plus the whole batch's training and,
        for every group, its ready time plus the training of the groups from
        it on; the learner waits only for groups not yet there.
        """
        le = self.wl.learner
        ids = groups[:, None] * self.gs + np.arange(self.gs)      # (groups, group_size) trajectory ids
        per_group = self.tok.a[ids].sum(axis=1)
        tokens = float(per_group.sum())
        rate = le.train_tokens_per_s * self.roles.n_learner ** le.scaling_exponent
        train = tokens / rate
        idle_from = max(self.free_at, self.back_at)      # a restart is down time, not a wait for data
        from_here = np.cumsum(per_group[::-1])[::-1] / rate   # training of group i and the ones after it
        start = max(idle_from, float((ready + from_here).max()) - train)   # the step's idle time comes first
        stale = self.k - self.groups.version.a[groups]
        self.stale_hist += np.bincount(stale, minlength=self.m + 1)[:self.m + 1] * self.gs
        # whether this step ends with a version, decided once: a cadence changed meanwhile counts from the next
        self.publishing = publishes(self.k + 1, self.V, self.publish_every, self.job.steps)
        publish = le.weight_publish_s if self.publishing else 0.0
        self.meter.steps.append(StepSample(train, publish, self.B, self.roles.n_learner, tokens, stale))
        if start > idle_from:
            self.meter.add_wait(idle_from, start)
            self.wait_total += start - idle_from
        self.k += 1
        self.busy += self.roles.n_learner * (train + publish)
        self.learner_busy = True
        self._push(start + train + publish, "step_end", ())

    def _on_step_end(self, t: float) -> None:
        """Step k ends: version k is published when the cadence says (rollout GPUs load it, a pause);
        admission moves on one batch either way."""
        self.steps_done += 1
        self.learner_busy = False
        self.free_at = t
        if self.restart_due:
            self._restart_learner(t)
        if self.publishing:
            self.V = self.steps_done
            sync = self.wl.rollout.weight_sync_s
            self.slots.owe_all(sync)
            self.meter.pause_gpu_s += sync * self.roles.target.rollout
            self.meter.loads += self.roles.target.rollout
        self.admission.open(self.B)
        for gpu, dest in self.roles.release_learners():
            self._begin_switch(gpu, dest, t)
        self._record_step(t)
        if self.progress:
            self.progress(self.steps_done, self.job.steps, t)

    def _record_step(self, t: float) -> None:
        self.timeline.append({"t": t, "step": self.steps_done, **self.roles.counts(),
                              "rate": self.B / max(t - self.last_step_end, 1e-9)})
        self.last_step_end = t

    # -- control (libra) -------------------------------------------------------------

    def _on_control(self, t: float) -> None:
        cc = self.control
        m = self.measure(t, window_ticks(cc))
        inv = allocator.Inventory(gpus=self.G, switch_cost_s=self.wl.cluster.switch_cost_s)
        spec = job_spec(self.wl, cc)
        d = allocator.plan(m, inv, [spec], plan_config(cc))
        if d.changed:
            self.decisions.append({"t": t, **d.event(m)})
            self._apply(d.allocation, t)
        self.adapt_publish(t, m, spec, cc, moving=d.changed)
        self._push(t + cc.interval_s, "control", ())

    def adapt_publish(self, t: float, m: allocator.Metrics, spec: allocator.JobSpec, cc: ControlConfig,
                      moving: bool) -> None:
        """The controller's publish cadence (``allocator.plan_publish``), as the live learner takes it.

        The learner reads the cadence at each step's end and counts it from its
        last published version (``pipeline.dataplane.cadence.publishes``).
        """
        d = allocator.plan_publish(m, spec, plan_config(cc), moving)
        if d.changed:
            self.decisions.append({"t": t, "publish": d.event()})
            self.publish_every, self.cadence_t, self.cadence_reason = d.publish_every, t, d.reason

    def measure(self, t: float, window: int) -> allocator.Metrics:
        """End the meter's tick at t and read the policy's inputs over the last ``window`` ticks."""
        self.meter.close_tick(t, self.groups.backlog())
        return self.meter.metrics(t, window, self._gauges(t))

    def _gauges(self, t: float) -> Gauges:
        r = self.roles
        return Gauges(allocation=r.target, changed_from=r.changed_from,
                      since_change_s=t - r.last_change_t, inflight=self.slots.inflight(),
                      queue=self._startable(), learner_gpus=r.n_learner,
                      learner_idle_since=None if self.learner_busy else self.free_at,
                      remaining=max(0, self.job.steps - self.steps_done) * self.job.batch_size,
                      publish_every=self.publish_every, publish_since_s=t - self.cadence_t,
                      publish_reason=self.cadence_reason,
                      learner_steps=self.steps_done)

    def _apply(self, new: Allocation, t: float) -> None:
        """Move GPUs from roles above their new count to roles below it."""
        for gpu, src, dest in self.roles.moves(new, self.slots).internal:
            self.leave(gpu, src, dest, t)
        self.order(new, t)

    def order(self, new: Allocation, t: float) -> None:
        """``new`` is ordered from t on (its moves under way): a learner of another size restarts.

        As on the control plane, where the learner is one process over all its
        slots: it commits the step in hand and exits, and the agent starts it
        again on its new slots; it trains nothing for ``switch_cost_s`` (a sim
        learner sleeps that out from its start, ``pipeline.sim.worker``).
        """
        if new.learner != self.roles.target.learner:
            if self.learner_busy:
                self.restart_due = True
            else:
                self._restart_learner(t)
        self.roles.ordered(new, t)

    def _restart_learner(self, t: float) -> None:
        self.restart_due = False
        self.back_at = t + self.wl.cluster.switch_cost_s
        self._push(self.back_at, "learner_back", ())

    def _on_learner_back(self, t: float) -> None:
        """The restart is over; ``settle`` starts a step if a batch is ready."""

    def leave(self, gpu: int, src: str, dest: int, t: float) -> None:
        """GPU ``gpu`` leaves ``src`` (a role or a ``Moves`` source) for role ``dest``, or ``AWAY`` (the pool)."""
        if src == "switching":
            if dest == AWAY:
                self._begin_switch(gpu, AWAY, t)     # the switch under way is void: it leaves now
            else:
                self.roles.switch_dest[gpu] = dest
        elif src == "leaving":
            self.roles.retarget_leaving(gpu, dest)
        elif src == "rollout":
            self._abort_rollout(gpu)
            self._begin_switch(gpu, dest, t)
        elif src == "learner":
            if self.learner_busy:
                self.roles.learner_leaving.append((gpu, dest))    # it finishes the step first
            else:
                self.roles.n_learner -= 1
                self._begin_switch(gpu, dest, t)
        elif src == "reward":
            self._begin_switch(gpu, dest, t)
            self.reward.resize(t, self.roles.reward_workers(self.wl.reward))
        else:
            raise ValueError(f"GPU {gpu}: no move from {src!r} inside the job (an inbound GPU is the pool's)")

    def _abort_rollout(self, gpu: int) -> None:
        """Hand the GPU's in-flight trajectories back; the work done on them is lost."""
        ids, left = self.slots.clear(gpu)
        if ids.size:
            self.admission.hand_back(ids)
            self.busy -= left / self.C

    def _begin_switch(self, gpu: int, dest: int, t: float) -> None:
        """The GPU stops; it switches to role ``dest`` for ``switch_cost_s``, or leaves the job (``AWAY``)."""
        r = self.roles
        self.slots.stop(gpu)
        r.switch_id[gpu] += 1
        if dest == AWAY:
            # the pool charges the switch on the way to the GPU's next job
            r.code[gpu] = AWAY
            self.hand_off(t, gpu)
            return
        r.code[gpu], r.switch_dest[gpu] = SWITCHING, dest
        self._push(t + self.wl.cluster.switch_cost_s, "switch_done", (gpu, int(r.switch_id[gpu])))

    def _on_switch_done(self, t: float, gpu: int, switch: int) -> None:
        if switch == self.roles.switch_id[gpu]:      # else it was turned round or left the job meanwhile
            self.join(t, gpu, int(self.roles.switch_dest[gpu]))

    def join(self, t: float, gpu: int, dest: int) -> None:
        """GPU ``gpu`` starts working in role ``dest`` (a switch ended, or it arrived from the pool)."""
        self.roles.code[gpu] = dest
        if dest == ROLLOUT:
            self.slots.join(gpu)
        elif dest == LEARNER:
            self.roles.n_learner += 1   # takes part from the next step
        else:
            self.reward.resize(t, self.roles.reward_workers(self.wl.reward))

    # -- result ---------------------------------------------------------------------

    def result(self) -> ModeResult:
        """The run's figures once its last step has published; call once (it takes unfinished work off busy)."""
        T = self.free_at    # the last step's publish
        self.busy -= self.slots.work_left() / self.C    # in-flight work never finished
        return ModeResult(
            trajectories_per_s=self.job.steps * self.B / T,
            gpu_busy_frac=self.busy / (self.G * T),
            learner_wait_frac=self.wait_total / T,
            staleness_p50=hist_quantile(self.stale_hist, 0.5),
            staleness_p99=hist_quantile(self.stale_hist, 0.99),
            dropped_stale=int(self.dropped),
            reconfigurations=self.roles.reconfigs,
            final_allocation=self.roles.target.as_dict(),
            sim_time_s=T, timeline=self.timeline, events=self.decisions)
