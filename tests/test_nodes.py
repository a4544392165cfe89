"""Several nodes on one broker: two node agents and a controller; a whole node fails and its work moves.

End to end with ``libra-ctl agent`` (nodes ``n1`` and ``n2``, 3 CPU slots
each), ``libra-ctl controller`` and sim workers (``tests/test_sim_workers.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline import config as config_mod
from pipeline.control import actions
from pipeline.control.allocation import AGENT_DEAD_S, allocation_status, live_agents, pin, read_placement
from pipeline.dataplane.keys import AGENTS, LEARNER, JobKeys, agent_procs
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.observe.audit import audit

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import ROOT, sim_job, stop_all, wait_for
except ModuleNotFoundError:
    from test_sim_workers import ROOT, sim_job, stop_all, wait_for

JOB = "simtest"
SLOTS = 3
RECLAIM_IDLE_S = 5.0     # rollout and reward entries pending this long at a dead consumer are taken over


def _short_reclaim(run_dir: Path) -> None:
    """The workers read their config from the manifest: reclaim within the test, not after minutes."""
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"]["streams"].update(rollout_min_idle_s=RECLAIM_IDLE_S, reward_min_idle_s=RECLAIM_IDLE_S)
    config_mod.validate(config_mod.from_dict(manifest["config"]))
    path.write_text(json.dumps(manifest, indent=2))


def _cli(run_dir: Path, env: dict, name: str, *argv: str) -> subprocess.Popen:
    out = open(run_dir / "logs" / f"{name}.out", "ab")
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_node(agent: subprocess.Popen) -> set[int]:
    """A node failure: SIGKILL the agent and every process under it; returns the worker pids killed.

    The agent is stopped first so it cannot start another worker between the listing and the kill.
    """
    agent.send_signal(signal.SIGSTOP)
    children = _descendants(agent.pid)
    for c in children:
        try:
            c.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    agent.kill()
    agent.wait(timeout=30)
    psutil.wait_procs(children, timeout=30)
    return {c.pid for c in children}


def _workers_by_node(r) -> dict[str, set[str]]:
    """The job's running workers (feeder excluded) per node, as ``libra-ctl status`` shows them."""
    out: dict[str, set[str]] = {}
    for w, rec in allocation_status(r, JOB)["workers"].items():
        if rec["state"] == "running" and rec["role"] != "feeder":
            out.setdefault(rec["node"], set()).add(w)
    return out


def _pending_at(r, node: str) -> int:
    """Entries still pending at the consumers named after ``node`` (its rollout and reward workers)."""
    n = 0
    for _stage, stream, group in JobKeys(JOB).stages:
        for c in r.xinfo_consumers(stream, group):
            if f"-{node}-" in c["name"].decode():
                n += c["pending"]
    return n


