"""The data-parallel learner: N ranks make the update one rank makes, and a drain or a kill leaves nothing behind.

Fast tests: the cut of a batch into whole-group shares, the token-level
normalisation over the whole batch (two shares' gradients add up to the
batch's), the rank pipe's frames, and two real ranks in one gloo process
group (this test process as rank 0, one ``python -m workers.ranks`` child)
against one rank on the same batches. Measured on 2 CPU cores with the tiny
policy (8 groups of 4): the summed gradient is one rank's to 2e-7 of its
scale (allowed: 1e-6); after the AdamW step the parameters agree except where
AdamW's per-element normalisation magnifies rounding (see
``_assert_same_update``: at most 0.08 lr, allowed 0.25 lr); the two ranks'
weights are bit-identical after every step.

Slow tests run the real learner worker with ``LIBRA_SLOTS="0,1"`` on groups
written straight into the scored stream: it trains, publishes, drains with a
checkpoint of its last step, and a one-rank learner resumes from that
checkpoint and repeats nothing (audit ok); a ``kill -9`` of rank 0 takes its
rank process with it.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import structlog
import torch
import torch.distributed as dist

from pipeline import config as config_mod
from pipeline.dataplane.keys import JobKeys
from pipeline.observe.audit import audit
from pipeline.run import policy_spec
from tests.test_learner_recovery import G, feed, learner_step, scored_groups, setup_run, start_learner, wait_for
from workers import ranks, update
from workers.checkpoint import latest_checkpoint, read_state
from workers.tiny_policy import ensure_policy, load_model

ROOT = Path(__file__).resolve().parent.parent
GRAD_TOL = 1e-6  # max |1 rank - 2 ranks| of the summed gradient, relative to its largest element


@pytest.fixture(scope="module")
def policy_dir():
    cfg = config_mod.load(None)
    return ensure_policy(ROOT / cfg.policy.cache_dir, policy_spec(cfg))


@pytest.fixture(scope="module")
def groups(policy_dir):
    return scored_groups(policy_dir, 8, seed=3)


def _cfg(*extra: str) -> config_mod.Config:
    # Small micro-batches: each rank cuts its share into several, as a real batch would be.
    return config_mod.load(None, [f"rollout.group_size={G}", "learner.batch_size=32", "learner.warmup_steps=0",
                                  "learner.micro_batch_tokens=800", *extra])


def _model(policy_dir):
    torch.manual_seed(0)
    return load_model(policy_dir)


def _one_rank(policy_dir, groups, cfg, steps: int) -> tuple[torch.nn.Module, list[update.StepSums]]:
    model = _model(policy_dir)
    opt = update.make_optimizer(model, cfg.learner)
    sums = [update.train_share(model, opt, update.plan_shares(groups, 0, s, 1)[0], cfg.learner, 1.0)
            for s in range(steps)]
    return model, sums


# --- shares -------------------------------------------------------------------------------------


def test_world_size_is_the_number_of_slots(monkeypatch):
    monkeypatch.delenv(ranks.SLOTS_ENV, raising=False)
    assert ranks.world_size() == 1
    for raw, n in (("", 1), ("3", 1), ("2,3", 2), ("0,1,2,3", 4)):
        monkeypatch.setenv(ranks.SLOTS_ENV, raw)
        assert ranks.world_size() == n


@pytest.mark.parametrize("world", [1, 2, 3, 8, 11])
def test_shares_are_disjoint_whole_groups_that_share_the_batch_token_count(groups, world):
    shares = update.plan_shares(groups, 0, 5, world)
    assert len(shares) == world
    ids = [g.prompt_id for s in shares for g in s.groups]
    assert sorted(ids) == sorted(g.prompt_id for g in groups) and len(set(ids)) == len(groups)
    order = {g.prompt_id: i for i, g in enumerate(groups)}
    total = sum(int(r[1].mask.sum()) for r in update.active_rows(update.group_rows(groups, 0)))
    for s in shares:
        assert [order[g.prompt_id] for g in s.groups] == sorted(order[g.prompt_id] for g in s.groups)
        assert (s.step, s.version, s.total_tokens, s.any_active) == (5, 0, total, True)
    if world == 1:
        assert shares[0].groups == tuple(groups)
    # Balanced: no rank carries more than the lightest plus the largest group.
    load = [sum(update.row_tokens(r) for r in update.active_rows(update.group_rows(s.groups, 0))) for s in shares]
    biggest = max(sum(update.row_tokens(r) for r in update.active_rows(update.group_rows([g], 0))) for g in groups)
    assert max(load) - min(load) <= biggest


def test_share_gradients_add_up_to_the_batch_gradient(policy_dir, groups):
    """Each share divides by the whole batch's token count: the sum is the batch's gradient, not a mean of means."""
    cfg = _cfg().learner
    whole = _model(policy_dir)
    update.accumulate_gradients(whole, update.active_rows(update.group_rows(groups, 0)), cfg, 1.0)
    summed = None
    for share in update.plan_shares(groups, 0, 0, 2):
        model = _model(policy_dir)
        update.accumulate_gradients(model, update.active_rows(update.group_rows(share.groups, 0)), cfg, 1.0,
                                    share.total_tokens)
        grads = [p.grad.clone() for p in model.parameters()]
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
    gap = max(float((a - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-12)
              for a, p in zip(summed, whole.parameters()))
    assert gap < 1e-5


def test_frames_carry_a_share_and_stop(groups):
    share = update.plan_shares(groups, 2, 7, 2)[1]
    pipe = io.BytesIO(ranks.encode_share(share) + ranks.encode_stop())
    got = ranks.read_frame(pipe, 1 << 24)
    assert (got.step, got.version, got.total_tokens, got.any_active) == (7, 2, share.total_tokens, True)
    assert [g.prompt_id for g in got.groups] == [g.prompt_id for g in share.groups]
    assert all(np.array_equal(a.completion, b.completion) and np.array_equal(a.logprobs, b.logprobs)
               for ga, gb in zip(got.groups, share.groups) for a, b in zip(ga.trajectories, gb.trajectories))
    assert ranks.read_frame(pipe, 1 << 24) is None          # stop
    assert ranks.read_frame(io.BytesIO(b""), 1 << 24) is None  # rank 0 gone: end of file


# --- two real ranks -------------------------------------------------------------------------------


def test_two_ranks_make_the_one_rank_update(tmp_path, policy_dir):
    """Rank 0 in a fresh interpreter, a ``workers.ranks`` child rank 1 (gloo); 2 steps against one rank.

    Not in this process: an in-process vLLM engine (tests/test_engine_vllm.py, test_standin.py) leaves
    torch.distributed's default group behind, and a test that owns the group would break theirs.
    """
    code = (f"import sys, pathlib; sys.path.insert(0, {str(ROOT)!r}); "
            f"from tests.test_learner_ranks import two_ranks_vs_one; "
            f"two_ranks_vs_one(pathlib.Path({str(tmp_path)!r}), pathlib.Path({str(policy_dir)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)


def two_ranks_vs_one(tmp_path: Path, policy_dir: Path) -> None:
    groups = scored_groups(policy_dir, 8, seed=3)
    cfg = _cfg()
    lr = cfg.learner.lr
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"config": cfg.to_dict()}))
    ref = _model(policy_dir)
    ref_opt = update.make_optimizer(ref, cfg.learner)
    model = _model(policy_dir)
    opt = update.make_optimizer(model, cfg.learner)
    group = ranks.RankGroup.start(run_dir, "learner-0", 2, model, policy_dir, None, structlog.get_logger())
    try:
        for step in range(2):
            one = update.train_share(ref, ref_opt, update.plan_shares(groups, 0, step, 1)[0], cfg.learner, 1.0)
            shares = update.plan_shares(groups, 0, step, 2)
            group.send(shares[1:])
            two = update.train_share(model, opt, shares[0], cfg.learner, 1.0, distributed=True)
            assert two.weight_spread == 0.0               # rank 1 holds exactly rank 0's weights
            assert (two.tokens, two.fresh_n) == (one.tokens, one.fresh_n) and two.tokens > 0
            assert two.loss == pytest.approx(one.loss, rel=1e-5, abs=1e-7)
            assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
            assert two.clip_weighted / two.clip_weight == pytest.approx(one.clip_weighted / one.clip_weight, abs=1e-6)
            if step == 0:
                _assert_same_update(model, ref, lr)
    finally:
        group.close()
    assert not dist.is_initialized() and [p.returncode for p in group.procs] == [0]
    with torch.no_grad():
        diff = torch.cat([(a - b).abs().flatten() for a, b in zip(model.parameters(), ref.parameters())])
    assert float(diff.max()) <= 0.25 * lr


def _assert_same_update(model, ref, lr: float) -> None:
    """The first step: the same summed gradient to float rounding, and AdamW's step from it.

    Measured: the gradients differ by 2e-7 of their scale. AdamW's first step
    is lr x g / (|g| + 1e-8) per element, so an element whose gradient is
    near 1e-8 turns that rounding into a visible move: 14 of 518,016
    parameters differ by more than 1e-3 lr, the largest by 0.08 lr (4e-5, of
    weights up to 1.2). One rank alone, cutting the batch into other
    micro-batches, differs from itself as much (23 elements, 0.09 lr).
    """
    with torch.no_grad():
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
        grad_gap = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
        diff = torch.cat([(a - b).abs().flatten() for a, b in zip(model.parameters(), ref.parameters())])
    print(f"step 1, 1 vs 2 ranks: gradient gap {grad_gap / scale:.2g} of its scale; parameters: max |diff| "
          f"{float(diff.max()):.2g} ({float(diff.max()) / lr:.2g} lr), {int((diff > 1e-3 * lr).sum())} of "
          f"{diff.numel()} above 1e-3 lr")
    assert grad_gap <= GRAD_TOL * scale
    assert float(diff.max()) <= 0.25 * lr and int((diff > 1e-3 * lr).sum()) <= 1e-4 * diff.numel()


# --- the learner process (slow) ---------------------------------------------------------------------


def _rank_children(pid: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(pid).children() if "workers.ranks" in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return []


def _gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _consumed(run_dir: Path) -> list[str]:
    return [i for c in sorted((run_dir / "checkpoints").glob("step-*"))
            for i in (c / "consumed.txt").read_text().split()]


def _drain_when_waiting(r, proc, step: int, pending: int) -> None:
    """SIGTERM once the learner has trained ``step`` and holds ``pending`` entries (a half batch among them)."""
    wait_for(lambda: learner_step(r) == step and r.xpending(JobKeys("rec").scored, "learner")["pending"] == pending,
             timeout_s=120)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_learner_drains_with_a_checkpoint_and_resumes_at_another_world_size(tmp_path, r, redis_url, policy_dir):
    """2 ranks train 3 steps and drain; 1 rank resumes for a step and drains; 2 ranks finish. Nothing twice."""
    run_dir, _ = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True,
                           extra=("learner.checkpoint_every=100", "streams.learner_min_idle_s=1e6"))
    keys = JobKeys("rec")
    groups = scored_groups(policy_dir, 24)  # 6 steps x 4 groups
    feed(r, groups[:14], issued=len(groups))  # 3 steps, and half a batch the learner then waits on
    proc = start_learner(run_dir, redis_url, slots="0,1")
    wait_for(lambda: learner_step(r) >= 1, timeout_s=120)
    children = _rank_children(proc.pid)
    assert len(children) == 1
    _drain_when_waiting(r, proc, step=3, pending=14)
    assert _gone(children)

    # The drain checkpointed the last step trained, acknowledged its 12 entries, and left the half batch pending.
    state = read_state(latest_checkpoint(run_dir / "checkpoints"))
    assert (state["step"], state["world_size"]) == (3, 2)
    assert r.xpending(keys.scored, "learner")["pending"] == 2
    assert sorted(_consumed(run_dir)) == sorted(f"{g.prompt_id}/{i}" for g in groups[:12] for i in range(G))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["gpus"] for s in steps] == [2, 2, 2] and all(s["rank_weight_spread"] == 0.0 for s in steps)
    assert all(s["tokens"] > s["policy_tokens"] > 0 and s["train_s"] > 0 and s["publish_s"] > 0 for s in steps)
    costs = json.loads(r.hget(keys.worker_costs, "learner-0"))
    assert costs["items"] == 3 * 16 and costs["tokens"] == sum(s["tokens"] for s in steps)
    assert costs["busy_s"] == pytest.approx(2 * sum(s["train_s"] for s in steps)) and costs["pause_s"] > 0
    assert any((run_dir / "policy").glob("v*"))

    # One rank restores the two ranks' checkpoint, trains a step and drains in turn.
    feed(r, groups[14:18], issued=0)
    _drain_when_waiting(r, start_learner(run_dir, redis_url, slots=""), step=4, pending=6)
    assert read_state(latest_checkpoint(run_dir / "checkpoints"))["world_size"] == 1

    # Two ranks restore that checkpoint (rank 1 loads its model and optimizer) and finish.
    feed(r, groups[18:], issued=0)
    assert start_learner(run_dir, redis_url, slots="0,1").wait(timeout=300) == 0
    a = audit(r, "rec", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 24 * G and a["duplicates_trained"] == 0 and a["in_flight"] == 0
    assert sorted(_consumed(run_dir)) == sorted(f"{g.prompt_id}/{i}" for g in groups for i in range(G))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6] and [s["gpus"] for s in steps] == [2, 2, 2, 1, 2, 2]
    # a rank restored with another optimizer state than rank 0's would part from it at its first step
    assert all(s["rank_weight_spread"] == 0.0 for s in steps)
    assert (run_dir / "logs" / "learner-0-rank1.jsonl").exists()


@pytest.mark.slow
def test_a_killed_rank_0_takes_its_ranks_with_it(tmp_path, r, redis_url, policy_dir):
    run_dir, _ = setup_run(tmp_path, r, redis_url, policy_dir, dedup=True)
    feed(r, scored_groups(policy_dir, 4), issued=4)  # one step, then the learner waits for more
    proc = start_learner(run_dir, redis_url, slots="0,1")
    wait_for(lambda: learner_step(r) >= 1, timeout_s=120)
    children = _rank_children(proc.pid)
    assert len(children) == 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(children), "a rank outlived rank 0"
