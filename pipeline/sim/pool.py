"""Several training jobs sharing one GPU pool in the des engine (a workload with ``[[jobs]]``).

Called by ``pipeline.sim.bench_pool`` (``libra-ctl bench policy`` on a
multi-job workload), in the CLI process, once per mode. Each job runs in its
own ``des.AsyncSim``, the same machinery as a lone job, on a view of the
workload that holds only that job (``job_workload``); every engine sees the
whole pool, and the GPUs a job does not hold are ``AWAY`` in its engine.
``PoolSim`` steps the engines in lockstep on one clock and owns what lies
between the jobs:

- the GPUs held by no job (``free``: left by a finished job, or by a job
  whose share shrank with no job to take them yet);
- GPUs on their way from one job to another (``bound_for``): a GPU leaves its
  job as a role change does (a rollout GPU hands its in-flight trajectories
  back at once, a learner GPU leaves at its step's end), yields nothing for
  ``switch_cost_s``, then joins its new job in the role it was ordered for;
- in libra mode, the control loop: every control interval (and at once when
  a job finishes, so its GPUs are reused) it reads each job's metrics from
  its own meter and calls ``allocator.plan({job: Metrics}, pool, jobs)``,
  then orders each job's new split (``_order``).

Without a control loop (``static``) the jobs keep the shares they start with
and the GPUs of a finished job stay idle.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from pipeline.config import ControlConfig
from pipeline.control import allocator
from pipeline.control.allocator import Allocation
from pipeline.control.job import plan_config
from pipeline.sim import des, fluid
from pipeline.sim.fluid import on_gpus
from pipeline.sim.result import ModeResult
from pipeline.sim.roles import AWAY, ROLE_CODE
from pipeline.sim.workload import Job, Workload


def job_workload(wl: Workload, job: Job) -> Workload:
    """The workload as one of its jobs sees it: the shared cluster and stages, that job alone."""
    return wl.view(job.name)


def pool_spec(view: Workload, control: ControlConfig | None = None) -> allocator.JobSpec:
    """The job as libra's policy sees it: ``des.job_spec`` plus its guarantee, cap and priority."""
    job = view.job
    return dataclasses.replace(des.job_spec(view, control or des.LIBRA_CONTROL), min_slots=job.min_gpus or 0,
                               max_slots=job.max_gpus or 0, priority=float(job.priority or 1))


def unmeasured(view: Workload) -> allocator.Metrics:
    """What the controller knows of a job that holds nothing yet: no rate measured."""
    return allocator.Metrics(
        window_s=0.0, allocation=Allocation(0, 0, 0), since_change_s=math.inf, changed_from=None,
        rollout_gpu_s_per_traj=0.0, rollout_pause_frac=0.0, rollout_inflight=0, rollout_queue=0,
        rollout_idle_frac=0.0, reward_s_per_traj=0.0, reward_cpu_workers=view.reward.cpu_workers,
        traj_tokens=0.0, learner_tokens_per_s=0.0, learner_gpus_measured=0, learner_publish_s=0.0,
        learner_wait_frac=0.0, backlog=0, backlog_trend_per_s=0.0, trained=0, staleness_p50=0.0,
        dropped_stale=0, remaining=view.job.steps * view.job.batch_size)


def job_views(wl: Workload) -> dict[str, Workload]:
    """Every job's one-job view, by job name, in the workload's order."""
    return {j.name: job_workload(wl, j) for j in wl.jobs}


def admit(wl: Workload) -> dict[str, allocator.JobSpec]:
    """The jobs' specs, once the pool is known to hold every job's minimum (else ``allocator.AdmissionError``)."""
    specs = {name: pool_spec(v) for name, v in job_views(wl).items()}
    allocator.admit(_inventory(wl), list(specs.values()))
    return specs


def _inventory(wl: Workload) -> allocator.Inventory:
    return allocator.Inventory(gpus=wl.cluster.gpus, switch_cost_s=wl.cluster.switch_cost_s)


