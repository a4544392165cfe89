"""``libra-ctl baseline`` and ``libra-ctl experiment`` (``pipeline.experiment``).

The planning (seeds, run directories, names, ports, GPUs, runs at once), the
progress figures and the stop of a run are tested on their own; the runner
and the command's outputs with stand-in runs (a small Python child that
writes a run directory); two slow tests run the real thing on the tiny
quick start: a two-seed baseline, then an experiment against it.
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
from pathlib import Path

import pytest

from pipeline import experiment as ex
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
QUICK = str(ROOT / "examples" / "quickstart.toml")


# --- planning ---------------------------------------------------------------------------------------------


def test_parse_vary():
    assert ex.parse_vary("learner.lr=5e-4, 1e-3") == ("learner.lr", ["5e-4", "1e-3"])
    # a comma inside a quoted string or a list is the value's own (before, it split the value)
    assert ex.parse_vary('job.train_prompts="data/a,b.jsonl",data/c.jsonl') == (
        "job.train_prompts", ['"data/a,b.jsonl"', "data/c.jsonl"])
    assert ex.parse_vary("k=[1,2],[3, 4]") == ("k", ["[1,2]", "[3, 4]"])
    for bad in ("learner.lr", "learner.lr=", "=1,2", "learner.lr=1,,2", "learner.lr=1,1"):
        with pytest.raises(ex.ExperimentError):
            ex.parse_vary(bad)


def test_plan_gives_every_run_its_seed_directory_and_names(tmp_path):
    groups = [("learner.lr=5e-4", "5e-4", ["learner.lr=5e-4"]), ("learner.lr=1e-3", "1e-3", ["learner.lr=1e-3"])]
    specs = ex.plan_runs(QUICK, ["job.seed=7"], groups, 2, "exp1", tmp_path, parallel=1)
    assert [(s.group, s.seed) for s in specs] == [("learner.lr=5e-4", 7), ("learner.lr=5e-4", 8),
                                                   ("learner.lr=1e-3", 7), ("learner.lr=1e-3", 8)]
    assert len({s.home for s in specs}) == 4 and len({s.log for s in specs}) == 4
    s = specs[3]
    assert s.name == "quickstart-learner.lr=1e-3-seed8"
    assert s.sets[:2] == ["job.seed=7", "learner.lr=1e-3"] and "job.seed=8" in s.sets   # the seed wins: it comes last
    assert f"run.runs_dir={json.dumps(str(s.home))}" in s.sets
    assert 'tracking.run_name="quickstart-learner.lr=1e-3-seed8"' in s.sets and 'tracking.group="exp1"' in s.sets
    assert not any(x.startswith("control.metrics_port") for x in s.sets)             # one at a time: no clash
    assert s.home.is_absolute() and s.steps == 40


def test_parallel_runs_turn_off_the_controllers_port_unless_set(tmp_path):
    groups = [("baseline", None, [])]
    specs = ex.plan_runs(QUICK, [], groups, 2, "e", tmp_path, parallel=2)
    assert all("control.metrics_port=0" in s.sets for s in specs)
    mine = ex.plan_runs(QUICK, ["control.metrics_port=9500"], groups, 2, "e", tmp_path, parallel=2)
    assert not any("control.metrics_port=0" in s.sets for s in mine)


def test_a_bad_value_stops_the_plan_before_any_run(tmp_path):
    with pytest.raises(ConfigError):
        ex.plan_runs(QUICK, [], [("learner.lr=abc", "abc", ["learner.lr=abc"])], 1, "e", tmp_path, 1)
    with pytest.raises(ex.ExperimentError):
        ex.plan_runs(QUICK, [], [("baseline", None, [])], 0, "e", tmp_path, 1)


def test_runs_at_once_from_gpus_or_cores():
    assert ex.default_parallel(3, [], cpus=2) == 1 and ex.default_parallel(3, [], cpus=16) == 8
    assert ex.default_parallel(2, [str(i) for i in range(8)], cpus=2) == 4
    n, devices, notes = ex.choose_parallel(None, 2, ["0", "1", "2", "3", "4"], 64, shared_redis=False)
    assert n == 2 and devices == [["0", "1"], ["2", "3"]] and not notes          # disjoint GPUs per run
    n, devices, notes = ex.choose_parallel(4, 2, ["0", "1", "2", "3"], 64, shared_redis=False)
    assert n == 2 and len(devices) == 2 and "4 visible" in notes[0]
    n, devices, notes = ex.choose_parallel(1, 2, ["0", "1", "2", "3"], 64, shared_redis=False)
    assert (n, devices) == (1, [])                                              # alone: the run's own choice
    n, devices, notes = ex.choose_parallel(4, 2, [], 64, shared_redis=True)
    assert (n, devices) == (1, []) and "one at a time" in notes[0]
    assert ex.choose_parallel(3, 2, [], 2, shared_redis=False)[:2] == (3, [])    # CPU: as asked


def test_differences_from_a_recorded_baseline_ignore_the_varied_and_per_run_keys():
    base = {"job": {"seed": 0, "steps": 40}, "learner": {"lr": 5e-4}, "env": {"options": {"a": 1}},
            "run": {"runs_dir": "x"}}
    other = {"job": {"seed": 3, "steps": 20}, "learner": {"lr": 1e-3}, "env": {"options": {"a": 2}},
             "run": {"runs_dir": "y"}}
    assert ex.config_differences(base, other, "learner.lr") == ["env.options", "job.steps"]


# --- progress ---------------------------------------------------------------------------------------------


def test_eta_from_finished_runs_or_the_running_ones_steps():
    assert ex.eta_s(6, 2, 2, [100.0, 120.0], [(30.0, 0.3), (10.0, None)]) == pytest.approx((80 + 100 + 2 * 110) / 2)
    assert ex.eta_s(2, 0, 1, [], [(50.0, 0.5)]) == pytest.approx((50 + 100) / 1)
    assert ex.eta_s(2, 0, 1, [], [(50.0, None)]) is None
    line = ex.progress_line(1, 4, ["lr=1 seed 0: step 3/40"], 65.0, 125.0)
    assert line.startswith("[#####---------------] 1/4 runs · lr=1 seed 0: step 3/40")
    assert "1m05s elapsed" in line and "ETA 2m05s" in line


def test_current_step_reads_the_end_of_metrics(tmp_path):
    run = tmp_path / "20260101-000000-q"
    run.mkdir()
    assert ex.current_step(tmp_path) is None
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "learner_step", "step": i}) + "\n"
                                               for i in range(1, 6)) + json.dumps({"kind": "sample"}) + "\n{cut")
    assert ex.current_step(tmp_path) == 5


# --- stopping a run ---------------------------------------------------------------------------------------


def test_stop_run_sends_sigint_to_the_group_and_waits(tmp_path):
    marker = tmp_path / "stopped"
    code = textwrap.dedent(f"""
        import signal, sys, time, pathlib
        def stop(*_):
            time.sleep(0.3)   # stopping its workers
            pathlib.Path({str(marker)!r}).write_text("clean")
            sys.exit(130)
        signal.signal(signal.SIGINT, stop)
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    assert ex.stop_run(proc, wait_s=20) == 130 and marker.read_text() == "clean"


