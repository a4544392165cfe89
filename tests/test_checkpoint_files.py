"""The learner's files across crashes: checkpoints and published weights.

A kill or a full disk in the middle of a write leaves no debris that outlives
the next write; a checkpoint costs the same late in a run as early; steps
and versions past 999,999 are ordered by number; a rollout worker whose
weights were pruned while it loaded them loads the newer ones instead of
dying.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import structlog

from pipeline import config as config_mod
from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.worker import WorkerContext, load_run_config
from pipeline.run import policy_spec
from tests.test_learner_recovery import ROOT, Killed, setup_run
from workers import checkpoint as ckpt_mod
from workers import rollout as rollout_mod
from workers.tiny_policy import ensure_policy, load_model
from workers.update import make_optimizer


@pytest.fixture(scope="module")
def policy_dir():
    return ensure_policy(ROOT / config_mod.load(None).policy.cache_dir, policy_spec(config_mod.load(None)))


def learner_publish(r, keys: JobKeys, pub_dir: Path, version: int, model, source: Path, keep: int) -> None:
    """What ``Learner.publish`` does on disk and in Redis: write, announce, prune."""
    final = ckpt_mod.write_published(pub_dir, version, model, source)
    r.hset(keys.policy, mapping=ckpt_mod.announcement(version, final, version))
    ckpt_mod.prune_published(pub_dir, keep)


def checkpoint_state(step: int) -> dict:
    return {"step": step, "version": step, "trained_total": 0, "dropped_total": 0, "dropped_branch_total": 0,
            "lineage": {}, "world_size": 1, "written_at": 0.0}


# --- published weights pruned under a starting rollout worker ---------------------------------------------------


def test_a_rollout_worker_whose_weights_are_pruned_while_its_engine_starts_loads_the_newer_ones(
        tmp_path, r, redis_url, policy_dir, monkeypatch):
    """An engine start takes seconds to minutes; a learner publishing ``keep_published`` versions meanwhile
    (one a step, replaying a backlog after a resume) prunes the directory the engine is reading. The worker
    loads the newest weights announced since, instead of dying (and dying again at every restart)."""
    run_dir, _cfg = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True, extra=("learner.keep_published=2",))
    keys, pub = JobKeys("rec"), run_dir / "policy"
    model = load_model(policy_dir)
    learner_publish(r, keys, pub, 1, model, policy_dir, keep=2)
    starts = []

    class SlowStartingEngine:
        """Reads its weights at the end of its start, as vLLM does after its setup."""

        def __init__(self, path: str):
            starts.append(path)
            if len(starts) == 1:   # the learner publishes two versions while the first start runs
                for v in (2, 3):
                    learner_publish(r, keys, pub, v, model, policy_dir, keep=2)
            self.path = path
            (Path(path) / "config.json").read_text()

        def reload(self, path: str):
            starts.append(path)
            if len(starts) == 3:   # two more publications while the first reload reads
                for v in (5, 6):
                    learner_publish(r, keys, pub, v, model, policy_dir, keep=2)
            (Path(path) / "config.json").read_text()
            self.path = path

    monkeypatch.setattr(rollout_mod, "make_engine", lambda _cfg, path: SlowStartingEngine(path))
    ctx = WorkerContext(cfg=load_run_config(run_dir), run_dir=run_dir, keys=keys, r=r, worker_id="rollout-h-0",
                        role="rollout", log=structlog.get_logger(), node="h")
    stage = rollout_mod.Rollout(ctx)
    assert [Path(p).name for p in starts] == ["v000001", "v000003"]
    assert ctx.policy_version == 3 and Path(stage.engine.path).name == "v000003"
    learner_publish(r, keys, pub, 4, model, policy_dir, keep=2)
    stage.maybe_reload()   # a reload whose directory is pruned under it goes on to the newest
    assert [Path(p).name for p in starts[2:]] == ["v000004", "v000006"]
    assert ctx.policy_version == 6 and Path(stage.engine.path).name == "v000006"


# --- crash debris that nothing ever removes --------------------------------------------------------------------


def test_a_publish_killed_mid_write_leaves_no_partial_weights_behind_after_later_publishes(tmp_path, policy_dir,
                                                                                           monkeypatch):
    """A learner killed inside ``write_published`` leaves ``v<N>.tmp`` (up to a whole model), and the restart
    numbers past it (``newest_published`` counts ``.tmp`` names), so no later write of ``v<N>`` clears it:
    the next publication removes it."""
    pub, model = tmp_path / "policy", load_model(policy_dir)
    for v in (1, 2):
        ckpt_mod.write_published(pub, v, model, policy_dir)
    save = ckpt_mod.save_weights

    def save_then_die(m, out, src):
        save(m, out, src)
        raise Killed

    monkeypatch.setattr(ckpt_mod, "save_weights", save_then_die)
    with pytest.raises(Killed):
        ckpt_mod.write_published(pub, 3, model, policy_dir)
    monkeypatch.undo()
    # the restart: a new number past every one used, then the run goes on publishing and pruning
    start = ckpt_mod.newest_published(pub) + 1
    for v in range(start, start + 6):
        ckpt_mod.write_published(pub, v, model, policy_dir)
        ckpt_mod.prune_published(pub, 2)
    assert sorted(p.name for p in pub.iterdir()) == ["v000008", "v000009"]


def test_a_checkpoint_killed_mid_write_at_a_step_never_checkpointed_again_leaves_nothing_behind(
        tmp_path, policy_dir, monkeypatch):
    """A drain checkpoints a step between two regular checkpoints. Killed (or out of disk: ENOSPC) inside
    that write, it leaves ``step-<N>.tmp`` holding the model and part of the optimizer; the restart
    restores the previous checkpoint, and no later checkpoint is of that step. The next checkpoint
    removes it (after ENOSPC, it holds the space the restart needs)."""
    ck, model = tmp_path / "checkpoints", load_model(policy_dir)
    opt = make_optimizer(model, config_mod.load(None).learner)
    ckpt_mod.write_checkpoint(ck, model, opt, ["a/0"], [], checkpoint_state(2), policy_dir)

    def disk_full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_mod.torch, "save", disk_full)
    with pytest.raises(OSError):   # the drain checkpoint of step 3, after the model was written
        ckpt_mod.write_checkpoint(ck, model, opt, ["b/0"], [], checkpoint_state(3), policy_dir)
    monkeypatch.undo()
    assert ckpt_mod.latest_checkpoint(ck).name == "step-000002"   # the partial one is never restored
    ckpt_mod.write_checkpoint(ck, model, opt, ["b/0", "c/0"], [], checkpoint_state(4), policy_dir)
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002", "step-000004"]


# --- fsync --------------------------------------------------------------------------------------------------


def test_writing_a_checkpoint_does_not_fsync_every_earlier_checkpoint_again(tmp_path, policy_dir, monkeypatch):
    """After the rename only the parent directory is fsynced, not every file of every earlier checkpoint
    (checkpoints are kept): a checkpoint's cost does not grow with the run. (Walking them all cost 3.6 s a
    checkpoint after 1,000 on this machine's ext4, on the way past ``learner.checkpoint_write_s``.)"""
    ck, model = tmp_path / "checkpoints", load_model(policy_dir)
    opt = make_optimizer(model, config_mod.load(None).learner)
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    ckpt_mod.write_checkpoint(ck, model, opt, [], [], checkpoint_state(1), policy_dir)
    first = len(calls)
    for s in range(2, 52):   # 50 earlier checkpoints, as a long run has
        shutil.copytree(ck / "step-000001", ck / f"step-{s:06d}")
    calls.clear()
    ckpt_mod.write_checkpoint(ck, model, opt, [], [], checkpoint_state(52), policy_dir)
    assert len(calls) <= first + 2, f"{len(calls)} fsyncs for one checkpoint after 50 (the first took {first})"


# --- ordering by name -----------------------------------------------------------------------------------------


def test_latest_checkpoint_orders_steps_by_number_past_999999(tmp_path):
    """By name ``step-1000000`` < ``step-999999``: the restart would restore an older checkpoint whose later
    steps' entries were acknowledged already (lost updates)."""
    ck = tmp_path / "checkpoints"
    for step in (999_999, 1_000_000):
        d = ck / f"step-{step:06d}"
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({"step": step}))
    assert ckpt_mod.latest_checkpoint(ck).name == "step-1000000"


def test_prune_published_keeps_the_newest_versions_past_999999(tmp_path):
    """By name ``v1000000`` sorts first: it would be deleted right after it is announced."""
    pub = tmp_path / "policy"
    for v in (999_998, 999_999, 1_000_000):
        (pub / f"v{v:06d}").mkdir(parents=True)
    ckpt_mod.prune_published(pub, 2)
    assert sorted(p.name for p in pub.iterdir()) == ["v1000000", "v999999"]
