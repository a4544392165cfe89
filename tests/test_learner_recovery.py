"""The learner's offsets ride on its checkpoints: a crash loses nothing and trains nothing twice.

A real learner process trains on scored groups written straight into the
scored stream (no rollout engine needed), is killed with SIGKILL between two
checkpoints, restarted, and finishes; `libra-ctl audit` then accounts for every
trajectory. A drain (SIGTERM) between two checkpoints checkpoints the steps
trained, and the restart repeats none. With deduplication switched off on
purpose, a duplicate group is trained twice and the audit fails. At the
quick-start staleness bound, a crash after a checkpoint and more publishes
trains the restored line's replayed work instead of dropping it as stale, and
drops what a discarded version generated only as far as the bound says, and a
group exactly at the bound is trained while one past it is dropped and
counted. A stale group dropped in a step whose checkpoint is durable but
whose acks were lost is skipped when it is replayed, not dropped twice; a
learner restored at its last step acknowledges such entries. A learner under
another consumer name takes over the entries a dead one held and trains them
once. At the controller's publish cadence the learner publishes every so many
steps, and a restart numbers its weights past the versions a dead learner only
recorded.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis
import structlog
import torch

from pipeline import config as config_mod
from pipeline.dataplane import messages
from pipeline.dataplane.cadence import write_cadence
from pipeline.observe.audit import audit
from pipeline.dataplane.keys import GROUP_LEARNER, JOBS, LEARNER, JobKeys
from pipeline.dataplane.lineage import Lineage, load_segments
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect
from pipeline.run import policy_spec
from pipeline.dataplane.streams import ensure_groups, group_pending, learner_backlog
from pipeline.dataplane.worker import WorkerContext, load_run_config
from workers import learner as learner_mod
from workers.envs import calc
from workers.tiny_policy import completion_logprobs, ensure_policy, load_model, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
G = 4


@pytest.fixture(scope="module")
def policy_dir():
    cfg = config_mod.load(None)
    return ensure_policy(ROOT / cfg.policy.cache_dir, policy_spec(cfg))


def scored_groups(policy_dir: Path, n: int, seed: int = 1) -> list[messages.Group]:
    """Groups of noisy demonstrations, scored by the verifier, with the v0 policy's log-probs."""
    tok, model = load_tokenizer(policy_dir), load_model(policy_dir)
    rng = random.Random(seed)
    groups = []
    for p in calc.make_problems(seed, n, "train"):
        prompt = tok.encode(p.prompt)
        texts = [calc.demonstration(p, rng, noise=0.5) for _ in range(G)]
        comps = [tok.encode(t) for t in texts]
        with torch.no_grad():
            lps = completion_logprobs(model, [prompt] * G, comps)
        trajs = tuple(messages.Trajectory(
            sample_idx=i, completion=np.array(c, np.int32), mask=np.array(calc.tool_span_mask(t), np.uint8),
            logprobs=(lp.numpy() * np.array(calc.tool_span_mask(t))).astype(np.float32), text=t,
            finish="answer", turns=3, tool_calls=2, tool_latency_s=(), tool_timeouts=0,
            reward=calc.verify(p, t)) for i, (t, c, lp) in enumerate(zip(texts, comps, lps)))
        groups.append(messages.Group(prompt_id=f"{p.prompt_id}@0", prompt=p.prompt, answer=p.answer,
                                     prompt_tokens=np.array(prompt, np.int32), version=0, worker="test",
                                     generated_at=time.time(), gen_s=0.0, trajectories=trajs))
    return groups


def setup_run(tmp_path: Path, r, redis_url: str, policy_dir: Path, dedup: bool,
              extra: tuple[str, ...] = ()) -> tuple[Path, config_mod.Config]:
    cfg = config_mod.load(None, ["job.name=rec", "job.steps=6", f"rollout.group_size={G}",
                                 "learner.batch_size=16", "learner.checkpoint_every=2", "learner.max_staleness=8",
                                 "learner.publish_every=1", "streams.max_queue_size=64",
                                 f"streams.dedup={'true' if dedup else 'false'}", *extra])
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"config": cfg.to_dict(),
                                                       "redis": {"url": redis_url, "embedded": False}}))
    keys = JobKeys("rec")
    r.sadd(JOBS, "rec")
    r.hset(keys.state, mapping={"phase": "running", "run_dir": str(run_dir)})
    r.hset(keys.policy, mapping={"version": 0, "path": str(policy_dir), "step": 0})
    ensure_groups(r, keys)
    return run_dir, cfg


def start_learner(run_dir: Path, redis_url: str, slots: str = "", worker_id: str = "learner-0") -> subprocess.Popen:
    """The learner process (consumer ``worker_id``), holding ``slots`` as the node agent would say them
    ("0,1": two ranks)."""
    env = dict(os.environ, **{ENV_URL: redis_url, "LIBRA_SLOTS": slots})
    return subprocess.Popen([sys.executable, "-m", "workers.learner", "--run-dir", str(run_dir),
                             "--worker-id", worker_id], cwd=ROOT, env=env)


