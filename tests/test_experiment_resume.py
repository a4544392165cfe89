"""``libra-ctl resume DIR`` of an experiment or a baseline: finished runs kept, stopped ones resumed from their
run directories, never-started ones started; then judged as a whole.

The fast tests start a stand-in for ``libra-ctl run`` (``tests/test_experiment.py``'s ``FAKE_RUN``); the slow one
interrupts a real baseline and resumes it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline import config as config_mod
from pipeline import experiment as ex
from pipeline.cli import main
from pipeline.observe import compare

try:
    from tests.test_experiment import FAKE_RUN, QUICK, ROOT, TINY
except ModuleNotFoundError:
    from test_experiment import FAKE_RUN, QUICK, ROOT, TINY

HALF_RUN = """
import json, pathlib, sys
run = pathlib.Path(sys.argv[1]) / "20260101-000000-quickstart"
run.mkdir(parents=True)
(run / "manifest.json").write_text("{}")
print("stopped half way", flush=True)
sys.exit(130)
"""

RESUMED = """
import json, pathlib, shutil, subprocess, sys
run = pathlib.Path(sys.argv[1])
home = run.parent
shutil.rmtree(run)   # the stand-in writes a whole run where the half one was
subprocess.run([sys.executable, "-c", sys.argv[2], str(home), "0", "5e-4"], check=True)
"""


@pytest.fixture
def scripted(monkeypatch):
    """start_run by a script: {value: "half" | "crash" | "run"}; every start is recorded (group, resume_dir)."""
    calls, script = [], {}

    def start(config, spec, devices):
        spec.home.mkdir(parents=True, exist_ok=True)
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        calls.append((spec.group, spec.resume_dir))
        if spec.resume_dir is not None:
            argv = ["-c", RESUMED, str(spec.resume_dir), FAKE_RUN]
        elif script.get(spec.value) == "half":
            argv = ["-c", HALF_RUN, str(spec.home)]
        else:   # FAKE_RUN crashes on 2e-3
            argv = ["-c", FAKE_RUN, str(spec.home), str(spec.seed),
                    spec.value if script.get(spec.value) == "crash" else "5e-4"]
        with open(spec.log, "a") as log:
            return subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    monkeypatch.setattr(ex, "start_run", start)
    monkeypatch.setattr(ex, "POLL_S", 0.05)
    monkeypatch.chdir(ROOT)    # resume goes to the directory the experiment ran in; put ours back after
    return calls, script


def test_resume_keeps_finished_runs_resumes_stopped_ones_and_starts_the_rest(tmp_path, scripted, capsys):
    calls, script = scripted
    config = tmp_path / "job.toml"
    shutil.copy(QUICK, config)
    out = tmp_path / "e"
    script.update({"5e-4": "run", "1e-3": "half", "2e-3": "crash"})
    assert ex.experiment(str(config), ["job.steps=4"], "learner.lr=5e-4,1e-3,2e-3", repeat=1, out=str(out),
                         parallel=1) == 1
    first = json.loads((out / "experiment.json").read_text())
    assert [r["ok"] for g in first["groups"] for r in g["runs"]] == [True, False, False]
    assert f"libra-ctl resume {out}" in capsys.readouterr().out
    kept = Path(first["groups"][0]["runs"][0]["run_dir"]) / "summary.json"
    kept_at = kept.stat().st_mtime_ns
    stopped = Path(first["groups"][1]["runs"][0]["run_dir"])

    calls.clear()
    script["2e-3"] = "run"                                # whatever made it crash was fixed
    assert main(["resume", str(out)]) == 0
    # the finished run is not run again; the stopped one resumes its own directory; the crashed one (no run
    # directory) starts afresh
    assert calls == [("learner.lr=1e-3", stopped), ("learner.lr=2e-3", None)]
    assert kept.stat().st_mtime_ns == kept_at
    err = capsys.readouterr().err
    assert "1 run(s) finished before and kept, 1 to resume from their checkpoints, 1 to start" in err
    doc = json.loads((out / "experiment.json").read_text())
    assert doc["id"] == first["id"] and not doc["interrupted"]
    assert [r["ok"] for g in doc["groups"] for r in g["runs"]] == [True, True, True]
    assert [g["verdict"]["outcome"] for g in doc["groups"]][0] == "baseline"

    calls.clear()                                         # all done: nothing runs, nothing is rewritten
    written = (out / "experiment.json").stat().st_mtime_ns
    assert main(["resume", str(out)]) == 0
    assert calls == [] and (out / "experiment.json").stat().st_mtime_ns == written
    assert "already finished" in capsys.readouterr().err


def test_resume_refuses_an_edited_config_and_a_directory_without_an_experiment(tmp_path, scripted, capsys):
    calls, script = scripted
    config = tmp_path / "job.toml"
    shutil.copy(QUICK, config)
    script[None] = "half"                                 # a baseline's runs have no value
    assert ex.baseline(str(config), ["job.steps=4"], repeat=1, out=str(tmp_path / "b"), parallel=1) == 1
    config.write_text(config.read_text() + "\n# edited\n")
    calls.clear()
    assert main(["resume", str(tmp_path / "b")]) == 2
    assert "changed since the experiment started" in capsys.readouterr().err and calls == []
    # --out on a directory an experiment started in is refused, saying how to continue it
    assert main(["baseline", str(config), "--out", str(tmp_path / "b")]) == 2
    assert f"libra-ctl resume {tmp_path / 'b'}" in capsys.readouterr().err
    (tmp_path / "b" / ex.INVOCATION).write_text("{not json")
    assert main(["resume", str(tmp_path / "b")]) == 2
    assert "damaged" in capsys.readouterr().err


@pytest.mark.slow
def test_a_real_baseline_stopped_by_ctrl_c_is_resumed_to_the_end(tmp_path):
    """`libra-ctl baseline` of 2 seeds, Ctrl-C while the second run trains, then `libra-ctl resume DIR`."""
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "pipeline.cli", "baseline", QUICK, "--repeat", "2", "--parallel", "1",
           "--out", str(out), *sum((["--set", s] for s in TINY), [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    second = out / "runs" / "baseline-seed1"
    deadline = time.monotonic() + 600
    while not list(second.glob("*/manifest.json")):      # the first run finished, the second has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    time.sleep(3)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    first = out / "runs" / "baseline-seed0"
    [summary] = first.glob("*/summary.json")
    at = summary.stat().st_mtime_ns
    assert f"libra-ctl resume {out}" in stdout
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "resume", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 run(s) finished before and kept, 1 to resume" in done.stderr
    doc = json.loads((out / "baseline.json").read_text())
    assert [r["ok"] for r in doc["runs"]] == [True, True] and not doc["interrupted"]
    assert summary.stat().st_mtime_ns == at                    # the kept run was not run again
    assert "--- libra-ctl resume" in (out / "logs" / "baseline-seed1.log").read_text()
    [resumed] = second.glob("*/summary.json")
    assert len(json.loads(resumed.read_text())["resumes"]) == 1      # its figures leave the stopped time out


# --- resume while the experiment it continues is still running ----------------------------------------------

ORIGINAL = textwrap.dedent("""
    import json, pathlib, subprocess, sys
    from pipeline import experiment as ex

    def start(config, spec, devices):   # a run that trains for a long time: its manifest written, no summary yet
        run = spec.home / "20260101-000000-quickstart"
        run.mkdir(parents=True, exist_ok=True)
        (run / "manifest.json").write_text("{}")
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        (spec.home / "started").write_text("")
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])   # in our process group

    ex.start_run = start
    ex.POLL_S = 0.05
    sys.exit(ex.experiment(sys.argv[1], ["job.steps=4"], "learner.lr=5e-4,1e-3", repeat=1, out=sys.argv[2],
                           parallel=1))
