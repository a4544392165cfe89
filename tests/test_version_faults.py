"""Versions, staleness and admission in cases that used to count wrong.

The sim learner's dead letters and second copies, the sim rollout's prompt
version, a restore's line start that holds its parent's weights, and a
learner drained while its batch filled.
"""

from __future__ import annotations

import types

import numpy as np
import structlog

from pipeline.dataplane import messages
from pipeline.dataplane.keys import GROUP_LEARNER, JobKeys
from pipeline.dataplane.streams import counted_in_flight, ensure_groups, group_pending, read

G = 4


def _counters(r, keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(keys.counters).items()}


def test_sim_learner_dead_letter_gives_the_feeders_room_back(r):
    """An undecodable scored entry the sim learner dead-letters gives its G trajectories back to the
    feeder's in-flight count, as the real learner's does (it gave 0: a group of room lost for good)."""
    from pipeline.sim.worker import SimLearner

    keys = JobKeys("rvsim")
    ensure_groups(r, keys)
    r.hset(keys.feeder, mapping={"cursor": 1, "group_size": G})
    r.hset(keys.counters, mapping={"issued": G, "issued_prompts": 1})
    r.xadd(keys.scored, {messages.FIELD: b"\xc1not msgpack"})
    entries = read(r, keys.scored, GROUP_LEARNER, "learner-0", 10, None)
    assert len(entries) == 1
    assert counted_in_flight(_counters(r, keys)) == G

    learner = SimLearner.__new__(SimLearner)
    learner.ctx = types.SimpleNamespace(r=r, keys=keys, log=structlog.get_logger(), stopping=lambda: False)
    entry_id, payload = entries[0]
    learner.dead_letter([(entry_id, payload, "malformed: not msgpack", G)])

    assert counted_in_flight(_counters(r, keys)) == 0, _counters(r, keys)


def test_sim_rollout_generates_a_prompt_with_the_weights_it_asks_for(r):
    """A prompt issued at v1 that a blocked read hands to a sim rollout worker holding v0 is generated with
    v1, as the vLLM worker's ``catch_up`` does (it was stamped v0: at max_staleness 0 only a drop)."""
    from pipeline import config as config_mod
    from pipeline.sim.worker import RolloutCall, SimRollout

    keys = JobKeys("rvsimro")
    cfg = config_mod.load(None, ["job.name=rvsimro", f"rollout.group_size={G}", "learner.max_staleness=0"])
    ctx = types.SimpleNamespace(r=r, keys=keys, cfg=cfg, worker_id="rollout-h-0", policy_version=0, done=0)
    ctx.set_version = lambda v: setattr(ctx, "policy_version", v)
    ctx.count = lambda n: None
    model = types.SimpleNamespace(
        rollout=lambda version, groups, gsz: RolloutCall(0.0, (1.0,) * groups, (0,) * (groups * gsz)),
        wl=types.SimpleNamespace(rollout=types.SimpleNamespace(weight_sync_s=0.0)))
    clock = types.SimpleNamespace(sleep=lambda s: 0.0)
    meter = types.SimpleNamespace(add=lambda **k: None)
    r.hset(keys.policy, mapping={"version": 0, "path": "/nowhere", "step": 0})
    ro = SimRollout(ctx, model, clock, meter)
    assert ctx.policy_version == 0
    # the learner publishes v1; the feeder then issues a prompt for it, which the worker's blocked read returns
    r.hset(keys.policy, mapping={"version": 1, "step": 1})
    prompt = messages.Prompt(prompt_id="p@0", prompt="Q:1+1\n", answer=2, issued_at=0.0, min_version=1)
    [group] = ro.generate([prompt])
    assert group.version >= prompt.min_version, f"generated with v{group.version} for a prompt of v1"


def test_a_restore_that_died_before_training_is_not_a_discarded_branch():
    """Checkpoint v3; restore 1 publishes its weights as v6 and dies before training, restore 2 as v7. v6
    holds v3's weights: its groups are on the line (a plain stale drop once too old), not off a discarded
    branch (``on_line`` was False for v6)."""
    tree = Lineage()
    tree.start_line(6, updates=3, parent=3)   # restore 1
    tree.start_line(7, updates=3, parent=3)   # restore 2, before restore 1 trained a step
    head = 10                                  # 3 updates on the new line
    assert tree.distance(3, head).updates == tree.distance(6, head).updates == 3
    assert tree.distance(3, head).on_line
    assert tree.distance(6, head).on_line, "v6 holds v3's weights: its work is not off a discarded branch"


