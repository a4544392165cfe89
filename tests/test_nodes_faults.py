"""Several nodes on one Redis, as a user scaling out met them: a killed agent's learner started twice, a dead
agent's workers outliving their job, a Redis database index the server lacks, relative paths in a joined run's
manifest. Each docstring says what happened before the fix ("Before")."""

from __future__ import annotations

import json
import time
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from pipeline import cli
from pipeline.control.actions import worker_key
from pipeline.control.allocation import pin
from pipeline.dataplane.keys import AGENTS, LEARNER

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job, wait_for
except ModuleNotFoundError:
    from test_sim_workers import sim_job, wait_for

JOB = "simtest"


def _silence(r, node: str, age_s: float = 60.0) -> None:
    """What the controller sees of an agent killed with ``kill -9`` more than AGENT_DEAD_S ago: its heartbeat is
    old. (Its workers were started with ``start_new_session`` and keep running, as docs/elastic.md says.)"""
    rec = json.loads(r.hget(AGENTS, node))
    rec["heartbeat"] = time.time() - age_s
    r.hset(AGENTS, node, json.dumps(rec))


@pytest.mark.slow
def test_learner_of_a_killed_agent_is_not_started_a_second_time_on_another_node(r, redis_url, tmp_path):
    """kill -9 of the agent whose node runs the learner: its learner-0 keeps running (an orphan of the dead
    agent); no second learner-0 may start while it does. Before: the controller placed learner-0 on another node after 10 s and that agent starts a second
    learner-0 while the first still trains. Seen with `libra-ctl agent`/`controller`/`sim-job` processes: both
    learners committed steps 20-22 and `libra-ctl audit` FAILED (6896 trajectories trained twice, 8192 ids lost).
    The controller's guard (loop.py act(): a moving worker starts once its old process has exited) only looks
    at the live agents' procs/desired hashes, so a dead agent's still-running worker is invisible to it."""
    from pipeline.control.agent import Agent, Slot
    from pipeline.control.loop import Controller

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    key = worker_key(JOB, LEARNER)
    n1 = Agent(r, redis_url, "n1", [Slot(0, None), Slot(1, None)], grace_s=10.0).start()
    agents = [n1]
    try:
        pin(r, JOB, {"learner": 1, "rollout": 1})
        ctl = Controller(r, interval_s=1.0)

        def n1_runs_learner():
            ctl.tick()
            n1.step()
            return key in n1.procs and n1.procs[key].alive()

        wait_for(n1_runs_learner, 30, "learner-0 on n1")
        old = n1.procs[key]
        time.sleep(2.0)                       # up and training

        # n1's agent is killed (no more steps, heartbeat gone); its learner process goes on
        _silence(r, "n1")
        n2 = Agent(r, redis_url, "n2", [Slot(0, None), Slot(1, None)], grace_s=10.0).start()
        agents.append(n2)
        both: list[tuple[int, int]] = []
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            _silence(r, "n1")
            ctl.tick()
            n2.step()
            new = n2.procs.get(key)
            if new is not None and new.alive() and old.alive():
                both.append((old.pid, new.pid))
            time.sleep(0.2)
        assert old.alive(), "the dead agent's learner was expected to run on (it did in the manual run)"
        assert not both, (f"learner-0 ran twice at once, pid {both[0][0]} (dead agent n1's) and {both[0][1]} "
                          f"(started by n2) for {len(both)} samples")
    finally:
        for a in agents:
            a.shutdown(timeout_s=10)


def _with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = dict(parse_qsl(parts.query))
        return url.split("?", 1)[0] + "?" + urlencode({**query, "db": db})
    return urlunsplit(parts._replace(path=f"/{db}"))


@pytest.mark.parametrize("argv", [["status"], ["agent", "--slots", "1", "--node", "review-dbx"],
                                  ["controller", "--once"]])