def libra_shares(wl: Workload, control: ControlConfig) -> dict[str, int]:
    """libra's start: the shares the pool policy gives at time 0, every job unmeasured and holding nothing."""
    specs = admit(wl)
    metrics = {name: unmeasured(v) for name, v in job_views(wl).items()}
    d = allocator.plan(metrics, _inventory(wl), list(specs.values()), plan_config(control))
    return {name: d.shares.get(name, 0) for name in specs}


def start_split(view: Workload, share: int) -> Allocation:
    """A job's split of the share it starts with: its first phase's best split (as ``static`` for a lone job).

    Called by ``PoolSim`` and by the live engine's pool runs (``pipeline.sim.bench_pool``).
    """
    return fluid.static_split(on_gpus(view, share))


def static_shares(wl: Workload) -> dict[str, int]:
    """A fixed partition in proportion to each job's work W_j, within its [min, max] share."""
    specs = admit(wl)
    views, g = job_views(wl), wl.cluster.gpus
    return fluid.proportional_shares({j: fluid.job_work_gpu_s(v) for j, v in views.items()},
                                     {j: allocator.min_share(s) for j, s in specs.items()},
                                     {j: allocator.max_share(s, g) for j, s in specs.items()}, g)


@dataclass
class PoolResult:
    """One mode's outcome on a pool: each job's run, and what happened between the jobs."""

    gpus: int
    jobs: dict[str, ModeResult]          # per job, as a lone run reports it (its time ends at its last publish)
    trajectories: dict[str, int]         # per job, trained
    below_min_gpu_s: dict[str, float]    # per job: integral of max(0, min_gpus - GPUs ordered to it) while it ran
    busy_gpu_s: float                    # stage work of every job, GPU-seconds
    moved_between_jobs: int              # GPUs bound to another job (a finished job's too; one turned round again)
    shares: list[dict] = field(default_factory=list)      # {"t", "shares": {job: GPUs ordered}} at each change
    decisions: list[dict] = field(default_factory=list)   # the pool decisions that moved GPUs

    @property
    def makespan_s(self) -> float:
        return max(r.sim_time_s for r in self.jobs.values())

    @property
    def trajectories_per_s(self) -> float:
        """The pool's rate: every job's trajectories over the time the last job finished."""
        return sum(self.trajectories.values()) / self.makespan_s

    @property
    def gpu_busy_frac(self) -> float:
        return self.busy_gpu_s / (self.gpus * self.makespan_s)


