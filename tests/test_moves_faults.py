"""Moving workers by hand, as README "Real workers move" and docs/elastic.md describe it, under the cases a
review found wrong: a pinned learner wider than one node, a sim job stopped by its supervisor, and an audit
pointed at a run whose Redis is not the one it finds first.

With `libra-ctl agent`, `controller` and `sim-job` processes on the suite's Redis (the bugs are in the shared
controller and commands, so the sim backend shows them as a real one would).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.control.allocation import allocation_status
from pipeline.dataplane.keys import AGENTS, JobKeys
from pipeline.dataplane.redisconn import ENV_URL

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import stop_all, wait_for
except ModuleNotFoundError:
    from test_sim_workers import stop_all, wait_for

ROOT = Path(__file__).resolve().parent.parent


def _cli(argv, env, log):
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _two_nodes_and_a_sim_job(r, env, tmp_path, job, procs):
    """Two agents of 2 CPU slots each, a controller, and a sim job on them that runs until stopped."""
    for node in ("na", "nb"):
        procs.append(_cli(["agent", "--slots", "2", "--node", node, "--grace", "10"], env, tmp_path / f"{node}.out"))
    procs.append(_cli(["controller", "--interval", "1"], env, tmp_path / "controller.out"))
    wait_for(lambda: r.hexists(AGENTS, "na") and r.hexists(AGENTS, "nb"), 30, "the agents")
    sim = _cli(["sim-job", "examples/bench/steady.toml", "--job", job, "--time-scale", "20", "--steps", "100000",
                "--runs-dir", str(tmp_path / "runs"), "--control", '{"cooldown_s": 600}'], env, tmp_path / "sim.out")
    procs.append(sim)
    wait_for(lambda: r.hget(JobKeys(job).state, "phase") == b"running", 60, "the job to run")
    wait_for(lambda: allocation_status(r, job)["roles"].get("learner"), 60, "a learner")
    return sim


@pytest.mark.timeout(180)
def test_a_pinned_learner_wider_than_a_node_gives_the_rest_to_rollout_as_scale_says(r, redis_url, tmp_path):
    """`libra-ctl scale learner=3 rollout=1` on two nodes of 2 slots prints "the controller cuts the learner to
    2 and gives the rest to rollout". Before, a pinned allocation cut the learner (`fit`) and gave nothing to
    rollout: the target stayed rollout=1 learner=2 and a slot sat free for as long as the pin held (auto
    mode gave it to rollout). Also, with no live agent the note said "cuts the learner to 0"."""
    env, procs, job = dict(os.environ, **{ENV_URL: redis_url}), [], "mvpin"
    try:
        _two_nodes_and_a_sim_job(r, env, tmp_path, job, procs)
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "scale", "learner=3", "rollout=1", "--job", job],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert "cuts the learner to 2 and gives the rest to rollout" in out.stderr, out.stdout + out.stderr
        wait_for(lambda: allocation_status(r, job)["target"] == {"rollout": 2, "reward": 1, "learner": 2}, 20,
              f"the target scale announced (now {allocation_status(r, job)['target']})")
        events = [json.loads(f[b"data"]) for _i, f in r.xrange(JobKeys(job).control_events)]
        pin = [e for e in events if e.get("kind") == "pinned"][-1]
        assert pin["reason"] == "pinned_trimmed" and pin["asked"]["learner"] == 3   # what was asked is kept
    finally:
        stop_all(procs[::-1])


def test_scale_names_no_learner_cut_when_no_agent_offers_a_slot(r, redis_url):
    """With no live agent, the note on the slots covers it; "cuts the learner to 0" was printed beside it."""
    from pipeline.sim.job import prepare_sim_run

    prepare_sim_run(r, ROOT / "examples/bench/steady.toml", "/tmp/libra-test-mv-noagent", job="mvnone",
                    redis_url=redis_url)
    env = dict(os.environ, **{ENV_URL: redis_url})
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "scale", "learner=3", "--job", "mvnone"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "the live agents offer mvnone 0" in out.stderr
    assert "cuts the learner to 0" not in out.stderr


@pytest.mark.timeout(180)
def test_sim_job_stopped_by_sigterm_stops_its_job(r, redis_url, tmp_path):
    """A supervisor (honcho, systemd) stops `libra-ctl sim-job` with SIGTERM. Before, Python's default action
    killed it outright: the job's phase stayed `running` and the agents kept its workers (and their slots)
    for good. Now it ends as Ctrl-C does: exit 130 and the job `stopped`, so its workers go."""
    env, procs, job = dict(os.environ, **{ENV_URL: redis_url}), [], "mvterm"
    try:
        sim = _two_nodes_and_a_sim_job(r, env, tmp_path, job, procs)
        sim.send_signal(signal.SIGTERM)
        assert sim.wait(30) == 130, (tmp_path / "sim.out").read_text()[-2000:]
        assert r.hget(JobKeys(job).state, "phase") == b"stopped"
        wait_for(lambda: not allocation_status(r, job)["roles"] or not any(allocation_status(r, job)["roles"].values()),
              60, "the job's workers to stop")
    finally:
        stop_all(procs[::-1])


def test_audit_refuses_a_redis_whose_job_is_another_runs(r, tmp_path):
    """`libra-ctl audit --job J --run runs/A` without --redis took the newest live run's Redis, which may hold
    another run of the same job name (the quick start's job is always `quickstart`): it audited that run's
    streams and counters against A's checkpoints and reported losses or passed on the wrong data. A Redis
    whose job records another run directory is now refused, naming both."""
    from pipeline import config as config_mod
    from pipeline.observe.audit import audit

    keys = JobKeys("mvaudit")
    manifest = json.dumps({"config": config_mod.load(str(ROOT / "examples/quickstart.toml"), []).to_dict()})
    for name in ("20261207-000001", "20261207-000002"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(manifest)
    r.hset(keys.state, mapping={"phase": "done", "run_dir": str(tmp_path / "20261207-000002")})
    with pytest.raises(SystemExit, match="belongs to run .*20261207-000002, not .*20261207-000001"):
        audit(r, "mvaudit", str(tmp_path / "20261207-000001"))
    # the same run, moved or copied elsewhere, keeps its name and is audited
    moved = tmp_path / "copy" / "20261207-000002"
    moved.mkdir(parents=True)
    (moved / "manifest.json").write_text((tmp_path / "20261207-000002" / "manifest.json").read_text())
    assert "problems" in audit(r, "mvaudit", str(moved))
