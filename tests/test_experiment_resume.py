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
import time
from pathlib import Path

import pytest

from pipeline import experiment as ex
from pipeline.cli import main

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