def learner_step(r) -> int:
    raw = r.hget(JobKeys("rec").learner_stats, "step")
    return json.loads(raw) if raw else 0


def wait_for(cond, timeout_s=300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def feed(r, groups, issued: int, at_once: bool = False) -> None:
    """Write scored groups, and count ``issued`` prompts (the first ``issued`` groups' ids) as the feeder would;
    ``at_once``: in one transaction, so that the learner's next read sees them all."""
    keys = JobKeys("rec")
    w = r.pipeline(transaction=True) if at_once else r
    for g in groups:
        w.xadd(keys.scored, {messages.FIELD: messages.encode(g)})
    w.hincrby(keys.counters, "issued_prompts", issued)
    w.hincrby(keys.counters, "issued", issued * G)
    if issued:  # the feeder's record: the first ``issued`` prompts among these groups
        w.sadd(keys.issued, *list(dict.fromkeys(g.prompt_id for g in groups))[:issued])
    if at_once:
        w.execute()


def published(r) -> int:
    return int(r.hget(JobKeys("rec").policy, "version"))


def ids_of(groups) -> set[str]:
    return {f"{g.prompt_id}/{t.sample_idx}" for g in groups for t in g.trajectories}


def records(run_dir: Path, name: str) -> list[str]:
    return [i for ck in sorted((run_dir / "checkpoints").glob("step-*")) if (ck / name).exists()
            for i in (ck / name).read_text().split()]


# --- the version tree -------------------------------------------------------------------------------


def test_lineage_counts_updates_along_the_restored_line_and_across_a_discarded_branch():
    """v0..v5 by one learner, checkpoint at v3 (step 3), restored as v6: v4 and v5 are a discarded branch."""
    tree = Lineage()
    tree.start_line(6, updates=3, parent=3)
    assert tree.distance(3, 6).updates == 0 and tree.distance(3, 6).on_line   # the same weights, two names
    assert tree.distance(2, 8).updates == 3 and tree.distance(2, 8).on_line   # 1 update before, 2 after
    assert tree.distance(8, 8).updates == 0 and tree.distance(8, 8).on_line
    # v5: 2 updates past the fork (v3) on the dead branch, 2 along the new line to v8
    assert tree.distance(5, 8).updates == 4 and not tree.distance(5, 8).on_line
    assert tree.distance(4, 6).updates == 1 and not tree.distance(4, 6).on_line
    # a second restore, of v7 (step 4), as v10: v8 and v9 are a branch off v7
    tree.start_line(10, updates=4, parent=7)
    assert tree.distance(6, 11).updates == 2 and tree.distance(6, 11).on_line
    assert tree.distance(9, 10).updates == 2 and not tree.distance(9, 10).on_line
    assert tree.distance(5, 10).updates == 3 and not tree.distance(5, 10).on_line
    assert Lineage(Lineage.segments_from_json(tree.to_json())).segments == tree.segments


@pytest.mark.slow
def test_a_crash_after_more_publishes_trains_the_restored_lines_work_at_the_quickstart_bound(
        tmp_path, r, redis_url, policy_dir):
    """max_staleness=2 (examples/quickstart.toml). Steps 1-5 each train 4 groups of the version just
    published; checkpoint at step 3 (v3); SIGKILL after step 5 (v5 published). The replay of steps 4-5
    holds groups of v3 (the checkpoint's weights: the restored line) and of v4 (a discarded branch).
    Counting version numbers, the restore (v6) judges the v3 groups 3 versions old and drops them;
    counted along the version tree they are 0 updates old and are trained. v5's groups, sampled on the
    branch, are 4 updates off by the time they are read and are dropped as such, each with its reason."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("learner.max_staleness=2", "learner.checkpoint_every=3"))
    keys = JobKeys("rec")
    groups = scored_groups(policy_dir, 28)
    batches = [[replace(g, version=v) for g in groups[4 * v:4 * v + 4]] for v in range(6)]
    proc = start_learner(run_dir, redis_url)
    for v in range(5):  # each batch generated by the version published just before
        wait_for(lambda: published(r) == v)
        feed(r, batches[v], issued=4)
    wait_for(lambda: learner_step(r) == 5 and published(r) == 5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000003"]

    proc = start_learner(run_dir, redis_url)
    wait_for(lambda: learner_step(r) == 5 and published(r) == 8)  # v6 restored, steps 4-5 replayed as v7, v8
    # generated by v5, the dead learner's last publish, and read once the replay is done: fed before it, a
    # read could bring them into step 4's batch, where they are 2 updates off and trained at their last chance
    feed(r, batches[5], issued=4)
    last = [replace(g, version=8) for g in groups[24:]]
    feed(r, last, issued=4)
    assert proc.wait(timeout=600) == 0

    assert load_segments(r, keys) == {0: (0, None), 6: (3, 3)}
    trained = records(run_dir, "consumed.txt")
    assert ids_of(batches[3]) <= set(trained), "the restored line's replayed work must be trained, not dropped"
    assert ids_of(batches[4]) <= set(trained)  # the branch's v4: 2 updates off (1 + 1), within the bound
    assert set(records(run_dir, "dropped_branch.txt")) == set(records(run_dir, "dropped.txt")) == ids_of(batches[5])
    assert int(r.hget(keys.counters, "dropped_branch")) == 4 * G
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["staleness_max"]) for m in steps[-3:]] == [(4, 0), (5, 2), (6, 0)]
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert (a["trained"], a["dropped_stale"], a["duplicates_trained"], a["in_flight"]) == (24 * G, 4 * G, 0, 0)


@pytest.mark.slow
def test_crash_between_checkpoints_loses_nothing_and_trains_nothing_twice(tmp_path, r, redis_url, policy_dir):
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True)
    groups = scored_groups(policy_dir, 24)  # 6 steps x 4 groups
    # 3 steps' data, then none: the learner waits after step 3, so the kill lands between the checkpoint
    # of step 2 and the next one however slowly the test polls (with all 6 steps fed, it could reach step 4).
    feed(r, groups[:12], issued=12)
    proc = start_learner(run_dir, redis_url)
    wait_for(lambda: learner_step(r) == 3)  # checkpoint at step 2; step 3 trained, not yet durable
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    published_before = int(r.hget(JobKeys("rec").policy, "version"))
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000002"]
    pending = r.xpending(JobKeys("rec").scored, "learner")["pending"]
    assert pending == 4, "the entries of the step after the checkpoint must still be pending"

    feed(r, groups[12:], issued=12)
    proc = start_learner(run_dir, redis_url)
    assert proc.wait(timeout=600) == 0
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 24 * G and a["duplicates_trained"] == 0 and a["in_flight"] == 0
    # The restore (of step 2) published under a new version: no number names two sets of weights.
    versions = [json.loads(line)["policy_version"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(versions) == published_before + 1 + (6 - 2)
    cli = subprocess.run([sys.executable, "-m", "pipeline.cli", "audit", "--job", "rec", "--json",
                          "--redis", redis_url], cwd=ROOT, capture_output=True, text=True)
    assert cli.returncode == 0 and json.loads(cli.stdout)["trained"] == 96


@pytest.mark.slow
def test_a_checkpoint_records_its_weights_and_a_restore_refuses_damaged_ones(tmp_path, r, redis_url, policy_dir):
    """state.json keeps the SHA-256 of the weights in memory; the restore compares the weights it loaded with it.
    A byte changed in the checkpoint's weights file (a damaged disk, a copy cut short and padded) loaded as
    weights that were never trained; now the learner refuses, naming the checkpoint, and writes nothing."""
    from workers.checkpoint import weights_digest

    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("job.steps=2",))
    feed(r, scored_groups(policy_dir, 8), issued=8)
    first = in_process_learner(run_dir, r)
    first.run()
    ckpt = run_dir / "checkpoints" / "step-000002"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["weights_sha256"] == weights_digest(first.model)
    assert weights_digest(first.model) != weights_digest(load_model(policy_dir))   # trained: not the initial ones

    again = in_process_learner(run_dir, r)   # restored from step 2, as written
    assert again.step == 2 and weights_digest(again.model) == state["weights_sha256"]

    weights = ckpt / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x40   # a byte of the last tensor's values, past the header
    weights.write_bytes(bytes(data))
    version = r.hget(JobKeys("rec").policy, "version")
    with pytest.raises(RuntimeError, match="step-000002: the weights loaded .* are not the ones it recorded"):
        in_process_learner(run_dir, r)
    assert r.hget(JobKeys("rec").policy, "version") == version   # nothing published from them


def consumer_pending(r, consumer: str) -> int:
    return next((int(c["pending"]) for c in r.xinfo_consumers(JobKeys("rec").scored, "learner")
                 if c["name"].decode() == consumer), 0)


@pytest.mark.slow
def test_a_learner_under_another_name_takes_over_a_dead_ones_pending_entries_and_trains_them_once(
        tmp_path, r, redis_url, policy_dir):
    """learner-0 dies (SIGKILL) holding the entries of the step after its checkpoint. A learner under
    another consumer name (a new world's rank 0) takes them over at start, before reading anything new,
    and trains every group once. Reclaiming by idle time is off (learner_min_idle_s), so only the
    take-over can hand those entries on."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("streams.learner_min_idle_s=1e6",))
    groups = scored_groups(policy_dir, 24)  # 6 steps x 4 groups
    feed(r, groups, issued=len(groups))
    proc = start_learner(run_dir, redis_url)
    try:
        wait_for(lambda: learner_step(r) >= 3)  # checkpoint at step 2; step 3 trained, not yet durable
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    held = consumer_pending(r, "learner-0")
    assert held >= 4, "the entries of the step after the checkpoint must still be pending at learner-0"

    proc = start_learner(run_dir, redis_url, worker_id="learner-b")
    try:
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [json.loads(line) for line in (run_dir / "logs" / "learner-b.jsonl").read_text().splitlines()]
    assert [e["entries"] for e in events if e["event"] == "took_over_pending"] == [held]
    assert consumer_pending(r, "learner-0") == 0 and consumer_pending(r, "learner-b") == 0
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 24 * G and a["duplicates_trained"] == 0 and a["in_flight"] == 0
    assert sorted(records(run_dir, "consumed.txt")) == sorted(ids_of(groups))   # every group, each once


@pytest.mark.slow
def test_at_the_quickstart_bound_a_group_at_the_bound_is_trained_and_one_past_it_dropped_and_counted(
        tmp_path, r, redis_url, policy_dir):
    """examples/quickstart.toml's max_staleness B. Every step publishes (v_k after step k), so a group of
    v0 read at step k is k-1 updates old: steps 1..B+1 train groups of v0 (the last at exactly B), and at
    step B+2 a group of v0, B+1 updates old, is dropped whole and counted as dropped_stale."""
    bound = config_mod.load(str(ROOT / "examples" / "quickstart.toml")).learner.max_staleness
    steps = bound + 2
    # The groups are stamped with the versions the learner will have published when it reaches them in
    # stream order, so it must not read ahead (learner.last_chance_first): ahead of its versions it could
    # not place them, and would drop them.
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=(f"learner.max_staleness={bound}", f"job.steps={steps}",
                                     "learner.last_chance_first=false"))
    keys = JobKeys("rec")
    groups = scored_groups(policy_dir, 4 * steps + 1)
    old, fresh = groups[:4 * (bound + 1)], groups[4 * (bound + 1):]
    stale, fresh = fresh[0], [replace(g, version=bound + 1) for g in fresh[1:]]
    feed(r, [*old, stale, *fresh], issued=len(groups))   # read in this order: 4 groups a step
    proc = start_learner(run_dir, redis_url)
    assert proc.wait(timeout=600) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["staleness_max"], m["dropped_stale"]) for m in metrics] == \
        [(k, k - 1, 0) for k in range(1, bound + 2)] + [(steps, 0, G)]
    assert metrics[bound]["staleness_hist"] == {str(bound): 4 * G}   # at the bound: all trained
    assert int(r.hget(keys.counters, "dropped_stale")) == G
    assert set(records(run_dir, "dropped.txt")) == ids_of([stale])
    assert set(records(run_dir, "consumed.txt")) == ids_of(old + fresh)
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert (a["trained"], a["dropped_stale"], a["duplicates_trained"]) == (4 * steps * G, G, 0)


