"""``libra-ctl agent``: the node agent, one per machine; it owns the worker processes of its slots.

It knows its slots (``--slots N`` CPU slots; else ``LIBRA_GPUS=0,1,...``;
else the GPUs nvidia-ml-py finds), registers them in ``AGENTS`` with a
heartbeat, and holds ``agent_lock(node)`` so one agent acts per node name.

Its main loop, every ``TICK_S``:

1. runs the control jobs waiting on its rq queue in-process (an rq
   ``SimpleWorker`` that never forks; ``pipeline.control.actions``): they only
   write the desired state of workers into ``agent_desired(node)``; at start
   it first requeues the jobs a killed predecessor took and did not finish;
2. reaps its processes that exited: a slot is free only once its process has
   exited; a crash (non-zero exit while the worker should run) is restarted
   with exponential back-off (kept in ``agent_backoff(node)``, so a
   restarted agent keeps a crash-looping worker's wait), a clean exit (the
   learner finished) is not;
   an adopted process's exit code is not ours to read, so an adopted learner
   that exits once its job is marked trained counts as a clean exit, and
   no learner is started for a trained job;
3. drives processes toward the desired state: SIGTERM to a worker that
   should not run or whose job is over (the stage finishes the batch in
   hand, writes and acks, exits; the learner commits its step and exits),
   SIGKILL to its process group after ``grace_s``; a worker that should
   run and has none is started when every one of its slots is free, with
   its own ``CUDA_VISIBLE_DEVICES``;
4. publishes its processes in ``agent_procs(node)`` and logs every start and
   stop in ``agent_log(node)``.

Workers are started here, in the agent's own process, with
``subprocess.Popen(start_new_session=True)``; each is recorded as (pid,
process start time), and a signal goes only to a process whose start time
still matches, so a reused pid is never mistaken for ours. A restarted agent
adopts the live workers its predecessor recorded instead of starting second
copies. SIGTERM or SIGINT to the agent drains all its workers, then it exits.

Its workers do not die with it (no PDEATHSIG): an agent restarted by
``libra-ctl run`` or by systemd adopts them. They die with the run that
owns them (``lifeline.watch_owner``), and the agent of a local run dies
with its run (``lifeline.watch_parent``). While Redis is unreachable the
agent keeps its workers and waits, up to ``$LIBRA_REDIS_OUTAGE_S``; then it
exits non-zero (its supervisor restarts it; the workers are adopted).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
import structlog

from pipeline import argtypes, cgroup
from pipeline.control import actions
from pipeline.control.actions import STATE_DRAIN, STATE_GONE, STATE_RUN
from pipeline.dataplane.keys import (AGENTS, ROLES, JobKeys, agent_backoff, agent_desired, agent_lock, agent_log,
                                     agent_procs)
from pipeline.dataplane.lifeline import ORPHAN_EXIT_S, process_start, watch_parent
from pipeline.dataplane.redisconn import ENV_URL, UNAVAILABLE, Outage, connect
from pipeline.dataplane.worker import NODE_ENV, SLOTS_ENV, this_node
from pipeline.logs import open_output

TICK_S = 0.2
HEARTBEAT_S = 1.0
LOCK_TTL_S = 15.0
GRACE_S = 30.0            # SIGTERM -> SIGKILL; longer than a stage's slowest batch
BACKOFF_S = (1.0, 60.0)   # first and longest wait before restarting a crashed worker
HAND_OVER_PAGE = 10_000   # pending entries listed or claimed per command when a worker's are handed over
STABLE_S = 60.0           # a worker that ran this long starts its back-off afresh
TOMBSTONE_S = 3600.0      # drained records are kept this long, so a late retried action stays ignored
GPUS_ENV = "LIBRA_GPUS"


def oom_counter() -> Path | None:
    """The file where the kernel counts the processes its out-of-memory killer killed (``oom_kill N``):
    this process's memory cgroup where it can be read (v2 ``memory.events``, v1 ``memory.oom_control``; a
    worker's cgroup is its agent's), else the machine's ``/proc/vmstat``; None where none can be read."""
    found = cgroup.candidates("memory.events", "memory", "memory.oom_control") + [Path("/proc/vmstat")]
    return next((c for c in found if oom_kills(c) is not None), None)


def oom_kills(path: Path | None) -> int | None:
    """The ``oom_kill`` count in ``path`` (see ``oom_counter``); None when it cannot be read."""
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            name, _sep, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


class SlotError(ValueError):
    """The agent cannot tell which slots it has; the message says the fix."""


