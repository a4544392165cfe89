"""The reconcile loop with several jobs on one agent's slots (no processes: the agent's rq jobs run in-process).

The allocator's pool logic is tested pure in ``test_allocator_pool``; here the
controller applies it: a job that arrives while another holds every slot is
given its minimum in one tick (the first job's surplus workers are drained, the
new job's placed on the slots they free), a pinned job keeps its slots out of
the pool, and admission refuses a job whose minimum the pool cannot hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pipeline import config as config_mod
from pipeline.control.allocation import get_allocation, pin
from pipeline.control.allocator import AdmissionError
from pipeline.control.events import read_events
from pipeline.control.job import check_admission
from pipeline.control.loop import Controller
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.dataplane.keys import AGENTS, JOBS, JobKeys, agent_desired

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_controller import fake_agent
    from tests.test_sim_workers import ROOT, sim_job
except ModuleNotFoundError:
    from test_controller import fake_agent
    from test_sim_workers import ROOT, sim_job


def running(r, node: str) -> dict[str, dict[str, list]]:
    """job -> role -> the slot lists of its workers the agent is told to run."""
    out: dict[str, dict[str, list]] = {}
    for raw in r.hvals(agent_desired(node)):
        d = json.loads(raw)
        if d["state"] == "run" and d["role"] != "feeder":
            out.setdefault(d["job"], {}).setdefault(d["role"], []).append(d["slots"])
    return out


def slot_total(roles: dict[str, list]) -> int:
    return sum(len(s) for k, v in roles.items() if k != "reward" for s in v)


def test_a_job_arriving_while_another_holds_every_slot_gets_its_minimum_in_one_tick(r, redis_url, tmp_path):
    sim_job(r, redis_url, tmp_path, name="first")
    agent = fake_agent(r, "n1", 6)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    agent.run_pending()
    assert slot_total(running(r, "n1")["first"]) == 6          # alone, the first job takes the pool
    sim_job(r, redis_url, tmp_path, name="second", control={"min_slots": 3})
    ctl.tick()
    agent.run_pending()
    now = running(r, "n1")
    assert slot_total(now["second"]) == 3 and slot_total(now["first"]) == 3
    used = [s for roles in now.values() for k, v in roles.items() if k != "reward" for ss in v for s in ss]
    assert len(used) == len(set(used)) == 6                  # no slot given twice
    decision = [e for e in read_events(r, "second") if e["kind"] == "decision"][-1]
    assert decision["pool"]["share"] == 3 and "guarantee" in decision["pool"]["reason"]
    shrink = [e for e in read_events(r, "first") if e["kind"] == "decision"][-1]
    assert shrink["reason"] == "share_shrunk" and any(a["action"] == "drain" for a in shrink["actions"])


def test_a_pinned_job_keeps_its_slots_out_of_the_pool(r, redis_url, tmp_path):
    sim_job(r, redis_url, tmp_path, name="pinned", control={"mode": "pinned"})
    agent = fake_agent(r, "n1", 6)
    ctl = Controller(r, interval_s=1.0)
    ctl.tick()
    pin(r, "pinned", {"rollout": 3, "learner": 1})
    ctl.tick()
    sim_job(r, redis_url, tmp_path, name="auto")
    ctl.tick()
    agent.run_pending()
    now = running(r, "n1")
    assert slot_total(now["pinned"]) == 4 and slot_total(now["auto"]) == 2
    assert get_allocation(r, "pinned")["target"]["rollout"] == 3


def test_admission_refuses_a_minimum_the_pool_cannot_hold(r, redis_url, tmp_path):
    sim_job(r, redis_url, tmp_path, name="running", control={"min_slots": 4})
    fake_agent(r, "n1", 6)
    ok = config_mod.load(None, ["job.name=fits", "control.min_slots=2"])
    check_admission(r, ok, own_slots=0)
    big = config_mod.load(None, ["job.name=big", "control.min_slots=3"])
    with pytest.raises(AdmissionError, match=r"running=4, big=3\) add up to 7 slots; the pool has 6"):
        check_admission(r, big, own_slots=0)
    # the same job again (a restart of its run) is not counted twice
    again = config_mod.load(None, ["job.name=running", "control.min_slots=4"])
    check_admission(r, again, own_slots=0)


def test_libra_ctl_run_refuses_a_job_the_pool_cannot_hold(r, redis_url, tmp_path):
    sim_job(r, redis_url, tmp_path, name="running", control={"min_slots": 5})
    fake_agent(r, "n1", 6)
    # the agent's heartbeat must stay fresh while the run starts, however slow this machine is
    r.hset(AGENTS, "n1", json.dumps({**json.loads(r.hget(AGENTS, "n1")), "heartbeat": time.time() + 3600}))
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "examples/quickstart.toml",
                          "--set", f"run.runs_dir={json.dumps(str(tmp_path / 'runs'))}",
                          "--set", "job.name=late", "--set", "control.min_slots=2"],
                         cwd=ROOT, env={**os.environ, ENV_URL: redis_url}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "job 'late' refused" in out.stderr and "running=5, late=2" in out.stderr
    assert "preparing the policy" not in out.stderr      # refused before a minute of warm start
    assert b"late" not in r.smembers(JOBS) and not r.exists(JobKeys("late").state)