def test_stop_run_kills_a_run_that_does_not_stop(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    assert ex.stop_run(proc, wait_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 10


# --- the commands with stand-in runs -----------------------------------------------------------------------

# A stand-in for `libra-ctl run`: writes a run directory as a run would (manifest, summary, metrics), or
# fails like one, or waits for a SIGINT. Its behaviour comes from the value of the varied key.
FAKE_RUN = textwrap.dedent("""
    import json, signal, sys, time, pathlib
    home, seed, value = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if value == "2e-3":
        print("Traceback (most recent call last):\\nRuntimeError: the learner crashed", flush=True)
        sys.exit(1)
    if value == "wait":   # like libra-ctl run: Python's own Ctrl-C handling, if SIGINT reaches it
        home.mkdir(parents=True, exist_ok=True)
        (home / "ready").write_text("")
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            (home / "stopped").write_text("clean")
            sys.exit(130)
    fast = value == "1e-3"
    run = home / f"20260101-000000-quickstart"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    t0 = 1000.0
    dt = 5.0 if fast else 10.0
    steps, lines = [], []
    for i in range(1, 5):
        steps.append({"kind": "learner_step", "step": i, "policy_version": i, "at": t0 + dt * i,
                      "reward_mean": 0.3 + 0.05 * i + 0.01 * seed, "trajectories": 32, "trained_total": 32 * i,
                      "dropped_stale_total": 0, "wait_s": 1.0, "train_s": 2.0})
    for k in range(6):
        frac = (0.5 + 0.02 * (k % 2)) if fast else (0.3 + 0.2 * (k % 2))
        lines.append({"kind": "sample", "at": t0 + 5 * k, "phase": "running",
                      "resources": {"slot_busy": {"frac": frac, "busy_s": frac * 10, "slot_s": 10}, "gpus": []},
                      "queues": {"learner_queue": 1 + k % 2, "reward_queue": 0, "learner_wait_ratio": 0.3}})
    evals = [{"tag": "start", "version": 0, "success_rate": 0.1}] + [
        {"tag": "periodic", "version": i, "success_rate": 0.1 + 0.1 * i + 0.01 * seed + (0.02 * (i == 4) if fast else 0)}
        for i in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\\n" for x in steps + lines))
    (run / "summary.json").write_text(json.dumps({
        "started_at": t0, "success_rate_start": 0.1, "success_rate_end": evals[-1]["success_rate"],
        "evals": evals, "trajectories_trained": 128, "dropped_stale": 0, "wall_s": 4 * dt + 5,
        "trajectories_per_s": 128 / (4 * dt + 5), "steps": 4}))
    print("run finished", flush=True)
""")


@pytest.fixture
def fake_runs(monkeypatch):
    started = []

    def start(config, spec, devices):
        spec.home.mkdir(parents=True, exist_ok=True)
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        started.append((spec, devices))
        with open(spec.log, "w") as log:
            return subprocess.Popen([sys.executable, "-c", FAKE_RUN, str(spec.home), str(spec.seed), spec.value or "5e-4"],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    monkeypatch.setattr(ex, "start_run", start)
    monkeypatch.setattr(ex, "POLL_S", 0.05)
    return started


def test_baseline_records_the_spread_and_flags_noise(tmp_path, fake_runs, capsys):
    code = ex.baseline(QUICK, [], repeat=3, out=str(tmp_path / "b"), parallel=2, effect=0.005)
    assert code == 0
    doc = json.loads((tmp_path / "b" / "baseline.json").read_text())
    assert doc["kind"] == "baseline" and doc["seeds"] == [0, 1, 2] and len(doc["runs"]) == 3
    assert all(r["ok"] and Path(r["run_dir"]).is_dir() for r in doc["runs"])
    assert doc["spread"]["success_final"]["mean"] == pytest.approx(0.51)
    assert doc["spread"]["success_final"]["sd"] == pytest.approx(0.01)
    assert doc["noisy"] is True and doc["target"] == pytest.approx(0.51)        # sd 0.01 > effect 0.005
    out = capsys.readouterr().out
    assert "final held-out success" in out and "WARNING" in out and "too noisy to tune on" in out
    assert "slot busy fluctuation" in out and (tmp_path / "b" / "table.md").read_text().startswith("| kind |")


def test_experiment_against_a_recorded_baseline(tmp_path, fake_runs, capsys):
    assert ex.baseline(QUICK, [], repeat=2, out=str(tmp_path / "b"), parallel=1) == 0
    capsys.readouterr()
    code = ex.experiment(QUICK, [], "learner.lr=1e-3,2e-3", repeat=2, baseline_dir=str(tmp_path / "b"),
                         out=str(tmp_path / "e"), parallel=1)
    assert code == 1                                                        # a run failed, the rest went on
    doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
    labels = [g["label"] for g in doc["groups"]]
    assert labels == ["baseline", "learner.lr=1e-3", "learner.lr=2e-3"]
    assert doc["baseline"]["source"].startswith("recorded in") and doc["target"] == pytest.approx(0.505)
    base, fast, bad = doc["groups"]
    assert fast["verdict"]["outcome"] == "better", fast["verdict"]
    assert {c["name"]: c["ok"] for c in fast["verdict"]["criteria"]} == {
        "time down": True, "fluctuation down": True, "reward no worse": True, "success no worse": True}
    # to 50.5%: the baseline's seed 0 never gets there (50%), its seed 1 at 40 s; both of 1e-3 by 20 s
    assert (base["aggregate"]["reached"], fast["aggregate"]["reached"]) == (1, 2)
    assert fast["aggregate"]["time_to_target_s"]["max"] <= 20 < base["aggregate"]["time_to_target_s"]["mean"]
    assert bad["verdict"]["outcome"] == "failed" and all("learner crashed" in r["error"] for r in bad["runs"])
    out = capsys.readouterr().out
    assert "learner.lr=1e-3: better" in out and "failed (exit 1): learner.lr=2e-3 seed 0" in out
    table = (tmp_path / "e" / "table.md").read_text()
    assert table.count("\n| ") == 3 and "| learner.lr=2e-3 | 0/2 |" in table
    page = (tmp_path / "e" / "report.html").read_text()
    assert page.count('class="band"') >= 4 and "RuntimeError: the learner crashed" in page
    assert (tmp_path / "e" / "curves.svg").read_text().startswith("<svg xmlns=")


def test_experiment_without_a_baseline_takes_the_first_value(tmp_path, fake_runs, capsys):
    assert ex.experiment(QUICK, [], "learner.lr=5e-4,1e-3", repeat=1, out=str(tmp_path / "e"), parallel=2) == 0
    doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
    assert [g["verdict"]["outcome"] for g in doc["groups"]] == ["baseline", "better"]
    assert doc["baseline"] == {"label": "learner.lr=5e-4", "source": "the first value's runs"}
    assert "baseline (learner.lr=5e-4, the first value's runs)" in capsys.readouterr().out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_the_running_runs_and_keeps_what_finished(tmp_path, fake_runs, monkeypatch, sig):
    plan = ex.Plan(QUICK, ex.plan_runs(QUICK, [], [("v=fin", "5e-4", []), ("v=wait", "wait", [])], 1, "e",
                                       tmp_path, 1), parallel=1)
    plan.specs += ex.plan_runs(QUICK, [], [("v=later", "5e-4", [])], 1, "e", tmp_path, 1)
    waiting = plan.specs[1].home
    monkeypatch.setattr(ex, "STOP_WAIT_S", 10.0)   # a run that ignored the SIGINT would be killed, not "clean"
    # started as a script's background job: SIGINT ignored, which its runs would inherit but for the runner
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def interrupt():   # Ctrl-C (or SIGTERM, taken as one), once the second run waits
        while not (waiting / "ready").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), sig)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        outcomes, interrupted = ex.Runner(plan, open(os.devnull, "w")).run()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN                  # the runner put it back
    finally:
        signal.signal(signal.SIGINT, before)
    assert interrupted and [o.code for o in outcomes] == [0, 130, None]
    assert (waiting / "stopped").read_text() == "clean"                      # it stopped itself on SIGINT
    assert ex.run_record(outcomes[0])["ok"] and ex.run_record(outcomes[2])["error"] == "not run (interrupted)"


def test_bad_input_exits_2_before_any_run(tmp_path, fake_runs, capsys):
    from pipeline.cli import main

    assert main(["experiment", QUICK, "--vary", "learner.lr", "--out", str(tmp_path / "e")]) == 2
    assert main(["experiment", QUICK, "--vary", "learner.lr=abc", "--out", str(tmp_path / "e")]) == 2
    assert main(["experiment", QUICK, "--vary", "learner.lr=1e-3", "--baseline", str(tmp_path)]) == 2
    assert fake_runs == []
    assert "no baseline.json" in capsys.readouterr().err


# --- the real thing -----------------------------------------------------------------------------------------

# Samples every 0.5 s: the two training steps last a few seconds, and the fluctuation (an sd over time) needs two
# samples taken while the job trains; at 1 s a run sometimes had one (slot_busy_sd None).
TINY = ["job.steps=2", "job.eval_size=16", "job.eval_every=1", "learner.batch_size=32", "rollout.groups_per_call=4",
        "metrics.interval_s=0.5", "learner.checkpoint_every=2"]


def libra(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_REDIS_URL"}   # every run on its embedded Redis
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def real_baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "baseline"
    proc = libra("baseline", "examples/quickstart.toml", "--repeat", "2", "--out", str(out),
                 *sum((["--set", s] for s in TINY), []))
    return out, proc


@pytest.mark.slow
def test_real_baseline_of_two_seeds(real_baseline):
    out, proc = real_baseline
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "baseline.json").read_text())
    assert [r["seed"] for r in doc["runs"]] == [0, 1] and all(r["ok"] for r in doc["runs"])
    dirs = [Path(r["run_dir"]) for r in doc["runs"]]
    assert len(set(dirs)) == 2 and all((d / "summary.json").exists() for d in dirs)
    for d, seed in zip(dirs, (0, 1)):
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["config"]["job"]["seed"] == seed and manifest["redis"]["embedded"]
        assert manifest["config"]["tracking"] == {**manifest["config"]["tracking"], "group": "baseline",
                                                  "run_name": f"quickstart-baseline-seed{seed}"}
    run = doc["runs"][0]
    assert run["slot_busy"] is not None and 0 < run["slot_busy"] <= 1 and run["slot_busy_sd"] is not None
    assert run["trajectories"] >= 64 and run["curve"][0]["version"] == 0 and run["curve"][-1]["version"] == 2
    assert doc["noisy"] in (True, False) and "noise: final held-out success" in proc.stdout
    assert "started baseline seed 1" in proc.stderr and "finished baseline seed 0" in proc.stderr


