"""Control actions: the rq jobs on a node agent's queue, and how they are sent.

The controller (and ``libra-ctl drain`` when no controller acts) calls
``send(r, node, action, ...)``; the job travels on ``agent_queue(node)`` with
rq's JSON serializer (never pickle) and a bounded ``Retry``, and is executed
inside the agent process by its in-process rq worker (``pipeline.control.agent``),
never in a forked work-horse.

A job never starts or stops a process. It only records the desired state of
one worker in ``agent_desired(node)`` ("ensure worker W of role R on slots
S", "drain W", "restart W at generation g"); the agent's main loop carries it
out. That makes every action idempotent: applying it twice leaves the same
record. Two numbers keep late or stale actions from undoing newer ones:

- ``seq`` (``CONTROL_SEQ``, one counter for every sender) orders actions on a
  worker: an action older than the one the record holds is ignored, so a
  retried ensure cannot revive a worker drained after it was sent;
- ``epoch`` (``CONTROLLER_EPOCH``, taken with the controller's lease) fences a
  controller that lost its lease: its actions are ignored. Operator actions
  carry epoch 0 and are not fenced.
"""

from __future__ import annotations

import json
import time

import redis

from pipeline.dataplane.keys import AGENTS, CONTROL_SEQ, CONTROLLER_EPOCH, agent_desired, agent_queue

RETRY_INTERVALS_S = (1, 2, 5)   # three retries, then the job stays in rq's failed registry
JOB_TIMEOUT_S = 30              # a job only writes a few keys
RESULT_TTL_S = 3600             # finished jobs stay an hour in rq's registries: the audit trail

STATE_RUN, STATE_DRAIN, STATE_GONE = "run", "drain", "gone"


class Stale(Exception):
    """An action older than what the agent already recorded, or from a fenced controller."""


def worker_key(job: str, worker: str) -> str:
    """The field of a worker in an agent's desired and procs hashes (ids are per job)."""
    return f"{job}/{worker}"


# --- sending -----------------------------------------------------------------------------------


def queue(r: redis.Redis, node: str):
    from rq import Queue
    from rq.serializers import JSONSerializer

    return Queue(agent_queue(node), connection=r, serializer=JSONSerializer)


def send(r: redis.Redis, node: str, func, *args, epoch: int = 0):
    """Enqueue ``func(node, *args, seq, epoch)`` on the node's agent queue; returns the rq job."""
    from rq import Retry

    seq = int(r.incr(CONTROL_SEQ))
    return queue(r, node).enqueue(func, node, *args, seq, epoch, retry=Retry(max=len(RETRY_INTERVALS_S),
                                  interval=list(RETRY_INTERVALS_S)), job_timeout=JOB_TIMEOUT_S,
                                  result_ttl=RESULT_TTL_S, failure_ttl=24 * 3600,
                                  description=f"{func.__name__}{(node, *args)}")


def ensure(r: redis.Redis, node: str, spec: dict, epoch: int = 0):
    """Ask ``node``'s agent to keep the worker ``spec`` describes running."""
    return send(r, node, ensure_worker, spec, epoch=epoch)


def drain(r: redis.Redis, node: str, job: str, worker: str, epoch: int = 0):
    return send(r, node, drain_worker, job, worker, epoch=epoch)


def restart(r: redis.Redis, node: str, job: str, worker: str, epoch: int = 0):
    return send(r, node, restart_worker, job, worker, epoch=epoch)


# --- the jobs (run inside the agent process) ------------------------------------------------------


def _connection() -> redis.Redis:
    from rq import get_current_job

    return get_current_job().connection


def _check_epoch(r: redis.Redis, epoch: int) -> None:
    current = int(r.get(CONTROLLER_EPOCH) or 0)
    if epoch and epoch < current:
        raise Stale(f"action from controller epoch {epoch}, the acting one is {current}")


def _record(r: redis.Redis, node: str, key: str) -> dict | None:
    raw = r.hget(agent_desired(node), key)
    return json.loads(raw) if raw else None


def _apply(r: redis.Redis, node: str, key: str, seq: int, epoch: int, change) -> str:
    """Write ``change(current record)`` unless a newer action got there first; returns what happened."""
    try:
        _check_epoch(r, epoch)
        cur = _record(r, node, key)
        if cur is not None and cur.get("seq", 0) >= seq:
            raise Stale(f"{key}: holds action {cur.get('seq')}, this is {seq}")
    except Stale as exc:
        return f"ignored: {exc}"
    new = change(cur)
    if new is None:
        return "unchanged"
    new.update(seq=seq, epoch=epoch, updated_at=time.time())
    r.hset(agent_desired(node), key, json.dumps(new))
    return f"{new['state']} {key}"


def _node_slots(r: redis.Redis, node: str) -> set[int]:
    raw = r.hget(AGENTS, node)
    if raw is None:
        raise ValueError(f"no agent registered for node {node!r}")
    return {s["index"] for s in json.loads(raw)["slots"]}


def ensure_worker(node: str, spec: dict, seq: int, epoch: int) -> str:
    """Desired: worker ``spec["worker"]`` of ``spec["role"]`` for ``spec["job"]`` runs on ``spec["slots"]``.

    ``spec`` also names ``run_dir`` and ``backend``; the run directory is part
    of the worker's identity (every run of a job reuses its worker ids), so the
    agent drains a process of another run under the same key. Unknown slots
    raise (rq retries, then fails the job; the controller plans again on the
    next tick).
    """
    r = _connection()
    missing = set(spec["slots"]) - _node_slots(r, node)
    if missing:
        raise ValueError(f"node {node} has no slots {sorted(missing)}")
    fields = ("job", "worker", "role", "slots", "run_dir", "backend")

    def change(cur):
        # the same id in another run directory is another worker: its generations start afresh
        gen = cur.get("generation", 0) if cur and cur.get("run_dir") == spec["run_dir"] else 0
        return {**{f: spec[f] for f in fields}, "state": STATE_RUN, "generation": gen}

    return _apply(r, node, worker_key(spec["job"], spec["worker"]), seq, epoch, change)


def drain_worker(node: str, job: str, worker: str, seq: int, epoch: int) -> str:
    """Desired: the worker stops reading, finishes the batch in hand, exits (killed after the grace)."""
    r = _connection()

    def change(cur):
        if cur is None:
            return {"job": job, "worker": worker, "role": "", "slots": [], "state": STATE_GONE, "generation": 0}
        return {**cur, "state": STATE_DRAIN} if cur["state"] == STATE_RUN else {**cur}

    return _apply(r, node, worker_key(job, worker), seq, epoch, change)


def restart_worker(node: str, job: str, worker: str, seq: int, epoch: int) -> str:
    """Desired: a fresh process for the worker (the running one is drained first)."""
    r = _connection()

    def change(cur):
        if cur is None or cur["state"] != STATE_RUN:
            return None
        return {**cur, "generation": cur.get("generation", 0) + 1}

    return _apply(r, node, worker_key(job, worker), seq, epoch, change)
