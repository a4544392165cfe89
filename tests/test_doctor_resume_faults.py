"""``libra-ctl doctor`` and ``libra-ctl verify-resume`` under faults: a silent Redis, a worker restarted after a
crash, a typo'd job or run directory, a missing matplotlib, an unexpected error while watching the run, a stray
checkpoint name. Doctor diagnoses what is there or says what is not; verify-resume always gives a verdict and
never leaves its run behind.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline import config as config_mod
from pipeline.observe import doctor
from pipeline.observe import resume_checks as rc
from pipeline.observe.doctor import diagnose

ROOT = Path(__file__).resolve().parent.parent

# the healthy window and config of tests/test_doctor.py
from tests.test_doctor import CONFIG, HEALTHY_LOGS, window  # noqa: E402


def _doctor_cli(*args, cwd=ROOT) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


# --- doctor ---------------------------------------------------------------------------------------


def test_doctor_run_dir_is_read_when_its_redis_times_out(tmp_path, monkeypatch, capsys):
    """``doctor --run RUN_DIR`` reads the run directory when the run's Redis is gone, also when its host went
    silent (a vanished node, a hung server) and answers with a timeout rather than a refusal. Before, only a
    refusal was caught: the TimeoutError escaped, and the CLI printed "Redis unreachable" with exit 1, which
    also reads as "findings"."""
    import pipeline.dataplane.redisconn as redisconn

    monkeypatch.setattr(redisconn, "SOCKET_TIMEOUT_S", 0.5)   # the real 15 s, shortened
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)          # the kernel accepts the connection; nothing ever answers
    try:
        run = tmp_path / "run"
        (run / "logs").mkdir(parents=True)
        (run / "manifest.json").write_text(json.dumps({"config": CONFIG}))
        (run / "redis.url").write_text(f"redis://127.0.0.1:{silent.getsockname()[1]}/0\n")
        (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in window(dropped=lambda i: 40)))
        args = argparse.Namespace(job=None, run=str(run), redis=None, window=300.0, sample_s=0.0, json=True)
        code = doctor.cmd_doctor(args)
    finally:
        silent.close()
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == "run directory"
    assert code == 1 and "stale_drops" in [f["code"] for f in doc["findings"]]


def test_a_traceback_of_an_earlier_start_of_the_worker_is_not_a_crash(tmp_path):
    """Every start of a worker marks its ``.out`` (``logs.open_output``; the agent, ``libra-ctl run`` and the
    local pool append a restarted worker's output to the same file), and doctor reads each file from its last
    start. A worker that crashed once and has run since is no crash; one whose latest start ends in a traceback
    still is. Before, any traceback in the last 400 lines made the worker the critical, primary bottleneck."""
    from pipeline.logs import open_output
    from pipeline.observe.doctor import read_logs

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    crash = ["Traceback (most recent call last):",
             '  File "/work/main/workers/rollout.py", line 88, in run',
             "    self.step()",
             "ConnectionResetError: [Errno 104] Connection reset by peer"]
    for lines in (crash, ["INFO: engine started", "INFO: weights reloaded v12", "INFO: generated 64 groups"]):
        with open_output(run / "logs" / "rollout-n-0.out") as f:   # a start, then its output
            f.write("".join(line + "\n" for line in lines).encode())
    d = diagnose(window(), HEALTHY_LOGS + read_logs(run), config=CONFIG)
    assert "worker_crashed" not in d.codes(), [(f.code, f.evidence) for f in d.findings]
    with open_output(run / "logs" / "rollout-n-0.out") as f:         # a third start, which crashed
        f.write("".join(line + "\n" for line in crash).encode())
    d = diagnose(window(), HEALTHY_LOGS + read_logs(run), config=CONFIG)
    assert "worker_crashed" in d.codes()


def test_doctor_on_an_unknown_job_is_not_reported_healthy(r, redis_url):
    """``--job`` with a name the Redis has never seen (a typo) exits 2 naming the jobs it has, as the other
    commands do. Before, doctor read an empty window and printed "no bottleneck found: the pipeline looks
    balanced", exit 0."""
    from tests.test_metrics import fake_job

    fake_job(r)            # job "obs" runs
    code, out = _doctor_cli("--redis", redis_url, "--job", "obz", "--json", "--sample-s", "0")
    assert code == 2 and "no job 'obz' on this Redis" in out, out


def test_doctor_on_a_missing_run_directory_is_not_reported_healthy(tmp_path):
    """``doctor --run PATH`` with a path that holds no run (a typo, or not mounted here) exits 2 saying so.
    Before, it diagnosed an empty window: "job None ... the pipeline looks balanced", exit 0."""
    code, out = _doctor_cli("--run", str(tmp_path / "no-such-run"), cwd=tmp_path)
    assert code == 2 and "is not a run directory" in out, out


# --- verify-resume ------------------------------------------------------------------------------


def _split_and_checks():
    recs = [{"kind": "learner_step", "step": s, "policy_version": s, "reward_mean": 0.2, "reward_std": 0.3,
             "success_rate": 0.2, "groups": 8, "trajectories": 64, "dropped_stale": 0, "at": float(s)}
            for s in range(1, 6)]
    recs += [{**r, "policy_version": r["step"] + 2, "at": 100.0 + r["step"]} for r in
             [{"kind": "learner_step", "step": s, "reward_mean": 0.2, "reward_std": 0.3, "success_rate": 0.2,
               "groups": 8, "trajectories": 64, "dropped_stale": 0} for s in range(5, 11)]]
    split = rc.split_at(recs, 50.0, 4, 10)
    return split, [rc.check_steps(split), rc.check_versions(split, 4)]


def test_verify_resume_verdict_survives_a_missing_matplotlib(tmp_path, monkeypatch):
    """matplotlib is an optional extra (``.[plot]``): without it the verdict is printed and written, and the
    plot line says it was skipped and how to get it. Before, the ImportError ended verify-resume with a
    traceback after the whole run, and the verdict was lost (no line, no JSON)."""
    from pipeline.verify_resume import Kill, report

    monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` raises ImportError
    cfg = config_mod.load(None, ["job.steps=10", "learner.checkpoint_every=2"])
    split, checks = _split_and_checks()
    assert all(c.ok for c in checks)
    out, verdict = io.StringIO(), tmp_path / "verdict.json"
    code = report(cfg, "x.toml", [], tmp_path, Kill("learner", 50.0, 4, 1), checks, split, [], str(verdict), out)
    assert code == 0
    assert "verify-resume: PASS" in out.getvalue() and "plot: skipped, matplotlib is not installed" in out.getvalue()
    assert json.loads(verdict.read_text())["verdict"] == "PASS"


def test_verify_resume_stops_its_run_when_it_fails_unexpectedly(tmp_path, monkeypatch):
    """The run is started in its own session (Ctrl-C never reaches it). Any error while verify-resume watches
    it (an OSError reading metrics.jsonl here) ends the run and becomes a FAIL naming the error. Before, only
    VerifyError and KeyboardInterrupt did: the exception propagated and left the whole run (embedded Redis,
    vLLM, learner) running, orphaned."""
    import pipeline.verify_resume as vr

    started = []

    class FakeRun(vr.Child):
        def __init__(self, args, out):   # the run: a process in its own session that would run for minutes
            self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)
            self.lines = ["run fake: preparing the policy"]
            self.out = out
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
            started.append(self)

    def unreadable(run_dir):
        raise OSError(5, "Input/output error", str(run_dir / "metrics.jsonl"))

    monkeypatch.setattr(vr, "Child", FakeRun)
    monkeypatch.setattr(vr.rc, "learner_steps", unreadable)
    sets = [f"run.runs_dir={json.dumps(str(tmp_path))}", "job.steps=10", "learner.checkpoint_every=2"]
    try:
        out = io.StringIO()
        code = vr.verify_resume(None, sets, timeout_s=30, out=out, err=io.StringIO())
        assert started and started[0].proc.poll() is not None, "the run was left running"
        assert code == 1 and "verify-resume: FAIL" in out.getvalue() and "Input/output error" in out.getvalue()
    finally:
        for c in started:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


# --- resume checks --------------------------------------------------------------------------------


def test_a_stray_checkpoint_name_does_not_crash_the_checks(tmp_path):
    """A ``step-*`` entry whose tail is not a number (``step-000004.old``, a copy kept by hand) is no
    checkpoint to the checks, as it is none to the learner and the audit. Before, sorting by
    ``int(name.split("-")[1])`` raised ValueError in ``wait_for_kill_point`` and in every check."""
    from workers.checkpoint import latest_checkpoint

    for step in (2, 4):
        d = tmp_path / "checkpoints" / f"step-{step:06d}"
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({"step": step, "version": step}))
        (d / "consumed.txt").write_text("")
        (d / "dropped.txt").write_text("")
    old = tmp_path / "checkpoints" / "step-000004.old"
    old.mkdir()
    (old / "state.json").write_text(json.dumps({"step": 4, "version": 4}))
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-000004"    # what the learner restores
    assert rc.latest_complete_step(tmp_path) == 4


def test_with_no_job_running_doctor_picks_the_job_started_last(r):
    """Without --job and with nothing running, doctor diagnoses the job started last, not the one whose name
    sorts last (before, "zeta" of a week ago beat "alpha" of a minute ago)."""
    from pipeline.dataplane.keys import JobKeys
    from tests.test_metrics import fake_job

    for name, age in (("zeta-old", 7 * 86400), ("alpha-new", 60)):
        keys = fake_job(r, name)
        r.hset(keys.state, mapping={"phase": "done", "started_at": time.time() - age})
    assert doctor.jobs_to_diagnose(r, None, None) == ["alpha-new"]
    r.hset(JobKeys("alpha-new").state, "started_at", "not a time")   # a damaged record sorts first, not fails
    assert doctor.jobs_to_diagnose(r, None, None) == ["zeta-old"]


def test_doctor_reads_from_the_latest_start_after_an_output_cut_mid_line(tmp_path):
    """An earlier start killed mid-line (a progress bar ends in ``\\r``, never a newline) is followed by the
    next start's line on a line of its own, and doctor finds it anywhere in a line: the earlier start's
    traceback is not read. Before, the start line was appended to the cut line, not found, and the running
    worker was reported as crashed."""
    from pipeline.logs import open_output
    from pipeline.observe.doctor import read_logs

    logs = tmp_path / "logs"
    logs.mkdir()
    out = logs / "rollout-n-0.out"
    with open_output(out) as f:          # life 1
        f.write(b"Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                b"ValueError: an error of the first life\n\rProcessed prompts:  50%|#####     | 8/16")
    with open_output(out) as f:          # life 2: started after the kill, running fine
        f.write(b"INFO engine loaded\n")
    raw = [x for x in read_logs(tmp_path) if isinstance(x, str)]
    assert not any("an error of the first life" in x for x in raw), raw