@pytest.mark.slow
@pytest.mark.parametrize("first", [True, False], ids=["last-chance-first", "arrival-order"])
def test_a_group_at_its_last_chance_behind_fresher_ones_is_trained_first(tmp_path, r, redis_url, policy_dir, first):
    """max_staleness 1, 4 groups a step. Step 1 trains 4 groups of v0 and publishes v1; then 9 groups arrive
    at once: 4 of v1, a late one of v0 (1 update old: step 2 is its last), 4 more of v1. Reading ahead
    (learner.last_chance_first) step 2 takes the late group first and 3 of v1, step 3 the next 4 of v1; in
    arrival order step 2 takes the first 4 of v1 and step 3 drops the late group as stale."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("learner.max_staleness=1", "job.steps=3",
                                     f"learner.last_chance_first={'true' if first else 'false'}"))
    keys = JobKeys("rec")
    groups = scored_groups(policy_dir, 13)
    late = groups[8]
    fresh = [replace(g, version=1) for g in groups[4:8] + groups[9:]]
    feed(r, groups[:4], issued=4)
    proc = start_learner(run_dir, redis_url)
    try:
        wait_for(lambda: published(r) == 1)
        feed(r, fresh[:4] + [late] + fresh[4:], issued=9, at_once=True)
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    hists = [m["staleness_hist"] for m in metrics]
    if first:
        assert hists == [{"0": 4 * G}, {"0": 3 * G, "1": G}, {"1": 4 * G}]
        assert [m["dropped_stale"] for m in metrics] == [0, 0, 0]
        assert ids_of([late]) <= set(records(run_dir, "consumed.txt"))
        # the learner held no more than its last step took: the ninth group waits in the stream, not at it
        assert int(r.hget(keys.counters, "learner_ahead")) == 0 and learner_backlog(r, keys) == 1
        assert consumer_pending(r, "learner-0") == 0
    else:
        assert hists == [{"0": 4 * G}, {"0": 4 * G}, {"1": 4 * G}]
        assert [m["dropped_stale"] for m in metrics] == [0, 0, G]
        assert set(records(run_dir, "dropped.txt")) == ids_of([late])
        assert learner_backlog(r, keys) == 0 and int(r.hget(keys.counters, "learner_ahead")) == 0
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]


@pytest.mark.slow
def test_drain_checkpoints_the_step_in_hand_and_a_restart_repeats_nothing(tmp_path, r, redis_url, policy_dir):
    """SIGTERM between two checkpoints: the learner checkpoints what it trained, acknowledges it, exits 0."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("learner.checkpoint_every=100", "streams.learner_min_idle_s=1e6"))
    keys = JobKeys("rec")
    groups = scored_groups(policy_dir, 24)
    feed(r, groups[:14], issued=14)  # 3 batches, and half a batch the learner then waits on
    proc = start_learner(run_dir, redis_url)
    wait_for(lambda: learner_step(r) == 3 and r.xpending(keys.scored, "learner")["pending"] == 14)
    assert not list((run_dir / "checkpoints").glob("step-*"))  # checkpoint_every=100: none yet
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000003"] and learner_step(r) == 3
    state = json.loads((run_dir / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["step"] == 3 and state["trained_total"] == 12 * G
    # The 12 trained entries are acknowledged; the 2 of the half batch, never trained, stay pending.
    pending = r.xpending_range(keys.scored, "learner", min="-", max="+", count=100)
    assert len(pending) == 2
    consumed = (run_dir / "checkpoints" / "step-000003" / "consumed.txt").read_text().split()
    assert sorted(consumed) == sorted(f"{g.prompt_id}/{i}" for g in groups[:12] for i in range(G))

    feed(r, groups[14:], issued=10)
    proc = start_learner(run_dir, redis_url)
    assert proc.wait(timeout=600) == 0
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 24 * G and a["duplicates_trained"] == 0 and a["in_flight"] == 0
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the restart trained steps 4-6 and nothing of 1-3 again


@pytest.mark.slow
@pytest.mark.parametrize("dedup", [True, False])
def test_audit_catches_a_duplicate_only_when_dedup_is_off(tmp_path, r, redis_url, policy_dir, dedup):
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=dedup)
    groups = scored_groups(policy_dir, 24)
    feed(r, groups[:10] + [groups[3]] + groups[10:], issued=len(groups))  # group 3 delivered twice
    proc = start_learner(run_dir, redis_url)
    assert proc.wait(timeout=600) == 0
    a = audit(r, "rec", str(run_dir))
    if dedup:
        assert a["ok"], a["problems"]
        assert a["duplicates_skipped"] == {"learner": G}
    else:
        assert not a["ok"] and a["duplicates_trained"] == G
        cli = subprocess.run([sys.executable, "-m", "pipeline.cli", "audit", "--job", "rec",
                              "--redis", redis_url], cwd=ROOT, capture_output=True, text=True)
        assert cli.returncode == 1 and "trained more than once" in cli.stdout


@pytest.mark.slow
def test_the_learner_publishes_at_the_cadence_the_controller_wrote(tmp_path, r, redis_url, policy_dir):
    """The controller's cadence (pipeline.dataplane.cadence) over the config's publish_every=1: versions 3
    and 6 only, each named by the updates it holds, and the audit still accounts for every trajectory."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True)
    write_cadence(r, JobKeys("rec"), 3, "test", at=time.time())
    feed(r, scored_groups(policy_dir, 4 * 6), issued=4 * 6)
    proc = start_learner(run_dir, redis_url)
    assert proc.wait(timeout=600) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["publish_every"] for m in metrics] == [3] * 6
    assert [m["step"] for m in metrics if m["publish_s"] > 0] == [3, 6]
    assert published(r) == 6
    assert sorted(p.name for p in (run_dir / "policy").iterdir() if p.name.startswith("v")) == ["v000003",
                                                                                               "v000006"]
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 4 * 6 * G


@pytest.mark.slow
def test_a_restart_numbers_its_weights_past_a_version_the_dead_learner_only_recorded(tmp_path, r, redis_url,
                                                                                       policy_dir):
    """At a publish cadence above 1 a learner names versions it never publishes (its step records carry
    them). One that dies there, before any checkpoint, leaves v0 published and v7 recorded: the restart
    publishes the initial weights as v8, so no number names two sets of weights."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("job.steps=2",))
    r.hset(JobKeys("rec").learner_stats, "policy_version", json.dumps(7))
    feed(r, scored_groups(policy_dir, 4 * 2), issued=4 * 2)
    proc = start_learner(run_dir, redis_url)
    assert proc.wait(timeout=600) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [9, 10]
    assert published(r) == 10


def test_a_restart_numbers_its_weights_past_a_version_written_to_disk_that_redis_does_not_know(
        tmp_path, r, redis_url, policy_dir):
    """Redis's AOF (fsync every second) can lose the announcement of the last weights the dead learner wrote:
    its ``policy/v000005`` is on disk, and Redis knows of none. The restart must not name other weights v5."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("job.steps=2",))
    (run_dir / "policy" / "v000005").mkdir(parents=True)
    feed(r, scored_groups(policy_dir, 4 * 2), issued=4 * 2)
    proc = start_learner(run_dir, redis_url)
    assert proc.wait(timeout=600) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [7, 8]
    assert published(r) == 8


class Killed(BaseException):
    """The learner process dies (SIGKILL) where this is raised."""


def killed_after_checkpoint(monkeypatch, step: int) -> None:
    """Make the in-process learner die right after checkpoint ``step`` is durable, before its acks."""
    write = learner_mod.write_checkpoint

    def write_then_die(*args, **kwargs):
        write(*args, **kwargs)
        if args[5]["step"] == step:
            raise Killed

    monkeypatch.setattr(learner_mod, "write_checkpoint", write_then_die)


def in_process_learner(run_dir: Path, r, world: int = 1) -> "learner_mod.Learner":
    ctx = WorkerContext(cfg=load_run_config(run_dir), run_dir=run_dir, keys=JobKeys("rec"), r=r,
                        worker_id=LEARNER, role="learner", log=structlog.get_logger(), node="h")
    return learner_mod.Learner(ctx, world=world)


@pytest.mark.slow
def test_a_stale_group_dropped_in_a_checkpointed_step_whose_acks_were_lost_is_not_dropped_again_after_a_restore(
        tmp_path, r, redis_url, policy_dir, monkeypatch):
    """Killed between checkpoint 2 and its acks: the restore replays step 2's entries, and the group dropped
    at step 2 is skipped as already judged, as its trained groups are: one record, one count, audit ok."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("job.steps=3", "learner.max_staleness=0", "learner.checkpoint_every=1",
                                     "learner.prefetch=false"))
    keys = JobKeys("rec")
    gs = scored_groups(policy_dir, 13)
    stale = [replace(gs[4], version=0)]   # judged at step 2 (the learner at v1): 1 update > max_staleness 0
    feed(r, [replace(g, version=0) for g in gs[0:4]] + stale + [replace(g, version=1) for g in gs[5:9]],
         issued=9, at_once=True)
    killed_after_checkpoint(monkeypatch, step=2)
    with pytest.raises(Killed):
        in_process_learner(run_dir, r).run()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000001", "step-000002"]
    assert int(r.hget(keys.counters, "dropped_stale")) == G and group_pending(r, keys.scored, GROUP_LEARNER) == 5

    monkeypatch.undo()
    feed(r, [replace(g, version=3) for g in gs[9:13]], issued=4, at_once=True)
    learner = in_process_learner(run_dir, r)   # restores step 2 under version 3, replays step 2's five entries
    assert learner.version == 3
    learner.run()
    assert sorted(records(run_dir, "dropped.txt")) == sorted(ids_of(stale))
    assert int(r.hget(keys.counters, "dropped_stale")) == G
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 12 * G and a["dropped_stale"] == G and a["duplicates_trained"] == 0


