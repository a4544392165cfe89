"""``libra-ctl chaos``: run a job while killing its processes and restarting its Redis, then audit it.

Called from the command line (``scripts/chaos``, ``libra-ctl chaos sim|real``)
and by ``tests/chaos/``. The harness owns everything it hurts. It starts the
Redis server itself (AOF on, ``appendfsync always``, so that a SIGKILL of the
server loses no acknowledged write) and then either

- ``sim``: a sim job (``pipeline.sim``: the real controller, node agent,
  streams and consumer groups, with cost-model workers on compressed time),
  whose controller and agent it starts and supervises itself, as
  ``libra-ctl run`` does; or
- ``real``: a whole ``libra-ctl run CONFIG`` (vLLM rollout, torch learner), which
  supervises its own controller, agent and feeder.

A seeded schedule (``make_schedule``) says what happens when, in seconds
after the learner's first step: ``kill ROLE`` (SIGKILL a live worker of that
role at work, past loading, picked at random), ``kill controller``, ``kill agent`` (each must be
restarted by its supervisor and the run must go on), and ``restart redis``
(SIGKILL the server, then start it again on the same directory and socket).
The same seed gives the same schedule; a failed run prints the command that
replays it. Only processes of this run are signalled: the workers an agent
recorded (checked by pid and process start time, as the agent does) and the
children of the processes this harness started.

At the end the job must have trained all its steps and ``libra-ctl audit``
must say ok: every issued trajectory trained, dropped as stale,
dead-lettered or still in flight (none lost), none trained twice. The
summary (kills by role, restarts, lost, duplicated, wall time) is printed and,
with ``--json OUT``, written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import redis

from pipeline import argtypes
from pipeline.config import ConfigError
from pipeline.control.agent import process_start
from pipeline.dataplane.lifeline import own_runs
from pipeline.logs import STDERR
from pipeline.dataplane.keys import AGENTS, CONTROLLER_EPOCH, JobKeys, agent_log, agent_procs
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect

ROOT = Path(__file__).resolve().parent.parent
WORKER_ROLES = ("rollout", "reward", "learner", "feeder")
POLL_S = 0.2
STEP_SHARE = 0.75           # the schedule's events come within this share of the job's steps at the latest
REDIS_DOWN_S = 1.0          # how long the server stays dead before its restart
TARGET_WAIT_S = 120.0       # how long a kill waits for a live process of its role (one may be restarting)
RESTART_WAIT_S = 90.0       # how long a killed controller or agent may take to come back
FIRST_STEP_WAIT_S = 900.0   # from the start to the learner's first step (a real run builds a policy, loads vLLM)

# Default kill counts: many on the sim backend (processes start in a second), few on the real one (vLLM loads
# in tens of seconds on a CPU).
SIM_KILLS = {"rollout": 8, "reward": 5, "learner": 4, "feeder": 3}
REAL_KILLS = {"rollout": 2, "reward": 1, "learner": 1, "feeder": 1}


class ChaosFailed(RuntimeError):
    """The run under chaos crashed, hung or lost its place; the message says where to look."""


# --- the schedule (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One planned fault: ``at_s`` seconds after the learner's first step, or once it reaches ``at_step``."""

    at_s: float
    kind: str          # "kill" (a worker of ``role``), "kill_controller", "kill_agent", "restart_redis"
    role: str = ""
    at_step: int = 0   # 0: no step bound

    @property
    def target(self) -> str:
        """What is hit: a worker role, "controller", "agent" or "redis"."""
        return self.role if self.kind == "kill" else self.kind.split("_", 1)[1]

    def describe(self) -> str:
        verb = "restart" if self.kind == "restart_redis" else "kill -9"
        by = f" (or step {self.at_step:>4})" if self.at_step else ""
        return f"t+{self.at_s:6.1f}s{by}  {verb} {self.target}"


@dataclass(frozen=True)
class Plan:
    """What a schedule holds: kills per worker role, control-plane kills, Redis restarts, and over how long."""

    kills: dict
    controller_kills: int = 1
    agent_kills: int = 1
    redis_restarts: int = 2
    span_s: float = 60.0
    steps: int = 0     # the job's steps: each event also comes at its share of STEP_SHARE of them (0: never)

    def events(self) -> list[tuple[str, str]]:
        """(kind, role) of every planned fault, in a fixed order (the seed shuffles it)."""
        out = [("kill", role) for role in WORKER_ROLES for _ in range(self.kills.get(role, 0))]
        out += [("kill_controller", "")] * self.controller_kills + [("kill_agent", "")] * self.agent_kills
        return out + [("restart_redis", "")] * self.redis_restarts


def make_schedule(seed: int, plan: Plan) -> list[Event]:
    """The faults of ``plan`` in a seeded order, one in each of equal slices of ``span_s``.

    Each event lands at a seeded point of the middle 80% of its slice, so two
    events are at least a fifth of a slice apart and the run can react to
    one before the next. Each also has a step bound (``step_bound``).
    """
    rng = random.Random(seed)
    kinds = plan.events()
    rng.shuffle(kinds)
    slice_s = plan.span_s / max(len(kinds), 1)
    times = [round(slice_s * (i + 0.1 + 0.8 * rng.random()), 1) for i in range(len(kinds))]
    return [Event(t, kind, role, step_bound(t, plan)) for t, (kind, role) in zip(times, kinds)]