@dataclass(frozen=True)
class Slot:
    index: int
    device: str | None    # CUDA device id of a GPU slot; None for a CPU slot

    def as_dict(self) -> dict:
        return {"index": self.index, "device": self.device}


def detect_slots(cpu_slots: int | None = None, env: dict | None = None) -> list[Slot]:
    """``--slots N`` CPU slots, else ``LIBRA_GPUS``, else the GPUs nvidia-ml-py sees."""
    env = os.environ if env is None else env
    if cpu_slots is not None:
        if cpu_slots < 1:
            raise SlotError(f"--slots {cpu_slots}: give at least 1 slot")
        return [Slot(i, None) for i in range(cpu_slots)]
    if env.get(GPUS_ENV, "").strip():
        ids = [g.strip() for g in env[GPUS_ENV].split(",") if g.strip()]
        return [Slot(i, d) for i, d in enumerate(ids)]
    n = nvml_gpu_count()
    if n:
        return [Slot(i, str(i)) for i in range(n)]
    raise SlotError(f"no GPU found (nvidia-ml-py) and {GPUS_ENV} is unset: pass --slots N to use N CPU slots, "
                    f"or set {GPUS_ENV}=0,1,...")


def nvml_gpu_count() -> int:
    """GPUs visible to NVML, 0 without nvidia-ml-py or a driver."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return 0


def worker_argv(backend: str, role: str, run_dir: str, worker: str) -> list[str]:
    """The command of a worker; a fixed table, so a control job can never name a program."""
    tail = ["--run-dir", run_dir, "--worker-id", worker]
    if role == "feeder":
        return [sys.executable, "-m", "workers.feeder", *tail]
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    if backend == "sim":
        return [sys.executable, "-m", "pipeline.sim.worker", "--role", role, *tail]
    if backend == "vllm":
        return [sys.executable, "-m", f"workers.{role}", *tail]
    raise ValueError(f"unknown backend {backend!r}; use vllm or sim")


@dataclass
class Proc:
    """A worker process this agent started (``popen``) or adopted from its predecessor (no ``popen``)."""

    key: str
    spec: dict
    pid: int
    start: int
    started_at: float
    popen: subprocess.Popen | None = None
    term_at: float | None = None
    killed: bool = False
    oom_base: int | None = None   # the kernel's count of OOM kills when it started (``oom_kills``)

    @property
    def slots(self) -> list[int]:
        return list(self.spec["slots"])

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return process_start(self.pid) == self.start

    @property
    def exit_code(self) -> int | None:
        return self.popen.returncode if self.popen is not None else None

    def ours(self) -> bool:
        """Still the process we recorded: an unreaped child of ours, or a matching start time."""
        if self.popen is not None:
            return self.popen.returncode is None
        return process_start(self.pid) == self.start

    def signal(self, sig: int, group: bool = False) -> bool:
        if not self.ours():
            return False
        try:
            # start_new_session made the worker a group leader: the group is it and what it started
            if group and os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def record(self, node: str) -> dict:
        return {**{k: self.spec[k] for k in ("job", "worker", "role", "slots", "backend")},
                "generation": self.spec.get("generation", 0), "node": node, "pid": self.pid,
                "start": self.start, "started_at": self.started_at,
                "state": "draining" if self.term_at else "running"}


def kill_group_left_by(pid: int) -> None:
    """SIGKILL what an exited worker (``pid``, a group leader: ``start_new_session``) left in its process group.

    Linux reuses no pid while a process group of that id has members: with no
    process under ``pid``, a group of that id is still the worker's own."""
    try:
        os.kill(pid, 0)
        return   # a process holds the pid again: the old group is empty (or never was)
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass   # no member left


def same_worker(d: dict, spec: dict) -> bool:
    """Whether the desired record ``d`` still describes the process started from ``spec``.

    A worker id is unique within a job, and every run of a job reuses its name:
    a record of another run directory is another worker (the process is
    drained and a fresh one started for the new run, never kept).
    """
    return (d.get("run_dir") == spec.get("run_dir") and d["role"] == spec["role"]
            and list(d["slots"]) == list(spec["slots"]) and d.get("generation", 0) == spec.get("generation", 0))


