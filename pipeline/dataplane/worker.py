"""The life of a worker process: identity, registration, heartbeat, stop signals.

Every stage process (``python -m workers.rollout|reward|learner``) starts with
``start_worker``: it loads the resolved config from the run's manifest,
connects to Redis, registers itself in the job's worker table and binds its
logger. SIGTERM and SIGINT ask it to stop after the batch in hand.
``CostMeter`` is how a worker reports what its time went to (busy, weight
loads, items, tokens); the controller reads those records.

A worker started outside the node agents (``libra-ctl worker``: a Procfile
pool, or by hand) runs with ``--external``: its record says
``"managed": "external"``, it picks a stable id with ``claim_external_id``,
and it watches ``JobKeys.external_drain``, where the controller (or
``libra-ctl drain``) asks it to stop after the batch in hand. No agent starts,
restarts or signals it; once drained it waits for its job's end instead of
exiting, because under honcho one process that exits stops them all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import structlog

from pipeline import config as config_mod, logs
from pipeline.dataplane.keys import LEARNER, BadName, JobKeys, check_name
from pipeline.dataplane.lifeline import ORPHAN_EXIT_S, pid_alive, watch_owner, watch_parent
from pipeline.dataplane.redisconn import ENV_OUTAGE, ENV_URL, UNAVAILABLE, Outage, connect
from pipeline.dataplane.streams import redis_full

HEARTBEAT_S = 2.0
JOB_EXIT_WAIT_S = 60.0   # how long an external worker whose job has ended waits for the job's process to exit
STALE_S = 10.0           # a record without a heartbeat for this long belongs to a gone (or stuck) process
START_GRACE_S = 120.0    # ... except while "starting": torch and vLLM load before the first heartbeat
NODE_ENV = "LIBRA_NODE"  # the node a worker runs on (set by its agent, or by libra-ctl worker)


def this_node() -> str:
    """This machine's node name: ``$LIBRA_NODE``, else the short host name (what agents and pool workers take
    by default, so that every part of a run names the node alike)."""
    return os.environ.get(NODE_ENV) or socket.gethostname().split(".")[0]
EXTERNAL = "external"    # the ``managed`` field of a worker started outside the agents
AGENT = "agent"          # ... and of one an agent started (it sets SLOTS_ENV)
SLOTS_ENV = "LIBRA_SLOTS"   # set by the node agent: the slots the worker holds, e.g. "2,3" ("" for none)
CLAIM_TRIES = 50         # WATCH retries when registering: every heartbeat of the job's workers changes the table
# States in which a worker holds its place in the job's allocation: at work, about to be (a learner queued for
# learner-0), or done with its work (a learner after its last step: not to be replaced).
HOLDS_PLACE = ("starting", "running", "waiting", "queued", "done")


def visible_devices() -> list[str] | None:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES: indices or UUIDs; [] on a CPU slot), None if unset."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if raw is None else [d.strip() for d in raw.split(",") if d.strip()]


def record_alive(rec: dict, now: float) -> bool:
    """Whether a worker record's process still holds its id: not exited, and heartbeating."""
    if rec.get("state") == "exited":
        return False
    age = now - rec.get("heartbeat", 0)
    return age < STALE_S or (rec.get("state") == "starting" and age < START_GRACE_S)


