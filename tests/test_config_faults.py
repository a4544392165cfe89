"""Settings the loader accepted that a run cannot honour: each is now refused when the config loads (exit 2,
naming the key, before any policy, Redis or worker), or, for a section given as a table, merged.

Each docstring says what happened before the fix ("Before")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import config as c

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "examples" / "quickstart.toml")


def config_cli(*overrides: str) -> subprocess.CompletedProcess:
    """``libra-ctl config examples/quickstart.toml --set ...``: the loader's verdict, nothing started."""
    argv = [sys.executable, "-m", "pipeline.cli", "config", QUICKSTART]
    for o in overrides:
        argv += ["--set", o]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


# --- values the loader accepts and a worker refuses minutes later -----------------------------------------------


def test_a_job_seed_above_32_bits_is_refused_by_the_loader():
    """Before: job.seed goes to vLLM's ``set_random_seed`` (``np.random.seed``: 0..2**32-1). The loader accepts up
    to 2**63-1, so ``--set job.seed=4294967296`` starts the run, every rollout worker dies at engine start
    with "ValueError: Seed must be between 0 and 2**32 - 1", and the run fails after 5 restarts (exit 1,
    run directory left)."""
    c.load(QUICKSTART, ["job.seed=4294967295"])   # the largest seed vLLM takes: fine
    proc = config_cli("job.seed=4294967296")
    assert proc.returncode == 2 and "job.seed" in proc.stderr, proc.stderr or proc.stdout[:200]


def test_a_zero_max_model_len_is_refused_by_the_loader():
    """Before: rollout.max_model_len = 0 passes validation (only > max_position_embeddings is checked, in run.py);
    vLLM's ModelConfig raises "max_model_len must be a positive integer" in every rollout worker."""
    with pytest.raises(c.ConfigError, match="rollout.max_model_len"):
        c.load(QUICKSTART, ["rollout.max_model_len=0"])


def test_a_malformed_redis_maxmemory_is_refused_by_the_loader():
    """Before: redis.maxmemory is pasted into the embedded server's redis.conf unchecked: ``--set redis.maxmemory=lots``
    prepares the policy, then fails with "run failed: embedded redis-server exited with 1 ... FATAL CONFIG
    FILE ERROR ... 'maxmemory lots'" and exit 1 (not 2), without naming the key."""
    for bad in ("lots", "", "2 gb"):
        with pytest.raises(c.ConfigError, match="redis.maxmemory"):
            c.load(QUICKSTART, [f"redis.maxmemory={bad!r}"])
    for good in ("2gb", "512mb", "0", "1073741824"):
        c.load(QUICKSTART, [f"redis.maxmemory={good!r}"])


# --- combinations that can never run -----------------------------------------------------------------------------


def test_max_slots_below_the_roles_minimums_is_refused_by_the_loader():
    """Before: control.max_slots = 1 can never hold a job (a rollout and a learner slot at least: min_share 2). The
    loader accepts it; ``libra-ctl run`` prepares the policy and starts the embedded Redis before the
    admission check refuses it ("needs at least 2 slots ... may hold at most 1")."""
    with pytest.raises(c.ConfigError, match="control.max_slots|control.min_"):
        c.load(QUICKSTART, ["control.max_slots=1"])


@pytest.mark.parametrize("override", [
    ["learner.workers=3", "control.max_learner=2"],
    ["rollout.workers=5", "control.max_rollout=2"],
    ["rollout.workers=1", "control.min_rollout=3"],
])
def test_initial_counts_outside_the_control_bounds_are_refused(override):
    """Before: The starting counts (rollout.workers, learner.workers) outside [control.min_*, control.max_*] are
    accepted and then silently trimmed or raised by the controller (``fit``): the configured start is not
    the start."""
    with pytest.raises(c.ConfigError):
        c.load(QUICKSTART, override)


def test_a_zero_eval_size_is_refused_or_means_no_evaluation():
    """Before: job.eval_size = 0 is accepted; the run evaluates no prompt and its summary says the held-out success
    is "none judged (the reward could not judge an episode: see the rollout workers' logs)": a misdiagnosis
    of a setting the loader should refuse (eval_every = 0 is the documented way to thin evaluations)."""
    with pytest.raises(c.ConfigError, match="job.eval_size"):
        c.load(QUICKSTART, ["job.eval_size=0"])


# --- --set parsing -------------------------------------------------------------------------------------------------


def test_a_section_given_as_a_table_does_not_reset_the_files_other_keys():
    """Before: ``--set 'learner={batch_size=64}'`` replaces the file's whole [learner] table: the quick start's
    lr 2.5e-4 silently becomes the default 5e-4 (and a repeated ``--set learner.lr=1e-4`` before it is lost
    too). Either merge the table into the section or refuse it."""
    try:
        cfg = c.load(QUICKSTART, ["learner={batch_size=64}"])
    except c.ConfigError:
        return   # refusing is a fix too
    assert cfg.learner.batch_size == 64
    assert cfg.learner.lr == 2.5e-4, f"the file's learner.lr was reset to {cfg.learner.lr}"
    try:
        cfg = c.load(QUICKSTART, ["learner.lr=1e-4", "learner={batch_size=64}"])
    except c.ConfigError:
        return
    assert cfg.learner.lr == 1e-4
