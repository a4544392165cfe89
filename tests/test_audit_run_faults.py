"""`libra-ctl audit --run RUN` finds the run's own Redis in the cases a review of its first version found
refused or lost (`--run .`, a renamed run, $LIBRA_REDIS_URL set, a sim job's run); `doctor --run` reads a run
whose Redis now refuses us; `scale --wait` waits for the counts it announced.

Real Redis servers (the suite's, one with a password, or an embedded one started on a run directory) and real
`libra-ctl` processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline import config as config_mod
from pipeline.dataplane.keys import JOBS, JobKeys
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect

ROOT = Path(__file__).resolve().parent.parent


def _manifest() -> str:
    return json.dumps({"config": config_mod.load(str(ROOT / "examples/quickstart.toml"), []).to_dict()})


def _audit(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "audit", *argv], cwd=cwd,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)


def test_audit_run_dot_from_inside_the_run_directory_is_not_refused(r, redis_url, tmp_path):
    """`cd runs/RUN && libra-ctl audit --job J --run .` on the Redis that holds RUN's job: the new run-name check
    compared Path('.').name (empty) with the recorded name, and refused the job's own run as 'another run'."""
    job = "rv4952dot"
    run = tmp_path / "20261207-101010-rv4952dot"
    run.mkdir()
    (run / "manifest.json").write_text(_manifest())
    r.sadd(JOBS, job)
    r.hset(JobKeys(job).state, mapping={"phase": "done", "run_dir": str(run)})
    env = {**os.environ, ENV_URL: redis_url}
    done = _audit(["--job", job, "--run", ".", "--json"], run, env)
    assert "belongs to run" not in done.stderr, done.stderr
    assert done.stdout.strip().startswith("{"), done.stdout + done.stderr


def _finished_embedded_run(tmp_path: Path, job: str) -> Path:
    """A finished run of `job` whose embedded Redis (RUN/redis, AOF) holds its state, stopped since."""
    run = tmp_path / f"20261207-101012-{job}"
    run.mkdir()
    manifest = json.loads(_manifest())
    server = EmbeddedRedis(run / "redis", maxmemory="64mb").start()
    try:
        c = connect(server.url)
        c.sadd(JOBS, job)
        c.hset(JobKeys(job).state, mapping={"phase": "done", "run_dir": str(run)})
        c.hset(JobKeys(job).policy, mapping={"version": 0, "step": 0})
        (run / "redis.url").write_text(server.url + "\n")
        manifest["redis"] = {"url": server.url, "embedded": True}
        (run / "manifest.json").write_text(json.dumps(manifest))
    finally:
        server.stop()
    return run


def test_audit_of_a_renamed_run_served_from_its_own_embedded_redis(tmp_path):
    """A finished run with the embedded Redis, its directory renamed afterwards. `libra-ctl audit --run NEW`
    (no --redis, as the refusal itself advises) serves the run's own AOF (RUN/redis) - a Redis that can hold
    no other run's job. Before, it was then refused as 'belongs to run OLD', telling the user to leave --redis
    out, which they did: there was no way left to audit the run."""
    job = "rv4952ren"
    old = _finished_embedded_run(tmp_path, job)
    new = tmp_path / f"{old.name}-kept"
    old.rename(new)
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    done = _audit(["--job", job, "--run", str(new), "--json"], tmp_path, env)
    assert "serving its data" in done.stderr, done.stderr
    assert "belongs to run" not in done.stderr, done.stderr


def test_audit_of_a_finished_embedded_run_with_libra_redis_url_set_uses_the_runs_data(redis_url, tmp_path):
    """`libra-ctl audit --job J --run RUN` (no --redis) of a finished run that used the embedded Redis, in a shell
    where $LIBRA_REDIS_URL is exported (a Procfile setup on the same machine). --help says "without --redis, its
    own Redis (a finished run's embedded one is served again from its data)", and `libra-ctl resume RUN` takes the
    run's own AOF "whatever $LIBRA_REDIS_URL names now" (run._choose_redis). Before, the audit took
    $LIBRA_REDIS_URL first and read another Redis, where the job was unknown (exit 2) or another run's."""
    job = "rv4952env"
    run = _finished_embedded_run(tmp_path, job)
    env = {**os.environ, ENV_URL: redis_url}   # the suite's Redis: no job rv4952env there
    done = _audit(["--job", job, "--run", str(run), "--json"], tmp_path, env)
    assert "serving its data" in done.stderr, done.stderr
    assert done.stdout.strip().startswith("{"), done.stdout + done.stderr