@dataclass
class WorkerContext:
    """What a worker process knows about itself; shared by the stage code and the heartbeat."""

    cfg: config_mod.Config
    run_dir: Path
    keys: JobKeys
    r: redis.Redis
    worker_id: str
    role: str
    log: structlog.stdlib.BoundLogger
    stop_event: threading.Event = field(default_factory=threading.Event)
    signalled: threading.Event = field(default_factory=threading.Event)   # SIGTERM/SIGINT, not a drain request
    # set by finish_worker: the heartbeat goes on through a drain, while the batch in hand finishes
    exiting: threading.Event = field(default_factory=threading.Event)
    heartbeat_thread: threading.Thread | None = None
    external: bool = False   # started by libra-ctl worker, not by an agent
    drain_requested: bool = False   # an external worker asked to drain (JobKeys.external_drain)
    node: str = field(default_factory=this_node)
    devices: list[str] | None = field(default_factory=visible_devices)   # fixed for the process's life
    state: str = "starting"
    done: int = 0  # trajectories handled, for the rate
    rate_per_s: float = 0.0
    policy_version: int = 0
    failure: dict | None = None  # why the worker is failing, e.g. {"kind": "oom", "detail"} (workers.oom)

    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def set_version(self, version: int) -> None:
        self.policy_version = version
        structlog.contextvars.bind_contextvars(policy_version=version)

    def count(self, n: int) -> None:
        self.done += n

    def record(self) -> dict:
        return {"id": self.worker_id, "role": self.role, "pid": os.getpid(),
                "node": self.node, "slots": [], "state": self.state,
                "heartbeat": time.time(), "done": self.done, "rate_per_s": round(self.rate_per_s, 3),
                "policy_version": self.policy_version,
                **({"managed": EXTERNAL} if self.external else {"managed": AGENT} if SLOTS_ENV in os.environ else {}),
                **({"devices": self.devices} if self.devices is not None else {}),
                **({"failure": self.failure} if self.failure else {})}

    def publish_state(self, state: str | None = None) -> None:
        if state:
            self.state = state
        self.r.hset(self.keys.workers, self.worker_id, json.dumps(self.record()))

    def still_ours(self) -> bool:
        """Whether the worker table's record of our id is still this process's.

        A drained external learner waits for the job's end under ``learner-0``
        while an agent may start the job's next ``learner-0``: the waiting one
        must not overwrite the live one's record.
        """
        raw = self.r.hget(self.keys.workers, self.worker_id)
        if raw is None:
            return True
        rec = json.loads(raw)
        return rec.get("pid") == os.getpid() and rec.get("node") == self.node


def room_downstream(ctx: WorkerContext, group_size: int, pause_s: float) -> bool:
    """Whether rollout may generate more: the groups not yet taken by the learner
    (``streams.downstream_backlog``) hold fewer than ``streams.max_queue_size`` trajectories.

    When they do not, the worker shows as waiting and pauses ``pause_s`` before
    its next look; the rollout workers call this between engine calls.
    """
    from pipeline.dataplane.streams import downstream_backlog

    if downstream_backlog(ctx.r, ctx.keys) * group_size >= ctx.cfg.streams.max_queue_size:
        ctx.state = "waiting"
        time.sleep(pause_s)
        return False
    ctx.state = "running"
    return True


def claim_policy(cfg: config_mod.Config, stage: str):
    """The reclaim settings of a stage, from ``streams.<stage>_min_idle_s`` and ``max_deliveries``."""
    from pipeline.dataplane.streams import ClaimPolicy

    idle_s = getattr(cfg.streams, f"{stage}_min_idle_s")
    return ClaimPolicy(min_idle_ms=int(idle_s * 1000), max_deliveries=cfg.streams.max_deliveries)


def dedup_for(cfg: config_mod.Config, stage: str):
    """The stage's exactly-once marks, or None when ``streams.dedup`` is off.

    A duplicate of a group can only come from a redelivery of its input, and
    an input is redelivered at most ``max_deliveries`` times, each after
    ``min_idle``: the marks need to outlive that window and no more, which
    bounds their memory by the stage's rate times the window.
    """
    from pipeline.dataplane.streams import Dedup

    if not cfg.streams.dedup:
        return None
    window_s = (cfg.streams.max_deliveries + 1) * getattr(cfg.streams, f"{stage}_min_idle_s")
    return Dedup(stage=stage, ttl_s=int(window_s) + 60)


def worker_args(role: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"workers.{role}")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--worker-id", required=True, type=_worker_id)
    p.add_argument("--external", action="store_true",
                   help="started outside the agents (libra-ctl worker): watch for drain requests, wait once drained")
    return p.parse_args()


def _worker_id(text: str) -> str:
    """A worker id: a Redis consumer name, a hash field and the name of its log file."""
    try:
        return check_name("worker id", text)
    except BadName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_run_config(run_dir: Path) -> config_mod.Config:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return config_mod.from_dict(manifest["config"])


