"""``libra-ctl verify-resume``: a run killed mid-way and resumed passes; one that loses data fails loudly.

The slow tests run the command for real on the quick-start job, shortened
with ``--set``: real Redis (embedded), real vLLM on CPU, the real learner,
killed with SIGKILL between two checkpoints (the learner alone, or with
``--hard`` the whole run), and resumed. One runs a build whose checkpoints
skip their offsets: ``tests/faults/skip_offsets/sitecustomize.py`` on the
run's PYTHONPATH makes every checkpoint leave a group's ids out, and the
verdict must be FAIL naming the accounting checks.

The fast tests drive the checks (``pipeline.observe.resume_checks``) with
step records, checkpoint directories and a real Redis built by hand: each
shows a check failing on the fault it is there to catch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline import config as config_mod
from pipeline.dataplane import messages
from pipeline.dataplane.keys import GROUP_LEARNER, JobKeys
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.dataplane.streams import ensure_groups
from pipeline.observe import resume_checks as rc
from pipeline.verify_resume import BadPlan, kill_step, kill_tree

ROOT = Path(__file__).resolve().parent.parent
FAULT_SKIP_OFFSETS = ROOT / "tests" / "faults" / "skip_offsets"
FAULT_FRESH_WEIGHTS = ROOT / "tests" / "faults" / "fresh_weights"
QUICK = ["job.steps=10", "learner.batch_size=64", "learner.checkpoint_every=2", "job.eval_size=48",
         "job.eval_every=2", "rollout.groups_per_call=4", "streams.max_queue_size=192"]


def verify_resume(tmp_path: Path, settings: list[str], *extra: str, pythonpath: list[Path] = ()):
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(ROOT), env.get("PYTHONPATH", "")])
    out = tmp_path / "verdict.json"
    sets = [f"run.runs_dir={json.dumps(str(tmp_path / 'runs'))}", "job.name=vr", *settings]
    cmd = [sys.executable, "-m", "pipeline.cli", "verify-resume", "examples/quickstart.toml", *extra,
           "--json", str(out), "--timeout", "900", *sum((["--set", s] for s in sets), [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    verdict = json.loads(out.read_text()) if out.exists() else None
    return proc, verdict


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", [[], ["--hard"]], ids=["learner", "hard"])
def test_verify_resume_passes_on_the_quick_start_job(tmp_path, mode):
    proc, verdict = verify_resume(tmp_path, QUICK, *mode)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert verdict["verdict"] == "PASS" and not verdict["failed"]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert {"run", "audit", "checkpoints", "offsets", "weights", "steps", "versions", "reward", "batch success",
            "held-out eval"} <= set(checks)
    assert checks["weights"]["ok"] is True and checks["weights"]["figures"]["restores"] >= 1, checks["weights"]
    assert checks["audit"]["figures"]["lost"] == 0 and checks["audit"]["figures"]["duplicates_trained"] == 0
    steps = checks["steps"]["figures"]
    assert 0 < steps["checkpoint_step"] < steps["kill_step"] < 10 and steps["replayed"] >= 1
    assert verdict["kill"]["mode"] == ("hard" if mode else "learner")
    assert Path(verdict["plot"]).stat().st_size > 0
    assert "PASS" in proc.stdout and "before kill  |" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_verify_resume_fails_loudly_when_checkpoints_skip_their_offsets(tmp_path):
    settings = [s for s in QUICK if not s.startswith("job.steps")] + ["job.steps=6"]
    proc, verdict = verify_resume(tmp_path, settings, pythonpath=[FAULT_SKIP_OFFSETS])
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert verdict["verdict"] == "FAIL"
    assert {"audit", "checkpoints"} <= set(verdict["failed"]), verdict["failed"]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["audit"]["figures"]["lost"] > 0
    assert "FAIL  audit" in proc.stdout and "FAIL  checkpoints" in proc.stdout
    assert "FAILED: " in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_verify_resume_fails_a_resume_that_loads_the_initial_weights(tmp_path):
    """docs/recovery.md: a resume comes back "with its policy where the checkpoint left it, not back at the
    start". A review's build whose restore loads the initial weights (with the checkpoint's step, counters and
    optimizer) PASSed every check of this 6-step run: steps and versions come from state.json, and the levels
    were within the noise. Now the learner refuses weights that are not its checkpoint's, and the verdict
    fails."""
    settings = [s for s in QUICK if not s.startswith("job.steps")] + ["job.steps=6"]
    proc, verdict = verify_resume(tmp_path, settings, pythonpath=[FAULT_FRESH_WEIGHTS])
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert verdict["verdict"] == "FAIL", verdict
    out = proc.stdout + proc.stderr
    assert "not the ones it recorded" in out, out[-3000:]   # the learner's refusal, in the run's last output


# --- the checks, on records built by hand ---------------------------------------------------------


def record(step: int, version: int, reward: float, at: float, groups: int = 8, trajectories: int = 64) -> dict:
    return {"kind": "learner_step", "step": step, "policy_version": version, "reward_mean": reward,
            "reward_std": 0.3, "success_rate": reward, "groups": groups, "trajectories": trajectories,
            "dropped_stale": 0, "at": at}


def curve(rewards_pre: list[float], rewards_post: list[float], c: int, post_versions_from: int) -> list[dict]:
    """Steps 1..k before the kill (at t < 100), then c+1.. after it."""
    pre = [record(i + 1, i + 1, x, float(i)) for i, x in enumerate(rewards_pre)]
    post = [record(c + 1 + i, post_versions_from + i, x, 100.0 + i) for i, x in enumerate(rewards_post)]
    return pre + post


def levels(split: rc.Split):
    w = rc.windows(split)
    return [rc.step_level(split.final, w[n], "reward_mean") for n in ("initial", "checkpoint", "resumed")]


def test_a_curve_that_restarts_fails_and_one_that_continues_passes():
    rising = [0.1, 0.1, 0.1, 0.1, 0.5, 0.6, 0.7, 0.8, 0.8, 0.8]     # steps 1-10; checkpoint at 8, kill after 9
    cont = curve(rising[:9], [0.8, 0.8, 0.85, 0.85, 0.9, 0.9, 0.9], c=8, post_versions_from=11)
    restart = curve(rising[:9], [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], c=8, post_versions_from=11)
    for records, ok in ((cont, True), (restart, False)):
        split = rc.split_at(records, 50.0, 8, 15)
        check = rc.check_level("reward", *levels(split))
        assert check.ok is ok, check.detail
    assert "restarted" in rc.check_level("reward", *levels(rc.split_at(restart, 50.0, 8, 15))).detail


def test_a_run_that_has_not_moved_passes_and_says_so():
    flat = curve([0.2] * 9, [0.2] * 7, c=8, post_versions_from=11)
    check = rc.check_level("reward", *levels(rc.split_at(flat, 50.0, 8, 15)))
    assert check.ok and "had not moved past the noise" in check.detail


def test_step_numbers_that_restart_or_skip_fail():
    good = rc.split_at(curve([0.1] * 5, [0.1] * 6, c=4, post_versions_from=7), 50.0, 4, 10)
    assert rc.check_steps(good).ok and rc.check_versions(good, 4).ok
    restarted = rc.split_at(curve([0.1] * 5, [0.1] * 10, c=0, post_versions_from=1), 50.0, 4, 10)
    assert not rc.check_steps(restarted).ok
    assert not rc.check_versions(restarted, 4).ok      # back to v1: a version names two weight sets
    skipped = [r for r in curve([0.1] * 5, [0.1] * 6, c=4, post_versions_from=7) if r["step"] != 7 or r["at"] < 50]
    check = rc.check_steps(rc.split_at(skipped, 50.0, 4, 10))
    assert not check.ok and "skipped [7]" in check.detail


def write_checkpoint_record(run_dir: Path, step: int, consumed: list[str], trained_total: int) -> None:
    d = run_dir / "checkpoints" / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / "consumed.txt").write_text("".join(f"{i}\n" for i in consumed))
    (d / "dropped.txt").write_text("")
    (d / "state.json").write_text(json.dumps({"step": step, "version": step, "trained_total": trained_total,
                                              "dropped_total": 0}))


def test_a_checkpoint_that_skips_ids_fails_the_checkpoint_check(tmp_path):
    ids = [f"p{g}@0/{i}" for g in range(16) for i in range(8)]
    final = {s: record(s, s, 0.1, float(s), trajectories=32) for s in (1, 2, 3, 4)}
    write_checkpoint_record(tmp_path, 2, ids[:64], 64)
    write_checkpoint_record(tmp_path, 4, ids[64:], 128)
    assert rc.check_checkpoints(tmp_path, final).ok
    (tmp_path / "checkpoints" / "step-000004" / "consumed.txt").write_text("".join(f"{i}\n" for i in ids[72:]))
    check = rc.check_checkpoints(tmp_path, final)
    assert not check.ok and "step-000004" in check.detail and "records 56 trained ids" in check.detail


def test_a_restore_that_loaded_other_weights_fails_the_weights_check(tmp_path):
    """The digest the learner logged for the weights it restored against the one its checkpoint recorded;
    restores before the kill (an earlier life of the run) are not this kill's."""
    ckpt = tmp_path / "checkpoints" / "step-000004"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": 4, "version": 4, "weights_sha256": "a" * 64}))
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "learner-0.jsonl"

    def restored(at: str, digest: str | None) -> str:
        rec = {"event": "restored", "checkpoint": str(ckpt), "step": 4, "timestamp": at}
        return json.dumps(rec if digest is None else {**rec, "weights_sha256": digest}) + "\n"

    kill_at = 1_800_000_000.0   # 2027-01-15T08:00:00Z
    before, after = "2027-01-15T07:59:00Z", "2027-01-15T08:00:30Z"
    assert rc.check_weights(tmp_path, kill_at).ok is False            # no restore after the kill at all
    log.write_text(restored(before, "b" * 64) + restored(after, "a" * 64))
    check = rc.check_weights(tmp_path, kill_at)
    assert check.ok is True and check.figures["restores"] == 1, check.detail
    log.write_text(restored(after, "a" * 64) + restored("2027-01-15T08:01:00Z", "c" * 64))
    check = rc.check_weights(tmp_path, kill_at)
    assert check.ok is False and "step-000004" in check.detail and "cccccccccccc" in check.detail, check.detail
    log.write_text(restored(after, None))                              # a learner that logged no digest
    assert rc.check_weights(tmp_path, kill_at).ok is None


