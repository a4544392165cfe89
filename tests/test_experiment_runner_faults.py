"""``libra-ctl baseline`` / ``experiment`` / ``rejudge`` under bad input, interrupted runs and odd machines: a
clear error before any run, every run stopped on a second Ctrl-C, no finished run's figures lost, defaults that
fit the cores this process may use.

Nothing trains: the planning and bookkeeping functions are called directly, and the commands run with the
stand-in runs of ``tests/test_experiment.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pipeline import experiment as ex
from tests import test_experiment
from tests.test_experiment import QUICK

fake_runs = test_experiment.fake_runs   # the stand-in runs fixture


# --- a second Ctrl-C while stopping kills only one run ---------------------------------------------------


def _stubborn(exit_after_s: float | None) -> subprocess.Popen:
    """A run that ignores SIGINT (stuck stopping its workers); with ``exit_after_s`` it ends by itself then."""
    code = textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep({exit_after_s if exit_after_s is not None else 60})
        sys.exit(0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_second_ctrl_c_while_stopping_kills_every_run_still_there():
    """With two runs stuck stopping, a second Ctrl-C kills every group still there, as stop_runs says.
    Before, it killed the one being waited on only; the other was still waited for (up to STOP_WAIT_S)."""
    first, second = _stubborn(None), _stubborn(3.0)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)

    def ctrl_c():
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        codes = ex.stop_runs([first, second], wait_s=30.0)
    finally:
        signal.signal(signal.SIGINT, before)
        for p in (first, second):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert codes == [-signal.SIGKILL, -signal.SIGKILL], codes


# --- a run that cannot start takes the whole experiment down ---------------------------------------------


def test_a_run_that_cannot_start_does_not_lose_the_runs_that_finished(tmp_path, fake_runs, capsys):
    """A value whose run directory name would be too long for the file system gets a short name (cut, with a
    hash), and a run that cannot start is recorded as failed while the rest go on. Before, start_run's mkdir
    raised ENAMETOOLONG out of Runner.run: a traceback, no experiment.json, the finished runs' figures lost."""
    long = "examples/data/" + "x" * 240 + ".jsonl"
    try:
        code = ex.experiment(QUICK, [], f"job.train_prompts=examples/data/calc_train.jsonl,{long}", repeat=1,
                             out=str(tmp_path / "e"), parallel=1)
    except OSError as exc:
        pytest.fail(f"the experiment crashed with {exc!r}; the finished run's figures were not recorded")
    except ex.ExperimentError:
        code = 2
    if code == 2:
        assert fake_runs == []
    else:
        doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
        assert doc["groups"][0]["runs"][0]["ok"]


# --- default --parallel counts CPUs the process may not use ----------------------------------------------


def test_default_parallel_counts_only_the_cpus_this_process_may_run_on(tmp_path, monkeypatch):
    """Under ``taskset -c 0,1`` (or a cpuset container) on a 16-core host, the default counts the 2 cores
    this process may use. Before, os.cpu_count() gave the host's 16: 8 runs at once on 2 cores."""
    monkeypatch.delenv("LIBRA_REDIS_URL", raising=False)
    monkeypatch.setattr(ex, "visible_devices", lambda env=os.environ: [])
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    plan = ex.make_plan(QUICK, [], [("baseline", None, [])], 4, "e", tmp_path, None)
    assert plan.parallel == 1


# --- the Prometheus port is turned off for a run that runs alone ------------------------------------------


def test_a_run_alone_keeps_its_prometheus_port(tmp_path, monkeypatch):
    """``baseline --repeat 1`` on a many-core machine runs one run, which keeps its controller's metrics port
    (the README turns it off only with more than one at a time). Before, the port went off: plan_runs got the
    parallel count before it was cut to the number of runs."""
    monkeypatch.delenv("LIBRA_REDIS_URL", raising=False)
    monkeypatch.setattr(ex, "visible_devices", lambda env=os.environ: [])
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    plan = ex.make_plan(QUICK, [], [("baseline", None, [])], 1, "e", tmp_path, None)
    assert plan.parallel == 1
    assert "control.metrics_port=0" not in plan.specs[0].sets


# --- varying a key the runner sets per run: every value runs the same config ------------------------------


@pytest.mark.parametrize("vary", ["run.runs_dir=/tmp/a,/tmp/b", "tracking.group=a,b", "tracking.run_name=a,b"])
def test_varying_a_key_the_runner_overrides_is_refused(tmp_path, fake_runs, capsys, vary):
    """``--vary`` of a key the runner sets for every run (run.runs_dir, tracking.group, tracking.run_name)
    exits 2 naming it. Before, the runner's own value overrode each varied one: every value ran the same
    config, and the experiment compared a variable that never changed."""
    from pipeline.cli import main

    code = main(["experiment", QUICK, "--vary", vary, "--repeat", "1", "--parallel", "1",
                 "--out", str(tmp_path / "e")])
    assert code == 2 and fake_runs == []


# --- --effect is never checked ------------------------------------------------------------------------------


@pytest.mark.parametrize("effect", ["-0.1", "nan"])
def test_an_effect_that_is_not_a_positive_rate_is_refused_before_any_run(tmp_path, fake_runs, capsys, effect):
    """``--effect`` outside (0, 1] (-0.1, nan) exits 2 before any run, as --target does. Before, -0.1 marked
    every baseline noisy and nan none, after the whole baseline had run."""
    from pipeline.cli import main

    code = main(["baseline", QUICK, "--repeat", "2", "--parallel", "1", "--effect", effect,
                 "--out", str(tmp_path / "b")])
    assert code == 2 and fake_runs == []


# --- a damaged record crashes rejudge / --baseline with a traceback -----------------------------------------


@pytest.mark.parametrize("text", ['{"kind": "experiment", "groups": [', "[]"])
def test_rejudge_of_a_damaged_experiment_json_is_a_clear_error(tmp_path, capsys, text):
    """``libra-ctl rejudge DIR`` on a cut or non-object experiment.json exits 2 saying so. Before, a
    JSONDecodeError or AttributeError traceback."""
    from pipeline.cli import main

    (tmp_path / "experiment.json").write_text(text)
    assert main(["rejudge", str(tmp_path)]) == 2
    assert "experiment.json" in capsys.readouterr().err


def test_a_baseline_json_that_is_not_an_object_is_a_clear_error(tmp_path, fake_runs, capsys):
    """``--baseline DIR`` whose baseline.json is JSON but not an object (``[]``) gets the "not a baseline"
    error (exit 2). Before, an AttributeError from ``doc.get``."""
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "baseline.json").write_text("[]")
    with pytest.raises(ex.ExperimentError):
        ex.load_baseline(str(tmp_path / "b"))


# --- --out . gives the experiment an empty id --------------------------------------------------------------


@pytest.mark.parametrize("out", [".", ".."])
def test_out_of_the_current_directory_gives_a_named_experiment(tmp_path, monkeypatch, out):
    """``--out .`` (or ``..``) names the experiment after the directory it is, so every run's tracking.group is
    that name. Before, the id was "" (or ".."): no W&B group, and a header reading "experiment : ..."."""
    from pipeline import config as config_mod

    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    _path, exp_id = ex.experiment_dir(out, config_mod.load(QUICK), "learner.lr")
    assert exp_id not in ("", ".", ".."), exp_id
