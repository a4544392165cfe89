"""The one-machine Procfile path (root ``Procfile``, ``honcho start``) as a user runs it: faults a review
found (the docstrings say what happened before).

The honcho test runs the real root Procfile in a copy of the repository (honcho writes ``runs/`` in its
working directory), with the embedded Redis of the ``redis`` line and a tiny quick-start job, on the suite's
policy cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.test_sim_workers import ROOT, sim_job, wait_for

HONCHO = ROOT / ".venv" / "bin" / "honcho"
LIBRA = ROOT / ".venv" / "bin" / "libra-ctl"
POLICY_CACHE = ROOT / ".cache" / "policies"   # the suite's own (examples/quickstart.toml's default)
TINY = ("--set job.steps=2 --set job.eval_size=16 --set learner.batch_size=32 --set rollout.groups_per_call=4 "
        f"--set policy.cache_dir={POLICY_CACHE}")

needs_venv = pytest.mark.skipif(not (HONCHO.exists() and LIBRA.exists()),
                                reason="the Procfile runs .venv/bin/libra-ctl: set up .venv with scripts/setup")


def repo_copy(tmp_path: Path) -> Path:
    """The repository as a user has it (Procfile, examples, .venv), in a directory of its own."""
    dst = tmp_path / "repo"
    shutil.copytree(ROOT, dst, symlinks=True,
                    ignore=shutil.ignore_patterns(".venv", ".git", "runs", ".cache", "__pycache__", ".pytest_cache"))
    (dst / ".venv").symlink_to(ROOT / ".venv")
    return dst


def user_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    env.update(extra)
    return env


def ours(repo: Path) -> set[int]:
    """Live processes whose command line names the copy (every line, worker and Redis of its runs)."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if (str(repo) in cmd or (p.info["cwd"] or "").startswith(str(repo))) and p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found - {os.getpid()}


