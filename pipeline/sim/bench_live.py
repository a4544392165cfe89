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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import redis

from pipeline.control import actions
from pipeline.control.allocation import allocation_status, live_agents, pin, unpin
from pipeline.control.allocator import Allocation
from pipeline.control.events import read_events
from pipeline.control.local import start_local_control
from pipeline.dataplane.keys import CONTROLLER_LEASE, JOBS, JobKeys
from pipeline.dataplane.redisconn import EmbeddedRedis, connect
from pipeline.redaction import redact
from pipeline.sim import des, fluid
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


@dataclass(frozen=True)
class LiveSettings:
    """How the live engine runs: time compression, where Redis and the run directories are."""

    time_scale: float = 20.0            # simulated seconds per wall second
    redis_url: str | None = None        # None: an embedded server, removed afterwards
    runs_dir: str = "runs"
    start_timeout_s: float = 300.0      # wall seconds for a mode's initial workers to come up

    def check(self, wl: Workload) -> None:
        if not 0 < self.time_scale < math.inf:
            raise ValueError(f"--time-scale {self.time_scale}: must be a number > 0")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s {self.start_timeout_s}: must be > 0")
        if wl.cluster.gpus > MAX_SLOTS:
            raise ValueError(f"the live engine runs up to {MAX_SLOTS} slots on one machine and {wl.name} has "
                             f"{wl.cluster.gpus} GPUs: use --engine des")


def control_settings(wl: Workload, scale: float) -> dict:
    """The job's ``[control]`` for the live run: the des engine's libra settings, in wall seconds."""
    ctl = des.LIBRA_CONTROL
    return {"mode": "pinned", "interval_s": ctl.interval_s / scale, "window_s": ctl.window_s / scale,
            "cooldown_s": ctl.cooldown_s / scale, "horizon_s": ctl.horizon_s / scale,
            "switch_cost_s": wl.cluster.switch_cost_s / scale,
            "learner_scaling_exponent": wl.learner.scaling_exponent,
            "reward_on_slots": wl.reward.gpu, "metrics_port": 0}


def worker_counts(wl: Workload, a: Allocation) -> dict[str, int]:
    """Processes per role for a split: reward on CPU runs REWARD_PROCESSES beside the slots."""
    return {"rollout": a.rollout, "learner": a.learner,
            "reward": a.reward if wl.reward.gpu else REWARD_PROCESSES}


@dataclass
class _Trace:
    """What a live mode saw: its learner steps and the allocation at each."""

    t0: float = 0.0
    steps: list = field(default_factory=list)
    timeline: list = field(default_factory=list)
    cursor: str = "0-0"
    # (worker, since) -> its last cost record: a worker id that comes back after a role change starts a new
    # record under the same key in Redis, so each incarnation's costs are kept here as last seen
    costs: dict = field(default_factory=dict)


