"""Processes that outlive their run (issue 13, item 6).

A ``libra-ctl run`` killed with SIGKILL leaves no process behind, and its
embedded Redis is a single server per run directory, so ``libra-ctl resume``
finishes the job; a controller or agent that dies inside a run is restarted
and the run finishes with its audit ok. The run tests use the tiny policy
with a handful of steps (slow); the embedded-Redis tests are fast.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pipeline.dataplane.redisconn import EmbeddedRedis, connect
from pipeline.observe.audit import audit
from tests.test_sim_workers import wait_for

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["job.eval_size=16", "job.eval_every=0", "learner.batch_size=32",
            "learner.checkpoint_every=1", "rollout.groups_per_call=4", "streams.max_queue_size=96"]


def _gone(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` that still run (a zombie has ended: only its parent has not reaped it yet)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _cmdline(p: psutil.Process) -> str:
    """``p``'s command line as one string; empty once it has ended (a process can end between a listing
    of the live ones and this read: the race CI met in the Ctrl-C test)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def _owner_script(data_dir: Path) -> str:
    return textwrap.dedent(f"""
        import time
        from pipeline.dataplane.redisconn import EmbeddedRedis, connect
        e = EmbeddedRedis({str(data_dir)!r}, appendfsync="always").start()
        connect(e.url).set("kept", "yes")
        print(e.url, flush=True)
        time.sleep(600)
    """)