@pytest.mark.slow
def test_work_moves_off_a_failed_node_and_nothing_is_lost(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path, time_scale=5.0, control={"mode": "pinned"})
    _short_reclaim(run_dir)
    keys = JobKeys(JOB)
    pin(r, JOB, {"rollout": 4, "learner": 1, "reward": 1})    # 5 slots: more than one node has
    env = dict(os.environ, **{ENV_URL: redis_url})
    agents = {node: _cli(run_dir, env, f"agent-{node}", "agent", "--slots", str(SLOTS), "--node", node,
                         "--grace", "10") for node in ("n1", "n2")}
    procs = list(agents.values())
    seen: list[psutil.Process] = []          # every worker seen under an agent, for the cleanup

    def trained() -> int:
        return int(r.hget(keys.counters, "trained") or 0)

    try:
        wait_for(lambda: {"n1", "n2"} <= set(live_agents(r)), 60, "both agents to register")
        # the feeder runs on the node that survives: the controller never moves it
        actions.ensure(r, "n2", {"job": JOB, "worker": "feeder-0", "role": "feeder", "slots": [],
                                 "run_dir": str(run_dir), "backend": "sim"})
        procs.append(_cli(run_dir, env, "controller", "controller", "--interval", "1"))

        # (1) the controller places workers on both nodes, and they train
        wait_for(lambda: set(_workers_by_node(r)) == {"n1", "n2"}, 60, "running workers on n1 and n2")
        assert {rec["node"] for rec in read_placement(r, JOB).values()} == {"n1", "n2"}
        wait_for(lambda: trained() >= 32, 90, "a learner step on the two nodes")
        by_node = _workers_by_node(r)
        for p in agents.values():
            seen += _descendants(p.pid)

        # (2) node n1 fails: its agent and every worker it started are killed at once
        recorded = {json.loads(v)["pid"] for v in r.hvals(agent_procs("n1"))}
        killed = _kill_node(agents["n1"])
        assert recorded and recorded <= killed, (recorded, killed)
        pending_at_death = _pending_at(r, "n1")

        # (3) the controller finds the agent gone, and places the job on n2 alone
        wait_for(lambda: "n1" not in live_agents(r), AGENT_DEAD_S + 30, "the controller to see n1 gone")
        wait_for(lambda: {rec["node"] for rec in read_placement(r, JOB).values()} == {"n2"}, 60,
                 "a placement on n2 only")
        wait_for(lambda: set(_workers_by_node(r)) == {"n2"}
                 and allocation_status(r, JOB)["roles"] == {"rollout": 2, "learner": 1, "reward": 1}, 90,
                 "the job's workers running on n2 only")
        a = allocation_status(r, JOB)
        assert a["workers"][LEARNER]["node"] == "n2" and not {n["node"]: n["alive"] for n in a["nodes"]}["n1"]
        seen += _descendants(agents["n2"].pid)
        before = trained()
        wait_for(lambda: trained() >= before + 64, 120, "training to go on on n2")
        # what the dead workers held is reclaimed by the live ones (the learner replays its own as learner-0)
        wait_for(lambda: _pending_at(r, "n1") == 0, 60, "the entries pending at n1's workers to be reclaimed")
        print({"before_failure": {n: sorted(w) for n, w in by_node.items()}, "killed": sorted(killed),
               "pending_at_death": pending_at_death, "trained": trained()})

        # (4) the job is done: the controller drains n2, and every trajectory is accounted for once
        r.hset(keys.state, "phase", "done")
        wait_for(lambda: not r.hlen(agent_procs("n2")), 60, "the job's workers on n2 to be drained")
        stop_all(procs[::-1])                             # controller first, then the agents
    finally:
        for p in procs:
            if p.poll() is None:
                seen += _descendants(p.pid)
        stop_all(procs[::-1])
        left = []
        for proc in seen:            # psutil checks the pid was not reused before it signals
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    left.append(proc)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=30)
    a = audit(r, JOB, str(run_dir))
    assert a["ok"], a["problems"]
    assert a["duplicates_trained"] == 0 and a["trained"] >= 96
    assert r.hget(AGENTS, "n2") is None                   # n2's agent left; n1's record is a dead one's


def test_a_learner_moved_to_another_node_starts_there_once_the_old_one_has_exited(r, redis_url, tmp_path):
    """learner-0 names no node: moved from n1 to n2, it must never run on both at once (both would claim its
    pending entries and write its checkpoint directory); the controller orders n2's once n1's has exited."""
    from pipeline.control.actions import worker_key
    from pipeline.control.agent import Agent, Slot
    from pipeline.control.loop import Controller

    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    key = worker_key(JOB, LEARNER)
    n1 = Agent(r, redis_url, "n1", [Slot(0, None), Slot(1, None)], grace_s=10.0).start()
    agents = [n1]
    try:
        ctl = Controller(r, interval_s=1.0)
        ctl.tick()

        def step_all():
            for a in agents:
                a.step()
            return True

        wait_for(lambda: step_all() and key in n1.procs and n1.procs[key].alive(), 30, "the learner on n1")
        old = n1.procs[key]
        time.sleep(2.0)                 # up and reading: a SIGTERM now takes a moment to drain
        n2 = Agent(r, redis_url, "n2", [Slot(0, None), Slot(1, None), Slot(2, None)], grace_s=10.0).start()
        agents.append(n2)
        pin(r, JOB, {"learner": 3})     # n1 has no room for 3 learner slots: learner-0 moves to n2
        both, old_end = [], None

        def moved():
            nonlocal old_end
            ctl.tick()
            step_all()
            new = n2.procs.get(key)
            if new is not None and new.alive() and old.alive():
                both.append((old.pid, new.pid))
            if old_end is None and not old.alive():
                old_end = time.monotonic()
            return new is not None and new.alive()

        wait_for(moved, 60, "learner-0 to start on n2")
        assert not both, f"learner-0 ran on n1 and n2 at once: {both[0]} ({len(both)} samples)"
        assert old_end is not None and n2.procs[key].started_at >= time.time() - (time.monotonic() - old_end) - 0.5
        assert n2.procs[key].slots == [0, 1, 2]
    finally:
        for a in agents:
            a.shutdown(timeout_s=10)
