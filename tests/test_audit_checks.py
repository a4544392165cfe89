"""`libra-ctl audit`'s checks by id, on builds that have the faults they are there to catch (issue 13).

Each test produces a fault for real, with real processes on a real Redis, and
checks that the audit says not ok, naming the check and the ids:

- ids: a learner that consumes entries without recording their ids (a fault
  put into the learner process through a ``sitecustomize`` on its
  PYTHONPATH), and a group lost while a stray one, never issued, is trained
  in its place: the counts balance, only the ids tell;
- pending: the learner that never looked over its own pending list again
  (the old build, issue 13 item 3): an entry stays pending at ``learner-0``
  after its last checkpoint, which the count of entries in flight hid; and a
  prompt left pending at a rollout worker that died, with no one to reclaim it;
- feeder: the old dead-letter bug (a rejected prompt gave the feeder back 0
  trajectories), under a running feeder: its in-flight count leaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import config as config_mod
from pipeline.cli import main as cli_main
from pipeline.dataplane import messages as m
from pipeline.dataplane import streams
from pipeline.dataplane.keys import GROUP_LEARNER, GROUP_ROLLOUT, JobKeys
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.dataplane.streams import Reject, ensure_groups
from pipeline.observe.audit import audit
from pipeline.run import policy_spec
from tests.test_dataplane import feeder_process, feeder_run, wait_for
from tests.test_faults_data import JOB, one_round
from tests.test_learner_recovery import feed, learner_step, scored_groups, setup_run
from workers import feeder
from workers.tiny_policy import ensure_policy

ROOT = Path(__file__).resolve().parent.parent
G = 4

# A learner that trains a group and forgets to record its ids in the checkpoint.
FORGET_CONSUMED = '''
import os
import workers.checkpoint as ck
_write, _lost = ck.write_checkpoint, os.environ["LIBRA_TEST_FORGET"] + "/"
def write_checkpoint(ckpt_dir, model, optimizer, consumed, *args, **kwargs):
    return _write(ckpt_dir, model, optimizer, [i for i in consumed if not i.startswith(_lost)], *args, **kwargs)
ck.write_checkpoint = write_checkpoint
'''

# The learner before issue 13's fix: it never looks over its own pending list.
NEVER_REPLAYS = '''
import workers.learner as ln
ln.Learner.pending_unheld = lambda self, count, held: []
'''


@pytest.fixture(scope="module")
def policy_dir():
    cfg = config_mod.load(None)
    return ensure_policy(ROOT / cfg.policy.cache_dir, policy_spec(cfg))


def start_learner_with(fault: str, tmp_path: Path, run_dir: Path, redis_url: str, **env) -> subprocess.Popen:
    """The learner process, with ``fault`` run at its start-up (a sitecustomize first on its PYTHONPATH).

    Started as ``workers.learner.main()``, not ``-m workers.learner``: ``-m`` runs a second copy of the
    module as ``__main__``, so a fault that patches ``workers.learner`` itself (``NEVER_REPLAYS``) would
    patch a copy the learner never runs, and the test would hold only while the learner happened not to
    replay (it failed once in CI when it did)."""
    site = tmp_path / "fault"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(fault)
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", "import workers.learner as ln; ln.main()", "--run-dir",
                             str(run_dir), "--worker-id", "learner-0"], cwd=ROOT,
                            env=dict(os.environ, **{ENV_URL: redis_url, "LIBRA_SLOTS": "", "PYTHONPATH": path},
                                     **env))


def ids(prompt_id: str) -> list[str]:
    return [f"{prompt_id}/{i}" for i in range(G)]


@pytest.mark.slow
def test_ids_check_names_what_a_learner_consumed_without_recording(tmp_path, r, redis_url, policy_dir):
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("job.steps=2",))
    groups = scored_groups(policy_dir, 8)
    feed(r, groups, issued=8)
    lost = groups[5].prompt_id
    proc = start_learner_with(FORGET_CONSUMED, tmp_path, run_dir, redis_url, LIBRA_TEST_FORGET=lost)
    assert proc.wait(timeout=600) == 0
    a = audit(r, "rec", str(run_dir))
    assert not a["ok"] and not a["checks"]["ids"]["ok"]
    assert a["checks"]["ids"]["unaccounted_ids"] == ids(lost)
    assert any(p.startswith("ids: 4 issued ids") and ids(lost)[0] in p for p in a["problems"])
    assert a["checks"]["pending"]["ok"] and a["checks"]["feeder"]["ok"]


@pytest.mark.slow
def test_ids_check_catches_a_lost_group_that_a_stray_one_replaced_while_the_counts_balance(
        tmp_path, r, redis_url, policy_dir):
    """8 prompts issued; the 8th group never reaches the scored stream, and a stray group (another
    run's, never issued here) is trained in its place. Trained + in flight = issued: only ids tell."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("job.steps=2",))
    groups = scored_groups(policy_dir, 9)
    feed(r, groups[:8], issued=8)
    keys = JobKeys("rec")
    r.xtrim(keys.scored, maxlen=7, approximate=False)  # the oldest group lost from the stream
    r.xadd(keys.scored, {m.FIELD: m.encode(groups[8])})  # the stray
    proc = start_learner_with("", tmp_path, run_dir, redis_url)
    assert proc.wait(timeout=600) == 0
    a = audit(r, "rec", str(run_dir))
    assert a["trained"] + a["dropped_stale"] + a["dead_lettered"] + a["in_flight"] == a["issued"] == 8 * G
    assert not a["ok"] and not a["checks"]["ids"]["ok"]
    assert a["checks"]["ids"]["unaccounted_ids"] == ids(groups[0].prompt_id)
    assert a["checks"]["ids"]["not_issued_ids"] == ids(groups[8].prompt_id)


@pytest.mark.slow
def test_pending_check_catches_an_entry_left_at_the_learner_that_never_replays(tmp_path, r, redis_url, policy_dir):
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("job.steps=2",))
    keys = JobKeys("rec")
    groups = scored_groups(policy_dir, 9)
    feed(r, groups[:4], issued=9)
    r.sadd(keys.issued, *[g.prompt_id for g in groups[4:]])
    proc = start_learner_with(NEVER_REPLAYS, tmp_path, run_dir, redis_url)
    try:
        wait_for(lambda: learner_step(r) >= 1, 300, "step 1")
        # A read as learner-0 whose reply never reached the learner: pending at learner-0, unseen by it.
        pipe = r.pipeline(transaction=True)
        pipe.xadd(keys.scored, {m.FIELD: m.encode(groups[8])})
        pipe.xreadgroup(GROUP_LEARNER, "learner-0", {keys.scored: ">"}, count=1)
        entry_id = pipe.execute()[0].decode()
        feed(r, groups[4:8], issued=0)
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    a = audit(r, "rec", str(run_dir))
    # What the old audit saw: every id accounted, the stuck group counted in flight.
    assert a["trained"] + a["in_flight"] == a["issued"]
    assert not a["ok"]
    assert a["checks"]["ids"]["ok"] and not a["checks"]["pending"]["ok"]
    [stuck] = a["checks"]["pending"]["stuck"]
    assert (stuck["id"], stuck["stream"], stuck["consumer"]) == (entry_id, keys.scored, "learner-0")
    assert stuck["idle_s"] >= 0 and "after its last checkpoint" in stuck["why"]
    assert any(p.startswith(f"pending: {entry_id} on {keys.scored} at learner-0") for p in a["problems"])


