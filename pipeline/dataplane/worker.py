"""The life of a worker process: identity, registration, heartbeat, stop signals.

Every stage process (``python -m workers.rollout|reward|learner``) starts with
``start_worker``: it loads the resolved config from the run's manifest,
connects to Redis, registers itself in the job's worker table and binds its
logger. SIGTERM and SIGINT ask it to stop after the batch in hand.
``CostMeter`` is how a worker reports what its time went to (busy, weight
loads, items, tokens); the controller reads those records.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import structlog

from pipeline import config as config_mod, logs
from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.redisconn import ENV_URL, connect

HEARTBEAT_S = 2.0


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
    state: str = "starting"
    done: int = 0  # trajectories handled, for the rate
    rate_per_s: float = 0.0
    policy_version: int = 0

    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def set_version(self, version: int) -> None:
        self.policy_version = version
        structlog.contextvars.bind_contextvars(policy_version=version)

    def count(self, n: int) -> None:
        self.done += n

    def record(self) -> dict:
        return {"id": self.worker_id, "role": self.role, "pid": os.getpid(),
                "node": socket.gethostname(), "slots": [], "state": self.state,
                "heartbeat": time.time(), "done": self.done, "rate_per_s": round(self.rate_per_s, 3),
                "policy_version": self.policy_version}

    def publish_state(self, state: str | None = None) -> None:
        if state:
            self.state = state
        self.r.hset(self.keys.workers, self.worker_id, json.dumps(self.record()))


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
    p.add_argument("--worker-id", required=True)
    return p.parse_args()


def load_run_config(run_dir: Path) -> config_mod.Config:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return config_mod.from_dict(manifest["config"])


def start_worker(role: str) -> WorkerContext:
    """Parse argv, load config, connect, register, install signal handlers, start the heartbeat."""
    args = worker_args(role)
    cfg = load_run_config(args.run_dir)
    url = os.environ.get(ENV_URL)
    if not url:
        raise SystemExit(f"{role}: {ENV_URL} is not set; workers are started by libra-ctl run")
    structlog.contextvars.bind_contextvars(job=cfg.job.name, role=role, worker=args.worker_id,
                                           policy_version=0)
    log = logs.configure(args.run_dir / "logs", args.worker_id, console=False)
    ctx = WorkerContext(cfg=cfg, run_dir=args.run_dir, keys=JobKeys(cfg.job.name), r=connect(url),
                        worker_id=args.worker_id, role=role, log=log)

    def on_signal(signum, _frame):
        log.info("stop_requested", signal=signal.Signals(signum).name)
        ctx.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ctx.publish_state("starting")
    threading.Thread(target=_heartbeat, args=(ctx,), daemon=True, name="heartbeat").start()
    log.info("worker_started", pid=os.getpid())
    return ctx


def _heartbeat(ctx: WorkerContext) -> None:
    """Refresh the worker's record and its service rate (an EMA of trajectories/s)."""
    last_done, last_t = ctx.done, time.monotonic()
    while not ctx.stop_event.wait(HEARTBEAT_S):
        now = time.monotonic()
        inst = (ctx.done - last_done) / max(now - last_t, 1e-6)
        ctx.rate_per_s = inst if ctx.rate_per_s == 0 else 0.7 * ctx.rate_per_s + 0.3 * inst
        last_done, last_t = ctx.done, now
        try:
            ctx.publish_state()
        except redis.RedisError as exc:
            ctx.log.warning("heartbeat_failed", error=str(exc))


def finish_worker(ctx: WorkerContext) -> None:
    ctx.stop_event.set()
    try:
        ctx.publish_state("exited")
    except redis.RedisError:
        pass
    ctx.log.info("worker_exited", done=ctx.done)


class CostMeter:
    """A worker's cumulative costs, in wall seconds, in ``JobKeys.worker_costs``; read by the controller.

    ``busy_s``: seconds of slot time spent on work (for a reward process of
    several scorers, scorer-seconds); ``pause_s``: weight loads; ``items``:
    trajectories done; ``tokens``: their prompt + response tokens; ``lanes``:
    scorers in the process; ``since``: when the meter started. Idle time is
    what is left of the time alive.
    """

    def __init__(self, r: redis.Redis, keys: JobKeys, worker: str, role: str):
        self.r, self.keys, self.worker = r, keys, worker
        self.rec = {"role": role, "since": time.time(), "at": time.time(), "busy_s": 0.0, "pause_s": 0.0,
                    "items": 0, "tokens": 0.0, "lanes": 1}
        self.publish()

    def add(self, **deltas) -> None:
        for k, v in deltas.items():
            self.rec[k] += v
        self.publish()

    def set(self, **values) -> None:
        self.rec.update(values)
        self.publish()

    def publish(self) -> None:
        self.rec["at"] = time.time()
        self.r.hset(self.keys.worker_costs, self.worker, json.dumps(self.rec))