def start_worker(role: str) -> WorkerContext:
    """Parse argv, load config, connect, register, install signal handlers, start the heartbeat."""
    args = worker_args(role)
    cfg = load_run_config(args.run_dir)
    url = os.environ.get(ENV_URL)
    if not url:
        raise SystemExit(f"{role}: {ENV_URL} is not set; workers are started by libra-ctl run, a node agent "
                         f"or libra-ctl worker {role} --job JOB")
    # every Outage of this process (streams, stage loops) waits as long as the job's config says
    os.environ[ENV_OUTAGE] = str(cfg.redis.outage_s)
    structlog.contextvars.bind_contextvars(job=cfg.job.name, role=role, worker=args.worker_id,
                                           policy_version=0)
    log = logs.configure(args.run_dir / "logs", args.worker_id, console=False)
    ctx = WorkerContext(cfg=cfg, run_dir=args.run_dir, keys=JobKeys(cfg.job.name), r=connect(url),
                        worker_id=args.worker_id, role=role, log=log, external=args.external)

    def on_signal(signum, _frame):
        log.info("stop_requested", signal=signal.Signals(signum).name)
        ctx.signalled.set()
        ctx.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # stop (as on SIGTERM) when the run we belong to is gone (an agent's worker outlives its agent, to be
    # adopted by the next one), or the process that started us (the feeder, under libra-ctl run)
    watch_owner()
    watch_parent(exit_after_s=ORPHAN_EXIT_S)
    Outage(log).call(register, ctx)
    ctx.heartbeat_thread = threading.Thread(target=_heartbeat, args=(ctx,), daemon=True, name="heartbeat")
    ctx.heartbeat_thread.start()
    log.info("worker_started", pid=os.getpid())
    return ctx


def register(ctx: WorkerContext) -> None:
    """The worker's first record, as ``starting``; SystemExit if a live external worker holds its id.

    Two processes under one id would be one consumer twice. An agent can
    start the job's ``learner-0`` just after a pool learner took the id (the
    controller placed it before the pool registered); this one then exits,
    non-zero, and the controller drains it. A drained external worker gives
    its id way (it stops heartbeating once the record is another's). Check
    and write are one transaction, as in ``claim_external_id``.
    """
    ctx.state = "starting"
    for _ in range(CLAIM_TRIES):
        with ctx.r.pipeline() as pipe:
            try:
                pipe.watch(ctx.keys.workers)
                raw = pipe.hget(ctx.keys.workers, ctx.worker_id)
                held = json.loads(raw) if raw else None
                if (held and held.get("managed") == EXTERNAL and held.get("state") in HOLDS_PLACE
                        and record_alive(held, time.time())
                        and (held.get("pid"), held.get("node")) != (os.getpid(), ctx.node)):
                    raise SystemExit(f"{ctx.worker_id} is held by the external worker pid {held.get('pid')} on "
                                     f"{held.get('node')}; not starting a second process under that id")
                pipe.multi()
                pipe.hset(ctx.keys.workers, ctx.worker_id, json.dumps(ctx.record()))
                pipe.execute()
                return
            except redis.WatchError:
                time.sleep(0.01)
    raise RuntimeError(f"could not register in {ctx.keys.workers}: it changed {CLAIM_TRIES} times in a row")


def _heartbeat(ctx: WorkerContext) -> None:
    """Refresh the worker's record and its service rate (an EMA of trajectories/s), until ``finish_worker``.

    A stop request (a drain, SIGTERM) lets the batch in hand finish, and the
    process holds its id until then: its record stays live, so no second
    process registers under the id while it works."""
    last_done, last_t = ctx.done, time.monotonic()
    while not ctx.exiting.wait(HEARTBEAT_S):
        now = time.monotonic()
        inst = (ctx.done - last_done) / max(now - last_t, 1e-6)
        ctx.rate_per_s = inst if ctx.rate_per_s == 0 else 0.7 * ctx.rate_per_s + 0.3 * inst
        last_done, last_t = ctx.done, now
        try:
            ctx.publish_state()
            if not ctx.external and not ctx.stop_event.is_set() and _job_over(ctx):
                # its agent drains it then; one that died (kill -9) leaves it running, holding its GPUs
                ctx.log.info("job_over_stopping")
                ctx.stop_event.set()   # as SIGTERM: the stage finishes the batch in hand
            if ctx.external and not ctx.drain_requested and ctx.r.sismember(ctx.keys.external_drain, ctx.worker_id):
                ctx.log.info("drain_requested")
                ctx.drain_requested = True
                ctx.stop_event.set()   # as SIGTERM: the stage finishes the batch in hand
        except redis.RedisError as exc:
            ctx.log.warning("heartbeat_failed", error=str(exc))


