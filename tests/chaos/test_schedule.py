"""The chaos schedule: seeded, reproducible, every role hit, spread out; and the command that replays it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.chaos import REAL_KILLS, SIM_KILLS, WORKER_ROLES, Plan, make_schedule, parse_kills, replay_command

ROOT = Path(__file__).resolve().parents[2]
SIM = Plan(kills=SIM_KILLS, controller_kills=1, agent_kills=1, redis_restarts=2, span_s=60.0)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    assert make_schedule(7, SIM) == make_schedule(7, SIM)
    assert make_schedule(7, SIM) != make_schedule(8, SIM)


@pytest.mark.parametrize("seed", range(20))
def test_a_schedule_holds_every_planned_event_in_order_and_spread_out(seed):
    events = make_schedule(seed, SIM)
    targets = [e.target for e in events]
    for role in WORKER_ROLES:
        assert targets.count(role) == SIM_KILLS[role]
    assert sum(SIM_KILLS.values()) >= 20
    assert (targets.count("controller"), targets.count("agent"), targets.count("redis")) == (1, 1, 2)
    times = [e.at_s for e in events]
    slice_s = SIM.span_s / len(events)
    assert times == sorted(times) and 0 < times[0] and times[-1] < SIM.span_s
    assert min(b - a for a, b in zip(times, times[1:])) >= 0.2 * slice_s - 0.1   # rounded to 0.1 s


def test_events_come_within_three_quarters_of_the_steps_at_the_latest():
    # a fast run must not train all its steps before the schedule ends (the events would be missed)
    events = make_schedule(4, Plan(kills=REAL_KILLS, redis_restarts=1, span_s=120.0, steps=30))
    steps = [e.at_step for e in events]
    assert steps == sorted(steps) and steps[0] >= 1 and steps[-1] <= 0.75 * 30
    assert all(e.at_step == 0 for e in make_schedule(4, SIM))   # no steps given: time only


def test_the_real_backend_still_hits_every_role():
    targets = {e.target for e in make_schedule(3, Plan(kills=REAL_KILLS, redis_restarts=1, span_s=60.0))}
    assert targets == {*WORKER_ROLES, "controller", "agent", "redis"}


def test_kill_counts_from_the_command_line():
    assert parse_kills(["learner=0", "rollout=9"], SIM_KILLS) == {**SIM_KILLS, "learner": 0, "rollout": 9}
    with pytest.raises(argparse.ArgumentTypeError, match="ROLE=N"):   # a usage error: exit 2
        parse_kills(["controller=1"], SIM_KILLS)


def test_the_replay_command_names_the_seed_once():
    argv = ["sim", "--seed", "3", "--steps", "90", "--dry-run", "--json", "out.json"]
    assert replay_command(argv, 5) == "scripts/chaos sim --steps 90 --json out.json --seed 5"
    assert replay_command(["real", "x.toml", "--seed=4"], 4) == "scripts/chaos real x.toml --seed 4"


def test_the_command_prints_the_same_schedule_for_the_same_seed():
    def dry(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pipeline.chaos", "sim", *args, "--dry-run"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    first = dry("--seed", "11")
    assert first == dry("--seed", "11")
    assert "chaos schedule (seed 11, 24 events)" in first
    assert "replay with: scripts/chaos sim --seed 11" in first
    for event in make_schedule(11, Plan(**{**SIM.__dict__, "steps": 160})):   # sim's default --steps
        assert event.describe() in first
    unseeded = dry()   # a random seed, printed with the command that replays it
    seed = int(unseeded.split("(seed ")[1].split(",")[0])
    assert f"scripts/chaos sim --seed {seed}" in unseeded