def honcho(repo: Path, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(HONCHO), "start", "--no-colour", *args], cwd=repo, env=env,
                            stdout=open(repo / "honcho.out", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(proc: subprocess.Popen, repo: Path, timeout_s: float) -> tuple[int | None, str]:
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in ours(repo):   # whatever the run left (the test's own, by pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, (repo / "honcho.out").read_text(errors="replace")


def test_a_pool_worker_whose_job_name_matches_no_running_job_says_which_jobs_run(r, redis_url, tmp_path):
    """LIBRA_JOB (the pools' job) must be job.name of LIBRA_CONFIG. When it is not, the pool lines wait for
    a job that never comes, for the whole run, saying only "waiting for job quickstart to run": the job runs
    on the agents' slots alone and nothing tells the user that the pools sit idle. A running job of another
    name on the same Redis should be named (e.g. "job quickstart does not run here; running: simtest")."""
    from pipeline.dataplane.keys import JobKeys
    from pipeline.dataplane.worker import live_run_dir

    sim_job(r, redis_url, tmp_path, name="simtest")
    assert live_run_dir(r, JobKeys("simtest")) is not None   # a pool line with --job simtest would join it
    proc = subprocess.Popen([str(LIBRA), "worker", "rollout", "--job", "quickstart", "--redis", redis_url],
                            cwd=ROOT, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        time.sleep(10)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    assert "waiting for job quickstart" in out, out
    assert "simtest" in out, f"nothing names the job that does run:\n{out}"


@needs_venv
@pytest.mark.slow
def test_the_resume_command_printed_after_ctrl_c_of_honcho_works_from_the_repo_dir(tmp_path):
    """Ctrl-C of `honcho start` mid-run: the job line prints "interrupted; stopping workers. resume with:
    libra-ctl resume runs/<id>" (README: Ctrl-C ... prints the `libra-ctl resume` command). Run as printed,
    from the same directory, it fails: "run failed: Redis unreachable: Error 2 connecting to
    .../runs/redis/redis.sock. No such file or directory", since the run's state is in the Procfile's Redis
    (runs/redis, recorded as a plain URL in the manifest), which only the `redis` line serves. Nothing says to
    start `libra-ctl redis` first; resume could start that embedded server itself, as it does for a run's own."""
    repo = repo_copy(tmp_path)
    env = user_env(LIBRA_RUN_ARGS=TINY.replace("job.steps=2", "job.steps=500"), LIBRA_AGENT_SLOTS="2")
    proc = honcho(repo, env)
    try:
        wait_for(lambda: re.search(r"step +[1-9]\d*/500", (repo / "honcho.out").read_text(errors="replace")), 200,
                 "the first training step")
        os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C in honcho's terminal: its process group
    finally:
        rc, out = finish(proc, repo, timeout_s=60)
    said = re.search(r"resume with: (libra-ctl resume (runs/\S+))", out)
    assert said, out[-3000:]
    resume = subprocess.Popen([str(LIBRA), "resume", said.group(2)], cwd=repo, env=user_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        got = resume.communicate(timeout=45)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:   # still running after 45 s: it resumed
        os.killpg(resume.pid, signal.SIGINT)
        got = resume.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        for pid in ours(repo):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "Redis unreachable" not in got, got
    # the Procfile's server, served again from its directory, and the run going on from its checkpoint
    assert f"embedded server at unix://{repo}/runs/redis/redis.sock" in got, got
    assert re.search(r"step +[1-9]\d*/500", got), got


def test_a_resume_serves_a_stopped_procfile_redis_from_its_directory(tmp_path):
    """The run directory of a Procfile run records the Procfile's server (`libra-ctl redis`, runs/redis) as its
    Redis, a plain URL: `libra-ctl resume` of it, once that server had stopped with the Procfile, failed
    "Redis unreachable". A server that does not answer, with its AOF in the socket's directory, is now served
    again from there, with the job's state as it was; a live one, or any other URL, is used as it is."""
    from pipeline import config as config_mod
    from pipeline.dataplane.redisconn import EmbeddedRedis, connect
    from pipeline.run import _choose_redis

    data = tmp_path / "runs" / "redis"
    server = EmbeddedRedis(data).start()
    url = server.url
    connect(url).hset("libra:{j}:state", "phase", "running")
    run_dir = tmp_path / "runs" / "20261207-000000-j"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text(json.dumps({"redis": {"url": url, "embedded": False}}))
    cfg = config_mod.load(None, ["job.name=j"])
    try:
        assert _choose_redis(cfg, run_dir, run_dir) == (url, None)            # up: used as it is
    finally:
        server.stop()
    got, embedded = _choose_redis(cfg, run_dir, run_dir)
    assert got is None and embedded is not None and embedded.data_dir == data.resolve()
    with embedded:
        assert connect(embedded.url).hget("libra:{j}:state", "phase") == b"running"   # its state, from the AOF
    (run_dir / "manifest.json").write_text(json.dumps({"redis": {"url": "redis://127.0.0.1:1/0", "embedded": False}}))
    assert _choose_redis(cfg, run_dir, run_dir) == ("redis://127.0.0.1:1/0", None)


def test_resume_serves_a_stopped_procfile_redis_whose_socket_fell_back_to_tmp(tmp_path):
    """A review of this session's fix (a resume serves a stopped Procfile Redis, runs/redis, again from its
    directory): ``EmbeddedRedis`` puts its socket in /tmp (``/tmp/libra-redis-<pid>-<id>.sock``) when the
    data directory's path is long (over ~78 characters for the repo) or holds a space or '=': a checkout in
    "~/My Projects/libra". The run then records that /tmp socket; ``stopped_server_dir`` only knows
    ``<dir>/redis.sock`` with the AOF beside it, so the resume still fails "Redis unreachable" (and a
    restarted Procfile serves on another /tmp name, so starting it first did not help either). The
    directory is now found beside the run (runs/redis), by the socket its redis.conf names."""
    from pipeline import config as config_mod
    from pipeline.dataplane.redisconn import EmbeddedRedis, connect
    from pipeline.run import _choose_redis

    base = tmp_path / "My Projects" / "libra"
    data = base / "runs" / "redis"
    server = EmbeddedRedis(data).start()
    url = server.url
    try:
        connect(url).hset("libra:{j}:state", "phase", "running")
        run_dir = base / "runs" / "20261207-000000-j"
        run_dir.mkdir(parents=True)
        (run_dir / "manifest.json").write_text(json.dumps({"redis": {"url": url, "embedded": False}}))
        cfg = config_mod.load(None, ["job.name=j"])
    finally:
        server.stop()
    got, embedded = _choose_redis(cfg, run_dir, run_dir)
    assert embedded is not None and embedded.data_dir == data.resolve(), (
        f"the stopped Procfile server ({data}, socket {url}) is not served again: the resume uses {got}, "
        f"which nothing serves")