class LiveBench:
    """A Redis server, a controller and an agent with the workload's slots; ``run_mode`` per mode."""

    def __init__(self, wl: Workload, workload_path: Path, settings: LiveSettings, say: Report,
                 seed: int | None = None):
        settings.check(wl)
        self.wl, self.path, self.settings, self.say = wl, Path(workload_path).resolve(), settings, say
        self.seed = wl.job.seed if seed is None else seed   # the sim workers' lengths and rewards
        self.scale = settings.time_scale
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
        interval = control_settings(self.wl, self.scale)["interval_s"]
        self.control = start_local_control(None, self.dir, url, slots=self.wl.cluster.gpus, node=NODE,
                                           interval_s=interval)
        self.say(f"live: Redis {redact(url)}, controller every {interval:.2f} s, agent with {self.wl.cluster.gpus} "
                 f"slots, {self.scale:g} simulated s per wall s; logs in {self.dir / 'logs'}")

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

    # --- one mode -------------------------------------------------------------------------------

    def run_mode(self, mode: str, split: Allocation) -> tuple[ModeResult, dict]:

        job, wl = f"bench-{mode}", self.wl
        counts = worker_counts(wl, split)
        try:
            run_dir = prepare_sim_run(self.r, self.path, self.dir, job=job, time_scale=self.scale,
                                      redis_url=self.url, reward_workers=counts["reward"],
                                      control=control_settings(wl, self.scale), seed=self.seed)
        except (RuntimeError, redis.RedisError) as exc:
            raise LiveEngineError(f"{job}: could not prepare the job: {exc}") from exc
        trace = _Trace()
        try:
            pin(self.r, job, counts)
            self._wait_started(job, counts, run_dir)
            actions.ensure(self.r, NODE, {"job": job, "worker": "feeder-0", "role": "feeder", "slots": [],
                                               "run_dir": str(run_dir), "backend": "sim"})
            trace.t0 = self._first_prompt_at(job, run_dir)
            if mode == "libra":
                unpin(self.r, job)       # the allocator takes over as the first prompt enters the pipeline
            self._follow(job, mode, trace, run_dir)
            result = self._result(job, trace)
        except (RuntimeError, redis.RedisError) as exc:
            if isinstance(exc, LiveEngineError):
                raise
            raise LiveEngineError(f"{job}: {exc}; see {run_dir / 'logs'} and {self.dir / 'logs'}") from exc
        finally:
            self._finish(job)
        return result, {"timeline": trace.timeline, "decisions": result.events,
                        "sim_time_s": result.sim_time_s, "run_dir": str(run_dir), "engine": "live"}

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

    def _follow(self, job: str, mode: str, trace: _Trace, run_dir: Path) -> None:
        """Record learner steps, worker costs and the allocation until the last step."""
        keys, steps = JobKeys(job), self.wl.job.steps
        expected_step_s = self.wl.job.batch_size / max(fluid.ideal_rate(self.wl), 1e-9) / self.scale
        # the first step also waits for the pipeline to fill: a rollout call, reward, a training step
        first_step_s = max(self.settings.start_timeout_s, STALL_STEPS * expected_step_s)
        last_progress, last_say = time.monotonic(), 0.0
        while True:
            self.control.check()
            phase = self.r.hget(keys.state, "phase")
            for w, v in self.r.hgetall(keys.worker_costs).items():
                c = json.loads(v)
                trace.costs[(w.decode(), c["since"])] = c
            roles = allocation_status(self.r, job)["roles"]
            if self._read_steps(keys, trace, roles):
                last_progress = time.monotonic()
            if phase == b"trained" and len(trace.steps) >= steps:
                return
            now = time.monotonic()
            if now - last_progress > (max(60.0, STALL_STEPS * expected_step_s) if trace.steps else first_step_s):
                raise LiveEngineError(f"{job}: no learner step for {now - last_progress:.0f} s; see "
                                      f"{run_dir / 'logs'} and {self.dir / 'logs'}")
            if now - last_say >= 5.0 and trace.steps:
                last_say, s = now, trace.timeline[-1]
                self.say(f"{mode}: step {s['step']}/{steps} at {s['t']:.0f} simulated s, {s['rate']:.1f} traj/s, "
                         + " ".join(f"{k}={v}" for k, v in sorted(roles.items())))
            time.sleep(POLL_S)

    def _read_steps(self, keys: JobKeys, trace: _Trace, roles: dict) -> bool:
        new = False
        for entry_id, f in self.r.xrange(keys.metrics, min=f"({trace.cursor}"):
            trace.cursor = entry_id.decode()
            if f.get(b"kind") != b"learner_step":
                continue
            s = json.loads(f[b"data"])
            prev = trace.steps[-1]["at"] if trace.steps else trace.t0
            trace.steps.append(s)
            trace.timeline.append({"t": (s["at"] - trace.t0) * self.scale, "step": s["step"],
                                   "rollout": roles.get("rollout", 0), "learner": s["gpus"],
                                   "reward": roles.get("reward", 0) if self.wl.reward.gpu else 0, "switching": 0,
                                   "rate": s["trajectories"] / max((s["at"] - prev) * self.scale, 1e-9)})
            new = True
        return new

    def _result(self, job: str, trace: _Trace) -> ModeResult:
        keys = JobKeys(job)
        wall = trace.steps[-1]["at"] - trace.t0
        counters = {a.decode(): int(b) for a, b in self.r.hgetall(keys.counters).items()}
        hist = np.zeros(self.wl.job.max_staleness + 2, dtype=np.int64)
        for s in trace.steps:
            for v, c in s.get("staleness_hist", {}).items():
                hist[min(int(v), len(hist) - 1)] += int(c)
        gpu_roles = ("rollout", "learner", "reward") if self.wl.reward.gpu else ("rollout", "learner")
        busy = sum(c["busy_s"] for c in trace.costs.values() if c["role"] in gpu_roles)
        roles = allocation_status(self.r, job)["roles"]
        trained = sum(s["trajectories"] for s in trace.steps)
        decisions = self._decisions(job)
        return ModeResult(
            trajectories_per_s=trained / (wall * self.scale),
            gpu_busy_frac=min(1.0, busy / (self.wl.cluster.gpus * wall)),
            learner_wait_frac=min(1.0, sum(self._wait_in_run(s, trace.t0) for s in trace.steps) / wall),
            staleness_p50=hist_quantile(hist, 0.5), staleness_p99=hist_quantile(hist, 0.99),
            dropped_stale=counters.get("dropped_stale", 0), reconfigurations=len(decisions),
            final_allocation={"rollout": roles.get("rollout", 0),
                              "reward": roles.get("reward", 0) if self.wl.reward.gpu else 0,
                              "learner": trace.steps[-1]["gpus"]},
            sim_time_s=wall * self.scale, timeline=trace.timeline, events=decisions)

    @staticmethod
    def _wait_in_run(step: dict, t0: float) -> float:
        """A step's wait for data after the clock started (the learner may wait for the first prompt)."""
        return min(step["wait_s"], max(0.0, step["at"] - t0 - step["train_s"] - step["publish_s"]))

    def _decisions(self, job: str) -> list[dict]:
        """The controller's decisions that changed the allocation."""
        return [e for e in read_events(self.r, job, 10_000) if e["kind"] == "decision" and e["to"] != e["from"]]

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