def test_doctor_of_a_finished_run_whose_redis_now_refuses_reads_the_run_directory(tmp_path):
    """`libra-ctl doctor --run RUN` of a finished run whose recorded Redis now asks for a password (set since, or
    rotated). An unreachable Redis gives the diagnosis from RUN's files; before, a refusal was re-raised, so the
    run's files - all doctor needs for a finished run - were never read: exit 1, one line."""
    import time

    import redis

    try:
        from tests.test_doctor import CONFIG, window
    except ModuleNotFoundError:
        from test_doctor import CONFIG, window

    try:
        from tests.test_security import free_port
    except ModuleNotFoundError:
        from test_security import free_port

    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--requirepass", "rotated-secret"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                redis.Redis(port=port, password="rotated-secret").ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        run = tmp_path / "run"
        (run / "logs").mkdir(parents=True)
        (run / "manifest.json").write_text(json.dumps({"config": CONFIG}))
        (run / "redis.url").write_text(f"redis://127.0.0.1:{port}/0\n")   # recorded before the password was set
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(s) for s in window(dropped=lambda i: 40)) + "\n")
        (run / "logs" / "learner-0.out").write_text("Traceback...\nRuntimeError: CUDA out of memory.\n")
        env = {k: v for k, v in os.environ.items() if k != ENV_URL}
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", "--run", str(run), "--json"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip().startswith("{"), done.stdout + done.stderr
        assert json.loads(done.stdout)["source"] == "run directory"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_audit_run_of_a_sim_job_finds_its_redis_as_before(r, redis_url, tmp_path):
    """A `libra-ctl sim-job` run directory has no redis.url (prepare_sim_run records the URL only in the
    manifest). `libra-ctl audit --job J --run RUN` without --redis or $LIBRA_REDIS_URL, in a directory whose
    runs/ holds the shared server's redis.url (`libra-ctl redis`, runs/redis): before 4952b30 find_redis_url
    found that server and the audit ran; its first version stopped at "records no Redis (no redis.url)", though
    the manifest names the URL and the usual search finds it."""
    from pipeline.sim.job import prepare_sim_run

    job = "rv4952sim"
    run = prepare_sim_run(r, ROOT / "examples/bench/steady.toml", tmp_path / "runs", job=job, redis_url=redis_url)
    (tmp_path / "runs" / "redis").mkdir(parents=True)
    (tmp_path / "runs" / "redis" / "redis.url").write_text(redis_url + "\n")   # the shared server's
    assert not (run / "redis.url").exists()
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    done = _audit(["--job", job, "--run", str(run), "--json"], tmp_path, env)
    assert "records no Redis" not in done.stderr, done.stderr
    assert done.stdout.strip().startswith("{"), done.stdout + done.stderr


def test_scale_wait_waits_for_the_counts_it_announced(r, redis_url, tmp_path):
    """`libra-ctl scale learner=3 rollout=1 --wait 25` on two agents of 2 slots: scale prints "the controller
    cuts the learner to 2 and gives the rest to rollout", and the controller runs learner=2 rollout=2 within
    seconds. Before, --wait still waited for learner=3 rollout=1, which can never run: exit 1 after 25 s, "not all
    counts running". A script that scales with --wait failed every time the note was printed."""
    try:
        from tests.test_moves_faults import _two_nodes_and_a_sim_job
        from tests.test_sim_workers import stop_all
    except ModuleNotFoundError:
        from test_moves_faults import _two_nodes_and_a_sim_job
        from test_sim_workers import stop_all

    env, procs, job = dict(os.environ, **{ENV_URL: redis_url}), [], "rv4952wait"
    try:
        _two_nodes_and_a_sim_job(r, env, tmp_path, job, procs)
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "scale", "learner=3", "rollout=1", "--job", job,
                              "--wait", "25"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
        assert "cuts the learner to 2 and gives the rest to rollout" in out.stderr, out.stdout + out.stderr
        assert out.returncode == 0 and "running learner=2" in out.stdout and "rollout=2" in out.stdout, \
            out.stdout + out.stderr
    finally:
        stop_all(procs[::-1])