@pytest.mark.slow
def test_a_learner_restored_at_its_last_step_acknowledges_the_entries_whose_acks_were_lost(
        tmp_path, r, redis_url, policy_dir, monkeypatch):
    """Killed between the last checkpoint and its acks: the restore has no step left to replay them into,
    and acknowledges the entries its checkpoints hold instead of leaving them pending for good."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("job.steps=2", "learner.checkpoint_every=1", "learner.prefetch=false"))
    keys = JobKeys("rec")
    feed(r, scored_groups(policy_dir, 8), issued=8, at_once=True)
    killed_after_checkpoint(monkeypatch, step=2)
    with pytest.raises(Killed):
        in_process_learner(run_dir, r).run()
    assert group_pending(r, keys.scored, GROUP_LEARNER) == 4

    monkeypatch.undo()
    in_process_learner(run_dir, r).run()
    assert group_pending(r, keys.scored, GROUP_LEARNER) == 0
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 8 * G and a["duplicates_trained"] == 0 and a["in_flight"] == 0


@pytest.mark.slow
def test_a_group_that_kills_the_learner_process_is_found_alone_and_dead_lettered_while_its_batch_is_trained(
        tmp_path, r, redis_url, policy_dir, monkeypatch):
    """A scored group whose gradient kills the learner process (an OOM kill, a native crash: nothing is raised
    that Python could count) rides in step 2, prefetched as it arrives. The restart probes the step's entries
    one at a time, and each death in a probe is charged to that group alone: after ``max_train_attempts`` (2)
    such deaths it is dead-lettered, the other three groups of its step are trained once, and nothing is left
    on record."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("job.steps=2", "learner.checkpoint_every=1", "learner.max_train_attempts=2",
                                     "learner.prefetch=true"))
    keys = JobKeys("rec")
    gs = scored_groups(policy_dir, 8)
    poison = gs[5]
    fatal = (poison.prompt_tokens.tolist(), poison.trajectories[0].completion.tolist())
    feed(r, gs, issued=8, at_once=True)
    from workers import update as update_mod
    logprobs = update_mod.completion_logprobs
    gradients_of_the_poison = []

    def dies_on_the_poison(model, prompts, completions, **kwargs):
        if any((p, c) == fatal for p, c in zip(prompts, completions)):
            gradients_of_the_poison.append(len(prompts))
            raise Killed
        return logprobs(model, prompts, completions, **kwargs)

    monkeypatch.setattr(update_mod, "completion_logprobs", dies_on_the_poison)
    lives = 0
    while lives < 6:
        lives += 1
        try:
            in_process_learner(run_dir, r).run()
            break
        except Killed:
            pass
    # life 1 dies prefetching step 2 whole; lives 2 and 3 die probing the poison alone; life 4 dead-letters it
    assert lives == 4 and learner_step(r) == 2
    first, *alone = gradients_of_the_poison   # rows in the forward pass that met the poison
    assert first > G and alone == [G, G]
    [(_id, dead)] = r.xrange(keys.dead_letters)
    assert dead[b"reason"] == b"learner: the learner process died 2 times training this group alone"
    assert dead[b"payload"] == messages.encode(poison)
    assert sorted(records(run_dir, "consumed.txt")) == sorted(ids_of(gs[:5] + gs[6:]))
    assert not r.exists(keys.learner_suspects) and not r.exists(keys.learner_training)
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 7 * G and a["dead_lettered"] == G and a["duplicates_trained"] == 0
    assert group_pending(r, keys.scored, GROUP_LEARNER) == 0


