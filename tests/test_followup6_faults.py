"""Three regressions a review found in this session's own changes, kept as tests: doctor leaving out a whole
window whose rollout runs and generates nothing (the start-up rule), a sweep drawing a cluster above the
workload format's new GPU bound after its first workloads, and a sim learner restored from a hash written
before it kept running totals. The docstrings say what happened before the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_doctor_verdict_faults import QS_CONFIG, sample
    from tests.test_sim_workers import sim_job, start, stop_all, wait_for
except ModuleNotFoundError:
    from test_doctor_verdict_faults import QS_CONFIG, sample
    from test_sim_workers import sim_job, start, stop_all, wait_for

from pipeline.dataplane.keys import JobKeys
from pipeline.observe.doctor import diagnose

ROOT = Path(__file__).resolve().parent.parent


# --- 4b5b524: doctor's start-up rule ------------------------------------------------------------------


def test_doctor_judges_a_rollout_that_runs_but_generates_nothing_for_the_whole_window():
    """A job whose rollout engine has loaded (worker state ``running``, past ``starting``) but has generated
    nothing for 300 s (30 samples, a hung engine or calls that never end) while the learner waits 100%.
    Before 4b5b524 doctor said "rollout is short" (exit 1). Now every sample is "taken while the job
    started": "nothing generated yet in 30 samples: the job is starting (rollout workers: running 1)",
    judged false, exit 2. The commit (and docs/observability.md: "nothing generated yet while the engines
    load") says samples are left out until the count rises *or a rollout worker is past starting*;
    ``BalanceChecks._loading`` only applies the worker-state test when a ``generated`` count exists."""
    samples = [sample(1.7e9 + 10 * i, counters={"issued": 512, "issued_prompts": 64}, wait=1.0,
                      workers={"feeder": {"waiting": 1}, "learner": {"waiting": 1}, "reward": {"running": 1},
                               "rollout": {"running": 1}},
                      stages={"rollout": (64, 0), "reward": (0, 0), "learner": (0, 0)},
                      busy={"reward": 0.0, "learner": 0.0, "rollout": 1.0}) for i in range(30)]
    d = diagnose(samples, [], config=QS_CONFIG)
    balance = [(c.name, c.status, c.detail) for c in d.checks if c.step == "balance"]
    assert d.judged, balance
    assert d.primary is not None and d.primary.bottleneck == "rollout", balance


# --- 49213d9: workload upper bound against bench policy --sweep-gpus -----------------------------------


def test_sweep_gpus_above_the_workload_bound_is_refused_before_the_sweep_runs(tmp_path):
    """`libra-ctl bench policy --sweep 2 --seed 239 --sweep-gpus 16 100000`: workload 0 draws 18 GPUs and
    runs; workload 1 draws 91,288 GPUs, which the new MAX_GPUS (65,536) bound of parse_workload refuses, so
    the sweep dies after its work with a WorkloadError traceback (rc 1). Before 49213d9 it ran. The up-front
    check (``workload_at(seed, 0, gpus)``) only tries index 0; --sweep-gpus MAX is never checked against
    MAX_GPUS."""
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "policy", "--sweep", "2", "--seed", "239",
                        "--sweep-gpus", "16", "100000"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    assert "Traceback" not in p.stderr, p.stderr[-600:]
    assert p.returncode == 2 and "sweep-gpus" in p.stderr, (p.returncode, p.stderr[-600:])
    assert "sweep 1/2" not in p.stderr + p.stdout, "refused only after running workloads"


# --- 49213d9: the sim learner's running totals, restored from an older hash ----------------------------


def test_sim_learner_restored_from_a_hash_without_totals_keeps_the_jobs_trained_total(r, redis_url, tmp_path):
    """A sim job started before 49213d9 (its ``sim_learner`` hash holds step and version only) whose learner
    is restarted on the new code: ``restore`` starts ``trained_total`` / ``dropped_stale_total`` at 0, so
    every later learner_step says the job trained only what came after the restart, and `libra-ctl report`'s
    headline "trajectories trained" is that short figure while the counters (audit, /metrics) hold the
    job's total. The totals should fall back to the counters hash (``trained``, ``dropped_stale``)."""
    name = "oldhash"
    run_dir = sim_job(r, redis_url, tmp_path, name=name, time_scale=20.0, job={"steps": 5})
    keys = JobKeys(name)
    procs = [start("feeder", run_dir, "feeder-0", redis_url), start("rollout", run_dir, "rollout-n-0", redis_url),
             start("reward", run_dir, "reward-n-c0", redis_url)]
    learner = start("learner", run_dir, "learner-0", redis_url)
    try:
        wait_for(lambda: int(r.hget(keys.sim_learner, "step") or 0) >= 2, 120, "two learner steps")
        stop_all([learner])
        r.hdel(keys.sim_learner, "trained_total", "dropped_stale_total")   # the hash as the older code wrote it
        learner = start("learner", run_dir, "learner-0", redis_url)
        wait_for(lambda: r.hget(keys.state, "phase") == b"trained", 120, "the job's last step")
    finally:
        stop_all([*procs, learner])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind", "learner_step") == "learner_step"]
    trained = int(r.hget(keys.counters, "trained") or 0)
    assert trained > 0
    assert steps[-1]["trained_total"] == trained, (steps[-1]["trained_total"], trained,
                                                   [s.get("trajectories") for s in steps])