def step_bound(at_s: float, plan: Plan) -> int:
    """The learner step by which an event at ``at_s`` comes even if its time has not: a fast run would
    otherwise train all its steps before the schedule ends. Events keep to the first ``STEP_SHARE`` of the
    steps, so the run trains on after the last one."""
    if not plan.steps:
        return 0
    return max(1, int(plan.steps * STEP_SHARE * at_s / plan.span_s))


def format_schedule(seed: int, events: list[Event]) -> str:
    return "\n".join([f"chaos schedule (seed {seed}, {len(events)} events):"] + ["  " + e.describe() for e in events])


ROOT = Path(__file__).resolve().parent.parent   # scripts/chaos runs from here
_VALUED = {"--seed", "--dir", "--json", "--set", "--kills", "--controller-kills", "--agent-kills",
           "--redis-restarts", "--span", "--timeout", "--steps", "--time-scale", "--rollout", "--reward"}


def replay_command(argv: list[str], seed: int, cwd: Path | None = None) -> str:
    """``scripts/chaos ARGS --seed SEED``: the command line that runs the same schedule again.

    Without ``--dry-run``, and without ``--dir``: a replay starts in a fresh
    directory (the old one's Redis and agent logs would count again). The
    config and ``--json`` paths are made absolute when ``cwd`` is not the
    repository root, where ``scripts/chaos`` runs.
    """
    here = (cwd or Path.cwd()).resolve()

    def path(p: str) -> str:
        return p if here == ROOT or Path(p).is_absolute() else str(here / p)

    args, it, config_seen = [], iter(argv), False
    for a in it:
        flag, eq, value = a.partition("=")
        if flag in ("--seed", "--dir"):
            if not eq:
                next(it, None)
        elif a == "--dry-run":
            pass
        elif flag == "--json":
            args += ["--json", path(value if eq else next(it, ""))]
        elif flag in _VALUED:
            args += [a] if eq else [a, next(it, "")]
        elif not a.startswith("-") and args[:1] == ["real"] and not config_seen:
            args.append(path(a))   # the config (argparse takes it before or after the options)
            config_seen = True
        else:
            args.append(a)
    return shlex.join(["scripts/chaos", *args, "--seed", str(seed)])


# --- what the harness starts and hurts -----------------------------------------------------------


class ChaosRedis:
    """The run's Redis: AOF with ``appendfsync always``; ``crash`` is SIGKILL, then a restart on the same files."""

    APPENDFSYNC = "always"

    def __init__(self, data_dir: Path):
        self.server = EmbeddedRedis(data_dir, maxmemory="2gb", appendfsync=self.APPENDFSYNC)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        self.server.start(timeout_s=60.0)

    def crash_and_restart(self, down_s: float = REDIS_DOWN_S) -> float:
        """SIGKILL redis-server, wait ``down_s``, start it again (it replays its AOF); returns the seconds down.

        ``EmbeddedRedis`` runs the server under a small watchdog
        (``dataplane.lifeline``); the server itself is the one killed, as a
        crash would, not the watchdog (whose death would stop it cleanly).
        """
        t0 = time.monotonic()
        wrapper = self.server.proc
        servers = [p for p in psutil.Process(wrapper.pid).children() if p.name().startswith("redis-server")]
        if not servers:
            raise ChaosFailed(f"no redis-server under pid {wrapper.pid}: Redis died by itself")
        for p in servers:
            p.kill()
        wrapper.wait(timeout=30)
        time.sleep(down_s)
        self.start()
        return time.monotonic() - t0

    def stop(self) -> None:
        self.server.stop()


@dataclass(frozen=True)
class Victim:
    """A live process of this run: what it is, its pid, and its start time (so a reused pid is never hit)."""

    name: str
    pid: int
    start: int


def agent_workers(r: redis.Redis, job: str, role: str) -> list[Victim]:
    """The job's running workers of ``role`` that a node agent started, as the agents recorded them."""
    out = []
    for node in sorted(n.decode() for n in r.hkeys(AGENTS)):
        for raw in r.hvals(agent_procs(node)):
            rec = json.loads(raw)
            if (rec["job"] == job and rec["role"] == role and rec["state"] == "running"
                    and process_start(rec["pid"]) == rec["start"]):
                out.append(Victim(rec["worker"], rec["pid"], rec["start"]))
    return sorted(out, key=lambda v: v.name)


def children_running(parent_pid: int, name: str, match: Callable[[int, list[str]], bool]) -> list[Victim]:
    """Children of ``parent_pid`` for which ``match(pid, command line)`` holds, named ``name``."""
    out = []
    try:
        kids = psutil.Process(parent_pid).children()
    except psutil.NoSuchProcess:
        return []
    for p in kids:
        try:
            cmd = p.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        start = process_start(p.pid)
        if start is not None and match(p.pid, cmd):
            out.append(Victim(name, p.pid, start))
    return out