class PoolSim:
    """The jobs of one workload on one pool, one ``AsyncSim`` each, on one clock.

    ``shares`` gives each job's GPUs at time 0 (a job's split of them is its
    first phase's best split, as ``static`` picks for a lone job); with
    ``control`` libra's pool policy moves GPUs from then on.
    """

    def __init__(self, wl: Workload, shares: dict[str, int], seeds: dict[str, int],
                 control: ControlConfig | None = None):
        self.G, self.switch_s = wl.cluster.gpus, wl.cluster.switch_cost_s
        self.control = control
        self.views = job_views(wl)
        self.specs = {name: pool_spec(v, control) for name, v in self.views.items()}
        self.sims = self._start_jobs(shares, seeds)
        self.active = list(self.sims)
        self.free: set[int] = set(range(sum(shares.values()), self.G))
        self.bound_for: dict[int, tuple[str, int] | None] = {}   # GPUs between jobs: (job, role code), None: free
        self.t = 0.0
        self.events: list[tuple[float, int, str, tuple]] = []     # a heap of (time, sequence, kind, payload)
        self._seq = 0
        self.results: dict[str, ModeResult] = {}
        self.below = {name: 0.0 for name in self.sims}
        self._held = {name: (0.0, shares[name]) for name in self.sims}   # since when a job has had how many
        self.moved = 0
        self.shares = [{"t": 0.0, "shares": dict(shares)}]
        self.decisions: list[dict] = []

    def _start_jobs(self, shares: dict[str, int], seeds: dict[str, int]) -> dict[str, des.AsyncSim]:
        """One engine per job, holding the next ``shares[job]`` GPUs of the pool at its first phase's best split."""
        if sum(shares.values()) > self.G:
            raise ValueError(f"shares {shares} hold more than the pool's {self.G} GPUs")
        sims, start = {}, 0
        for name, view in self.views.items():
            n = shares[name]
            if n < allocator.min_share(dataclasses.replace(self.specs[name], min_slots=0)):
                raise ValueError(f"job {name!r} starts with {n} GPUs: too few for one GPU per stage")
            split = start_split(view, n)
            sims[name] = des.AsyncSim(view, split, seeds[name], held=np.arange(start, start + n))
            sims[name].hand_off = self._hand_off
            start += n
        return sims

    # -- clock ----------------------------------------------------------------------

    def run(self) -> PoolResult:
        for sim in self.sims.values():
            sim.settle()
        if self.control:
            self._push(self.control.interval_s, "tick", ())
        while self.active:
            t1 = min([self.sims[j].next_time() for j in self.active] + [self.events[0][0] if self.events else math.inf])
            for j in self.active:
                self.sims[j].advance_to(t1)
            self.t = t1
            for j in self.active:
                self.sims[j].handle_due_events()
            self._handle_due_events()
            for j in self.active:
                self.sims[j].settle()
            self._retire_finished()
        return self._result()

    def _push(self, t: float, kind: str, payload: tuple) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    def _handle_due_events(self) -> None:
        while self.events and self.events[0][0] <= self.t:
            t_e, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"_on_{kind}")(t_e, *payload)

    # -- GPUs between jobs -------------------------------------------------------------

    def _hand_off(self, t: float, gpu: int) -> None:
        """A GPU has left its job: it switches on to the job it is bound for, or stays free."""
        if self.bound_for.get(gpu) is None:
            self.bound_for.pop(gpu, None)
            self.free.add(gpu)
        else:
            self._push(t + self.switch_s, "arrive", (gpu,))

    def _on_arrive(self, t: float, gpu: int) -> None:
        """The switch is over: the GPU works for its new job (free if it was turned away meanwhile)."""
        dest = self.bound_for.pop(gpu, None)
        if dest is None or dest[0] not in self.active:
            self.free.add(gpu)
            return
        job, role = dest
        del self.sims[job].roles.inbound[gpu]
        self.sims[job].join(t, gpu, role)

    def _release(self, job: str, gpu: int, src: str, t: float) -> None:
        """GPU ``gpu`` leaves ``job`` for no job yet (``_fill`` may bind it to one)."""
        if src == "inbound":
            del self.sims[job].roles.inbound[gpu]      # still on its way: it goes on, unbound
            self.bound_for[gpu] = None
        else:
            self.bound_for[gpu] = None
            self.sims[job].leave(gpu, src, AWAY, t)    # hands it off now, or a learner GPU at its step's end

    def _fill(self, need: list[tuple[str, int]], t: float) -> None:
        """Bind a GPU to each (job, role) in ``need``: free ones first, then ones still leaving their job."""
        leaving = sorted(g for g, dest in self.bound_for.items() if dest is None)
        pool = sorted(self.free) + leaving
        if len(need) > len(pool):
            raise RuntimeError(f"{len(need)} GPUs ordered from the pool, which has {len(pool)}: shares exceed it")
        for (job, role), gpu in zip(need, pool):
            if gpu in self.free:
                self.free.remove(gpu)
                self._push(t + self.switch_s, "arrive", (gpu,))
            self.bound_for[gpu] = (job, role)
            self.sims[job].roles.inbound[gpu] = role
            self.moved += 1

    # -- control (libra) -----------------------------------------------------------------

    def _on_tick(self, t: float) -> None:
        self._control(t)
        if self.active:
            self._push(t + self.control.interval_s, "tick", ())

    def _on_job_done(self, t: float) -> None:
        self._control(t)

    def _control(self, t: float) -> None:
        """Measure every running job, ask the pool policy, order the jobs whose split changes."""
        if not self.active:
            return
        for j in self.active:
            held, ordered = self.sims[j].roles.committed(), self.sims[j].roles.target
            if held != ordered:
                raise RuntimeError(f"job {j}: GPUs bound {held.as_dict()} differ from those ordered "
                                   f"{ordered.as_dict()}: the pool's books disagree")
        window = des.window_ticks(self.control)
        metrics = {j: self.sims[j].measure(t, window) for j in self.active}
        inv = allocator.Inventory(gpus=self.G, switch_cost_s=self.switch_s)
        d = allocator.plan(metrics, inv, [self.specs[j] for j in self.active], plan_config(self.control))
        new = {j: d.decisions[j].allocation for j in self.active
               if d.decisions[j].allocation != self.sims[j].roles.target}
        if new:
            self.decisions.append({"t": t, **d.event(metrics)})
            self._order(new, t)
        for j in self.active:
            self.sims[j].adapt_publish(t, metrics[j], self.specs[j], self.control, moving=j in new)

    def _order(self, new: dict[str, Allocation], t: float) -> None:
        """Each job in ``new`` moves to its new split: GPUs change role, leave the job, or come from the pool."""
        need: list[tuple[str, int]] = []
        for job, alloc in new.items():
            sim = self.sims[job]
            moves = sim.roles.moves(alloc, sim.slots)
            for gpu, src, dest in moves.internal:
                if src == "inbound":                  # not here yet: it comes for the other role
                    sim.roles.inbound[gpu] = dest
                    self.bound_for[gpu] = (job, dest)
                else:
                    sim.leave(gpu, src, dest, t)
            for gpu, src in moves.outgoing:
                self._release(job, gpu, src, t)
            need += [(job, ROLE_CODE[r]) for r in moves.incoming]
            self._account(job, t, alloc.total)
            sim.order(alloc, t)
        self._fill(need, t)
        self.shares.append({"t": t, "shares": {j: self.sims[j].roles.target.total for j in self.active}})

    def _account(self, job: str, t: float, total: int) -> None:
        """Add the GPU-seconds below its minimum since the last change; ``job`` holds ``total`` from t."""
        since, held = self._held[job]
        self.below[job] += (t - since) * max(0, (self.views[job].job.min_gpus or 0) - held)
        self._held[job] = (t, total)

    # -- jobs that finish ------------------------------------------------------------------

    def _retire_finished(self) -> None:
        """A job whose last step has published frees its GPUs; libra reuses them at once."""
        done = [j for j in self.active if self.sims[j].done]
        for job in done:
            sim = self.sims[job]
            self.active.remove(job)
            self.results[job] = sim.result()
            self._account(job, sim.free_at, 0)
            for gpu in np.flatnonzero(sim.roles.code != AWAY):
                self.free.add(int(gpu))
                sim.roles.code[gpu] = AWAY
            for gpu in sim.roles.inbound:
                self.bound_for[gpu] = None
            sim.roles.inbound.clear()
        if done:
            self.shares.append({"t": self.t, "shares": {j: self.sims[j].roles.target.total for j in self.active}})
        if done and self.control and self.active:
            self._push(self.t, "job_done", ())

    def _result(self) -> PoolResult:
        return PoolResult(
            gpus=self.G, jobs={j: self.results[j] for j in self.sims},
            trajectories={j: v.job.steps * v.job.batch_size for j, v in self.views.items()},
            below_min_gpu_s=dict(self.below), busy_gpu_s=sum(s.busy for s in self.sims.values()),
            moved_between_jobs=self.moved, shares=self.shares, decisions=self.decisions)