def test_sim_learner_drops_a_stale_group_once_when_a_second_copy_arrives(r):
    """Two copies of a stale group reach the sim learner: one drop of G, G duplicates skipped, as the real
    learner judges them (both were dropped: 2G for G issued, and the feeder over-issued)."""
    from pipeline import config as config_mod
    from pipeline.dataplane.lookahead import InHand
    from pipeline.dataplane.redisconn import Outage
    from pipeline.sim.worker import SimLearner, _Batch, _trajectory

    keys = JobKeys("rvsimdup")
    cfg = config_mod.load(None, ["job.name=rvsimdup", f"rollout.group_size={G}", "learner.batch_size=8",
                                 "learner.max_staleness=1"])
    log = structlog.get_logger()
    learner = SimLearner.__new__(SimLearner)
    learner.ctx = types.SimpleNamespace(r=r, keys=keys, cfg=cfg, log=log, stopping=lambda: False)
    learner.cfg = cfg.learner
    learner.outage = Outage(log)
    learner.lineage = Lineage()
    learner.version = 5                          # the learner at v5: a v0 group is 5 updates old
    learner.ahead = InHand(limit=8)
    stale = messages.Group(prompt_id="p@0", prompt="Q", answer=1, prompt_tokens=np.zeros(1, np.int32),
                           version=0, worker="w", generated_at=0.0, gen_s=0.0,
                           trajectories=tuple(_trajectory(i, 0) for i in range(G)))
    learner.ahead.add(b"1-0", stale, b"")
    learner.ahead.add(b"2-0", stale, b"")        # the second copy
    batch = _Batch([], [], [])
    learner.take_in_hand(batch)
    assert len(batch.entry_ids) == 2
    assert (len(batch.dropped), batch.duplicates) == (1, G), \
        f"{len(batch.dropped)} drops of one group, {batch.duplicates} duplicates skipped"


# --- the real learner, in process ------------------------------------------------------------------------

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402

from pipeline.dataplane.lineage import Lineage  # noqa: E402
from tests.test_learner_recovery import ROOT, feed, in_process_learner, scored_groups, setup_run  # noqa: E402


@pytest.fixture(scope="module")
def policy_dir():
    from pipeline import config as config_mod
    from pipeline.run import policy_spec
    from workers.tiny_policy import ensure_policy

    cfg = config_mod.load(None)
    return ensure_policy(ROOT / cfg.policy.cache_dir, policy_spec(cfg))


def test_a_learner_drained_mid_batch_leaves_no_stale_drops_counted(tmp_path, r, redis_url, policy_dir):
    """A learner drained while its batch fills leaves its held drops uncounted: the entries stay pending for
    the next learner, so the feeder counts them in flight (``dropped_held`` was left at the batch's drops
    and the feeder over-issued until another learner started)."""
    run_dir, cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                             extra=("job.steps=2", "learner.max_staleness=1", "learner.prefetch=false",
                                    "learner.last_chance_first=false"))
    keys = JobKeys("rec")
    gs = scored_groups(policy_dir, 1)
    # v5 is no version the learner (at v0) made: dropped at once, as stale off a branch
    feed(r, [replace(gs[0], version=5)], issued=1, at_once=True)
    learner = in_process_learner(run_dir, r)
    real = learner.read_waiting

    def read_then_drain(*a, **k):
        out = real(*a, **k)
        if out:
            learner.ctx.stop_event.set()   # SIGTERM arrives while the batch fills
        return out

    learner.read_waiting = read_then_drain
    learner.run()
    assert learner.step == 0
    c = _counters(r, keys)
    assert group_pending(r, keys.scored, GROUP_LEARNER) == 1   # replayed by the next learner
    assert c.get("dropped_held", 0) == 0 and counted_in_flight(c) == G, c
