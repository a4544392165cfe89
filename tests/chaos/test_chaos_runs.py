"""CI-sized chaos runs: a sim job under many kills and two Redis restarts, the real tiny policy under a few.

Each runs ``libra-ctl chaos`` as a user would, on a Redis server the harness
starts and restarts itself (AOF, appendfsync always), and checks its JSON
summary: every planned kill done (every role hit), the controller and the
agent killed and back at work, Redis restarted, all steps trained, and the
audit ok with nothing lost and nothing trained twice.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.chaos import REAL_KILLS, SIM_KILLS, WORKER_ROLES

ROOT = Path(__file__).resolve().parents[2]

# The quick-start job, shortened: small batches, frequent checkpoints (a killed learner replays little), a
# 2 s controller period (a killed controller's lease lapses in 6 s instead of 30).
REAL_SETTINGS = ["job.steps=30", "job.eval_size=32", "job.eval_every=0", "learner.batch_size=64",
                 "learner.checkpoint_every=2", "rollout.groups_per_call=4", "streams.max_queue_size=192",
                 "control.interval_s=2"]


def chaos(tmp_path: Path, *args: str, timeout_s: float) -> dict:
    out = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "chaos", *args, "--dir", str(tmp_path / "chaos"),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert out.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert done.returncode == (0 if summary["ok"] else 1)
    assert summary["ok"], f"{summary['problems']}\n{done.stdout[-6000:]}"
    return summary


def check(s: dict, kills: dict, redis_restarts: int) -> None:
    assert s["kills_by_role"] == kills and set(kills) == set(WORKER_ROLES) and all(kills.values())
    assert (s["controller_kills"], s["controller_restarts"]) == (1, 1)
    assert (s["agent_kills"], s["agent_restarts"]) == (1, 1)
    assert s["redis_restarts"] == redis_restarts and s["redis_appendfsync"] == "always"
    assert not s["missed"] and len(s["events"]) == s["events_planned"]
    assert s["steps"] == s["steps_planned"]
    assert s["audit_ok"] and s["audit"]["ok"]
    assert s["lost"] == 0 and s["duplicated"] == 0 and s["audit"]["duplicates_trained"] == 0
    assert s["audit"]["trained"] > 0
    assert s["leftover_processes"] == []


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sim_run_survives_twenty_kills_a_controller_an_agent_and_two_redis_restarts(tmp_path):
    s = chaos(tmp_path, "sim", "--seed", "11", timeout_s=1100)
    assert s["worker_kills"] >= 20
    check(s, SIM_KILLS, redis_restarts=2)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_real_tiny_policy_run_survives_kills_of_every_role_and_a_redis_restart(tmp_path):
    args = ["real", "examples/quickstart.toml", *sum((["--set", s] for s in REAL_SETTINGS), []), "--seed", "2"]
    s = chaos(tmp_path, *args, timeout_s=1400)
    check(s, REAL_KILLS, redis_restarts=1)
