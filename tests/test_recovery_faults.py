"""Failure paths a user following the recovery docs met: a drained reward worker that kept running, and an audit
that reported purged dead letters as lost.

Each docstring says what happened before the fix ("Before")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline import cli
from pipeline.control.events import read_events
from pipeline.control.loop import Controller
from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_REWARD, JobKeys, agent_desired
from pipeline.dataplane.streams import ClaimPolicy, Reject, ensure_groups, run_stage
from pipeline.observe.audit import audit

try:
    from tests.test_streams import unscored_group
    from tests.test_dataplane import feeder_run
    from tests.test_controller import JOB as SIM_JOB, fake_agent
    from tests.test_sim_workers import sim_job
except ModuleNotFoundError:   # tests/ on sys.path as a directory
    from test_streams import unscored_group
    from test_dataplane import feeder_run
    from test_controller import JOB as SIM_JOB, fake_agent
    from test_sim_workers import sim_job

ROOT = Path(__file__).resolve().parent.parent


def ctl(redis_url, *args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--redis", redis_url],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_audit_stays_ok_after_the_operator_purges_a_dead_letter(r, redis_url, tmp_path):
    """`libra-ctl dlq purge ID --yes` is the documented way to drop dead letters (the DLQ is never trimmed
    otherwise, docs/guarantees.md). After it, `libra-ctl audit` must not report the purged group as lost:
    the operator's decision is not data loss. Before: the purged ids become "issued ids neither trained,
    dropped, dead-lettered nor in flight" and audit exits 1 for the rest of the job's life, exactly as a
    real loss would (seen on a live run: 20 dead letters from a raising reward, one purged -> FAILED)."""
    job = "t"
    keys = JobKeys(job)
    feeder_run(tmp_path, r, redis_url, job=job, extra=("rollout.group_size=2",))
    ensure_groups(r, keys)
    for pid in ("good@0", "bad@0"):
        r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group(pid))})
    r.sadd(keys.issued, "good@0", "bad@0")
    r.hset(keys.counters, mapping={"issued": 4, "issued_prompts": 2})
    rounds = []
    run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
              handle=lambda gs: [Reject("verifier down") if g.prompt_id == "bad@0" else g.with_rewards([1.0, 0.0], 0.0)
                                 for g in gs],
              count=10, block_ms=20, max_bytes=1 << 20, stop=lambda: rounds.append(1) or len(rounds) > 2,
              claims=ClaimPolicy(60_000, 3))
    before = audit(r, job)
    assert before["dead_lettered"] == 2 and before["checks"]["ids"]["ok"], before["problems"]

    [dead] = json.loads(ctl(redis_url, "dlq", "list", "--job", job, "--json").stdout)
    purged = ctl(redis_url, "dlq", "purge", dead["id"], "--job", job, "--yes")
    assert purged.returncode == 0, purged.stderr
    after = audit(r, job)
    assert after["checks"]["ids"]["ok"], after["problems"]
    assert after["issued"] == after["trained"] + after["dropped_stale"] + after["dead_lettered"] + \
        after["in_flight"] + after.get("purged", 0)


def test_drain_of_a_reward_worker_through_the_controller_drains_it(r, redis_url, tmp_path, capsys):
    """`libra-ctl drain reward-...` says "will be drained by the controller"; the drain must reach the agent.
    Before: the controller consumed the request (an event kind=drain, drained=[reward worker]) but sent no
    action: a reward worker on the CPU holds no slot, so `place()` gave the same id straight back and `act()`
    found nothing to change. The worker was never drained (live run: `libra-ctl drain reward-vm-c0` at step 12, the worker ran on until the
    run's end; the event read `"actions": [], "drained": ["reward-vm-c0"]`). A rollout or learner drain on
    the same run did reach its agent."""
    sim_job(r, redis_url, tmp_path, control={"mode": "pinned"})
    jobs = fake_agent(r, "n1", 2)
    ctl_ = Controller(r, interval_s=1.0)
    ctl_.tick()
    jobs.run_pending()
    desired = {k.decode(): json.loads(v) for k, v in r.hgetall(agent_desired("n1")).items()}
    [reward] = [d["worker"] for d in desired.values() if d["role"] == "reward" and d["state"] == "run"]

    assert cli.main(["drain", reward, "--redis", redis_url]) == 0
    assert "will be drained by the controller" in capsys.readouterr().out
    ctl_.tick()
    jobs.run_pending()
    e = read_events(r, SIM_JOB)[-1]
    assert e["drained"] == [reward]
    # the drain must reach the agent: a drain action for the worker (a replacement may follow, as for rollout)
    assert ("drain", reward) in {(a["action"], a["worker"]) for a in e["actions"]}, e
