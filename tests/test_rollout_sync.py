"""Rollout catches up to a prompt's ``min_version`` before generating it (the synchronous mode's guarantee),
and dead-letters what is not a prompt instead of dying on it.

The engine here is a recorder of reloads: what is under test is the rollout
stage's decision to load newer weights, read from a real Redis, not vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import structlog

from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_ROLLOUT, JobKeys
from pipeline.dataplane.streams import ClaimPolicy, ensure_groups, group_pending, run_stage
from tests.test_streams import unscored_group
from workers.rollout import Rollout


class Reloads:
    def __init__(self):
        self.paths: list[str] = []

    def reload(self, path: str) -> None:
        self.paths.append(path)


class Meter:
    def got_input(self) -> None:
        pass

    def add(self, **_kw) -> None:
        pass


def stage(r, version: int) -> Rollout:
    ctx = SimpleNamespace(r=r, keys=JobKeys("sync"), log=structlog.get_logger(), policy_version=version)
    ctx.set_version = lambda v: setattr(ctx, "policy_version", v)
    ctx.stopping = lambda: False
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


def test_a_well_formed_message_of_another_kind_on_the_prompts_stream_is_dead_lettered_and_the_worker_lives(r):
    keys = JobKeys("sync")
    ensure_groups(r, keys)
    r.hset(keys.feeder, "group_size", 2)
    r.hset(keys.policy, mapping={"version": 0, "path": "/weights/v0"})
    r.xadd(keys.prompts, {m.FIELD: m.encode(m.Prompt("p@0", "Q:1+2\n", 3, 1.0))})
    r.xadd(keys.prompts, {m.FIELD: m.encode(unscored_group("g@0"))})   # well-formed, on the wrong stream
    s = stage(r, version=0)
    s.play = lambda prompts: [unscored_group(p.prompt_id) for p in prompts]   # the engine's part
    rounds = []
    run_stage(r, keys, source=keys.prompts, group=GROUP_ROLLOUT, consumer="rollout-n-0", sink=keys.rollouts,
              handle=s.generate, count=8, block_ms=50, max_bytes=1 << 20, counter="generated",
              stop=lambda: rounds.append(1) or len(rounds) > 2,
              claims=ClaimPolicy(min_idle_ms=60_000, max_deliveries=3))
    [(_id, dead)] = r.xrange(keys.dead_letters)
    assert dead[b"reason"] == b"rollout stage expects a prompt" and int(dead[b"deliveries"]) == 1
    assert m.decode(dead[b"payload"], 1 << 20).prompt_id == "g@0" and int(dead[b"trajectories"]) == 2
    assert [m.decode(f[m.FIELD], 1 << 20).prompt_id for _i, f in r.xrange(keys.rollouts)] == ["p@0"]
    assert group_pending(r, keys.prompts, GROUP_ROLLOUT) == 0


def test_a_redis_restart_while_catching_up_is_waited_out_not_fatal(tmp_path):
    """catch_up runs inside the stage's handling of a batch, outside run_stage's outage handling: a Redis
    that restarts while it reads the published version is now waited out and the newer weights loaded.
    Before, the ConnectionError killed the worker (and with it the engine, minutes to restart on a GPU)."""
    import threading

    from pipeline.dataplane.redisconn import connect
    from tests.test_faults_redis import Server

    server = Server(tmp_path / "redis").start()
    try:
        r = connect(server.url)
        r.hset(JobKeys("sync").policy, mapping={"version": 5, "path": "/weights/v5"})
        s = stage(r, version=4)
        server.kill()                                    # down when catch_up reads the policy ...
        # ... and back after longer than the client's own retries last (about 1.5 s), same data (AOF)
        threading.Timer(4.0, server.start).start()
        s.catch_up(5)
        assert s.engine.paths == ["/weights/v5"] and s.ctx.policy_version == 5
    finally:
        server.stop()
