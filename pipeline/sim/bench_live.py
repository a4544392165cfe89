"""The ``live`` engine of ``libra-ctl bench policy``: the workload on the real control plane.

Called by ``pipeline.sim.bench_allocator.run_bench`` for ``--engine live``. Where the
``des`` engine simulates the pipeline, this one runs it: a Redis server (an
embedded one unless ``--redis`` names one), ``libra-ctl controller`` and one
``libra-ctl agent`` holding one CPU slot per GPU of the workload, and the
``sim`` worker backend (``pipeline/sim/worker.py``), whose rollout, reward and
learner processes exchange real messages over the job's streams and consumer
groups but sleep the workload's costs on compressed time (``time_scale``
simulated seconds per wall second). The workload runs as written: its GPUs,
batch size, group size, staleness bound and steps.

One job per asynchronous mode, one after the other on the same control plane:

- ``static``: pinned at ``fluid.static_split`` (the first phase's best
  integer split);
- ``static-best``: pinned at the split the des engine finds best for the
  whole run (the hindsight oracle; each live candidate would be a full run);
  when that is the static split, the static run stands for it;
- ``libra``: starts pinned at the static split, and is handed to the
  controller's policy (``libra-ctl scale --auto``) the moment the first
  prompt enters the pipeline.

A multi-job workload (``[[jobs]]``) runs ``static`` and ``libra`` through
``run_pool`` (called by ``pipeline.sim.bench_pool.run_live_pool``): every job of
the workload at once on the same control plane, one ``bench-<mode>-<job>``
each, running its one-job view (``Workload.view``) with its ``min_gpus``,
``max_gpus`` and ``priority`` as its ``[control]`` ``min_slots``, ``max_slots``
and ``priority``. ``static`` pins each job at its static share's split for the
whole run (a finished job's slots stay idle); ``libra`` starts each at the split
of its share of the pool policy's first plan (``pool.libra_shares``) and hands
it to the controller's pool policy at its first prompt. Each poll samples the
slots the controller gives each job (its target) and those its workers hold
(``allocation_status``); the simulated GPU-seconds a running job was given
fewer than its minimum are its ``below_min_gpu_s``, as the des engine counts
GPUs ordered (a worker restarting for a role change holds no slot for a
moment, which is a move's cost, not a broken guarantee).

A mode's clock starts at its first prompt, after every worker of its initial
allocation has started (process start-up on this machine is not the
workload's), and stops at the publish of its last learner step. Role changes
during the run do pay: a sim worker started into a running job sleeps out the
workload's ``switch_cost_s`` from its process start. ``sync`` (colocated,
which the live stack does not run) and ``ideal`` (a bound) come from the des
engine, and the report says so; the des engine also runs the live modes, so
the report states how far the two engines agree.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import redis

from pipeline.control import actions, allocator
from pipeline.control.allocation import allocation_status, live_agents, pin, unpin
from pipeline.control.allocator import Allocation
from pipeline.control.events import merged_events, read_events
from pipeline.control.job import load_job
from pipeline.control.local import start_local_control
from pipeline.dataplane.keys import CONTROLLER_LEASE, JOBS, JobKeys
from pipeline.dataplane.redisconn import EmbeddedRedis, connect
from pipeline.redaction import redact
from pipeline.sim import des, fluid
from pipeline.sim.pool import PoolResult
from pipeline.sim.result import ModeResult, hist_quantile
from pipeline.sim.job import prepare_sim_run
from pipeline.sim.workload import Workload

LIVE_MODES = ("static", "static-best", "libra")
MAX_SLOTS = 64              # CPU slots one machine of ours runs (a sim worker process each)
NODE = "bench"
REWARD_PROCESSES = 2        # CPU reward: processes that share the workload's cpu_workers scorers
POLL_S = 1.0
STALL_STEPS = 20.0          # no learner step for this many expected step times: the run is stuck
Report = Callable[[str], None]


class LiveEngineError(RuntimeError):
    """The live run could not start or stalled; the message names the logs to read."""


# The auto time scale: at most MAX_AUTO_SCALE simulated seconds per wall second, and no faster than keeps the
# workload's fastest phase, at the ideal rate, within WALL_RATE trajectories per wall second. Every trajectory
# is encoded, written, read and acknowledged by real processes, and on a 2-core machine running 64 slot
# processes the data plane stops keeping up somewhere between 1,500 and 2,000 a second: drift's first phase
# alone (static split) ran at 1.01 of the des engine's rate at 20 simulated seconds per wall second (1,444 a
# wall second at the ideal rate) and at 0.67 at 30 (2,167).
WALL_RATE = 1_500.0
MAX_AUTO_SCALE = 20.0


def peak_rate(wl: Workload) -> float:
    """Trajectories per simulated second of ``wl``'s fastest phase at the ideal rate (of any of its jobs,
    each alone on the cluster: what the jobs of a pool make together at most, give or take their mix)."""
    views = [wl.view(j.name) for j in wl.jobs] if wl.multi_job else [wl]
    return max(fluid.ideal_phase_rate(v, ph) for v in views for ph in v.job.phases)


def auto_time_scale(wl: Workload) -> float:
    """The default ``--time-scale``: ``MAX_AUTO_SCALE``, or less where the peak rate would pass ``WALL_RATE``."""
    return min(MAX_AUTO_SCALE, WALL_RATE / peak_rate(wl))


@dataclass(frozen=True)
class LiveSettings:
    """How the live engine runs: time compression, where Redis and the run directories are."""

    time_scale: float | None = None     # simulated seconds per wall second; None: auto_time_scale
    redis_url: str | None = None        # None: an embedded server, removed afterwards
    runs_dir: str = "runs"
    start_timeout_s: float = 300.0      # wall seconds for a mode's initial workers to come up

    def check(self, wl: Workload) -> None:
        if self.time_scale is not None and not 0 < self.time_scale < math.inf:
            raise ValueError(f"--time-scale {self.time_scale}: must be a number > 0")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s {self.start_timeout_s}: must be > 0")
        if wl.cluster.gpus > MAX_SLOTS:
            raise ValueError(f"the live engine runs up to {MAX_SLOTS} slots on one machine and {wl.name} has "
                             f"{wl.cluster.gpus} GPUs: use --engine des")
        for job in wl.jobs:   # the live job's config (rollout.group_size) takes GRPO's groups of 2 or more
            if job.group_size < 2:
                raise ValueError(f"{wl.name}: group_size = {job.group_size}: the live engine's jobs need at least "
                                 "2 samples per prompt; use --engine des")


def control_settings(wl: Workload, scale: float) -> dict:
    """The job's ``[control]`` for the live run: the des engine's libra settings, in wall seconds.

    ``wl`` is one job (a multi-job workload's view of one of its jobs): its
    ``min_gpus``, ``max_gpus`` and ``priority`` become ``min_slots``,
    ``max_slots`` and ``priority``, as ``pool.pool_spec`` gives them to the des engine.
    """
    ctl, job = des.LIBRA_CONTROL, wl.job
    return {"mode": "pinned", "interval_s": ctl.interval_s / scale, "window_s": ctl.window_s / scale,
            "cooldown_s": ctl.cooldown_s / scale, "horizon_s": ctl.horizon_s / scale,
            "switch_cost_s": wl.cluster.switch_cost_s / scale,
            "learner_scaling_exponent": wl.learner.scaling_exponent,
            "reward_on_slots": wl.reward.gpu, "metrics_port": 0,
            "min_slots": job.min_gpus or 0, "max_slots": job.max_gpus or 0, "priority": float(job.priority or 1)}


def worker_counts(wl: Workload, a: Allocation) -> dict[str, int]:
    """Processes per role for a split: reward on CPU runs REWARD_PROCESSES beside the slots."""
    return {"rollout": a.rollout, "learner": a.learner,
            "reward": a.reward if wl.reward.gpu else REWARD_PROCESSES}


@dataclass
class _Trace:
    """What the live engine saw of one job: its learner steps, the allocation at each, its slots over time."""

    job: str                 # its name on the control plane
    wl: Workload             # the workload as this job sees it (one job)
    run_dir: Path
    counts: dict             # the worker processes per role it starts with (``worker_counts``)
    min_slots: int = 0       # its guarantee ([control] min_slots): below_min_gpu_s counts the shortfall
    t0: float = 0.0
    steps: list = field(default_factory=list)
    timeline: list = field(default_factory=list)
    cursor: str = "0-0"
    # (worker, since) -> its last cost record: a worker id that comes back after a role change starts a new
    # record under the same key in Redis, so each incarnation's costs are kept here as last seen
    costs: dict = field(default_factory=dict)
    roles: dict = field(default_factory=dict)       # workers running per role at the last poll
    held: int = 0                                   # slots its workers held at the last poll
    ordered: int = 0                                # slots the controller gave it (its target) at the last poll
    sampled_at: float = 0.0                         # wall time of that poll
    slots: list = field(default_factory=list)       # {"t", "held", "ordered"} each time they change
    below_min_gpu_s: float = 0.0                    # simulated GPU-seconds it was given fewer than min_slots
    last_progress: float = 0.0                      # time.monotonic() of its last new step
    done: bool = False                              # its last step has published

class LiveBench:
    """A Redis server, a controller and an agent with the workload's slots; ``run_mode`` per mode."""

    def __init__(self, wl: Workload, workload_path: Path, settings: LiveSettings, say: Report,
                 seed: int | None = None):
        settings.check(wl)
        self.wl, self.path, self.settings, self.say = wl, Path(workload_path).resolve(), settings, say
        self.seed = seed     # the sim workers' lengths and rewards; None: the workload's own (run_mode)
        self.scale = settings.time_scale or auto_time_scale(wl)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.dir = Path(settings.runs_dir).resolve() / f"bench-{wl.name}-{stamp}"
        self.redis_dir: Path | None = None
        self.embedded: EmbeddedRedis | None = None
        self.control = None

    def __enter__(self) -> "LiveBench":
        try:
            self._start()
        except BaseException as exc:
            self.__exit__()
            if isinstance(exc, (RuntimeError, redis.RedisError)) and not isinstance(exc, LiveEngineError):
                raise LiveEngineError(f"could not start Redis, the controller or the agent: {exc}; see "
                                      f"{self.dir / 'logs'}") from exc
            raise
        return self

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        url = self.settings.redis_url
        if url is None:
            # a short path: the server's unix socket lives there
            self.redis_dir = Path(tempfile.mkdtemp(prefix="libra-bench-"))
            self.embedded = EmbeddedRedis(self.redis_dir, maxmemory="4gb", appendfsync="no")
            self.embedded.start()
            url = self.embedded.url
        self.url, self.r = url, connect(url)
        if self.embedded is None:
            self._check_own_redis(url)
        # learner steps carry this machine's clock, a first prompt the server's (its stream id)
        secs, micros = self.r.time()
        self.clock_offset = secs + micros / 1e6 - time.time()
        interval = des.LIBRA_CONTROL.interval_s / self.scale     # every job's control_settings interval_s
        self.control = start_local_control(None, self.dir, url, slots=self.wl.cluster.gpus, node=NODE,
                                           interval_s=interval)
        self.say(f"live: Redis {redact(url)}, controller every {interval:.2f} s, agent with {self.wl.cluster.gpus} "
                 f"slots, {self.scale:.3g} simulated s per wall s; logs in {self.dir / 'logs'}")
        wall = peak_rate(self.wl) * self.scale
        if self.settings.time_scale is None:
            self.say(f"live: time scale auto: the fastest phase at the ideal rate makes {wall:,.0f} trajectories "
                     f"per wall second (at most {WALL_RATE:,.0f}, and {MAX_AUTO_SCALE:g} simulated s per wall s)")
        elif wall > WALL_RATE:
            self.say(f"live: warning: at --time-scale {self.scale:g} the fastest phase at the ideal rate makes "
                     f"{wall:,.0f} trajectories per wall second, over the {WALL_RATE:,.0f} the data plane keeps up "
                     f"with on a 2-core machine; the live figures may trail the des engine's for the host's sake "
                     f"(leave --time-scale out for {auto_time_scale(self.wl):.3g})")

    def _check_own_redis(self, url: str) -> None:
        """A given Redis must have no controller, agent or running job: ours would act on them."""
        busy = [n.decode() for n in self.r.smembers(JOBS)
                if self.r.hget(JobKeys(n.decode()).state, "phase") in (b"running", b"trained")]
        if self.r.exists(CONTROLLER_LEASE) or live_agents(self.r) or busy:
            raise LiveEngineError(f"{redact(url)} already has a controller, node agents or running jobs"
                                  f"{' (' + ', '.join(sorted(busy)) + ')' if busy else ''}; the live engine needs "
                                  "a Redis of its own (leave out --redis for an embedded one)")

    def __exit__(self, *exc) -> None:
        try:
            if self.control:
                self.control.stop()
        finally:
            if self.embedded:
                self.embedded.stop()
            if self.redis_dir:
                shutil.rmtree(self.redis_dir, ignore_errors=True)

    # --- one job, or every job of a pool ----------------------------------------------------------

    def run_mode(self, mode: str, split: Allocation) -> tuple[ModeResult, dict]:
        """One job's mode: pinned at ``split``, handed to the controller at its first prompt for libra."""
        seed = self.wl.job.seed if self.seed is None else self.seed
        trace = self._prepare(f"bench-{mode}", self.wl, split, seed)
        try:
            with self._failures(mode, [trace]):
                self._launch([trace], unpin_at_start=mode == "libra")
                self._follow([trace], mode)
                result = self._result(trace)
        finally:
            self._finish(trace.job)
        return result, {"timeline": trace.timeline, "decisions": result.events,
                        "sim_time_s": result.sim_time_s, "run_dir": str(trace.run_dir), "engine": "live"}

    def run_pool(self, mode: str, views: dict[str, Workload], splits: dict[str, Allocation],
                 seeds: dict[str, int]) -> tuple[PoolResult, dict]:
        """Every job of a multi-job workload at once, one ``bench-<mode>-<job>`` each (``bench_pool.run_live_pool``).

        ``views``: each job's one-job view (``pool.job_views``); ``splits``: the
        split each starts pinned at. ``static`` keeps them pinned (a finished
        job's slots stay idle); ``libra`` hands each to the controller's pool
        policy once its first prompt is in. Returns the pool's figures as the des
        engine's ``PoolResult`` and the details ``bench_pool.draw_pool`` reads.
        """
        traces: list[_Trace] = []
        try:
            for name, view in views.items():
                traces.append(self._prepare(f"bench-{mode}-{name}", view, splits[name], seeds[name], name))
            with self._failures(mode, traces):
                self._admit(traces)
                self._launch(traces, unpin_at_start=mode == "libra")
                self._follow(traces, mode)
                results = {name: self._result(tr) for name, tr in zip(views, traces)}
                moved = self._moved_between_jobs([tr.job for tr in traces])
        finally:
            for tr in traces:
                self._finish(tr.job)
        start = min(tr.t0 for tr in traces)
        out = PoolResult(
            gpus=self.wl.cluster.gpus, jobs=results,
            trajectories={name: sum(s["trajectories"] for s in tr.steps) for name, tr in zip(views, traces)},
            below_min_gpu_s={name: tr.below_min_gpu_s for name, tr in zip(views, traces)},
            busy_gpu_s=sum(self._busy_s(tr) for tr in traces) * self.scale, moved_between_jobs=moved,
            shares=self._shares(dict(zip(views, traces)), start),
            decisions=[e for r in results.values() for e in r.events])
        return out, {"shares": out.shares, "decisions": out.decisions, "sim_time_s": out.makespan_s,
                     "timelines": {name: r.timeline for name, r in results.items()},
                     "slots": {name: tr.slots for name, tr in zip(views, traces)},
                     "run_dirs": {name: str(tr.run_dir) for name, tr in zip(views, traces)}, "engine": "live"}

    def _prepare(self, job: str, view: Workload, split: Allocation, seed: int,
                 workload_job: str | None = None) -> _Trace:
        """The job's run directory and fresh Redis state, pinned at ``split`` (the controller starts it)."""
        counts = worker_counts(view, split)
        try:
            run_dir = prepare_sim_run(self.r, self.path, self.dir, job=job, time_scale=self.scale,
                                      redis_url=self.url, reward_workers=counts["reward"],
                                      control=control_settings(view, self.scale), seed=seed,
                                      workload_job=workload_job)
        except (RuntimeError, redis.RedisError) as exc:
            raise LiveEngineError(f"{job}: could not prepare the job: {exc}") from exc
        try:
            pin(self.r, job, counts)
        except (ValueError, redis.RedisError) as exc:
            self._finish(job)
            raise LiveEngineError(f"{job}: could not pin its split {split.as_dict()}: {exc}") from exc
        return _Trace(job, view, run_dir, counts, min_slots=view.job.min_gpus or 0)

    @contextmanager
    def _failures(self, mode: str, traces: list[_Trace]):
        """A failed run raises LiveEngineError naming the logs to read."""
        try:
            yield
        except (RuntimeError, redis.RedisError) as exc:
            if isinstance(exc, LiveEngineError):
                raise
            logs = " and ".join(str(p) for p in [*(tr.run_dir / "logs" for tr in traces), self.dir / "logs"])
            raise LiveEngineError(f"{traces[0].job if len(traces) == 1 else mode}: {exc}; see {logs}") from exc

    def _admit(self, traces: list[_Trace]) -> None:
        """The jobs as the controller reads them (their manifests' [control]) must fit the agent's slots together."""
        specs = []
        for tr in traces:
            info = load_job(self.r, tr.job)
            if info is None:
                raise LiveEngineError(f"{tr.job}: the controller cannot read its run directory {tr.run_dir}")
            specs.append(info.spec())
        # the agent's slots once it has registered, else the ones it was started with (as control.job.check_admission)
        slots = sum(len(rec["slots"]) for rec in live_agents(self.r).values()) or self.wl.cluster.gpus
        try:
            allocator.admit(allocator.Inventory(gpus=slots, switch_cost_s=self.wl.cluster.switch_cost_s), specs)
        except allocator.AdmissionError as exc:
            raise LiveEngineError(f"a job is refused by admission on the agent's {slots} slots: {exc}; lower the "
                                  "jobs' min_gpus or add GPUs to [cluster]") from None

    def _launch(self, traces: list[_Trace], unpin_at_start: bool) -> None:
        """Start every job's initial workers, then their feeders; each job's clock starts at its first prompt."""
        for tr in traces:
            self._wait_started(tr.job, tr.counts, tr.run_dir)
        for tr in traces:
            actions.ensure(self.r, NODE, {"job": tr.job, "worker": "feeder-0", "role": "feeder", "slots": [],
                                          "run_dir": str(tr.run_dir), "backend": "sim"})
        for tr in traces:
            tr.t0 = self._first_prompt_at(tr.job, tr.run_dir)
            if unpin_at_start:
                unpin(self.r, tr.job)       # the allocator takes over as the first prompt enters the pipeline
        now = time.time()
        for tr in traces:
            self._sample(tr, allocation_status(self.r, tr.job), now)
            tr.last_progress = time.monotonic()

    def _wait_started(self, job: str, counts: dict, run_dir: Path) -> None:
        """Until every worker of the initial allocation has started (loaded its first weights)."""
        keys, deadline = JobKeys(job), time.monotonic() + self.settings.start_timeout_s
        # processes: one learner process holds all the learner's slots
        want = {role: (1 if role == "learner" else n) for role, n in counts.items() if n}
        self.say(f"{job}: starting " + " ".join(f"{k}={v}" for k, v in counts.items()))
        last_say = time.monotonic()
        while time.monotonic() < deadline:
            self.control.check()
            up: dict[str, int] = {}
            for raw in self.r.hvals(keys.workers):
                w = json.loads(raw)
                if w.get("state") in ("running", "waiting"):
                    up[w["role"]] = up.get(w["role"], 0) + 1
            if all(up.get(role, 0) >= n for role, n in want.items()):
                return
            if time.monotonic() - last_say >= 10.0:
                last_say = time.monotonic()
                self.say(f"{job}: processes up " + " ".join(f"{r}={up.get(r, 0)}/{n}" for r, n in want.items()))
            time.sleep(POLL_S)
        raise LiveEngineError(f"{job}: its workers did not all start within {self.settings.start_timeout_s:.0f} s "
                              f"(up: {up}, wanted {want}); see {run_dir / 'logs'} and {self.dir / 'logs'}")

    def _first_prompt_at(self, job: str, run_dir: Path) -> float:
        """Wall time (this machine's clock) of the job's first prompt, from its stream entry id."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            first = self.r.xrange(JobKeys(job).prompts, count=1)
            if first:
                return int(first[0][0].split(b"-")[0]) / 1000.0 - self.clock_offset
            self.control.check()
            time.sleep(0.05)
        raise LiveEngineError(f"{job}: the feeder wrote no prompt; see {run_dir / 'logs'}")

    def _follow(self, traces: list[_Trace], mode: str) -> None:
        """Record learner steps, worker costs and slots until every job's last step.

        A job whose last step has published is marked done at once, so the
        controller drains it and (libra) hands its slots to the others.
        """
        last_say = 0.0
        while not all(tr.done for tr in traces):
            self.control.check()
            now = time.time()
            for tr in (tr for tr in traces if not tr.done):
                self._poll(tr, now)
            mono = time.monotonic()
            if mono - last_say >= 5.0 and any(tr.steps for tr in traces):
                last_say = mono
                self.say(f"{mode}: " + "; ".join(self._progress(tr, len(traces) > 1) for tr in traces))
            time.sleep(POLL_S)

    def _poll(self, tr: _Trace, now: float) -> None:
        """One look at a running job: costs, slots, new steps; marks it done after its last step."""
        keys, steps = JobKeys(tr.job), tr.wl.job.steps
        phase = self.r.hget(keys.state, "phase")
        for w, v in self.r.hgetall(keys.worker_costs).items():
            c = json.loads(v)
            tr.costs[(w.decode(), c["since"])] = c
        status = allocation_status(self.r, tr.job)
        self._sample(tr, status, now)
        if self._read_steps(keys, tr):
            tr.last_progress = time.monotonic()
        if phase == b"trained" and len(tr.steps) >= steps:
            tr.done = True
            self.r.hset(keys.state, "phase", "done")     # the controller drains it; its slots are free
            return
        expected_step_s = tr.wl.job.batch_size / max(fluid.ideal_rate(tr.wl), 1e-9) / self.scale
        # the first step also waits for the pipeline to fill: a rollout call, reward, a training step
        limit = (max(60.0, STALL_STEPS * expected_step_s) if tr.steps
                 else max(self.settings.start_timeout_s, STALL_STEPS * expected_step_s))
        idle = time.monotonic() - tr.last_progress
        if idle > limit:
            raise LiveEngineError(f"{tr.job}: no learner step for {idle:.0f} s (step {len(tr.steps)}/{steps}); see "
                                  f"{tr.run_dir / 'logs'} and {self.dir / 'logs'}")

    def _sample(self, tr: _Trace, status: dict, now: float) -> None:
        """The slots the job's workers hold now; the time since the last poll counts below its minimum if short."""
        if tr.sampled_at:
            span = max(0.0, now - max(tr.sampled_at, tr.t0)) * self.scale
            tr.below_min_gpu_s += span * max(0, tr.min_slots - tr.ordered)
        tr.roles, tr.sampled_at = status["roles"], now
        tr.held = sum(len(w["slots"]) for w in status["workers"].values())
        tr.ordered = sum(n for role, n in status["target"].items() if role != "reward" or tr.wl.reward.gpu)
        if not tr.slots or (tr.slots[-1]["held"], tr.slots[-1]["ordered"]) != (tr.held, tr.ordered):
            tr.slots.append({"t": (now - tr.t0) * self.scale, "held": tr.held, "ordered": tr.ordered})

    def _progress(self, tr: _Trace, named: bool) -> str:
        """A progress line's part for one job: its last step, rate and workers per role."""
        head = f"{tr.job} " if named else ""
        if not tr.steps:
            return f"{head}step 0/{tr.wl.job.steps}"
        s = tr.timeline[-1]
        return (f"{head}step {s['step']}/{tr.wl.job.steps} at {s['t']:.0f} simulated s, {s['rate']:.1f} traj/s, "
                + " ".join(f"{k}={v}" for k, v in sorted(tr.roles.items())))

    def _read_steps(self, keys: JobKeys, trace: _Trace) -> bool:
        new, roles = False, trace.roles
        for entry_id, f in self.r.xrange(keys.metrics, min=f"({trace.cursor}"):
            trace.cursor = entry_id.decode()
            if f.get(b"kind") != b"learner_step":
                continue
            s = json.loads(f[b"data"])
            prev = trace.steps[-1]["at"] if trace.steps else trace.t0
            trace.steps.append(s)
            trace.timeline.append({"t": (s["at"] - trace.t0) * self.scale, "step": s["step"],
                                   "rollout": roles.get("rollout", 0), "learner": s["gpus"],
                                   "reward": roles.get("reward", 0) if trace.wl.reward.gpu else 0, "switching": 0,
                                   "rate": s["trajectories"] / max((s["at"] - prev) * self.scale, 1e-9)})
            new = True
        return new

    def _busy_s(self, trace: _Trace) -> float:
        """Wall seconds the job's slot workers spent at work."""
        gpu_roles = ("rollout", "learner", "reward") if trace.wl.reward.gpu else ("rollout", "learner")
        return sum(c["busy_s"] for c in trace.costs.values() if c["role"] in gpu_roles)

    def _result(self, trace: _Trace) -> ModeResult:
        wl = trace.wl
        wall = trace.steps[-1]["at"] - trace.t0
        counters = {a.decode(): int(b) for a, b in self.r.hgetall(JobKeys(trace.job).counters).items()}
        hist = np.zeros(wl.job.max_staleness + 2, dtype=np.int64)
        for s in trace.steps:
            for v, c in s.get("staleness_hist", {}).items():
                hist[min(int(v), len(hist) - 1)] += int(c)
        roles = trace.roles      # as last seen running, before the job was marked done
        trained = sum(s["trajectories"] for s in trace.steps)
        decisions = self._decisions(trace.job)
        return ModeResult(
            trajectories_per_s=trained / (wall * self.scale),
            gpu_busy_frac=min(1.0, self._busy_s(trace) / (wl.cluster.gpus * wall)),
            learner_wait_frac=min(1.0, sum(self._wait_in_run(s, trace.t0) for s in trace.steps) / wall),
            staleness_p50=hist_quantile(hist, 0.5), staleness_p99=hist_quantile(hist, 0.99),
            dropped_stale=counters.get("dropped_stale", 0), reconfigurations=len(decisions),
            final_allocation={"rollout": roles.get("rollout", 0),
                              "reward": roles.get("reward", 0) if wl.reward.gpu else 0,
                              "learner": trace.steps[-1]["gpus"]},
            sim_time_s=wall * self.scale, timeline=trace.timeline, events=decisions)

    @staticmethod
    def _wait_in_run(step: dict, t0: float) -> float:
        """A step's wait for data after the clock started (the learner may wait for the first prompt)."""
        return min(step["wait_s"], max(0.0, step["at"] - t0 - step["train_s"] - step["publish_s"]))

    def _decisions(self, job: str) -> list[dict]:
        """The controller's decisions that changed the allocation."""
        return [e for e in read_events(self.r, job, 10_000) if e["kind"] == "decision" and e["to"] != e["from"]]

    def _moved_between_jobs(self, jobs: list[str]) -> int:
        """Slots the controller's pool plans moved from one job to another.

        Each job whose allocation a tick changes records that tick's pool plan
        in its decision event, so one plan appears in several jobs' events, one
        after the other: it is counted once.
        """
        moved, last = 0, None
        for e in merged_events(self.r, jobs, 10_000 * len(jobs)):
            plan = e.get("pool") if e["kind"] == "decision" else None
            if plan is None:
                continue
            key = (json.dumps(plan["shares"], sort_keys=True), plan["moved_between_jobs"])
            if key != last:
                moved += plan["moved_between_jobs"]
            last = key
        return moved

    def _shares(self, traces: dict[str, _Trace], start: float) -> list[dict]:
        """Slots held per job on the pool's clock (from its first job's first prompt), at each change.

        A job holds none from its last publish on (as in the des engine's shares), though its workers drain after.
        """
        points = []
        for name, tr in traces.items():
            end = (tr.steps[-1]["at"] - start) * self.scale
            points += [(t, name, p["held"]) for p in tr.slots if (t := (tr.t0 - start) * self.scale + p["t"]) < end]
            points.append((end, name, 0))
        points.sort()
        held = {name: 0 for name in traces}
        out: list[dict] = []
        for t, name, n in points:
            held[name] = n
            if out and out[-1]["t"] == t:
                out[-1]["shares"] = dict(held)
            else:
                out.append({"t": max(0.0, t), "shares": dict(held)})
        return out

    def _finish(self, job: str) -> None:
        """Mark the job done; the controller drains its workers, and the next mode gets free slots.

        Never raises: it runs after a failure too, whose error must not be masked.
        """
        try:
            self.r.hset(JobKeys(job).state, "phase", "done")
            deadline = time.monotonic() + 120.0
            while allocation_status(self.r, job)["workers"]:
                self.control.check()
                if time.monotonic() > deadline:
                    self.say(f"{job}: workers still running 120 s after the job ended; see {self.dir / 'logs'}")
                    return
                time.sleep(POLL_S)
        except (RuntimeError, redis.RedisError) as exc:
            self.say(f"{job}: could not drain its workers: {exc}")


def live_summary(result: dict) -> list[str]:
    """The table's lines for a live result (one job or a pool): the engine of each mode, and live/des."""
    if result.get("engine") != "live":
        return []
    engines = {m: result["details"][m]["engine"] for m in result["modes"]}
    lines = ["", "engine: " + "  ".join(f"{m} {e}" for m, e in engines.items())]
    if result["live_vs_des"]:
        lines.append("live/des: " + "  ".join(f"{m} {v:.3f}" for m, v in result["live_vs_des"].items()))
    return lines
