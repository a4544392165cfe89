"""Rollout catches up to a prompt's ``min_version`` before generating it (the synchronous mode's guarantee).

The engine here is a recorder of reloads: what is under test is the rollout
stage's decision to load newer weights, read from a real Redis, not vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import structlog

from pipeline.dataplane.keys import JobKeys
from workers.rollout import Rollout


class Reloads:
    def __init__(self):
        self.paths: list[str] = []

    def reload(self, path: str) -> None:
        self.paths.append(path)


class Meter:
    def add(self, **_kw) -> None:
        pass


def stage(r, version: int) -> Rollout:
    ctx = SimpleNamespace(r=r, keys=JobKeys("sync"), log=structlog.get_logger(), policy_version=version)
    ctx.set_version = lambda v: setattr(ctx, "policy_version", v)
    s = object.__new__(Rollout)
    s.ctx, s.engine, s.meter = ctx, Reloads(), Meter()
    return s


def test_a_prompt_stamped_with_a_newer_version_loads_it_first(r):
    keys = JobKeys("sync")
    r.delete(keys.policy)
    r.hset(keys.policy, mapping={"version": 5, "path": "/weights/v5"})
    s = stage(r, version=4)
    s.catch_up(5)
    assert s.engine.paths == ["/weights/v5"] and s.ctx.policy_version == 5
    s.catch_up(3)   # older than what it holds: nothing to load
    s.catch_up(5)
    assert s.engine.paths == ["/weights/v5"]


def test_a_version_not_published_is_logged_not_waited_for(r):
    keys = JobKeys("sync")
    r.delete(keys.policy)
    r.hset(keys.policy, mapping={"version": 5, "path": "/weights/v5"})
    s = stage(r, version=5)
    s.catch_up(7)   # published versions only grow, so this cannot happen; it must not hang or go back
    assert s.engine.paths == [] and s.ctx.policy_version == 5