def runs_module(*words: str) -> Callable[[int, list[str]], bool]:
    """A ``children_running`` match: the command line holds ``words`` in a row (e.g. ``-m workers.feeder``)."""
    n = len(words)
    return lambda _pid, cmd: any(tuple(cmd[i:i + n]) == words for i in range(len(cmd) - n + 1))


def registered_agents(r: redis.Redis) -> set[int]:
    """Pids of the agents in ``AGENTS`` (an agent's command line is rq's process title, not its argv)."""
    return {json.loads(raw)["pid"] for raw in r.hvals(AGENTS)}


def kill(v: Victim, wait_s: float = 10.0) -> bool:
    """SIGKILL ``v`` if it is still the process recorded (pid and start time), and wait until it is dead.

    Returns whether the signal went. A killed process lingers a moment (and as
    a zombie until its parent reaps it): waiting keeps the next kill from
    picking it again.
    """
    if process_start(v.pid) != v.start:
        return False
    try:
        os.kill(v.pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while process_start(v.pid) == v.start and time.monotonic() < deadline:
        time.sleep(0.01)
    return True


# --- the two backends ------------------------------------------------------------------------------

# The sim job's cost model: rollout is the heavy stage, a learner step lasts about half a wall second at
# time_scale 10 on 3 rollout slots, and a process started into the running job pays 0.5 wall seconds.
SIM_WORKLOAD = """name = "chaos"

[cluster]
gpus = {gpus}
switch_cost_s = 5.0

[rollout]
concurrency = 8
decode_tokens_per_s = 50.0
prefill_tokens_per_s = 100000.0
weight_sync_s = 0.5

[reward]
gpu = false
seconds = 0.01
cpu_workers = 4

[learner]
train_tokens_per_s = 3000.0
scaling_exponent = 0.9
weight_publish_s = 0.1

[job]
batch_size = 32
group_size = 4
max_staleness = 2
steps = {steps}
seed = {seed}

[[phase]]
until_step = {steps}
prompt_tokens = 100
response_tokens = {{ median = 200, p99 = 400, max = 800 }}
"""


def write_sim_workload(path: Path, *, steps: int, gpus: int, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SIM_WORKLOAD.format(steps=steps, gpus=gpus, seed=seed))
    return path


def worker_env(url: str) -> dict:
    return dict(os.environ, **{ENV_URL: url, "PYTHONUNBUFFERED": "1"})


class Backend:
    """A run under chaos: how it starts, where its processes are, and how it ends."""

    job: str
    steps: int
    run_dir: Path | None = None

    def start(self, url: str) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """Supervise what this harness supervises; ChaosFailed if the run died."""

    def workers(self, r: redis.Redis, role: str) -> list[Victim]:
        return agent_workers(r, self.job, role)

    def controllers(self, r: redis.Redis) -> list[Victim]:
        raise NotImplementedError

    def agents(self, r: redis.Redis) -> list[Victim]:
        raise NotImplementedError

    def finish(self, r: redis.Redis, timeout_s: float) -> None:
        """End the trained job; ChaosFailed if it does not end cleanly."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop whatever of the run still runs (also after a failure)."""


class SimBackend(Backend):
    """A sim job (``pipeline.sim``) on a controller and an agent this harness starts and supervises.

    The allocation is pinned (``rollout`` slots, one learner slot, ``reward``
    processes beside the slots); the agent starts the feeder, as
    ``libra-ctl sim-job`` has it do.
    """

    NODE = "chaos"

    def __init__(self, base: Path, *, steps: int, time_scale: float, seed: int, rollout: int = 3,
                 reward: int = 2, job: str = "chaos"):
        self.base, self.steps, self.time_scale, self.seed, self.job = base, steps, time_scale, seed, job
        self.counts = {"rollout": rollout, "reward": reward, "learner": 1}
        self.control = None

    def start(self, url: str) -> None:
        from pipeline.control import actions
        from pipeline.control.allocation import pin
        from pipeline.control.local import start_local_control
        from pipeline.sim.job import prepare_sim_run

        r = connect(url)
        own_runs()   # the workers end with this harness, as they do with libra-ctl run
        slots = self.counts["rollout"] + self.counts["learner"]
        workload = write_sim_workload(self.base / "workload.toml", steps=self.steps, gpus=slots, seed=self.seed)
        control = {"mode": "pinned", "interval_s": 1.0, "metrics_port": 0}
        self.run_dir = prepare_sim_run(r, workload, self.base / "runs", job=self.job, time_scale=self.time_scale,
                                       redis_url=url, reward_workers=self.counts["reward"], control=control)
        pin(r, self.job, self.counts)
        self.control = start_local_control(None, self.run_dir, url, slots=slots, node=self.NODE, interval_s=1.0,
                                           say=lambda line: print(f"  {line}", flush=True))
        actions.ensure(r, self.NODE, {"job": self.job, "worker": "feeder-0", "role": "feeder", "slots": [],
                                      "run_dir": str(self.run_dir), "backend": "sim"})

    def tick(self) -> None:
        try:
            self.control.check()   # restarts a dead controller or agent after its back-off
        except RuntimeError as exc:   # a crash loop
            raise ChaosFailed(str(exc)) from None

    def controllers(self, r: redis.Redis) -> list[Victim]:
        return self.started("controller")

    def agents(self, r: redis.Redis) -> list[Victim]:
        return self.started("agent")

    def started(self, name: str) -> list[Victim]:
        """The live process ``name`` of the ones this harness started and supervises."""
        out = []
        for n, p in self.control.procs if self.control else ():
            start = process_start(p.pid) if n == name and p.poll() is None else None
            if start is not None:
                out.append(Victim(name, p.pid, start))
        return out

    def finish(self, r: redis.Redis, timeout_s: float) -> None:
        # any phase but running/trained ends the job: the controller and the agent drain its workers
        r.hset(JobKeys(self.job).state, "phase", "done")
        self.stop()

    def stop(self) -> None:
        if self.control is not None:
            self.control.stop()
            self.control = None


class RealBackend(Backend):
    """``libra-ctl run CONFIG`` on this harness's Redis; it supervises its own controller, agent and feeder."""

    def __init__(self, base: Path, config: str, sets: list[str], job: str = "chaos-real"):
        from pipeline import config as config_mod

        self.base, self.job = base, job
        self.sets = [*sets, f"job.name={job}", f"run.runs_dir={json.dumps(str(base / 'runs'))}"]
        self.config = config
        self.steps = config_mod.load(config, self.sets).job.steps   # a bad config or --set fails here
        self.proc: subprocess.Popen | None = None
        self.output = base / "run.out"

    def start(self, url: str) -> None:
        argv = [sys.executable, "-m", "pipeline.cli", "run", self.config, *sum((["--set", s] for s in self.sets), [])]
        self.base.mkdir(parents=True, exist_ok=True)
        with open(self.output, "ab") as out:
            self.proc = subprocess.Popen(argv, env=worker_env(url), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def tick(self) -> None:
        if self.proc.poll() not in (None, 0):   # 0: it trained every step, evaluated and stopped (finish checks)
            raise ChaosFailed(f"libra-ctl run exited with code {self.proc.returncode}; "
                              f"its output ends:\n{tail(self.output)}")

    def workers(self, r: redis.Redis, role: str) -> list[Victim]:
        found = agent_workers(r, self.job, role)
        if role == "feeder":   # libra-ctl run starts the feeder itself
            found += children_running(self.proc.pid, "feeder-0", runs_module("-m", "workers.feeder"))
        return found

    def controllers(self, r: redis.Redis) -> list[Victim]:
        return children_running(self.proc.pid, "controller", runs_module("pipeline.cli", "controller"))

    def agents(self, r: redis.Redis) -> list[Victim]:
        pids = registered_agents(r)
        return children_running(self.proc.pid, "agent", lambda pid, _cmd: pid in pids)

    def finish(self, r: redis.Redis, timeout_s: float) -> None:
        """The run evaluates the final policy, stops its processes and exits 0."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ChaosFailed(f"libra-ctl run did not exit within {timeout_s:.0f}s of the last step; its output "
                              f"ends:\n{tail(self.output)}") from None
        if code != 0:
            raise ChaosFailed(f"libra-ctl run exited with code {code}; its output ends:\n{tail(self.output)}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)   # the run stops its controller, agent and workers in order
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def worker_exits(r: redis.Redis, job: str) -> dict:
    """How the job's agent-started workers ended, from the agents' logs.

    ``killed``: SIGKILL (ours, or an agent's after the drain grace);
    ``signalled``: another signal (SIGTERM before the worker's handler was
    in place); ``crashed``: a non-zero exit code, which no fault of the
    schedule explains: a worker must survive a Redis restart; ``clean``: 0;
    ``unknown``: adopted by a restarted agent, whose exit code only its
    parent could read.
    """
    out = {"killed": 0, "signalled": 0, "crashed": 0, "clean": 0, "unknown": 0}
    for log in r.keys(agent_log("*")):
        for _id, f in r.xrange(log):
            if f.get(b"event") != b"exited" or not f.get(b"key", b"").startswith(f"{job}/".encode()):
                continue
            code = json.loads(f.get(b"code", b"null"))
            kind = ("unknown" if code is None else "clean" if code == 0 else "crashed" if code > 0
                    else "killed" if code == -signal.SIGKILL else "signalled")
            out[kind] += 1
    return out


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def leftover_processes(r: redis.Redis, job: str, seen: set) -> list[Victim]:
    """Processes of the run still alive: every worker of ``job`` an agent ever started (its log's ``spawned``
    events, pid and start time), and every process in ``seen`` (controllers, agents, a real run's feeders).
    After the run's end: none."""
    started = set(seen)
    for log in r.keys(agent_log("*")):
        for _id, f in r.xrange(log):
            if f.get(b"event") == b"spawned" and f.get(b"key", b"").startswith(f"{job}/".encode()):
                started.add(Victim(f[b"key"].decode().split("/", 1)[1], int(f[b"pid"]), int(f[b"start"])))
    return sorted((v for v in started if process_start(v.pid) == v.start), key=lambda v: v.pid)


# --- the run under chaos ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What the harness did and saw."""

    kills: dict = field(default_factory=lambda: {role: 0 for role in WORKER_ROLES})
    controller_kills: int = 0
    agent_kills: int = 0
    controller_restarts: int = 0    # killed, and a new one back at work (holding the lease; heartbeating)
    agent_restarts: int = 0
    redis_restarts: int = 0
    controllers: set = field(default_factory=set)   # every controller and agent process seen (Victims): a crash
    agents: set = field(default_factory=set)        # loop shows as many more processes than restarts
    feeders: set = field(default_factory=set)       # the feeders seen (a real run starts its own, no agent logs it)
    performed: list = field(default_factory=list)   # one record per event done: planned and actual time, target
    missed: list = field(default_factory=list)      # events that could not be done, with the reason


    def seen(self) -> set:
        """Every process of the run the harness saw besides the workers agents logged."""
        return self.controllers | self.agents | self.feeders


class ChaosRun:
    """Start the backend on a fresh Redis, play the schedule, let the job finish, audit it."""

    def __init__(self, backend: Backend, redis_server: ChaosRedis, schedule: list[Event], seed: int, *,
                 timeout_s: float, out=STDERR):
        self.backend, self.redis, self.schedule, self.seed = backend, redis_server, schedule, seed
        self.timeout_s, self.out = timeout_s, out
        self.targets = random.Random(f"{seed}/targets")   # which live worker a kill picks
        self.tally = Tally()
        self.r: redis.Redis | None = None
        self.t_start = self.t0 = 0.0
        self.deadline = 0.0

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    # --- waiting, while watching the run ---------------------------------------------------------

    def tick(self) -> None:
        """Supervise the run, note its controller and agent processes; ChaosFailed past the deadline."""
        self.backend.tick()
        try:
            self.tally.controllers.update(self.backend.controllers(self.r))
            self.tally.agents.update(self.backend.agents(self.r))
            self.tally.feeders.update(self.backend.workers(self.r, "feeder"))
        except (redis.ConnectionError, redis.TimeoutError):
            pass   # our own Redis restarting
        if time.monotonic() > self.deadline:
            raise ChaosFailed(f"the run took longer than --timeout {self.timeout_s:.0f}s")

    def wait_for(self, cond: Callable[[], object], timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            self.tick()
            try:
                got = cond()
            except (redis.ConnectionError, redis.TimeoutError):
                got = None   # our own Redis restarting: it answers again in a moment
            if got:
                return got
            if time.monotonic() > deadline:
                raise ChaosFailed(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(POLL_S)

    def learner_step(self) -> int:
        raw = self.r.hget(JobKeys(self.backend.job).learner_stats, "step")
        return int(json.loads(raw)) if raw else 0

    def reached(self, step: int) -> bool:
        return bool(step) and self.learner_step() >= step

    def trained(self) -> bool:
        return self.r.hget(JobKeys(self.backend.job).state, "phase") in (b"trained", b"done")

    # --- the events --------------------------------------------------------------------------------

    def now(self) -> float:
        """Seconds since the learner's first step."""
        return round(time.monotonic() - self.t0, 1)

    def perform(self, ev: Event) -> None:
        if self.trained():
            self.miss(ev, "the job had trained all its steps before this event (raise --steps)")
            return
        if ev.kind == "restart_redis":
            at = self.now()
            down = self.redis.crash_and_restart()
            self.r.connection_pool.disconnect()
            self.tally.redis_restarts += 1
            self.done(ev, at, "redis", f"down {down:.1f}s")
        elif ev.kind == "kill":
            self.kill_worker(ev)
        else:
            self.kill_control(ev)

    def kill_worker(self, ev: Event) -> None:
        deadline = time.monotonic() + TARGET_WAIT_S
        while time.monotonic() < deadline:
            live = [v for v in self.backend.workers(self.r, ev.role) if self.at_work(v)]
            if live:
                victim, at = self.targets.choice(live), self.now()
                if kill(victim):
                    self.tally.kills[ev.role] += 1
                    self.done(ev, at, victim.name, f"pid {victim.pid}")
                    return
            self.tick()
            time.sleep(POLL_S)
        self.miss(ev, f"no live {ev.role} worker for {TARGET_WAIT_S:.0f}s")

    def at_work(self, v: Victim) -> bool:
        """Whether ``v`` has started its work: the worker table's record of its id is this process's and past
        ``starting``. A kill due while a worker is down waits for its successor to load and run: killing a
        process still loading tests only the agent's back-off, and with one worker of a role the back-off
        grows to a minute and starves the job (a schedule of 10 rollout kills on one rollout slot did)."""
        raw = self.r.hget(JobKeys(self.backend.job).workers, v.name)
        rec = json.loads(raw) if raw else {}
        return rec.get("pid") == v.pid and rec.get("state") not in (None, "starting")

    def kill_control(self, ev: Event) -> None:
        """Kill the controller or the agent, then wait until its supervisor has brought back one that works."""
        by_kind = self.backend.controllers if ev.target == "controller" else self.backend.agents
        victim = self.wait_for(lambda: by_kind(self.r), TARGET_WAIT_S, f"a live {ev.target}")[0]
        epoch, at = int(self.r.get(CONTROLLER_EPOCH) or 0), self.now()
        if not kill(victim):
            self.miss(ev, f"the {ev.target} (pid {victim.pid}) exited before the kill")
            return
        t_kill = time.monotonic()
        if ev.target == "controller":
            self.tally.controller_kills += 1
        else:
            self.tally.agent_kills += 1

        def back() -> list[Victim]:
            fresh = [v for v in by_kind(self.r) if v.pid != victim.pid]
            if ev.target == "controller":   # a controller is back once it holds the lease: a new epoch
                return fresh if int(self.r.get(CONTROLLER_EPOCH) or 0) > epoch else []
            beats = {rec["pid"]: rec["heartbeat"] for rec in map(json.loads, self.r.hvals(AGENTS))}
            return [v for v in fresh if time.time() - beats.get(v.pid, 0) < RESTART_WAIT_S / 10]

        fresh = self.wait_for(back, RESTART_WAIT_S, f"the {ev.target} killed at t+{at}s to be back at work")
        if ev.target == "controller":
            self.tally.controller_restarts += 1
        else:
            self.tally.agent_restarts += 1
        self.done(ev, at, ev.target, f"pid {victim.pid} -> {fresh[0].pid}, back in {time.monotonic() - t_kill:.1f}s")

    def done(self, ev: Event, at: float, name: str, detail: str) -> None:
        self.tally.performed.append({"planned_s": ev.at_s, "at_s": at, "kind": ev.kind, "target": ev.target,
                                     "name": name, "detail": detail})
        self.say(f"  t+{at:6.1f}s  {'restarted' if ev.kind == 'restart_redis' else 'killed'} {name} ({detail})")

    def miss(self, ev: Event, reason: str) -> None:
        self.tally.missed.append({"planned_s": ev.at_s, "kind": ev.kind, "target": ev.target, "reason": reason})
        self.say(f"  t+{ev.at_s:6.1f}s  MISSED {ev.target}: {reason}")

    # --- the whole run ---------------------------------------------------------------------------------

    def run(self) -> dict:
        self.t_start = time.monotonic()
        self.deadline = self.t_start + self.timeout_s
        self.redis.start()
        self.r = connect(self.redis.url)
        self.say(f"redis: {self.redis.url}, AOF with appendfsync {ChaosRedis.APPENDFSYNC} (a SIGKILL of the server "
                 "loses no acknowledged write; everysec could lose up to a second of them)")
        self.backend.start(self.redis.url)
        self.wait_for(lambda: self.learner_step() >= 1, FIRST_STEP_WAIT_S, "the learner's first step")
        self.t0 = time.monotonic()
        if self.backend.run_dir is None:   # libra-ctl run made it
            self.backend.run_dir = Path(self.r.hget(JobKeys(self.backend.job).state, "run_dir").decode())
        self.say(f"the learner made its first step after {self.t0 - self.t_start:.0f}s; chaos starts "
                 f"(run directory {self.backend.run_dir})")
        paused = 0.0   # the schedule's clock stands still while an event waits for a target or a recovery
        for ev in self.schedule:
            due = self.t0 + paused + ev.at_s
            self.wait_for(lambda: time.monotonic() >= due or self.reached(ev.at_step) or self.trained(),
                          due - time.monotonic() + TARGET_WAIT_S, "the next event")
            self.perform(ev)
            paused += max(time.monotonic() - due, 0.0)
        self.say("schedule done; waiting for the job to train all its steps")
        self.wait_for(self.trained, self.deadline - time.monotonic(), f"all {self.backend.steps} steps")
        self.backend.finish(self.r, timeout_s=max(self.deadline - time.monotonic(), 60.0))
        return self.summary()

    def summary(self) -> dict:
        a = audit_job(self.redis.url, self.backend.job, self.backend.run_dir)
        leftovers = self.leftovers()
        t = self.tally
        accounted = a["trained"] + a["dropped_stale"] + a["dead_lettered"] + a["in_flight"]
        s = {
            "seed": self.seed, "job": self.backend.job, "run_dir": str(self.backend.run_dir),
            "kills_by_role": t.kills, "worker_kills": sum(t.kills.values()),
            "controller_kills": t.controller_kills, "controller_restarts": t.controller_restarts,
            "controller_processes": len(t.controllers),
            "agent_kills": t.agent_kills, "agent_restarts": t.agent_restarts, "agent_processes": len(t.agents),
            "redis_restarts": t.redis_restarts, "worker_exits": worker_exits(self.r, self.backend.job), "redis_appendfsync": ChaosRedis.APPENDFSYNC,
            "steps_planned": self.backend.steps, "steps": self.learner_step(),
            "lost": max(a["issued"] - accounted, 0), "duplicated": a["duplicates_trained"],
            "audit_ok": a["ok"], "audit": a, "leftover_processes": [asdict(v) for v in leftovers],
            "events_planned": len(self.schedule), "events": t.performed, "missed": t.missed,
            "wall_s": round(time.monotonic() - self.t_start, 1),
        }
        s["problems"] = problems(s)
        s["ok"] = not s["problems"]
        return s

    def leftovers(self, wait_s: float = 15.0) -> list[Victim]:
        """The run's processes still alive ``wait_s`` after its end (a stopped process may take a moment)."""
        deadline = time.monotonic() + wait_s
        while True:
            left = leftover_processes(self.r, self.backend.job, self.tally.seen())
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def cleanup(self) -> None:
        """Stop the run and then Redis, whatever happened; kill any worker the run left behind."""
        try:
            self.backend.stop()
            if self.r is not None:
                for v in leftover_processes(self.r, self.backend.job, self.tally.seen()):
                    kill(v)
        except redis.RedisError:
            pass
        finally:
            self.redis.stop()


def problems(s: dict) -> list[str]:
    """What makes a chaos run fail, in words."""
    out = [f"audit: {p}" for p in s["audit"]["problems"]]
    if s["lost"]:
        out.append(f"{s['lost']} trajectories lost")
    if s["duplicated"]:
        out.append(f"{s['duplicated']} trajectories trained twice")
    if s["steps"] < s["steps_planned"]:
        out.append(f"trained {s['steps']} of {s['steps_planned']} steps")
    if s["missed"]:
        out.append(f"{len(s['missed'])} of {s['events_planned']} planned events not done")
    if s["controller_restarts"] < s["controller_kills"] or s["agent_restarts"] < s["agent_kills"]:
        out.append("a killed controller or agent was not restarted")
    if s["worker_exits"]["crashed"]:
        out.append(f"{s['worker_exits']['crashed']} worker exits with an error (a crash no fault explains: "
                   "see the run's logs)")
    if s["leftover_processes"]:
        out.append(f"{len(s['leftover_processes'])} worker processes outlived the run")
    return out


def audit_job(url: str, job: str, run_dir: Path | None) -> dict:
    """``libra-ctl audit --json`` of the job, run as the command a user would run."""
    argv = [sys.executable, "-m", "pipeline.cli", "audit", "--job", job, "--json", "--redis", url]
    if run_dir:
        argv += ["--run", str(run_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ChaosFailed(f"libra-ctl audit failed (exit {done.returncode}): {done.stderr[-2000:]}") from None


def format_summary(s: dict) -> str:
    kills = ", ".join(f"{role} {n}" for role, n in s["kills_by_role"].items())
    rows = [
        ("worker kills", f"{s['worker_kills']} ({kills})"),
        ("controller kills / restarts", f"{s['controller_kills']} / {s['controller_restarts']} "
                                        f"({s['controller_processes']} processes in all)"),
        ("agent kills / restarts", f"{s['agent_kills']} / {s['agent_restarts']} ({s['agent_processes']} processes in all)"),
        ("redis restarts", f"{s['redis_restarts']} (appendfsync {s['redis_appendfsync']})"),
        ("worker exits seen by agents", ", ".join(f"{k} {v}" for k, v in s["worker_exits"].items())),
        ("steps trained", f"{s['steps']} of {s['steps_planned']}"),
        ("audit", "ok" if s["audit_ok"] else "FAILED"),
        ("lost", str(s["lost"])),
        ("trained twice", str(s["duplicated"])),
        ("wall time", f"{s['wall_s']:.0f} s"),
    ]
    width = max(len(k) for k, _v in rows)
    body = "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
    verdict = "chaos: ok" if s["ok"] else "chaos: FAILED: " + "; ".join(s["problems"])
    injected = s["worker_kills"] + s["controller_kills"] + s["agent_kills"] + s["redis_restarts"]
    if s["ok"] and not injected:   # a clean run, not a survived one
        verdict += " (no fault was injected: every kill and restart count was 0)"
    return f"{body}\n{verdict}"


# --- command line --------------------------------------------------------------------------------------


def kill_count(item: str) -> str:
    """An argparse type for ``--kills``: ``ROLE=N`` with a worker role and a whole N (else exit 2)."""
    role, _, n = item.partition("=")
    if role not in WORKER_ROLES or not (n.isascii() and n.isdigit()):
        raise argparse.ArgumentTypeError(f"{item!r}: give ROLE=N with ROLE one of {', '.join(WORKER_ROLES)}")
    return item


def parse_kills(items: list[str] | None, defaults: dict) -> dict:
    """``ROLE=N`` pairs over the backend's default kill counts."""
    kills = dict(defaults)
    for item in items or []:
        role, _, n = kill_count(item).partition("=")
        kills[role] = int(n)
    return kills


def plan_of(args, steps: int) -> Plan:
    defaults = SIM_KILLS if args.backend == "sim" else REAL_KILLS
    return Plan(kills=parse_kills(args.kills, defaults), controller_kills=args.controller_kills,
                agent_kills=args.agent_kills, redis_restarts=args.redis_restarts, span_s=args.span, steps=steps)


def job_steps(args) -> int:
    """The job's learner steps: ``--steps`` of a sim job, the config's of a real one (ConfigError if bad)."""
    if args.backend == "sim":
        return args.steps
    from pipeline import config as config_mod

    return config_mod.load(args.config, args.set or []).job.steps


def backend_of(args, base: Path, seed: int) -> Backend:
    if args.backend == "sim":
        return SimBackend(base, steps=args.steps, time_scale=args.time_scale, seed=seed, rollout=args.rollout,
                          reward=args.reward)
    return RealBackend(base, args.config, args.set or [])


def user_argv() -> list[str]:
    """The arguments after ``chaos`` (``libra-ctl chaos ...``) or after the module (``python -m pipeline.chaos``)."""
    argv = sys.argv[1:]
    return argv[1:] if argv[:1] == ["chaos"] else argv


def cmd_chaos(args) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    try:
        steps = job_steps(args)
    except ConfigError as exc:
        print(f"libra-ctl chaos: config error: {exc}", file=sys.stderr)
        return 2
    schedule = make_schedule(seed, plan_of(args, steps))
    replay = replay_command(args.argv if args.argv is not None else user_argv(), seed)
    print(format_schedule(seed, schedule), flush=True)
    print(f"replay with: {replay}", flush=True)
    if args.dry_run:
        return 0
    base = Path(args.dir or f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}").resolve()
    if (base / "redis").exists() or base.exists() and not base.is_dir():
        print(f"libra-ctl chaos: --dir {base} holds an earlier run (or is a file): its Redis and logs would "
              "count again; give a new directory", file=sys.stderr)
        return 2
    base.mkdir(parents=True, exist_ok=True)
    try:
        backend = backend_of(args, base, seed)
    except ConfigError as exc:   # a bad config or --set: nothing started yet
        print(f"libra-ctl chaos: config error: {exc}", file=sys.stderr)
        return 2
    run = ChaosRun(backend, ChaosRedis(base / "redis"), schedule, seed, timeout_s=args.timeout, out=sys.stdout)
    try:
        summary = run.run()
    except ChaosFailed as exc:
        summary = {"seed": seed, "ok": False, "problems": [str(exc)], "events": run.tally.performed,
                   "missed": run.tally.missed, "run_dir": str(backend.run_dir)}
        print(f"\nchaos: FAILED: {exc}", flush=True)
    finally:
        run.cleanup()
    summary.update(backend=args.backend, replay=replay, schedule=[asdict(e) for e in schedule], dir=str(base))
    if "audit" in summary:
        print(format_summary(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if not summary["ok"]:
        print(f"logs: {backend.run_dir or base}/logs\nreplay with: {replay}", flush=True)
    return 0 if summary["ok"] else 1


def add_arguments(p) -> None:
    count, positive = argtypes.count, argtypes.seconds
    sub = p.add_subparsers(dest="backend", required=True)
    # no abbreviated flags: the replay line rebuilds the command from what was typed
    sim = sub.add_parser("sim", help="a sim job (cost-model workers on the real control plane); many kills",
                         allow_abbrev=False)
    sim.add_argument("--steps", type=count, default=160, help="learner steps of the job (it must outlast --span)")
    sim.add_argument("--time-scale", type=positive, default=10.0, help="simulated seconds per wall second")
    sim.add_argument("--rollout", type=count, default=3, help="rollout slots (workers)")
    sim.add_argument("--reward", type=count, default=2, help="reward worker processes")
    real = sub.add_parser("real", help="libra-ctl run CONFIG (vLLM rollout, torch learner); fewer kills",
                          allow_abbrev=False)
    real.add_argument("config", help="job TOML, e.g. examples/quickstart.toml")
    real.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    for q, span in ((sim, 60.0), (real, 120.0)):
        q.add_argument("--seed", type=argtypes.whole, help="seed of the schedule (default: a random one, printed)")
        q.add_argument("--kills", action="append", metavar="ROLE=N", type=kill_count,
                       help=f"worker kills of a role (default {SIM_KILLS if q is sim else REAL_KILLS})")
        q.add_argument("--controller-kills", type=argtypes.whole, default=1)
        q.add_argument("--agent-kills", type=argtypes.whole, default=1)
        q.add_argument("--redis-restarts", type=argtypes.whole, default=2 if q is sim else 1)
        q.add_argument("--span", type=positive, default=span, help="seconds after the first learner step over "
                                                                   "which the events are spread")
        q.add_argument("--timeout", type=positive, default=1800.0, help="give up after this many seconds")
        q.add_argument("--dir", help="where Redis, the run and the logs go (default runs/chaos-<stamp>)")
        q.add_argument("--json", metavar="OUT", help="write the summary as JSON")
        q.add_argument("--dry-run", action="store_true", help="print the schedule and stop")
        q.set_defaults(func=cmd_chaos, argv=None)


def add_commands(sub) -> None:
    p = sub.add_parser("chaos", help="a live run under kill -9 and Redis restarts, then the audit (docs/chaos.md)")
    add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if argv is not None:
        args.argv = list(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
