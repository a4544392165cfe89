"""Bugs a review of the changes of one day found in them: the progress reader stopping at its first read, and a
job-name claim left behind by a run that ended before it owned the job."""

from __future__ import annotations

import io
import json
import socket

import pytest

import pipeline.experiment as ex
from pipeline.dataplane.keys import JobKeys


def test_current_step_reads_a_file_longer_than_one_read_in_one_call(tmp_path):
    """``current_step`` reads all that was appended since its last call: a metrics.jsonl of more than
    ``STEP_READ_BYTES`` whose newest learner step comes after the first MiB gives that step on the first call.
    Before, the read stopped after a full chunk that ended inside a line (nearly always), taken for a line
    still being written: one MiB per call, a 20 MiB file 10 minutes behind at the plain line's 30 s."""
    run = tmp_path / "20260101-000000-long"
    run.mkdir()
    sample = json.dumps({"kind": "sample", "at": 0.0, "pad": "x" * 3000})
    with open(run / "metrics.jsonl", "w") as f:
        for _ in range(ex.STEP_READ_BYTES // len(sample) + 5):
            f.write(sample + "\n")
        f.write(json.dumps({"kind": "learner_step", "step": 9, "policy_version": 9}) + "\n")
    assert (run / "metrics.jsonl").stat().st_size > ex.STEP_READ_BYTES
    assert ex.current_step(tmp_path) == 9


@pytest.mark.timeout(120)
def test_a_run_interrupted_between_reset_and_its_first_state_leaves_no_live_claim(r, redis_url, tmp_path,
                                                                                  monkeypatch):
    """``reset_job`` leaves the job in phase ``starting`` with this process's pid and host, a claim the run's
    first state write replaces. A run that ends before it (Ctrl-C while the manifest is written, a Redis outage
    on the policy announcement) releases the claim: once ``run_job`` has returned, the job name is free to a
    run from another host. Before, the claim stayed, and every other host of the shared Redis was refused the
    name for good (``live_owner`` cannot check a pid elsewhere)."""
    from pipeline import config as config_mod
    from pipeline import run as run_mod
    from pipeline.dataplane import jobs as jobs_mod

    cfg = config_mod.load("examples/quickstart.toml", [f"redis.url={json.dumps(redis_url)}",
                                                       f"run.runs_dir={json.dumps(str(tmp_path / 'runs'))}",
                                                       'job.name="claimjob"'])
    monkeypatch.setattr(run_mod, "own_runs", lambda: None)
    monkeypatch.setattr(run_mod.signal, "signal", lambda *a: None)   # leave pytest's handlers alone
    monkeypatch.setenv(run_mod.ENV_OUTAGE, "5")
    monkeypatch.setattr(run_mod, "check_prompt_files", lambda cfg, out=None: [])
    monkeypatch.setattr(run_mod, "prepare_policy", lambda cfg, out=None: str(tmp_path))

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt   # Ctrl-C (or SIGTERM, taken as one) while the manifest is written

    monkeypatch.setattr(run_mod.manifest_mod, "write_manifest", interrupted)
    out = io.StringIO()
    assert run_mod.run_job(cfg, ["libra-ctl", "run"], out) == 130, out.getvalue()

    # another host of the same Redis starts the job name again
    other = socket.gethostname() + "-other"
    monkeypatch.setattr(jobs_mod.socket, "gethostname", lambda: other)
    try:
        jobs_mod.reset_job(r, JobKeys("claimjob"))
    except jobs_mod.JobRunning as exc:
        pytest.fail(f"the ended run still holds the job name: {exc}; state {r.hgetall(JobKeys('claimjob').state)}")