def test_pending_check_catches_a_prompt_left_at_a_dead_rollout_worker(tmp_path, r, redis_url):
    """A rollout worker takes a prompt and dies; no one reclaims it. Once it has been pending longer
    than the reclaim idle time plus a step, the audit names it, its consumer gone."""
    run_dir, cfg = feeder_run(tmp_path, r, redis_url, job=JOB)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["config"]["streams"].update(rollout_min_idle_s=0.5, block_ms=100)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    keys = JobKeys(JOB)
    ensure_groups(r, keys)
    # a learner step, as the learner records it: the "step" of the bound
    r.hset(keys.learner_stats, mapping={"wait_s": "0.2", "train_s": "0.2", "publish_s": "0.1"})
    for pid in ("p1@0", "p2@0"):
        r.xadd(keys.prompts, {m.FIELD: m.encode(m.Prompt(pid, "Q", 1, time.time()))})
    r.hset(keys.counters, mapping={"issued": 2 * G, "issued_prompts": 2})
    r.sadd(keys.issued, "p1@0", "p2@0")
    worker = subprocess.run([sys.executable, "-c", (
        "import sys; from pipeline.dataplane.redisconn import connect; "
        f"connect(sys.argv[1]).xreadgroup({GROUP_ROLLOUT!r}, 'rollout-n-9', {{sys.argv[2]: '>'}}, count=1)"),
        redis_url, keys.prompts], cwd=ROOT, timeout=60)
    assert worker.returncode == 0  # the worker is gone, the prompt it took pending at it
    bound = 0.5 + 0.5 + 0.1
    time.sleep(bound + 0.5)
    a = audit(r, JOB)
    assert not a["ok"] and not a["checks"]["pending"]["ok"] and a["checks"]["ids"]["ok"]
    [stuck] = a["checks"]["pending"]["stuck"]
    first = r.xrange(keys.prompts)[0][0].decode()
    assert (stuck["id"], stuck["stream"], stuck["consumer"], stuck["consumer_alive"]) == (
        first, keys.prompts, "rollout-n-9", False)
    assert stuck["idle_s"] > bound and a["checks"]["pending"]["bounds_s"]["rollout"] == pytest.approx(bound)