def test_a_suspect_acknowledged_since_is_forgotten_and_does_not_hold_prefetch_off(tmp_path, r, redis_url,
                                                                                   policy_dir):
    """Suspects whose entries are no longer pending (dead-lettered, or acknowledged with a checkpoint) never
    come back to be probed: a restart forgets them, so prefetch (off while a suspect waits) comes back."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("learner.prefetch=true",))
    keys = JobKeys("rec")
    feed(r, scored_groups(policy_dir, 2), issued=2, at_once=True)
    [(_s, [(pending, _f), (acked, _g)])] = r.xreadgroup(GROUP_LEARNER, LEARNER, {keys.scored: ">"}, count=2)
    r.xack(keys.scored, GROUP_LEARNER, acked)
    r.hset(keys.learner_training, mapping={pending: "step", acked: "probe"})   # what a dead learner left
    learner = in_process_learner(run_dir, r)
    assert learner.suspects == {pending: 0}
    assert r.hgetall(keys.learner_suspects) == {pending: b"0"} and not r.exists(keys.learner_training)
    assert learner.start_prefetch() is None
    r.xack(keys.scored, GROUP_LEARNER, pending)
    learner = in_process_learner(run_dir, r)
    assert learner.suspects == {} and not r.exists(keys.learner_suspects)
    assert learner.start_prefetch() is not None


@pytest.fixture
def private_redis(tmp_path):
    with EmbeddedRedis(tmp_path / "private-redis") as server:
        yield server.url


@pytest.mark.slow
def test_a_drain_while_redis_is_full_still_checkpoints_the_steps_trained(tmp_path, private_redis, policy_dir):
    """A drain (SIGTERM) between checkpoints checkpoints the steps trained even while Redis is full (XACK goes
    through a full Redis): clearing the learner's training marks on the way out does not wait on a write a
    full Redis refuses while the learner stops (a mark left costs the restart a probe, nothing more)."""
    r = connect(private_redis)
    run_dir, _cfg = setup_run(tmp_path, r, private_redis, policy_dir, dedup=True,
                              extra=("learner.checkpoint_every=2", "learner.prefetch=false"))
    keys = JobKeys("rec")
    feed(r, scored_groups(policy_dir, 4), issued=4, at_once=True)   # one step, then the learner waits
    learner = in_process_learner(run_dir, r)
    read_waiting = learner.read_waiting

    def drained_while_full(count, block_ms, held):
        if learner.step == 1:   # step 1 trained (not checkpointed: every 2); waiting for step 2's data
            r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) // 2))
            learner.ctx.stop_event.set()   # SIGTERM
            return []
        return read_waiting(count, block_ms, held)

    learner.read_waiting = drained_while_full
    try:
        learner.run()   # the checkpoint's cost-meter write, after its files and acks, may meet the full Redis
    except redis.ResponseError:
        pass
    finally:
        r.config_set("maxmemory", "2gb")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000001"]
    assert group_pending(r, keys.scored, GROUP_LEARNER) == 0


@pytest.mark.slow
def test_a_rank_killed_while_idle_does_not_dead_letter_the_good_batch_after_it(tmp_path, r, redis_url, policy_dir):
    """world = 2. Rank 1 is SIGKILLed (the kernel's OOM killer, a chaos kill) while rank 0 waits for data: no
    group is at fault. The step that finds it gone is a death, as rank 0's own would be: no training attempt
    is counted against the batch (counted, two such kills dead-lettered all four good groups as "training
    raised 2 times"); the restart probes them alone and trains them."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("job.steps=1", "learner.checkpoint_every=1", "learner.max_train_attempts=2"))
    keys = JobKeys("rec")
    gs = scored_groups(policy_dir, 4)
    feed(r, gs, issued=4, at_once=True)
    for _life in range(2):
        learner = in_process_learner(run_dir, r, world=2)
        try:
            rank1 = learner.ranks.procs[0]
            os.kill(rank1.pid, signal.SIGKILL)   # a healthy rank dies; no data was sent to it
            rank1.wait()
            with pytest.raises(RuntimeError, match="rank 1 exited"):
                learner.run()
        finally:
            learner.close()
    learner = in_process_learner(run_dir, r, world=2)
    try:
        learner.run()
    finally:
        learner.close()
    dead = [f[b"reason"].decode() for _i, f in r.xrange(keys.dead_letters)]
    assert dead == [], dead
    assert sorted(records(run_dir, "consumed.txt")) == sorted(ids_of(gs))


@pytest.mark.slow
def test_with_two_ranks_a_group_that_makes_training_raise_is_found_alone_and_the_rest_trained(
        tmp_path, r, redis_url, policy_dir):
    """world = 2: a step that raises cannot try its groups alone (the ranks' collectives are mid-step), so
    the batch's training marks stay and the restart tries each group alone on rank 0. The poison (a token
    outside the vocabulary: IndexError on the CPU, whichever rank it lands on) is dead-lettered with that
    error; the other three groups are trained (counted against the whole batch, all four were
    dead-lettered)."""
    from tests.test_containment import poisoned

    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                              extra=("job.steps=1", "learner.checkpoint_every=1", "learner.max_train_attempts=2"))
    keys = JobKeys("rec")
    gs = scored_groups(policy_dir, 4)
    batch = [gs[0], poisoned(gs[1], 10 ** 6), gs[3], gs[2]]
    feed(r, batch, issued=4, at_once=True)
    for _life in range(6):
        learner = in_process_learner(run_dir, r, world=2)
        try:
            learner.run()
            break
        except Exception:  # noqa: BLE001 - the step raised (IndexError, or the rank's death): a restart
            pass
        finally:
            learner.close()
    assert learner_step(r) == 1
    dead = [(messages.decode(f[b"payload"], 1 << 20).prompt_id, f[b"reason"].decode())
            for _i, f in r.xrange(keys.dead_letters)]
    assert [pid for pid, _why in dead] == [batch[1].prompt_id] and "IndexError" in dead[0][1], dead
    assert sorted(records(run_dir, "consumed.txt")) == sorted(ids_of([gs[0], gs[3], gs[2]]))   # the step, less it


