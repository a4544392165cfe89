"""Faults in the data plane's accounting and offsets (issue 13, items 2 and 3), on a real Redis.

- Every dead letter gives the feeder back exactly the trajectories its entry
  stood for: a rejected prompt, a malformed group, a prompt redelivered past
  ``max_deliveries``, a rejected group, and, at the learner, an undecodable
  entry and an unscored group. Without that the feeder's in-flight count never
  falls again and it stops for good. A replayed dead letter is in flight again.
  The feeder's count and ``libra-ctl audit``'s measured one agree throughout.
- Entries pending at ``learner-0`` that the learner does not hold (delivered
  to it, but the reply never reached the process) are replayed by the running
  learner, trained or skipped as duplicates, and acknowledged at its next
  checkpoint, so nothing stays pending and pins the scored stream's trim point.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline import config as config_mod
from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_LEARNER, GROUP_REWARD, GROUP_ROLLOUT, JobKeys
from pipeline.dataplane.streams import ClaimPolicy, Reject, ensure_groups, read, reclaim, run_stage
from pipeline.observe.audit import audit, dlq_entries, dlq_replay
from pipeline.run import policy_spec
from tests.test_dataplane import feeder_process, feeder_run, wait_for
from tests.test_learner_recovery import feed, learner_step, scored_groups, setup_run, start_learner
from workers import feeder
from workers.tiny_policy import ensure_policy

ROOT = Path(__file__).resolve().parent.parent
JOB = "faults"
G = 4
TRUNCATED = b"\x93\x01"  # msgpack: an array of three, cut after the first element


@pytest.fixture(scope="module")
def policy_dir():
    cfg = config_mod.load(None)
    return ensure_policy(ROOT / cfg.policy.cache_dir, policy_spec(cfg))


def unscored_group(pid: str) -> m.Group:
    trajs = tuple(m.Trajectory(
        sample_idx=i, completion=np.arange(8, dtype=np.int32), mask=np.ones(8, np.uint8),
        logprobs=np.full(8, -0.5, np.float32), text="t", finish="answer", turns=1, tool_calls=0,
        tool_latency_s=(), tool_timeouts=0) for i in range(G))
    return m.Group(prompt_id=pid, prompt="Q", answer=1, prompt_tokens=np.array([1, 2], np.int32), version=0,
                   worker="test", generated_at=1.0, gen_s=0.0, trajectories=trajs)


def one_round(r, keys: JobKeys, *, source: str, group: str, sink: str, handle, counter: str) -> None:
    """One round of the production stage loop (reclaim, read one entry, decode, handle, write and ack)."""
    rounds = []

    def stop() -> bool:
        rounds.append(1)
        return len(rounds) > 1

    run_stage(r, keys, source=source, group=group, consumer=f"{group}-t-0", sink=sink, handle=handle, count=1,
              block_ms=50, max_bytes=1 << 20, stop=stop, counter=counter,
              claims=ClaimPolicy(min_idle_ms=60_000, max_deliveries=3))


def take_prompt(r, keys: JobKeys, consumer: str) -> tuple[bytes, m.Prompt]:
    [(entry_id, payload)] = read(r, keys.prompts, GROUP_ROLLOUT, consumer, 1, 0)
    return entry_id, m.decode(payload, 1 << 20)


def test_every_dead_letter_gives_the_feeder_back_the_trajectories_its_entry_stood_for(tmp_path, r, redis_url):
    keys = JobKeys(JOB)
    ensure_groups(r, keys)
    run_dir, cfg = feeder_run(tmp_path, r, redis_url, job=JOB)
    assert cfg.rollout.group_size == G
    limit = feeder.admission_limit(cfg)
    ctx = SimpleNamespace(r=r, keys=keys)  # what feeder.in_flight reads

    def issued() -> int:
        return int(r.hget(keys.counters, "issued") or 0)

    def room_given_back(n_dead: int, what: str) -> None:
        wait_for(lambda: issued() == limit + n_dead * G, 15, f"the feeder to admit again after {what}")
        assert feeder.in_flight(ctx) == limit

    with feeder_process(run_dir, redis_url) as proc:
        wait_for(lambda: issued() == limit, 30, "the feeder to fill the admission window")
        assert feeder.in_flight(ctx) == limit == 4 * G

        # 1. The rollout stage rejects a prompt: the prompt stands for the group it was to become.
        one_round(r, keys, source=keys.prompts, group=GROUP_ROLLOUT, sink=keys.rollouts, counter="generated",
                  handle=lambda prompts: [Reject("prompt too long") for _p in prompts])
        room_given_back(1, "a rejected prompt")

        # 2. A rollout worker wrote a truncated group for a prompt (write and ack in one transaction);
        #    the reward stage dead-letters it undecoded: it stood for that prompt's group.
        entry_id, _prompt = take_prompt(r, keys, "rollout-t-1")
        pipe = r.pipeline(transaction=True)
        pipe.xadd(keys.rollouts, {m.FIELD: TRUNCATED})
        pipe.xack(keys.prompts, GROUP_ROLLOUT, entry_id)
        pipe.execute()
        one_round(r, keys, source=keys.rollouts, group=GROUP_REWARD, sink=keys.scored, counter="scored",
                  handle=lambda groups: pytest.fail("nothing decodes"))
        room_given_back(2, "a malformed group")

        # 3. A prompt delivered more than max_deliveries times.
        entry_id, _prompt = take_prompt(r, keys, "rollout-t-2")  # delivery 1; the worker dies with it
        claimed, _cursor = reclaim(r, keys, keys.prompts, GROUP_ROLLOUT, "rollout-t-0",
                                   ClaimPolicy(min_idle_ms=0, max_deliveries=1), 10, "0-0")
        assert claimed == []  # delivery 2 > 1: dead-lettered, not handed out
        room_given_back(3, "a prompt redelivered too often")

        # 4. The reward stage rejects a whole group (verifier down): its trajectories.
        entry_id, prompt = take_prompt(r, keys, "rollout-t-1")
        pipe = r.pipeline(transaction=True)
        pipe.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(prompt.prompt_id))})
        pipe.xack(keys.prompts, GROUP_ROLLOUT, entry_id)
        pipe.execute()
        one_round(r, keys, source=keys.rollouts, group=GROUP_REWARD, sink=keys.scored, counter="scored",
                  handle=lambda groups: [Reject("verifier down") for _g in groups])
        room_given_back(4, "a rejected group")

        dead = dlq_entries(r, keys)
        assert [d["trajectories"] for d in dead] == [G] * 4
        assert int(r.hget(keys.counters, "dead_lettered")) == 4 * G

        # A replayed dead letter is in flight again: the feeder makes no room for it twice.
        assert dlq_replay(r, keys, [dead[0]["id"]]) == 1
        wait_for(lambda: feeder.in_flight(ctx) == limit + G, 5, "the replayed prompt to count in flight")
        time.sleep(0.5)
        assert issued() == limit + 4 * G  # over the limit now: nothing more admitted
        r.hset(keys.state, "phase", "done")
        assert proc.wait(timeout=30) == 0

    a = audit(r, JOB)
    assert a["ok"], a["problems"]
    assert a["dead_lettered"] == 3 * G and a["dead_lettered_malformed"] == 1
    assert a["in_flight"] == feeder.in_flight(ctx) == limit + G  # measured and counted agree


@pytest.mark.slow
def test_the_learner_replays_entries_pending_at_it_that_it_does_not_hold(tmp_path, r, redis_url, policy_dir):
    """Entries delivered to learner-0 whose reply was lost are trained (or skipped) and acknowledged."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("job.steps=3",))
    keys = JobKeys("rec")
    groups = scored_groups(policy_dir, 12)
    # Step 1, with an undecodable entry and an unscored group among the good ones: the learner
    # dead-letters both, and each stood for an issued group.
    unscored = unscored_group("unscored@0")
    for payload in (m.encode(groups[0]), TRUNCATED, m.encode(groups[1]), m.encode(groups[2]),
                    m.encode(unscored), m.encode(groups[3])):
        r.xadd(keys.scored, {m.FIELD: payload})
    r.hincrby(keys.counters, "issued_prompts", 14)
    r.hincrby(keys.counters, "issued", 14 * G)
    proc = start_learner(run_dir, redis_url)
    try:
        wait_for(lambda: learner_step(r) >= 1, 300, "step 1")
        assert r.xpending(keys.scored, GROUP_LEARNER)["pending"] == 4  # held for the checkpoint at step 2
        # A read as learner-0 whose reply never reached the learner (a dropped connection, and
        # redis-py retries the command): the entries are pending at learner-0, which never saw
        # them. XADD and XREADGROUP in one transaction, so the learner, blocked on the stream,
        # cannot get them first. Among them, first (so that it is read before the last step fills),
        # a copy of a group trained at step 1.
        pipe = r.pipeline(transaction=True)
        for g in [groups[0]] + groups[4:8]:
            pipe.xadd(keys.scored, {m.FIELD: m.encode(g)})
        pipe.xreadgroup(GROUP_LEARNER, "learner-0", {keys.scored: ">"}, count=5)
        assert len(pipe.execute()[-1][0][1]) == 5
        feed(r, groups[8:], issued=0)
        wait_for(lambda: learner_step(r) >= 3, 120, "step 3: the entries lost to learner-0 trained")
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert r.xpending(keys.scored, GROUP_LEARNER)["pending"] == 0
    assert r.xlen(keys.scored) <= 1  # trimmed: nothing pins the trim point
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 12 * G and a["duplicates_trained"] == 0 and a["in_flight"] == 0
    assert a["dead_lettered"] == 2 * G and a["duplicates_skipped"] == {"learner": G}
    assert feeder.in_flight(SimpleNamespace(r=r, keys=keys)) == 0
    consumed = {tid for ck in (run_dir / "checkpoints").glob("step-*")
                for tid in (ck / "consumed.txt").read_text().split()}
    assert consumed == {f"{g.prompt_id}/{i}" for g in groups for i in range(G)}