@pytest.mark.slow
def test_real_experiment_against_the_baseline(real_baseline, tmp_path):
    base, proc = real_baseline
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = libra("experiment", "examples/quickstart.toml", "--vary", "learner.lr=1e-3", "--repeat", "1",
                 "--baseline", str(base), "--out", str(tmp_path / "e"), *sum((["--set", s] for s in TINY), []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
    base_g, lr = doc["groups"]
    assert base_g["label"] == "baseline" and lr["label"] == "learner.lr=1e-3" and lr["runs"][0]["ok"]
    assert lr["verdict"]["outcome"] in ("better", "not better", "inconclusive")
    assert len(lr["verdict"]["criteria"]) == 4
    manifest = json.loads((Path(lr["runs"][0]["run_dir"]) / "manifest.json").read_text())
    assert manifest["config"]["learner"]["lr"] == 1e-3
    assert manifest["config"]["tracking"]["run_name"] == "quickstart-learner.lr=1e-3-seed0"
    assert "verdict against the baseline" in proc.stdout and "learner.lr=1e-3" in proc.stdout
    for name in ("table.md", "report.html", "curves.svg"):
        assert (tmp_path / "e" / name).stat().st_size > 0


def test_rejudge_recomputes_an_experiment_with_another_target_without_running(tmp_path, fake_runs, capsys):
    assert ex.experiment(QUICK, [], "learner.lr=5e-4,1e-3", repeat=1, out=str(tmp_path / "e"), parallel=2) == 0
    before = json.loads((tmp_path / "e" / "experiment.json").read_text())
    started = len(fake_runs)
    capsys.readouterr()
    assert ex.rejudge(str(tmp_path / "e"), target=0.3) == 0
    assert len(fake_runs) == started                                    # nothing ran
    doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
    assert (doc["target"], doc["target_source"]) == (0.3, "--target") and before["target"] != 0.3
    fast = doc["groups"][1]["runs"][0]
    # the fake's seed-0 curve (1e-3): 0.1, 0.2, 0.3, ... at 5 s a version: 0.3 at version 2, 10 s after its start
    assert fast["time_to_target_s"] == pytest.approx(10.0)
    assert "target 30.0% held-out success (--target)" in (tmp_path / "e" / "table.md").read_text()
    assert "learner.lr=1e-3:" in capsys.readouterr().out
    with pytest.raises(ex.ExperimentError, match="holds no experiment.json"):
        ex.rejudge(str(tmp_path))
    with pytest.raises(ex.ExperimentError, match="--target"):
        ex.rejudge(str(tmp_path / "e"), target=1.5)