def group(prompt_id: str) -> messages.Group:
    traj = tuple(messages.Trajectory(sample_idx=i, completion=np.array([1, 2], np.int32), mask=np.ones(2, np.uint8),
                                     logprobs=np.zeros(2, np.float32), text="x", finish="answer", turns=1,
                                     tool_calls=0, tool_latency_s=(), tool_timeouts=0, reward=1.0)
                 for i in range(2))
    return messages.Group(prompt_id=prompt_id, prompt="p", answer=1, prompt_tokens=np.array([1], np.int32),
                          version=0, worker="test", generated_at=time.time(), gen_s=0.0, trajectories=traj)


def test_an_entry_left_pending_after_its_checkpoint_fails_the_offsets_check(tmp_path, r):
    keys = JobKeys("vr")
    ensure_groups(r, keys)
    write_checkpoint_record(tmp_path, 2, ["a@0/0", "a@0/1"], 2)
    for pid in ("a@0", "b@0"):
        r.xadd(keys.scored, {messages.FIELD: messages.encode(group(pid))})
    r.xreadgroup(GROUP_LEARNER, "learner-0", {keys.scored: ">"}, count=2)   # both delivered, neither acked
    first = r.xrange(keys.scored, count=1)[0][0]
    check = rc.check_offsets(r, keys, tmp_path, 1 << 20)
    assert not check.ok and check.figures["trained_but_unacknowledged"] == 1
    r.xack(keys.scored, GROUP_LEARNER, first)      # what the learner does once the checkpoint is durable
    check = rc.check_offsets(r, keys, tmp_path, 1 << 20)
    assert check.ok and check.figures["pending"] == 1