""")


def test_resume_refuses_an_experiment_that_is_still_running(tmp_path, scripted):
    """`libra-ctl resume DIR` of an experiment whose `libra-ctl experiment` process is still running (another
    terminal, a job scheduler retrying) must refuse, naming it, and start nothing.

    Before: nothing marked the experiment as running. The resume takes the live run for a stopped one and resumes
    it (a real `libra-ctl resume` then fails on the run's Redis lock and is recorded as FAILED), starts afresh
    the runs the original has not reached yet (the original starts them too: each seed trained twice, two run
    directories in one home), and writes experiment.json, which the original overwrites when it ends."""
    calls, script = scripted
    out = tmp_path / "e"
    proc = subprocess.Popen([sys.executable, "-c", ORIGINAL, QUICK, str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not list((out / "runs").glob("*/started")):
            assert proc.poll() is None and time.monotonic() < deadline, "the original experiment did not start"
            time.sleep(0.1)
        assert proc.poll() is None                                # the original experiment still runs
        script.update({"5e-4": "run", "1e-3": "run"})
        code = main(["resume", str(out)])
        assert (code, calls) == (2, []), (code, calls)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- a plan refused at load leaves a directory no command can use ---------------------------------------------


def test_an_experiment_refused_while_planning_leaves_its_out_directory_usable(tmp_path, scripted):
    """`libra-ctl experiment ... --set job.seed=4294967295 --repeat 2 --out DIR` is refused (exit 2, "bad input,
    checked before anything runs"): its second seed, 2**32, is more than job.seed may be. The user lowers
    --repeat and runs the same command again.

    Before: invocation.json was written before the runs were planned, so the second command is refused with
    "DIR already holds an experiment; choose another --out (or continue that one: libra-ctl resume DIR)", and
    `libra-ctl resume DIR` fails with the first command's config error again: the directory is a dead end that
    only deleting it clears (before today's change the same command could simply be run again)."""
    calls, script = scripted
    out = tmp_path / "e"
    sets = [f"job.seed={config_mod.MAX_SEED}", "job.steps=4"]
    with pytest.raises(config_mod.ConfigError, match="job.seed"):
        ex.experiment(QUICK, sets, "learner.lr=5e-4,1e-3", repeat=2, out=str(out), parallel=1)
    assert calls == []                                            # refused before any run
    script.update({"5e-4": "run", "1e-3": "run"})
    assert ex.experiment(QUICK, sets, "learner.lr=5e-4,1e-3", repeat=1, out=str(out), parallel=1) == 0
    assert len(calls) == 2


# --- a resumed run judged as if it had run at once -------------------------------------------------------------


def _resumed_run(home: Path, pause_s: float) -> None:
    """A run that trained steps 1-2, was stopped, and was resumed ``pause_s`` later for steps 3-4 (as
    ``libra-ctl resume`` writes it: summary started_at is the first start, resumed_at the resume's)."""
    run = home / "20260101-000000-quickstart"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    t0, back = 1000.0, 1000.0 + 25.0 + pause_s
    steps = [(1, t0 + 10), (2, t0 + 20), (3, back + 10), (4, back + 20)]
    lines = [{"kind": "learner_step", "step": s, "policy_version": s, "at": at, "reward_mean": 0.5,
              "trajectories": 32, "trained_total": 32 * s, "dropped_stale_total": 0, "wait_s": 1.0, "train_s": 2.0}
             for s, at in steps]
    lines += [{"kind": "sample", "at": t0 + 5 * k, "phase": "running",
               "resources": {"slot_busy": {"frac": 0.5, "busy_s": 5, "slot_s": 10}, "gpus": []},
               "queues": {"learner_queue": 1, "reward_queue": 0, "learner_wait_ratio": 0.3}} for k in range(5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    evals = [{"tag": "start", "version": 0, "success_rate": 0.1, "n": 16, "at": t0 + 1},
             {"tag": "periodic", "version": 2, "success_rate": 0.3, "n": 16, "at": t0 + 21},
             {"tag": "final", "version": 4, "success_rate": 0.6, "n": 16, "at": back + 21}]
    (run / "summary.json").write_text(json.dumps({
        "started_at": t0, "resumed_at": back, "success_rate_start": 0.1, "success_rate_end": 0.6,
        "eval_prompts": 16, "eval_prompts_start": 16, "evals": evals, "trajectories_trained": 128,
        "dropped_stale": 0, "wall_s": 22.0, "trajectories_per_s": 2.9, "steps": 4}))


def test_a_resumed_runs_time_to_target_leaves_out_the_time_it_was_stopped(tmp_path):
    """README: `libra-ctl resume DIR` of an experiment judges the whole "as if it had run at once". A run stopped
    after 25 s of training and resumed the next morning reached 50% held-out success after ~45 s of training.

    Before: its curve was on the wall clock from its first start, so the night it spent stopped counts as training
    time: time to target ~8 h, and the verdict calls its value slower than one whose runs were not interrupted."""
    home = tmp_path / "home"
    _resumed_run(home, pause_s=8 * 3600)
    spec = ex.RunSpec("learner.lr=1e-3", "1e-3", 0, [], "q", home, tmp_path / "q.log", 4)
    rec = compare.with_target(ex.run_record(ex.Outcome(spec, 0)), 0.5)
    assert rec["ok"]
    assert rec["time_to_target_s"] is not None and rec["time_to_target_s"] < 600, rec["curve"]


# --- progress of a resumed experiment --------------------------------------------------------------------------


def test_the_eta_of_a_resumed_experiment_is_not_taken_from_a_resumed_runs_remainder(tmp_path, monkeypatch):
    """A resumed experiment: one run resumed near its end (it finishes at once), one run to start from scratch.

    Before: the resumed run's few seconds went into the mean length of a run, so while the fresh run trains the
    progress line says `ETA 0m00s` for a whole run still to go (or, with more runs queued, a small fraction of
    the real time). A resumed run's time says nothing about a whole run's: without another measure the ETA is
    unknown ("?"), as at the start of an experiment."""
    import io

    specs = [ex.RunSpec(f"g{i}", None, i, [], f"n{i}", tmp_path / f"h{i}", tmp_path / f"l{i}.log", 4)
             for i in range(2)]
    specs[0].resume_dir = tmp_path / "h0" / "run"

    def start(config, spec, devices):
        spec.home.mkdir(parents=True, exist_ok=True)
        wait = "0" if spec.resume_dir is not None else "2"   # the resumed one had little left to do
        return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({wait})"])

    monkeypatch.setattr(ex, "start_run", start)
    monkeypatch.setattr(ex, "POLL_S", 0.05)
    monkeypatch.setattr(ex, "PLAIN_EVERY_S", 0.0)
    out = io.StringIO()
    outcomes, interrupted = ex.Runner(ex.Plan("c", specs, 1), out).run()
    assert [o.code for o in outcomes] == [0, 0] and not interrupted
    lines = [x for x in out.getvalue().splitlines() if x.startswith("[") and "1/2 runs" in x]
    assert lines, out.getvalue()
    assert not any("ETA 0m00s" in x for x in lines), lines


def test_resume_of_an_experiment_from_before_resume_says_why_not(tmp_path, capsys):
    """An experiment directory written before experiments could be resumed (experiment.json, no invocation.json):
    `libra-ctl resume` says that, rather than "not a run directory (no manifest.json)"."""
    (tmp_path / "experiment.json").write_text("{}")
    assert main(["resume", str(tmp_path)]) == 2
    assert "holds no invocation.json" in capsys.readouterr().err