@pytest.mark.slow
def test_with_mini_batches_a_group_that_raises_after_an_update_is_dead_lettered_and_the_step_retrained_whole(
        tmp_path, r, redis_url, policy_dir, monkeypatch):
    """``learner.mini_batches = 2``, and a group whose gradient raises (as an out-of-memory backward does;
    its no-grad forward for the proximal log-probs passes) in the second mini-batch: the first has already
    stepped the optimizer when it raises. The group is dead-lettered, and the weights, which hold half a
    step, are not trained on again: the learner exits with ``StepPartlyApplied`` and its restart trains the
    step from the checkpoint. Each group is trained once: the weights are those of one clean step on the
    other groups (before, the step was retried in the process and the first mini-batch's groups were
    trained twice)."""
    from workers import update as update_mod
    from workers.update import load_policy, make_optimizer, plan_shares, train_share

    run_dir, cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                             extra=("job.steps=1", "learner.checkpoint_every=1", "learner.max_train_attempts=1",
                                    "learner.mini_batches=2", "learner.prefetch=false"))
    keys = JobKeys("rec")
    gs = scored_groups(policy_dir, 5)
    [plan] = plan_shares(gs[:4], [0] * 4, 0, 0, 1, cfg.learner)
    assert plan.actives[0]
    # a group of the second mini-batch with a gradient to compute
    [bad, *_] = [g for g, mini in zip(gs, plan.mini) if mini == 1 and len(set(g.rewards)) > 1]
    accumulate = update_mod.accumulate_gradients

    def raises_on_bad(model, active, *args, **kwargs):
        if any(row.traj.text == bad.trajectories[0].text for row in active):
            raise RuntimeError("backward failed")
        return accumulate(model, active, *args, **kwargs)

    monkeypatch.setattr(update_mod, "accumulate_gradients", raises_on_bad)
    monkeypatch.setattr(learner_mod, "accumulate_gradients", raises_on_bad)
    feed(r, gs, issued=5, at_once=True)

    with pytest.raises(learner_mod.StepPartlyApplied):
        in_process_learner(run_dir, r).run()
    [(_id, dead)] = r.xrange(keys.dead_letters)
    assert dead[b"payload"] == messages.encode(bad) and dead[b"reason"] == b"learner: RuntimeError: backward failed"
    assert learner_step(r) == 0 and not r.exists(keys.learner_training)

    in_process_learner(run_dir, r).run()
    kept = [g for g in gs if g is not bad]
    assert learner_step(r) == 1 and sorted(records(run_dir, "consumed.txt")) == sorted(ids_of(kept))
    monkeypatch.undo()
    model = load_policy(policy_dir, torch.device("cpu"), cfg.learner)
    [share] = plan_shares(kept, [0] * 4, 0, 0, 1, cfg.learner)
    train_share(model, make_optimizer(model, cfg.learner), share, cfg.learner, cfg.rollout.temperature)
    trained = load_model(run_dir / "policy" / "v000001")
    for (name, a), b in zip(model.named_parameters(), trained.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 4 * G and a["dead_lettered"] == G and a["duplicates_trained"] == 0
