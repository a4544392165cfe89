"""The learner's publish cadence: learner steps per published version, as the controller sets it.

Every published version costs a weight load on each rollout engine and a
publish on the learner. While the data trained has room under
``max_staleness``, the controller stretches the cadence (``allocator.plan_publish``)
and writes it here (``write_cadence``, from ``pipeline.control.loop``); the
learner reads it at the end of each step (``read_cadence``: ``workers.learner``,
and the sim backend's learner in ``pipeline.sim.worker``), and so does the
controller's observer. Without a value (no controller, or a cadence it never
changed) the learner keeps its config's ``learner.publish_every``.
"""

from __future__ import annotations

import redis

from pipeline.dataplane.keys import JobKeys


def read_cadence(r: redis.Redis, keys: JobKeys, default: int, max_staleness: int) -> tuple[int, float | None]:
    """(steps per version, when the controller set it, or None) for the job; ``default`` when unset."""
    return parse_cadence(r.hgetall(keys.publish), default, max_staleness)


def parse_cadence(rec: dict, default: int, max_staleness: int) -> tuple[int, float | None]:
    """``read_cadence`` of the job's ``publish`` hash as HGETALL returned it.

    A value outside 1..max(1, max_staleness) is not applied (the config's
    bound, which a published version must never exceed): the default stands.
    """
    try:
        every, at = int(rec[b"every"]), float(rec[b"at"])
    except (KeyError, ValueError):
        return default, None
    if not 1 <= every <= max(1, max_staleness):
        return default, None
    return every, at


def write_cadence(r: redis.Redis, keys: JobKeys, every: int, reason: str, at: float) -> None:
    r.hset(keys.publish, mapping={"every": every, "at": at, "reason": reason})


def publishes(step: int, published_step: int, every: int, steps: int) -> bool:
    """Whether step ``step`` ends with a published version: ``every`` steps after the last one, and the last."""
    return step - published_step >= every or step >= steps
