"""Out-of-memory errors of a worker, reported as such instead of as a generic crash.

Every stage process (``workers.rollout``, ``workers.reward``,
``workers.learner``) runs its stage inside ``oom_reported(ctx)``: an
out-of-memory error (Python's ``MemoryError``, torch's
``OutOfMemoryError``, a CUDA or vLLM allocation failure) is logged as
``oom``, recorded in the worker's record (``failure``: kind ``oom`` and the
detail; ``libra-ctl status`` shows it) and in the job's events
(``libra-ctl events``, ``runs/<id>/events.jsonl``), and then re-raised: the
worker exits non-zero and its agent decides. A full Redis is not this: its
``OutOfMemoryError`` is backpressure (``pipeline.dataplane.streams``).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import redis

# Messages of allocation failures that arrive as a plain RuntimeError or ValueError: CUDA's caching
# allocator ("CUDA out of memory"), cuBLAS/cuDNN, and vLLM when the KV cache does not fit.
_OOM_TEXTS = ("out of memory", "no available memory for the cache blocks", "insufficient memory")
EVENTS_MAXLEN = 10_000  # as the controller caps the events stream (pipeline.control.events)


def is_oom(exc: BaseException, quoted: str = "") -> bool:
    """Whether ``exc`` is a process running out of (host or device) memory; never a full Redis.

    ``quoted``: text the failing code was handed (a transcript a reward
    judges). An untyped error whose message may only repeat an allocation
    failure that text mentions is that code's failure, not the process's.
    """
    if isinstance(exc, redis.RedisError):
        return False
    if isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__):
        return True
    text, quoted = str(exc).lower(), quoted.lower()
    return isinstance(exc, (RuntimeError, ValueError)) and any(t in text and t not in quoted for t in _OOM_TEXTS)


def oom_detail(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:2000]}"


def record_oom(ctx, exc: BaseException, fatal: bool = True) -> dict:
    """Log and append to the job's events; returns the failure record.

    ``fatal``: the worker is about to exit with it, so its record says so too
    (``failure``); otherwise the worker contained it (the learner's
    ``train_contained`` taking a group out) and goes on.
    """
    failure = {"kind": "oom", "detail": oom_detail(exc), "at": time.time()}
    ctx.log.error("oom", detail=failure["detail"], fatal=fatal)
    event = {"at": failure["at"], "job": ctx.keys.job, "kind": "worker_oom", "worker": ctx.worker_id,
             "role": ctx.role, "node": ctx.node, "detail": failure["detail"], "fatal": fatal}
    line = json.dumps(event)
    try:
        if fatal:
            ctx.failure = failure
            ctx.publish_state("oom")
        ctx.r.xadd(ctx.keys.control_events, {"data": line}, maxlen=EVENTS_MAXLEN, approximate=True)
    except redis.RedisError as err:
        ctx.log.warning("oom_not_recorded", error=str(err))
    try:
        with open(ctx.run_dir / "events.jsonl", "a") as f:
            f.write(line + "\n")
    except OSError:
        pass   # the run directory lives on another machine
    return failure


@contextmanager
def oom_reported(ctx):
    """Run a stage; an out-of-memory error is recorded as ``oom`` (``record_oom``) and re-raised."""
    try:
        yield
    except BaseException as exc:
        if is_oom(exc):
            record_oom(ctx, exc)
        raise