def same_dir(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


@dataclass
class Backoff:
    restarts: int = 0
    next_at: float = 0.0  # time.time() of the earliest restart (wall clock: it outlives the agent's process)
    run_dir: str = ""     # the run whose worker crashed: a later run's worker of the same id starts afresh
    failures: int = 0     # of those restarts, the exits in a row with an error code or by the OOM killer
    code: int | None = None   # the last exit code (None: an adopted process's, unknown)
    oom: bool = False     # the last exit was a SIGKILL while the kernel's OOM killer killed (``oom_kills``)


class ControlJobRunner:
    """rq's SimpleWorker driven step by step from the agent's loop: jobs run here, never in a fork.

    Only the control actions run (``actions.ACTIONS``): a job that
    ``actions.check_job`` refuses (another function, a pickled payload, a
    callback, a webhook, arguments of another shape or for another node) is
    failed with the reason in rq's failed registry, never imported nor called.
    """

    def __init__(self, r: redis.Redis, node: str, log=None):
        from rq import SimpleWorker
        from rq.job import Job
        from rq.scheduler import RQScheduler
        from rq.serializers import JSONSerializer
        from rq.timeouts import TimerDeathPenalty

        class ActionJob(Job):
            @property
            def func(self):
                # a second lock behind check_job: whatever path leads rq to the function, only an action resolves
                if not isinstance(self.func_name, str) or self.func_name not in actions.ACTIONS:
                    raise actions.Refused(f"{self.func_name!r} is not a control action")
                return super().func

        class InProcessWorker(SimpleWorker):
            death_penalty_class = TimerDeathPenalty   # no SIGALRM: works from any thread

            def _install_signal_handlers(self):
                pass   # the agent owns SIGTERM and SIGINT

            def subscribe(self):
                pass   # nor rq's command channel: no `rq shutdown` stops an agent, and no thread is left behind

            def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
                # One try. rq's own loop retries a lost connection for ever, deaf to the agent's stop and to its
                # outage limit (a SIGTERM while Redis was away never ended the agent): a connection error goes
                # to the agent's loop, which waits the outage out (Outage) and stops when asked.
                self.heartbeat()
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                got = self.queue_class.dequeue_any(self._ordered_queues, timeout, connection=self.connection,
                                                   job_class=self.job_class, serializer=self.serializer,
                                                   death_penalty_class=self.death_penalty_class)
                if got is not None:
                    self.reorder_queues(reference_queue=got[1])
                    got[0].redis_server_version = self.get_redis_server_version()
                return got

        self.node = node
        self.log = log or structlog.get_logger("agent").bind(node=node)
        self.queue = actions.queue(r, node)
        self.worker = InProcessWorker([self.queue], connection=r, serializer=JSONSerializer, job_class=ActionJob,
                                      name=f"libra-agent-{node}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.scheduler = RQScheduler([self.queue], connection=r, serializer=JSONSerializer)
        self.scheduler.prepare_registries([self.queue.name])
        self.worker.bootstrap(logging_level="WARNING")

    def recover(self) -> int:
        """Put back at the front of the queue the jobs a dead predecessor took and did not finish.

        rq moves a job off the queue into an intermediate list, then into the
        started registry while it runs; an agent killed in between leaves it
        there, and nothing of ours would ever run it (rq's own maintenance
        fails a job stuck that way after a minute). Only the agent holding
        the node's lock takes from its queue, so at start every job found
        there is a predecessor's. An action is idempotent (``seq``), so one
        that did write its record before the kill writes the same again.
        """
        from rq.job import JobStatus

        q = self.queue
        left = q.intermediate_queue.get_job_ids() + q.started_job_registry.get_job_ids(cleanup=False)
        requeued = 0
        for job_id in dict.fromkeys(left):
            job = q.fetch_job(job_id)
            q.intermediate_queue.remove(job_id)
            if job is None:
                continue
            q.started_job_registry.remove_executions(job)
            if job.get_status() in (JobStatus.QUEUED, JobStatus.STARTED):   # not finished, failed nor refused
                q.enqueue_job(job, at_front=True)
                requeued += 1
        if requeued:
            self.log.warning("control_jobs_requeued", jobs=requeued)
        return requeued

    def run_pending(self, limit: int = 64) -> int:
        """Move due retries back onto the queue, then run (or refuse) up to ``limit`` queued jobs."""
        self.scheduler.enqueue_scheduled_jobs()
        done = 0
        while done < limit:
            got = self.dequeue()
            if got is None:
                break
            job, queue = got
            try:
                actions.check_job(job, self.node)
            except actions.Refused as exc:
                self.refuse(job, queue, str(exc))
            else:
                self.worker.execute_job(job, queue)
            done += 1
        return done

    def dequeue(self):
        """The next (job, queue), or None; a job hash rq cannot read is dropped and logged, never run."""
        while True:
            try:
                return self.worker.dequeue_job_and_maintain_ttl(None)
            except (ValueError, TypeError, KeyError) as exc:
                job_id = getattr(exc, "job_id", None)   # rq names the job whose hash failed to load
                if job_id is None:
                    raise
                self.queue.connection.lrem(self.queue.intermediate_queue_key, 0, job_id)
                self.log.warning("control_job_refused", job_id=str(job_id)[:100], reason=f"unreadable: {exc}"[:300])

    def refuse(self, job, queue, reason: str) -> None:
        """Fail ``job`` without running it: no retry, no callback, no webhook."""
        job.retries_left = 0
        job.webhooks = []
        self.worker.handle_job_failure(job, queue, exc_string=f"refused by the agent of {self.node}: {reason}")
        self.log.warning("control_job_refused", job_id=job.id, reason=reason)

    def close(self) -> None:
        self.worker.teardown()


class Agent:
    """One node's agent. ``step()`` is one pass of the loop; ``run()`` loops until stopped."""

    def __init__(self, r: redis.Redis, url: str, node: str, slots: list[Slot], *, grace_s: float = GRACE_S,
                 backoff_s: tuple[float, float] = BACKOFF_S, log=None, cwd: str | None = None):
        self.r, self.url, self.node, self.slots = r, url, node, list(slots)
        self.grace_s, self.backoff_s = grace_s, backoff_s
        self.cwd = cwd
        self.oom_counter = oom_counter()
        self.log = log or structlog.get_logger("agent").bind(node=node)
        self.procs: dict[str, Proc] = {}
        self.backoff: dict[str, Backoff] = {}
        self.completed: dict[str, int] = {}   # key -> seq of the desired record it exited 0 under
        self.slotless: dict[str, int] = {}    # key -> seq of a desired record naming a slot we lack (said once)
        self.jobs: ControlJobRunner | None = None
        self.stop_event = threading.Event()
        self.started_at = time.time()
        self._last_beat = 0.0
        self._published: dict[str, str] = {}
        from pipeline.control.lease import Lease

        self.lock = Lease(r, agent_lock(node), ttl_s=LOCK_TTL_S)

    # --- life ------------------------------------------------------------------------------------

    def start(self, lock_wait_s: float = LOCK_TTL_S + 2) -> "Agent":
        # A predecessor killed on this host left its lock behind: free it (only while that dead agent's
        # token is still the value) rather than wait out its TTL. A live holder is refused at once.
        deadline = time.monotonic() + lock_wait_s
        while not self.lock.acquire() and time.monotonic() < deadline:
            dead = self.dead_predecessor()
            if dead is None:
                break
            self.lock.free(dead)
            self.log.info("freed_dead_agents_lock", token=dead)
        if not self.lock.held:
            raise SystemExit(f"agent: another agent holds node name {self.node!r} "
                             f"({(self.r.get(agent_lock(self.node)) or b'').decode()}); pick another --node")
        self.adopt()
        self.backoff = {k.decode(): Backoff(**json.loads(v))
                        for k, v in self.r.hgetall(agent_backoff(self.node)).items()}
        self.jobs = ControlJobRunner(self.r, self.node, self.log)
        self.jobs.recover()
        self.heartbeat(force=True)
        self.log.info("agent_started", slots=[s.as_dict() for s in self.slots], pid=os.getpid())
        return self

    def dead_predecessor(self) -> str | None:
        """The token of the node's lock when an agent of this host whose process is gone holds it, else None."""
        token, raw = self.r.get(agent_lock(self.node)), self.r.hget(AGENTS, self.node)
        if not token or not raw:
            return None
        rec, pid = json.loads(raw), token.decode().split(":")[1]
        dead = (rec.get("host") == socket.gethostname() and str(rec.get("pid")) == pid
                and process_start(int(pid)) is None)
        return token.decode() if dead else None

    def run(self) -> None:
        # Redis away or stalled: the workers go on, and so does the agent, until the outage limit
        outage = Outage(self.log, stop=self.stop_event.is_set)
        cut_off = False
        while not self.stop_event.is_set():
            try:
                if cut_off:
                    # A control job the outage cut off is in rq's intermediate list or started registry, where
                    # nothing would run it again before a restart: no job of ours runs now, so put it back.
                    # The node's lock first: an agent that took the node meanwhile owns its queue (we exit).
                    self.heartbeat(force=True)
                    self.jobs.recover()
                    cut_off = False
                self.step()
                outage.ok()
            except UNAVAILABLE as exc:
                if self.stop_event.is_set():
                    break
                cut_off = True
                outage.wait(exc)   # RedisUnavailable past the limit: we exit, our workers stay (adopted)
                continue
            self.stop_event.wait(TICK_S)
        self.shutdown()

    def step(self) -> None:
        self.heartbeat()   # first: an agent whose node lock another took (after an outage) acts no more
        self.jobs.run_pending()
        desired = self.read_desired()
        self.reap(desired)
        self.drive(desired)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Drain every worker of ours (SIGTERM, SIGKILL after the grace), then leave."""
        for p in self.procs.values():
            self.terminate(p)
        deadline = time.monotonic() + (self.grace_s if timeout_s is None else timeout_s)
        while self.procs and time.monotonic() < deadline:
            self.reap({})
            time.sleep(0.05)
        for p in list(self.procs.values()):
            self.kill(p)
        while self.procs:
            self.reap({})
            time.sleep(0.05)
        try:
            self.publish(force=True)
            if self.jobs:
                self.jobs.close()
            self.r.hdel(AGENTS, self.node)
            self.lock.release()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.log.warning("redis_unavailable_at_exit", error=str(exc))   # the lock and record expire
        self.log.info("agent_stopped")

    # --- state ------------------------------------------------------------------------------------

    def read_desired(self) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self.r.hgetall(agent_desired(self.node)).items()}

    def adopt(self) -> None:
        """Take over the live workers a previous agent of this node recorded; forget the dead ones."""
        for key, raw in self.r.hgetall(agent_procs(self.node)).items():
            rec = json.loads(raw)
            if process_start(rec["pid"]) == rec["start"]:
                spec = {k: rec[k] for k in ("job", "worker", "role", "slots", "backend", "generation")}
                spec["run_dir"] = rec.get("run_dir", "")
                # one our predecessor was draining stays drained: its exit is no crash to restart
                term_at = time.time() if rec.get("state") == "draining" else None
                self.procs[key.decode()] = Proc(key.decode(), spec, rec["pid"], rec["start"], rec["started_at"],
                                                term_at=term_at)
                self.log.info("adopted", key=key.decode(), pid=rec["pid"], draining=term_at is not None)
            else:
                kill_group_left_by(rec["pid"])   # it died with the agent: what it started goes too
        self.publish(force=True)

    def busy_slots(self) -> set[int]:
        """Slots held by a process of ours that has not exited (draining ones included)."""
        return {s for p in self.procs.values() for s in p.slots}

    # --- the loop's steps -------------------------------------------------------------------------------

    def reap(self, desired: dict[str, dict]) -> None:
        """Forget exited processes (their slots are free from now on) and book crashes for restart."""
        for key, p in list(self.procs.items()):
            if p.alive():
                continue
            kill_group_left_by(p.pid)   # a vLLM engine process or a rank it left would hold the slot's GPU
            code = p.exit_code
            ran = time.time() - p.started_at
            d = desired.get(key)
            ended = p.term_at is None and d and d["state"] == STATE_RUN and same_worker(d, p.spec)
            # read before the process is forgotten: a Redis error here leaves it to the next pass
            done = ended and (code == 0 or (code is None and self.finished_training(p)))
            del self.procs[key]
            oom = self.oom_killed(p)
            self.event("exited", p, code=code, ran_s=round(ran, 2), **({"oom": True} if oom else {}))
            if done:
                self.completed[key] = d["seq"]     # finished its work (the learner's last step)
            elif ended:
                self.book_restart(key, ran, d["run_dir"], code, oom)
            if p.spec["role"] in ("rollout", "reward"):
                try:
                    hand_over_pending(self.r, p.spec["job"], p.spec["role"], p.spec["worker"], self.log)
                except UNAVAILABLE as exc:   # they stay pending, and are reclaimed once idle long enough
                    self.log.warning("hand_over_failed", worker=p.spec["worker"], error=str(exc))

    def finished_training(self, p: Proc) -> bool:
        """Whether an adopted process (whose exit code only its parent could read) left because it was done.

        A learner marks its job ``trained`` as its last act before it exits 0
        (and the run's owner may have moved it on to ``stopping`` or ``done``
        since); any other adopted process that exits is taken for a crash, as
        a child's non-zero exit is.
        """
        if p.spec["role"] != "learner":
            return False
        return self.job_run(p.spec["job"], {})[0] in ("trained", "stopping", "done")

    def oom_killed(self, p: Proc) -> bool:
        """Whether ``p`` died of a SIGKILL we did not send while the kernel's OOM killer killed: its count
        (this agent's memory cgroup's, else the machine's) went up since ``p`` started."""
        if p.exit_code != -signal.SIGKILL or p.killed or p.oom_base is None:
            return False
        now = oom_kills(self.oom_counter)
        return now is not None and now > p.oom_base

    def book_restart(self, key: str, ran_s: float, run_dir: str, code: int | None = None,
                     oom: bool = False) -> None:
        """Wait before the next start, longer after each crash; count the exits in a row with an error code
        or by the OOM killer (what ``libra-ctl run`` fails on: a worker whose every start fails; another
        kill, a signal, is not one: chaos, or a user)."""
        b = self.backoff.setdefault(key, Backoff())
        if ran_s > STABLE_S or b.run_dir != run_dir:
            b.restarts = b.failures = 0
        b.run_dir, b.code, b.oom = run_dir, code, oom
        b.failures = b.failures + 1 if oom or (code is not None and code > 0) else 0
        first, longest = self.backoff_s
        wait = min(first * 2 ** min(b.restarts, 30), longest)   # a long crash loop: the longest, no overflow
        b.restarts += 1
        b.next_at = time.time() + wait
        self.log.warning("worker_crashed", key=key, restart_in_s=wait, restarts=b.restarts)
        try:   # for a restarted agent; past the longest wait and a stable run, a record says nothing more
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(agent_backoff(self.node), key, json.dumps(asdict(b)))
            pipe.expire(agent_backoff(self.node), int(longest + STABLE_S) + 1)
            pipe.execute()
        except UNAVAILABLE as exc:   # the wait holds in this process all the same
            self.log.warning("backoff_not_recorded", key=key, error=str(exc))

    def drive(self, desired: dict[str, dict]) -> None:
        now = time.time()
        runs: dict[str, tuple[str, str]] = {}   # job -> (phase, run_dir), read once a pass
        for key, p in self.procs.items():
            d = desired.get(key)
            keep = d is not None and d["state"] == STATE_RUN and same_worker(d, p.spec)
            if keep:
                phase, current = self.job_run(p.spec["job"], runs)
                keep = not current or same_dir(current, p.spec["run_dir"])   # not an earlier run's worker
                # a job that is over: its workers go even if the controller's drain never reached us (it is
                # sent to the agents it sees; one away when the job ended would keep them, and their slots)
                keep = keep and phase in ("running", "trained", "")
            if not keep:
                self.terminate(p)
            if p.term_at is not None and not p.killed and time.time() - p.term_at > self.grace_s:
                self.kill(p)
        busy = self.busy_slots()
        for key, d in sorted(desired.items()):
            if d["state"] == STATE_DRAIN and key not in self.procs:
                self.set_desired(key, {**d, "state": STATE_GONE})
                continue
            if d["state"] == STATE_GONE and time.time() - d.get("updated_at", 0) > TOMBSTONE_S:
                self.r.hdel(agent_desired(self.node), key)
                continue
            if d["state"] != STATE_RUN or key in self.procs or self.completed.get(key) == d["seq"]:
                continue
            b = self.backoff.get(key)
            if (b is not None and b.run_dir == d["run_dir"] and b.next_at > now) or busy & set(d["slots"]):
                continue   # back-off, or a slot still held by a process that has not exited
            phase, run_dir = self.job_run(d["job"], runs)
            if phase not in ("running", "trained"):
                continue   # the job is over (or gone): desired state left behind is not revived
            if phase == "trained" and d["role"] == "learner":
                continue   # its steps are done (an agent restarted since it exited 0 has no record of that)
            if run_dir and not same_dir(run_dir, d["run_dir"]):
                continue   # an earlier run's record (an action of it retried after the reset): never started
            if missing := set(d["slots"]) - {s.index for s in self.slots}:
                if self.slotless.get(key) != d["seq"]:   # said once per record; the controller places it again
                    self.slotless[key] = d["seq"]
                    self.log.warning("desired_slots_missing", key=key, slots=sorted(missing),
                                     have=[s.index for s in self.slots])
                continue
            self.spawn(key, d)
            busy |= set(d["slots"])

    def job_run(self, job: str, runs: dict[str, tuple[str, str]]) -> tuple[str, str]:
        """The job's phase and the run directory of its current run ("" when unknown), cached in ``runs``."""
        if job not in runs:
            phase, run_dir = self.r.hmget(JobKeys(job).state, ["phase", "run_dir"])
            runs[job] = ((phase or b"").decode(), (run_dir or b"").decode())
        return runs[job]

    def set_desired(self, key: str, rec: dict) -> None:
        rec["updated_at"] = time.time()
        self.r.hset(agent_desired(self.node), key, json.dumps(rec))

    def spawn(self, key: str, d: dict) -> None:
        by_index = {s.index: s for s in self.slots}
        devices = [by_index[i].device for i in d["slots"] if by_index[i].device is not None]
        # the URL (it may hold a password) travels in the environment: argv is visible to every user
        env = dict(os.environ, **{ENV_URL: self.url, "PYTHONUNBUFFERED": "1", NODE_ENV: self.node,
                                  SLOTS_ENV: ",".join(str(i) for i in d["slots"]),
                                  # a CPU slot hides every GPU; a GPU slot shows only its own, numbered
                                  # as nvidia-smi and NVML number them (CUDA's default puts the fastest first)
                                  "CUDA_VISIBLE_DEVICES": ",".join(devices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        argv = worker_argv(d["backend"], d["role"], d["run_dir"], d["worker"])
        out = _log_file(d["run_dir"], d["worker"])
        oom_base = oom_kills(self.oom_counter)
        try:
            popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd,
                                     start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        # an unreaped child always has a /proc entry, so its start time can be read now
        start = process_start(popen.pid) or 0
        spec = {k: d[k] for k in ("job", "worker", "role", "slots", "run_dir", "backend")}
        spec["generation"] = d.get("generation", 0)
        p = Proc(key, spec, popen.pid, start, time.time(), popen, oom_base=oom_base)
        self.procs[key] = p
        self.event("spawned", p)
        self.publish(force=True)

    def terminate(self, p: Proc) -> None:
        """Ask a worker to stop after the batch in hand (once)."""
        if p.term_at is not None:
            return
        p.term_at = time.time()
        if p.signal(signal.SIGTERM):
            self.event("sigterm", p)
        try:
            self.publish(force=True)
        except UNAVAILABLE as exc:   # a shutdown while Redis is away still signals every worker; the next
            self.log.warning("procs_not_published", error=str(exc))   # publish writes the state

    def kill(self, p: Proc) -> None:
        if p.killed:
            return
        p.killed = True
        if p.signal(signal.SIGKILL, group=True):
            self.event("sigkill", p)

    # --- what others read ------------------------------------------------------------------------------

    def event(self, what: str, p: Proc, **extra) -> None:
        rec = {"event": what, "key": p.key, "pid": p.pid, "start": p.start, "role": p.spec["role"],
               "slots": json.dumps(p.slots), "at": time.time(),
               **{k: json.dumps(v) for k, v in extra.items()}}
        try:
            self.r.xadd(agent_log(self.node), rec, maxlen=10_000, approximate=True)
        except UNAVAILABLE:
            pass   # Redis away (or our run stopping it): the log line below still has it
        self.log.info(what, key=p.key, pid=p.pid, slots=p.slots, **extra)

    def publish(self, force: bool = False) -> None:
        """Mirror ``self.procs`` into ``agent_procs(node)`` (only what changed)."""
        now = {k: json.dumps({**p.record(self.node), "run_dir": p.spec.get("run_dir", "")})
               for k, p in self.procs.items()}
        if not force and now == self._published:
            return
        pipe = self.r.pipeline(transaction=True)
        gone = set(self._published) - set(now) if not force else None
        if force:
            pipe.delete(agent_procs(self.node))
        elif gone:
            pipe.hdel(agent_procs(self.node), *gone)
        if now:
            pipe.hset(agent_procs(self.node), mapping=now)
        pipe.execute()
        self._published = now

    def heartbeat(self, force: bool = False) -> None:
        self.publish()
        if not force and time.monotonic() - self._last_beat < HEARTBEAT_S:
            return
        # a lock that expired while Redis was away is taken again, unless another agent has it now
        if not (self.lock.renew() or self.lock.acquire()):
            raise SystemExit(f"agent: lost the lock of node {self.node!r} to another agent")
        self.r.hset(AGENTS, self.node, json.dumps({
            "node": self.node, "host": socket.gethostname(), "pid": os.getpid(), "started_at": self.started_at,
            "heartbeat": time.time(), "slots": [s.as_dict() for s in self.slots]}))
        self._last_beat = time.monotonic()


def _log_file(run_dir: str, worker: str):
    """Append a worker's stdout and stderr to the run's logs; DEVNULL when this node cannot see the run dir."""
    try:
        path = Path(run_dir) / "logs"
        path.mkdir(parents=True, exist_ok=True)
        return open_output(path / f"{worker}.out")
    except OSError:
        return subprocess.DEVNULL


def hand_over_pending(r: redis.Redis, job: str, role: str, consumer: str, log=None) -> int:
    """After a stage worker exited: give its pending entries to a live worker of its role, then delete it.

    Redis has no "unclaim": XCLAIM moves the entries (JUSTID, so no delivery is
    counted) and sets their idle time past the group's reclaim threshold, so
    the receiver's next reclaim picks them up. A worker drained cleanly has
    nothing pending; one killed mid-batch has its batch here. Without a live
    worker to take them they stay pending, reclaimed once idle long enough.
    """
    keys = JobKeys(job)
    stream, group = {s: (src, g) for s, src, g in keys.stages}[role]
    ids, start = [], "-"
    try:
        while True:   # every one: deleting a consumer drops what it still holds from the pending list
            page = [e["message_id"] for e in r.xpending_range(stream, group, start, "+", HAND_OVER_PAGE,
                                                              consumername=consumer)]
            ids += page
            if len(page) < HAND_OVER_PAGE:
                break
            start = "(" + (page[-1].decode() if isinstance(page[-1], bytes) else page[-1])
    except redis.ResponseError:
        return 0   # no such stream or group (the job is gone)
    target = live_worker(r, keys, role, exclude=consumer)
    if ids and target:
        for i in range(0, len(ids), HAND_OVER_PAGE):
            r.xclaim(stream, group, target, 0, ids[i:i + HAND_OVER_PAGE], idle=365 * 24 * 3600 * 1000,
                     justid=True)
        if log:
            log.info("handed_over_pending", worker=consumer, to=target, entries=len(ids))
    if not ids or target:
        r.xgroup_delconsumer(stream, group, consumer)
    return len(ids) if target else 0


def live_worker(r: redis.Redis, keys: JobKeys, role: str, exclude: str, fresh_s: float = 10.0) -> str | None:
    """A worker of ``role`` with a fresh heartbeat (the most recent one), other than ``exclude``."""
    best = None
    for wid, raw in r.hgetall(keys.workers).items():
        rec = json.loads(raw)
        if (rec["role"] == role and rec["id"] != exclude and rec["state"] in ("starting", "running", "waiting")
                and time.time() - rec.get("heartbeat", 0) < fresh_s):
            if best is None or rec["heartbeat"] > best["heartbeat"]:
                best = rec
    return best["id"] if best else None


# --- command line ----------------------------------------------------------------------------------


def run_agent(url: str, node: str, slots: list[Slot], grace_s: float) -> int:
    from pipeline import logs

    structlog.contextvars.bind_contextvars(role="agent", node=node)
    log = logs.configure(None, f"agent-{node}")
    # under libra-ctl run: end (draining, as on SIGTERM) when the run is gone; its workers watch the run
    # themselves and exit within ORPHAN_EXIT_S, so the drain cannot take longer than that
    watch_parent(exit_after_s=ORPHAN_EXIT_S + 5.0)
    agent = Agent(connect(url), url, node, slots, grace_s=grace_s, log=log).start()

    def on_signal(signum, _frame):
        log.info("stop_requested", signal=signal.Signals(signum).name)
        agent.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.run()
    return 0


def cmd_agent(args) -> int:
    from pipeline.dataplane.redisconn import find_redis_url

    try:
        slots = detect_slots(args.slots)
    except SlotError as exc:
        print(f"libra-ctl agent: {exc}", file=sys.stderr)
        return 2
    node = args.node or this_node()
    return run_agent(find_redis_url(args.redis), node, slots, args.grace)


def add_commands(sub) -> None:
    p = sub.add_parser("agent", help="node agent: start, drain and restart this machine's workers")
    p.add_argument("--slots", type=argtypes.count, help=f"N CPU slots (default: ${GPUS_ENV}, else the GPUs NVML finds)")
    p.add_argument("--node", help=f"node name (default: ${NODE_ENV}, else the short host name)")
    p.add_argument("--grace", type=argtypes.seconds, default=GRACE_S, help="seconds from SIGTERM to SIGKILL of a worker")
    p.add_argument("--redis", help=f"Redis URL (default: ${ENV_URL})")
    p.set_defaults(func=cmd_agent)