def _job_over(ctx: WorkerContext) -> bool:
    """Whether the worker's run is over: its job ended (``done``, ``stopped``), or the job's state names another
    run directory (a new run of the job name, which this process must not work for)."""
    phase, run_dir = ctx.r.hmget(ctx.keys.state, ["phase", "run_dir"])
    if phase in (b"done", b"stopped"):
        return True
    # by name: a run directory's name is its run id, the same seen from any working directory
    return run_dir is not None and Path(run_dir.decode()).name != ctx.run_dir.resolve().name


def finish_worker(ctx: WorkerContext) -> None:
    """Mark the worker exited; an external one that stopped by itself first waits for its job's end."""
    ctx.stop_event.set()
    ctx.exiting.set()
    if ctx.heartbeat_thread is not None:   # a beat under way must not write "running" over "exited"
        ctx.heartbeat_thread.join(timeout=HEARTBEAT_S + 5.0)
    # called from the stage's ``finally``: an exception on its way out means a crash (exit non-zero, no wait)
    crashed = sys.exc_info()[1] is not None
    try:
        if ctx.external and not crashed and not ctx.signalled.is_set():
            _wait_for_job_end(ctx)
        if ctx.external:
            ctx.r.srem(ctx.keys.external_drain, ctx.worker_id)
        if ctx.still_ours():
            ctx.publish_state("exited")
    except redis.RedisError:
        pass
    ctx.log.info("worker_exited", done=ctx.done)


def _wait_for_job_end(ctx: WorkerContext) -> None:
    """Stay, heartbeating, until the job is over and its process gone, its run replaced, or a signal.

    An external worker stops by itself when drained (state ``drained``: the
    controller may replace it) or, the learner, when its steps are done
    (``done``: it keeps its place). Under honcho one process that exits stops
    every other one: it does not exit until its job has ended, nor, for up to
    ``JOB_EXIT_WAIT_S`` after, while the job's own process (the Procfile's
    job line) is still writing its summary and report, so that the job line
    ends the Procfile with the job's exit code rather than being stopped.
    """
    from pipeline.dataplane.jobs import live_owner

    mine = "drained" if ctx.drain_requested else "done"
    ctx.log.info("waiting_for_job_end", state=mine)
    run_dir = ctx.run_dir.resolve()
    ended_at = None
    while True:
        if ctx.still_ours():
            ctx.publish_state(mine)
        job = ctx.r.hgetall(ctx.keys.state)
        if Path(job.get(b"run_dir", b"").decode()).resolve() != run_dir:
            return
        if job.get(b"phase") not in (b"running", b"trained"):
            ended_at = ended_at or time.monotonic()
            # a job run on another machine reads as alive: the wait is bounded
            if not live_owner(job) or time.monotonic() - ended_at > JOB_EXIT_WAIT_S:
                return
        if ctx.signalled.wait(HEARTBEAT_S if ended_at is None else 0.2):
            return


def live_run_dir(r: redis.Redis, keys: JobKeys) -> str | None:
    """The run directory of the job's live run on this Redis; None while none runs (or its owner is gone)."""
    from pipeline.dataplane.jobs import live_owner

    state = r.hgetall(keys.state)
    if state.get(b"phase") not in (b"running", b"trained") or not state.get(b"run_dir") or not live_owner(state):
        return None
    return state[b"run_dir"].decode()


class IdTaken(RuntimeError):
    """The id an external worker asked for is held by another live worker."""


def claim_external_id(r: redis.Redis, keys: JobKeys, role: str, node: str, *, pid: int | None = None,
                      want: str | None = None) -> str | None:
    """Register a worker started outside the agents under a stable id; the id, or None while it must wait.

    Ids are ``<role>-<node>-ext<k>``, the lowest ``k`` no live worker of the
    job holds, so a pool worker started again on its node gets its old id
    (and its consumer's pending entries) back; ``want`` asks for one id. The
    learner is one process under the consumer name ``learner-0``: while an
    agent's learner holds it, the claim records this worker as ``queued``
    (the controller counts it, and drains its own learner) and returns None;
    call again. IdTaken when another external worker holds the id. Check and
    write are one transaction (WATCH), so pool workers started together never
    share an id.
    """
    pid = os.getpid() if pid is None else pid
    for _ in range(CLAIM_TRIES):
        with r.pipeline() as pipe:
            try:
                pipe.watch(keys.workers)
                now = time.time()
                recs = {w.decode(): json.loads(v) for w, v in pipe.hgetall(keys.workers).items()}
                wid, state = _pick_id(recs, role, node, pid, want, now)
                mine = [w for w, rec in recs.items() if (rec.get("pid"), rec.get("node")) == (pid, node) and w != wid]
                pipe.multi()
                pipe.hset(keys.workers, wid, json.dumps({
                    "id": wid, "role": role, "pid": pid, "node": node, "slots": [], "state": state,
                    "heartbeat": now, "managed": EXTERNAL}))
                if mine:
                    pipe.hdel(keys.workers, *mine)   # our queued record, once we hold the learner's id
                pipe.srem(keys.external_drain, wid)
                pipe.execute()
                return wid if state == "starting" else None
            except redis.WatchError:
                time.sleep(0.01)
    raise RuntimeError(f"could not register in {keys.workers}: it changed {CLAIM_TRIES} times in a row")