def test_the_kill_lands_between_two_checkpoints_or_the_config_is_refused():
    def cfg(*sets):
        return config_mod.load(None, list(sets))

    assert kill_step(cfg("job.steps=10", "learner.checkpoint_every=2")) == 5
    assert kill_step(cfg("job.steps=40", "learner.checkpoint_every=10")) == 25
    assert kill_step(cfg("job.steps=6", "learner.checkpoint_every=2")) == 3
    for sets in (("job.steps=10", "learner.checkpoint_every=1"), ("job.steps=3", "learner.checkpoint_every=2")):
        with pytest.raises(BadPlan):
            kill_step(cfg(*sets))
    with pytest.raises(BadPlan):
        kill_step(cfg("job.steps=10", "learner.checkpoint_every=2"), at_step=4)   # on a checkpoint


def test_a_hard_kill_is_timed_when_the_whole_tree_stands_stopped(tmp_path):
    # two grandchildren stamp the time as fast as they can: nothing the tree wrote may be stamped after the
    # kill's time, or a step the learner ended while the others were being stopped would count as the resumed
    # run's (seen on a loaded machine: "after the resume steps 6,5,6,..." where the kill began after step 5)
    stamps = tmp_path / "stamps"
    code = ("import sys, time\nf = open(sys.argv[1], 'a')\n"
            "while True:\n    f.write(repr(time.time()) + '\\n')\n    f.flush()\n")
    (tmp_path / "stamp.py").write_text(code)
    child = f"{sys.executable} {tmp_path / 'stamp.py'} {stamps}"
    tree = subprocess.Popen(["bash", "-c", f"{child} & {child} & wait"], start_new_session=True)
    deadline = time.monotonic() + 30
    while (not stamps.exists() or stamps.read_text().count("\n") < 100) and time.monotonic() < deadline:
        time.sleep(0.05)
    n, at = kill_tree(tree.pid)
    tree.wait()
    assert n == 3
    lines = stamps.read_text().split("\n")[:-1]      # whole lines only
    assert len(lines) >= 100 and max(map(float, lines)) <= at
