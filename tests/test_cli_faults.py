"""``libra-ctl run`` / ``resume`` and the operator commands on bad input, a Redis that is down, a resume
beside a live run and Ctrl-C during setup: a message and an exit code, never a traceback or a hang.

Exit codes as the CLI states them: 2 for bad input (an unknown job, a count that is not role=N, zero workers
of a stage, a damaged manifest), 1 for a run or check that failed (a Redis that does not answer, a run that
still runs), 130 for an interrupt. A new run that stops before its manifest is written leaves no directory.

The run tests start ``libra-ctl run`` / ``resume`` as subprocesses with a stand-in policy directory (only
the files ``run.check_policy_dir`` looks for), so they stop long before any worker starts.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import cli, config, manifest
from pipeline.control.allocation import get_allocation
from pipeline.control.loop import Controller
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis

from tests.test_controller import desired_roles, fake_agent
from tests.test_sim_workers import sim_job

ROOT = Path(__file__).resolve().parent.parent
JOB = "simtest"


def _down_url() -> str:
    """A TCP Redis URL nothing listens on (a port just freed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"redis://127.0.0.1:{port}/0"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _stand_in_policy(tmp_path: Path) -> Path:
    pol = tmp_path / "policy"
    pol.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (pol / f).write_text("{}")
    return pol


def _sets(tmp_path: Path, *extra: str) -> list[str]:
    out = []
    for s in (f"run.runs_dir={json.dumps(str(tmp_path / 'runs'))}", *extra):
        out += ["--set", s]
    return out


# --- operator commands against a Redis that is down ------------------------------------------------


@pytest.mark.parametrize("argv", [["status"], ["scale", "rollout=1"], ["drain", "rollout-x-1"], ["events"],
                                  ["audit", "--job", "j"], ["dlq", "list", "--job", "j"]])
def test_operator_commands_on_a_redis_that_is_down_exit_with_a_message_not_a_traceback(argv, capsys):
    """``--redis URL`` of a server that is down: the command says so and exits 1 (a traceback before)."""
    url = _down_url()
    try:
        rc = cli.main([*argv, "--redis", url])
    except SystemExit as exc:     # a clear message through SystemExit would be fine too
        rc = exc.code
    except Exception as exc:  # noqa: BLE001 - what the command let escape is the finding
        pytest.fail(f"libra-ctl {' '.join(argv)} --redis {url}: {type(exc).__name__} escaped: {exc}")
    assert rc not in (0, None)


def test_status_skips_the_stale_socket_of_a_killed_run_and_reads_the_live_one(tmp_path, monkeypatch, capsys):
    """A run whose server was SIGKILLed (``verify-resume --hard``, the OOM killer) leaves its socket file (the
    kernel does not unlink it): ``find_redis_url`` skips a socket nothing answers on and reads the live run's
    server beside it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV_URL, raising=False)
    live_dir, dead_dir = tmp_path / "runs" / "a-live", tmp_path / "runs" / "b-killed"
    for d in (live_dir, dead_dir):
        d.mkdir(parents=True)
    with EmbeddedRedis(tmp_path / "srv") as server:
        (live_dir / "redis.url").write_text(server.url + "\n")
        stale = tmp_path / "dead.sock"             # what a SIGKILLed redis-server leaves
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(stale))
        s.close()
        (dead_dir / "redis.url").write_text(f"unix://{stale}\n")
        os.utime(live_dir / "redis.url", (time.time() - 60, time.time() - 60))   # the killed run is newer
        try:
            rc = cli.main(["status"])
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"libra-ctl status picked the killed run's stale socket {stale}: "
                        f"{type(exc).__name__}: {exc}")
        assert rc == 0


# --- libra-ctl run / resume ------------------------------------------------------------------------


def test_run_with_a_redis_url_that_is_down_fails_with_a_message(tmp_path):
    pol = _stand_in_policy(tmp_path)
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "examples/quickstart.toml",
                        *_sets(tmp_path, f"policy.path={json.dumps(str(pol))}",
                               f"redis.url={json.dumps(_down_url())}")],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 1 and "Redis unreachable" in p.stderr, p.stderr[-3000:]
    assert not list((tmp_path / "runs").glob("*")), "a run directory without a manifest was left behind"


def _run_dir_with_manifest(tmp_path: Path) -> Path:
    pol = _stand_in_policy(tmp_path)
    cfg = config.load(ROOT / "examples" / "quickstart.toml",
                      [f"run.runs_dir={json.dumps(str(tmp_path / 'runs'))}", f"policy.path={json.dumps(str(pol))}",
                       f"job.train_prompts={json.dumps(str(ROOT / 'examples/data/calc_train.jsonl'))}",
                       f"job.eval_prompts={json.dumps(str(ROOT / 'examples/data/calc_eval.jsonl'))}"])
    run_dir = manifest.new_run_dir(cfg)
    manifest.write_manifest(run_dir, cfg, argv=["libra-ctl", "run"], redis_url="unix:///x.sock", embedded=True,
                            policy_dir=str(pol), bad_prompt_lines=[])
    return run_dir


def test_resume_of_a_run_whose_embedded_redis_still_runs_says_so_without_a_traceback(tmp_path):
    """``libra-ctl resume RUN_DIR`` while the run (its embedded server) is still up: the lock refuses a
    second server on the AOF, and the resume says why."""
    run_dir = _run_dir_with_manifest(tmp_path)
    with EmbeddedRedis(run_dir / "redis"):      # the live run's server
        p = subprocess.run([sys.executable, "-m", "pipeline.cli", "resume", str(run_dir)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=240)
    assert "is still running" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 1   # as check_resumable's "still running (pid ...)" does


def test_resume_of_an_embedded_run_uses_its_own_server_whatever_libra_redis_url_names(tmp_path, monkeypatch):
    """A run that kept its state in its embedded server resumes on that server (restarted from the run's
    AOF), not on the Redis ``$LIBRA_REDIS_URL`` names in the resuming shell, which holds none of it."""
    from pipeline.run import _choose_redis

    run_dir = _run_dir_with_manifest(tmp_path)
    cfg = config.load(None, [])
    monkeypatch.setenv("LIBRA_REDIS_URL", "redis://127.0.0.1:6379/9")
    url, embedded = _choose_redis(cfg, run_dir, run_dir)
    assert url is None and embedded is not None and embedded.data_dir == (run_dir / "redis").resolve()


def test_a_resumed_runs_summary_rate_counts_only_what_it_trained(r, redis_url, tmp_path):
    """A resume whose newest checkpoint holds 25,600 trained trajectories, and 640 trained since in 64 s:
    ``summary.json``'s ``trajectories_per_s`` is about 10, not the job's whole count over this process's
    wall (about 410)."""
    from pipeline.run import Orchestrator

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-100").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-100" / "state.json").write_text(json.dumps({"step": 100,
                                                                                 "trained_total": 25_600}))
    cfg = config.load(None, ["job.name=resumed"])
    orch = Orchestrator(cfg, run_dir, r, redis_url, out=io.StringIO())   # not the stderr bound at import
    r.hset(orch.keys.counters, "trained", 25_600 + 640)
    orch.t0 -= 64
    ev = {"success_rate": 0.5, "n": 10, "version": 110}
    assert 9.5 < orch.summary(ev, ev)["trajectories_per_s"] < 10.1


def test_resume_of_a_directory_with_a_damaged_manifest_is_bad_input(tmp_path, capsys):
    """A manifest.json that is not the run's JSON (cut short, edited): exit 2 with a message, as for a
    directory without one."""
    (tmp_path / "manifest.json").write_text('{"run_id": "x", "config": {')
    try:
        rc = cli.main(["resume", str(tmp_path)])
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"libra-ctl resume with a damaged manifest: {type(exc).__name__} escaped: {exc}")
    assert rc == 2


def test_ctrl_c_while_the_policy_is_prepared_stops_cleanly(tmp_path):
    """Ctrl-C (or honcho's SIGTERM, which the run takes as Ctrl-C) while ``prepare_policy`` builds the
    policy: the run says it was interrupted, exits 130, and leaves no run directory without a manifest."""
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "examples/quickstart.toml",
                          *_sets(tmp_path, f"policy.cache_dir={json.dumps(str(tmp_path / 'cache'))}")],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = p.stdout.readline()
        assert "preparing the policy" in first, first
        time.sleep(3)    # an empty cache: the build of the tiny policy takes far longer than this
        p.send_signal(signal.SIGINT)
        out = first + p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "Traceback" not in out and "interrupted before the run started" in out, out[-3000:]
    # 130, or (seen once under a loaded CI, with the message printed) death by SIGINT: $? = 130 either way
    assert p.returncode in (130, -signal.SIGINT), (p.returncode, out[-3000:])
    assert not list((tmp_path / "runs").glob("*")), "a run directory without a manifest was left behind"


# --- libra-ctl scale ---------------------------------------------------------------------------------


def test_scale_refuses_zero_reward_workers(r, redis_url, tmp_path, capsys):
    """Zero workers of any stage is refused, as the config refuses ``reward.workers = 0``: taken, the controller
    drained every reward worker, nothing was scored again, and the run waited for its learner forever."""
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    jobs = fake_agent(r, "n1", 4)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    jobs.run_pending()
    assert "reward" in desired_roles(r, "n1")
    rc = cli.main(["scale", "reward=0", "--job", JOB, "--redis", redis_url])
    ctl.tick()
    jobs.run_pending()
    assert rc == 2, (f"scale reward=0 exited {rc}: pinned {get_allocation(r, JOB)['pinned']}, "
                     f"desired on n1 now {desired_roles(r, 'n1')}")


@pytest.mark.parametrize("count", ["rollout=-1", "actor=2", "rollout"])
def test_scale_bad_counts_are_bad_input_exit_2(r, redis_url, tmp_path, count, capsys):
    """A negative count, an unknown role or a missing ``=N`` is bad input (exit 2), as ``rollout=0`` is."""
    sim_job(r, redis_url, tmp_path)
    assert cli.main(["scale", "rollout=0", "--job", JOB, "--redis", redis_url]) == 2
    try:
        rc = cli.main(["scale", count, "--job", JOB, "--redis", redis_url])
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1    # a message: Python exits 1
    assert rc == 2


def test_the_runs_output_goes_to_stderr_as_it_is_when_written_not_as_it_was_at_import(r, redis_url, tmp_path,
                                                                                        monkeypatch):
    """The run's progress (``Orchestrator``, ``run_job``, ``resume_job``), chaos and verify-resume write by
    default to ``sys.stderr`` as it is when they write: one replaced since import (a harness that closed its
    capture, a redirection) is never written to. Before, the default was bound at import, and an
    Orchestrator made later raised "I/O operation on closed file" (seen under xdist)."""
    from pipeline.run import Orchestrator

    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)   # replaced after pipeline.run was imported
    orch = Orchestrator(config.load(None, ["job.name=outjob"]), tmp_path, r, redis_url)
    print("progress", file=orch.out)
    assert not orch.tty and now.getvalue() == "progress\n"