def _pick_id(recs: dict[str, dict], role: str, node: str, pid: int, want: str | None,
             now: float) -> tuple[str, str]:
    """(id, state) of a claim: ``starting`` under a free id, or ``queued`` while the learner's is held."""
    def free(wid: str) -> bool:
        rec = recs.get(wid)
        return (rec is None or not record_alive(rec, now) or (rec.get("pid"), rec.get("node")) == (pid, node)
                or (wid == LEARNER and rec.get("state") == "drained")   # a drained learner gives way
                # a process of this node that is gone (killed, its line restarted at once): its heartbeat is
                # still fresh, but its id is free
                or (rec.get("node") == node and node == this_node() and not pid_alive(rec.get("pid"))))

    if want or role == "learner":
        wid = want or LEARNER
        if free(wid):
            return wid, "starting"
        held = recs[wid]
        if held.get("managed") == EXTERNAL or want:
            raise IdTaken(f"{wid} is held by the live worker pid {held.get('pid')} on {held.get('node')}")
    k = 0
    while not free(f"{role}-{node}-ext{k}"):
        k += 1
    return f"{role}-{node}-ext{k}", "starting" if role != "learner" else "queued"


class CostMeter:
    """A worker's cumulative costs, in wall seconds, in ``JobKeys.worker_costs``; read by the controller.

    ``busy_s``: seconds of slot time spent on work (for a reward process of
    several scorers, scorer-seconds); ``pause_s``: weight loads (the engine's
    first load included), ``reload_s`` and ``reloads``: those of new versions; ``wait_s``:
    waiting for input (an empty stream); ``blocked_s``: held back by
    backpressure (no room downstream); ``items``: trajectories done;
    ``tokens``: their prompt + response tokens; ``lanes``: scorers in the
    process; ``since``: when the meter started. Idle time is what is left of
    the time alive.

    A stage brackets its reads with ``reading()`` (about to wait for input)
    and ``got_input()`` (input arrived, or the read came back empty), and the
    meter adds the time between to ``wait_s``.
    """

    def __init__(self, r: redis.Redis, keys: JobKeys, worker: str, role: str):
        self.r, self.keys, self.worker = r, keys, worker
        self.rec = {"role": role, "since": time.time(), "at": time.time(), "busy_s": 0.0, "pause_s": 0.0,
                    "reload_s": 0.0, "reloads": 0, "wait_s": 0.0, "blocked_s": 0.0, "items": 0, "tokens": 0.0,
                    "lanes": 1}
        self._read_at: float | None = None
        self.publish()

    def reading(self) -> None:
        self._read_at = time.monotonic()

    def got_input(self) -> None:
        if self._read_at is not None:
            self.rec["wait_s"] += time.monotonic() - self._read_at
            self._read_at = None

    def add(self, **deltas) -> None:
        for k, v in deltas.items():
            self.rec[k] += v
        self.publish()

    def set(self, **values) -> None:
        self.rec.update(values)
        self.publish()

    def publish(self) -> None:
        """Write the record; skipped while Redis is unreachable or full (the record is cumulative: the next one
        covers it, and a full Redis must not end a stage over a figure)."""
        self.rec["at"] = time.time()
        try:
            self.r.hset(self.keys.worker_costs, self.worker, json.dumps(self.rec))
        except UNAVAILABLE:
            pass
        except redis.ResponseError as exc:
            if not redis_full(exc):
                raise
