"""The field guide's checklist with Libra's tools: baseline -> experiment (one variable at a time) -> the
comparison, on CI-sized real runs: faults a review found (the docstrings say what happened before).

Each run drives the real ``libra-ctl`` CLI in subprocesses on its own embedded Redis (no $LIBRA_REDIS_URL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CTL = [sys.executable, "-m", "pipeline.cli"]
TINY = ["--set", "job.steps=3", "--set", "learner.batch_size=32", "--set", "job.eval_size=16",
        "--set", "control.metrics_port=0"]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("LIBRA_REDIS_URL", None)
    env["WANDB_MODE"] = "disabled"
    return env


def _ctl(*args, timeout=170, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + list(args), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


def test_experiment_refuses_a_second_vary_instead_of_dropping_it(tmp_path):
    """The field guide: change ONE variable at a time. ``--vary`` is "the one key to vary"; given twice, the
    first was silently dropped (argparse's store) and the experiment runs on the second one alone. The first
    --vary here has an invalid value (batch 30, not a multiple of group_size 8), so an experiment that read it
    would exit 2 before running anything; instead it starts running learner.lr alone."""
    proc = subprocess.Popen(
        CTL + ["experiment", "examples/quickstart.toml", "--vary", "learner.batch_size=30,40",
               "--vary", "learner.lr=1e-3,2e-3", "--repeat", "1", "--out", str(tmp_path / "exp")] + TINY,
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline, err, started = time.monotonic() + 90, "", False
    while time.monotonic() < deadline:   # until it exits, or says what it runs
        line = proc.stderr.readline()
        if not line:
            break
        err += line
        if line.startswith("experiment "):
            started = True
            break
    if started:   # it started running runs: stop them in order
        os.killpg(proc.pid, signal.SIGINT)
        rest, more = proc.communicate(timeout=150)
        err += more
    else:
        err += proc.communicate()[1]
    assert proc.returncode == 2, (
        f"two --vary keys were accepted (exit {proc.returncode}); stderr head:\n{err[:600]}")
    assert "vary" in err


def test_the_experiment_table_compares_throughput_and_diversity():
    """README: compare "on all four metric kinds"; the field guide's final check reads throughput, reward and
    diversity at once ("High throughput with one collapsed tool-call path is a failure"). experiment.json held
    each value's trajectories/s and distinct rate, but the table the user reads (stdout, table.md, report.html)
    showed neither."""
    from pipeline.observe.compare import comparison_table

    header, _rows = comparison_table([], 0.5)
    assert "trajectories/s" in header and "distinct rate" in header and "final reward" in header, header


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resumed_baseline_run_throughput_agrees_with_its_wall_time(tmp_path):
    """README: a baseline/experiment stopped and then finished with ``libra-ctl resume DIR`` is "judged and
    written as if it had run at once". compare.run_figures times a resumed run over its whole clock (wall_s)
    and counts all its trajectories, but takes "trajectories/s trained" from summary.json, which run.py writes
    for the last process alone (trained since the resume / that process's wall). The throughput row then
    disagrees with the same run's own trajectories and wall time (and with what it would be had it run at once)."""
    out = tmp_path / "base"
    proc = subprocess.Popen(
        CTL + ["baseline", "examples/quickstart.toml", "--repeat", "1", "--out", str(out)] + TINY
        + ["--set", "job.steps=6"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 100
    metrics = None
    while time.monotonic() < deadline and proc.poll() is None:   # stop it once its first learner step is in
        found = list(out.glob("runs/baseline-seed0/*/metrics.jsonl"))
        if found and '"learner_step"' in found[0].read_text():
            metrics = found[0]
            break
        time.sleep(0.2)
    assert metrics is not None and proc.poll() is None, "the run finished or never trained before the interrupt"
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=150)
    assert proc.returncode == 130
    p = _ctl("resume", str(out), timeout=170)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    run = json.loads((out / "baseline.json").read_text())["runs"][0]
    assert run["ok"] and run["trained"] == 192
    whole = run["trained"] / run["wall_s"]
    assert run["trajectories_per_s"] == pytest.approx(whole, rel=0.01), (
        f"trajectories/s {run['trajectories_per_s']} but {run['trained']} trained in {run['wall_s']} s "
        f"= {whole:.2f}/s")