def test_a_redis_url_naming_a_database_the_server_lacks_fails_clearly(redis_url, argv, capsys):
    """LIBRA_REDIS_URL with a database index the server does not have (a typo, or a Redis Cluster / managed
    Redis that only has db 0): a one-line message. Before: `libra-ctl agent`, `controller` and `status` died
    with a redis-py traceback
    (`redis.exceptions.ResponseError: DB index is out of range`), while a wrong password or an unreachable
    server gets a one-line `libra-ctl: Redis ...` message (pipeline/cli.py main() catches only connection
    and timeout errors)."""
    bad = _with_db(redis_url, 999)
    try:
        rc = cli.main([*argv, "--redis", bad])
    except Exception as exc:   # noqa: BLE001 - the defect: an uncaught redis error reaches the user
        pytest.fail(f"libra-ctl {' '.join(argv)} raised {type(exc).__name__}: {exc}")
    err = capsys.readouterr().err
    assert rc != 0 and "libra-ctl:" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_workers_of_a_dead_agent_do_not_outlive_their_job(r, redis_url, tmp_path):
    """Node agent killed (kill -9) and not brought back: its workers keep running (as documented), and stop once
    their job is over. Before: nothing ever stopped them: after the job's phase went to `done` they were still running minutes later (manual run:
    rollout-n2-1, rollout-n2-2, reward-n2-c0 of job simA, 5 min after `sim-job` exited 0), holding their slots'
    GPUs on a real node. The job-over drain is sent only to live agents (loop.py act()/agent.py drive()); the
    workers themselves do not watch their job's phase (the feeder does, and it exited)."""
    from pipeline.control.actions import ensure
    from pipeline.control.agent import Agent, Slot
    from pipeline.dataplane.keys import JobKeys

    run_dir = sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    n1 = Agent(r, redis_url, "n1", [Slot(0, None)], grace_s=10.0).start()
    key = worker_key(JOB, "rollout-n1-0")
    try:
        ensure(r, "n1", {"job": JOB, "worker": "rollout-n1-0", "role": "rollout", "slots": [0],
                         "run_dir": str(run_dir), "backend": "sim"})

        def runs():
            n1.step()
            return key in n1.procs and n1.procs[key].alive()

        wait_for(runs, 30, "rollout-n1-0 on n1")
        orphan = n1.procs[key]
        _silence(r, "n1")                                   # the agent is gone; its worker is not
        r.hset(JobKeys(JOB).state, "phase", "done")         # the job ends (sim-job / run set this)
        wait_for(lambda: not orphan.alive(), 45, "the dead agent's worker to stop after its job ended")
    finally:
        n1.shutdown(timeout_s=10)


_PREPARE = r"""
import sys
from pipeline import config as C, run as R

class Stop(Exception):
    pass

def stop_here(*_a, **_k):   # the manifest is written; no worker is needed to show what it records
    raise Stop()

R.Orchestrator = stop_here
cfg = C.load("examples/quickstart.toml", [f"redis.url={sys.argv[1]}", f"run.runs_dir={sys.argv[2]}",
                                          "job.name=reviewpaths"])
try:
    R.run_job(cfg, ["run", "examples/quickstart.toml"])
except Stop:
    pass
"""

_WORKER_VIEW = r"""
import sys
from pipeline.dataplane.worker import load_run_config
from workers.envs import env_from_config
from pathlib import Path
cfg = load_run_config(Path(sys.argv[1]))
env = env_from_config(cfg)
print(len(list(env.read_prompts(cfg.job.eval_prompts))), len(list(env.read_prompts(cfg.job.train_prompts))))
"""


@pytest.mark.slow
def test_a_joined_agents_workers_find_the_runs_prompt_files_from_their_own_directory(redis_url, tmp_path):
    """README "Scaling out" / deploy/: agents run from their own directory (the unit's WorkingDirectory,
    `/opt/libra`; here /tmp/nodes), `libra-ctl run examples/quickstart.toml` joins them from the user's checkout.
    Before: the run checked the prompt files against ITS cwd, then recorded them relative (`examples/data/...`) in the
    manifest; every rollout worker the agents start opens `job.eval_prompts` relative to the agent's cwd:
    manual run: `rollout-n3-1 failed 5 times in a row ... FileNotFoundError: 'examples/data/calc_eval.jsonl'`,
    run failed (exit 1). (deploy/README: "Libra records absolute paths (run_dir, the policy directory)".)"""
    import subprocess
    import sys

    try:
        from tests.test_sim_workers import ROOT
    except ModuleNotFoundError:
        from test_sim_workers import ROOT
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-c", _PREPARE, redis_url, str(runs)], cwd=ROOT, capture_output=True, check=False,
                          text=True, timeout=300)
    run_dirs = sorted(runs.glob("*reviewpaths"))
    assert run_dirs and (run_dirs[-1] / "manifest.json").exists(), done.stdout + done.stderr
    elsewhere = tmp_path / "agent-cwd"                 # an agent started from another directory
    elsewhere.mkdir()
    view = subprocess.run([sys.executable, "-c", _WORKER_VIEW, str(run_dirs[-1])], cwd=elsewhere,
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert view.returncode == 0, view.stderr[-1500:]
