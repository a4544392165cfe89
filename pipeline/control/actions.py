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

rq resolves a job's function by its import path, so anyone who can write to
Redis could name any function. An agent runs only the three actions below
(``ACTIONS``), with the argument shapes they take: ``check_job`` looks at a
job's function name, arguments, callbacks and webhooks before rq imports or
calls anything, and the agent fails a job it refuses without running it.
"""

from __future__ import annotations

import json
import re
import time

import redis

from pipeline.dataplane.keys import AGENTS, CONTROL_SEQ, CONTROLLER_EPOCH, ROLES, agent_desired, agent_queue

RETRY_INTERVALS_S = (1, 2, 5)   # three retries, then the job stays in rq's failed registry
JOB_TIMEOUT_S = 30              # a job only writes a few keys
RESULT_TTL_S = 3600             # finished jobs stay an hour in rq's registries: the audit trail

STATE_RUN, STATE_DRAIN, STATE_GONE = "run", "drain", "gone"


class Stale(Exception):
    """An action older than what the agent already recorded, or from a fenced controller."""


class Refused(ValueError):
    """A control job that is not one of the actions, or whose arguments do not have their shape."""


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


# --- what an agent agrees to run ------------------------------------------------------------------

# A job or worker name: it ends up in Redis keys and in a log file name, so no '/', no leading '.'.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,199}")
SPEC_FIELDS = {"job", "worker", "role", "slots", "run_dir", "backend"}
BACKENDS = ("sim", "vllm")
MAX_SLOTS = 4096


def _name(what: str, value) -> None:
    if not (isinstance(value, str) and NAME.fullmatch(value)):
        raise Refused(f"{what} {value!r:.200} is not a name ({NAME.pattern})")


def _int(what: str, value, least: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and least <= value < 1 << 63):
        raise Refused(f"{what} {value!r:.100} is not an integer >= {least}")


def _spec(spec) -> None:
    if not (isinstance(spec, dict) and set(spec) == SPEC_FIELDS):
        got = sorted(map(str, spec)) if isinstance(spec, dict) else type(spec).__name__
        raise Refused(f"spec must have exactly the fields {sorted(SPEC_FIELDS)}, not {got!s:.200}")
    _name("job", spec["job"])
    _name("worker", spec["worker"])
    if spec["role"] not in (*ROLES, "feeder"):
        raise Refused(f"role {spec['role']!r:.100} is not one of {[*ROLES, 'feeder']}")
    if spec["backend"] not in BACKENDS:
        raise Refused(f"backend {spec['backend']!r:.100} is not one of {list(BACKENDS)}")
    slots = spec["slots"]
    if not (isinstance(slots, list) and len(slots) <= MAX_SLOTS):
        raise Refused(f"slots {slots!r:.200} is not a list of slot indexes")
    for s in slots:
        _int("slot", s, 0)
    if len(set(slots)) != len(slots):
        raise Refused(f"slots {slots!r:.200} names a slot twice")
    run_dir = spec["run_dir"]
    if not (isinstance(run_dir, str) and 0 < len(run_dir) <= 4096 and "\0" not in run_dir):
        raise Refused(f"run_dir {run_dir!r:.200} is not a path")


# function path -> the shape check of its arguments after ``node`` (the trailing seq and epoch included)
ACTIONS = {
    f"{__name__}.ensure_worker": (_spec,),
    f"{__name__}.drain_worker": (lambda v: _name("job", v), lambda v: _name("worker", v)),
    f"{__name__}.restart_worker": (lambda v: _name("job", v), lambda v: _name("worker", v)),
}


def check_job(job, node: str) -> str:
    """Raise ``Refused`` unless the rq ``job`` is an action for ``node``; returns its function path.

    Reads only what the job carries (its JSON data and fields): nothing is
    imported or called, so a refused job never runs a line of its own.
    """
    from rq.exceptions import DeserializationError

    try:
        func, instance, args, kwargs = job.func_name, job.instance, job.args, job.kwargs
    except DeserializationError:
        raise Refused("its data is not JSON (never unpickled)") from None
    if not isinstance(func, str) or func not in ACTIONS:
        raise Refused(f"{func!r:.200} is not a control action (only {sorted(ACTIONS)})")
    callbacks = [getattr(job, f"_{k}_callback_name", None) for k in ("success", "failure", "stopped")]
    if instance is not None or kwargs or any(callbacks) or getattr(job, "webhooks", None):
        raise Refused(f"{func}: an action takes no instance, keyword arguments, callbacks or webhooks")
    shape = ACTIONS[func]
    if not (isinstance(args, (list, tuple)) and len(args) == len(shape) + 3):
        raise Refused(f"{func}: takes {len(shape) + 3} arguments (node, ..., seq, epoch)")
    if args[0] != node:
        raise Refused(f"{func}: addressed to node {args[0]!r:.100}, this agent is {node!r}")
    for check, value in zip(shape, args[1:-2]):
        check(value)
    _int("seq", args[-2], 1)
    _int("epoch", args[-1], 0)
    return func