def test_the_embedded_redis_of_a_directory_is_single_and_dies_with_its_owner(tmp_path):
    data = tmp_path / "redis"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    owner = subprocess.Popen([sys.executable, "-c", _owner_script(data)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        url = owner.stdout.readline().strip()
        server_pid = int((data / "redis.lock").read_text())
        server = psutil.Process(server_pid)
        with pytest.raises(RuntimeError, match=f"pid {server_pid}"):
            EmbeddedRedis(data).start(timeout_s=1.0)   # a second server on the same AOF: refused
        assert connect(url).get("kept") == b"yes"      # and the first one untouched
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        wait_for(lambda: not _gone([server]), 30, "the embedded redis-server to end with its owner")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    with EmbeddedRedis(data) as again:   # the dead server's lock and socket are no obstacle
        assert connect(again.url).get("kept") == b"yes"


def _start_run(tmp_path: Path, job: str, steps: int, preexec_fn=None) -> tuple[subprocess.Popen, Path, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("LIBRA_REDIS_URL",)}
    env["PYTHONPATH"] = str(ROOT)
    runs = tmp_path / "runs"
    cache = Path(os.environ.get("LIBRA_TEST_POLICY_CACHE", str(ROOT / ".cache" / "policies")))
    args = [sys.executable, "-m", "pipeline.cli", "run", "examples/quickstart.toml",
            "--set", f"run.runs_dir={json.dumps(str(runs))}", "--set", f"policy.cache_dir={json.dumps(str(cache))}",
            "--set", f"job.name={job}", "--set", f"job.steps={steps}", *sum((["--set", s] for s in SETTINGS), [])]
    log = open(tmp_path / f"{job}.out", "a")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec_fn)
    run_dir = wait_for(lambda: next(iter(runs.glob("*/redis.url")), None), 600, "the run's Redis").parent
    return proc, run_dir, env


def _trained(run_dir: Path, job: str) -> int:
    try:
        r = connect((run_dir / "redis.url").read_text().strip(), socket_timeout=5)
        return int(r.hget(f"libra:{{{job}}}:counters", "trained") or 0)
    except Exception:   # noqa: BLE001 - not up yet, or going away
        return 0


def _after_first_step(proc: subprocess.Popen, run_dir: Path, job: str) -> list[psutil.Process]:
    """Once the run's learner has trained a step: every process the run started."""
    wait_for(lambda: _trained(run_dir, job) > 0, 900, "a first learner step")
    return psutil.Process(proc.pid).children(recursive=True)


def _audit(run_dir: Path, job: str) -> dict:
    with EmbeddedRedis(run_dir / "redis") as server:
        return audit(connect(server.url), job, str(run_dir))


def _by_name(procs: list[psutil.Process], word: str) -> list[psutil.Process]:
    return [p for p in _gone(procs) if word in _cmdline(p)]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_kill_9_of_a_run_leaves_nothing_behind_and_resume_finishes(tmp_path):
    job, steps = "kill9", 6
    proc, run_dir, env = _start_run(tmp_path, job, steps)
    family: list[psutil.Process] = []
    try:
        family = _after_first_step(proc, run_dir, job)
        labels = {p.pid: _cmdline(p)[:80] for p in family}
        names = " ".join(labels.values())
        assert all(w in names for w in ("redis-server", "controller", "agent", "workers.feeder",
                                        "workers.rollout", "workers.reward", "workers.learner")), names
        agent_log = run_dir / "logs" / "agent.out"
        seen = agent_log.stat().st_size
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        ends = {}

        def _track():
            alive = _gone(family)
            for q in family:
                if q not in alive and q.pid not in ends:
                    ends[q.pid] = (round(time.monotonic() - t0, 1), labels[q.pid])
            return not alive
        try:
            wait_for(_track, 60, "every process of the killed run to end")
            print("\n".join(f"{t:6.1f}s {label}" for t, label in sorted(ends.values())))
        except AssertionError as e:
            left = "\n".join(f"{p.pid} {_cmdline(p)[:200]}" for p in _gone(family))
            raise AssertionError(f"{e}; still running:\n{left}") from None
        print(f"{len(family)} processes of the killed run ended within {time.monotonic() - t0:.1f}s")
        # the agent ends with the run before its workers do (they poll for the run): it drains them and
        # takes their exits for the end of the run, never for crashes to restart
        after = agent_log.read_bytes()[seen:].decode(errors="replace")
        assert "worker_crashed" not in after and "spawned" not in after, after
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _gone(family):   # the killed run's own processes only: never the session's Redis
            p.kill()
    _resume_and_check(run_dir, job, steps, env)


def _resume_and_check(run_dir: Path, job: str, steps: int, env: dict) -> list[int]:
    """``libra-ctl resume RUN_DIR`` finishes every step, nothing trained twice; returns the learner's step records."""
    resumed = subprocess.run([sys.executable, "-m", "pipeline.cli", "resume", str(run_dir)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a = _audit(run_dir, job)
    assert a["ok"], a["problems"]
    assert a["duplicates_trained"] == 0 and a["trained"] >= steps * 32
    # the resumed run went on in the same TensorBoard directory, with a new event file, up to the last step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    assert {e.step for e in ea.Scalars("train/loss")} == set(range(1, steps + 1))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m["step"] for m in map(json.loads, lines) if m.get("kind") == "learner_step"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigterm_of_a_run_stops_it_in_order_and_resume_finishes(tmp_path):
    """SIGTERM (systemd, honcho) is a Ctrl-C: the learner drains, the run exits 130 naming the resume
    command, nothing is left running, and the resume trains the remaining steps and none of the first again."""
    job, steps = "term", 6
    proc, run_dir, env = _start_run(tmp_path, job, steps)
    family: list[psutil.Process] = []
    try:
        family = _after_first_step(proc, run_dir, job)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 130, (tmp_path / f"{job}.out").read_text()
        # stopped in order before the run exited, not orphaned to die later
        assert not _gone(family), "\n".join(_cmdline(p)[:200] for p in _gone(family))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _gone(family):
            p.kill()
    out = (tmp_path / f"{job}.out").read_text()
    assert f"resume with: libra-ctl resume {run_dir}" in out, out
    drained = _audit(run_dir, job)["trained"]
    assert drained > 0, "the drained learner's steps must be checkpointed and acknowledged"
    trained_steps = _resume_and_check(run_dir, job, steps, env)
    # the drain checkpointed the step in hand: the resumed learner replays no step of the first run
    assert trained_steps == list(range(1, steps + 1)), trained_steps


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_killed_controller_and_agent_are_restarted_and_the_run_finishes(tmp_path):
    job, steps = "restart", 40   # enough steps left for the new agent to take over before the end
    proc, run_dir, _env = _start_run(tmp_path, job, steps)
    try:
        wait_for(lambda: _trained(run_dir, job) > 0, 900, "a first learner step")
        family = psutil.Process(proc.pid).children(recursive=True)
        workers = _by_name(family, "--worker-id")
        # rq renames the agent's process title after its worker ("rq:worker:libra-agent-<node>-...")
        targets = [_by_name(family, word) for word in ("pipeline.cli controller", "libra-agent-")]
        assert all(len(t) == 1 for t in targets), "\n".join(_cmdline(p) for p in _gone(family))
        for (p,) in targets:
            p.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=900) == 0, (tmp_path / f"{job}.out").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (tmp_path / f"{job}.out").read_text()
    assert "controller restarted" in out and "agent restarted" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"]["controller"] >= 1 and summary["restarts"]["agent"] >= 1
    # the old agent's workers were adopted, not started a second time, and ended with the run
    agent_log = (run_dir / "logs" / "agent.out").read_text()
    assert "adopted" in agent_log
    assert all(len(re.findall(rf"\bspawned\s+key={job}/{w}\s", agent_log)) == 1
               for w in ("learner-0", "reward-vm-c0", "rollout-vm-1")), agent_log
    wait_for(lambda: not _gone(workers), 60, "the workers to end with the run")
    a = _audit(run_dir, job)
    assert a["ok"], a["problems"]
    assert a["duplicates_trained"] == 0 and a["trained"] >= steps * 32