def test_feeder_check_catches_the_in_flight_count_leaked_by_a_dead_letter(tmp_path, r, redis_url, monkeypatch):
    """The old dead-letter bug: a rejected prompt's dead letter gave back 0 trajectories. The feeder's
    count of work in flight keeps the group it will never see; the old audit, counting the dead letter
    as one group, balanced."""
    keys = JobKeys(JOB)
    ensure_groups(r, keys)
    run_dir, cfg = feeder_run(tmp_path, r, redis_url, job=JOB)
    limit = feeder.admission_limit(cfg)
    with feeder_process(run_dir, redis_url) as proc:
        wait_for(lambda: int(r.hget(keys.counters, "issued") or 0) == limit, 30, "the feeder to fill its window")
        # the old build: _size, 0 for anything but a group
        monkeypatch.setattr(streams, "trajectories_of", lambda msg, _group_size: streams._size(msg))
        one_round(r, keys, source=keys.prompts, group=GROUP_ROLLOUT, sink=keys.rollouts, counter="generated",
                  handle=lambda prompts: [Reject("prompt too long") for _p in prompts])
        r.hset(keys.state, "phase", "done")
        assert proc.wait(timeout=30) == 0
    a = audit(r, JOB)
    assert a["trained"] + a["dropped_stale"] + a["dead_lettered"] + a["in_flight"] == a["issued"]  # old audit: ok
    assert not a["ok"]
    check = a["checks"]["feeder"]
    assert not check["ok"] and a["checks"]["ids"]["ok"]
    assert (check["believes_in_flight"], check["measured_in_flight"]) == (limit, limit - G)
    [short] = check["short_dead_letters"]
    rejected = m.decode(r.xrange(keys.dead_letters)[0][1][b"payload"], 1 << 20).prompt_id
    assert short["ids"] == ids(rejected) and (short["recorded"], short["carried"]) == (0, G)
    assert any(p.startswith("feeder:") and "4 leaked" in p and ids(rejected)[0] in p for p in a["problems"])
    assert cli_main(["audit", "--job", JOB, "--redis", redis_url]) == 1
