"""The fault-injection and simulation tools on arguments and inputs they used to get wrong.

``libra-ctl chaos`` sizes that are not positive; the sim reward workers'
share of the workload's scorers and what they count; the des meter's
backlog trend.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _chaos(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.chaos", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# --- chaos: odd arguments -------------------------------------------------------------------------


@pytest.mark.parametrize("span", ["0", "-10"])
def test_chaos_refuses_a_span_that_is_not_positive(span):
    """``--span 0`` (a ZeroDivisionError, even with --dry-run) and ``--span -10`` (a schedule at negative
    times, fired all at once) are usage errors: exit 2 with the reason."""
    done = _chaos("sim", "--seed", "1", "--span", span, "--dry-run")
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    assert done.returncode == 2, (done.returncode, done.stdout[-400:])


@pytest.mark.parametrize("arg", [("--steps", "0"), ("--reward", "0"), ("--time-scale", "0")])
def test_chaos_sim_refuses_bad_sizes_before_starting_a_run(tmp_path, arg):
    """``--steps 0``, ``--reward 0`` and ``--time-scale 0`` are refused before anything starts (they used to
    start Redis and die with a traceback, or, for the time scale, wait out ``--timeout``)."""
    done = _chaos("sim", "--seed", "1", "--span", "5", "--timeout", "3", "--dir", str(tmp_path / "c"), *arg)
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    assert done.returncode == 2, (done.returncode, done.stdout[-400:])


# --- the sim workers' cost model ---------------------------------------------------------------------


def test_sim_reward_processes_together_stand_for_the_workloads_cpu_workers(tmp_path):
    """3 reward processes of a workload with 4 CPU scorers stand for 4 together, as the des engine models
    (each took ceil(4/3) = 2: 6 scorers, and the controller, which sums them, was told 6)."""
    from pipeline.chaos import write_sim_workload
    from pipeline.sim.worker import CostModel
    from pipeline.sim.workload import load_workload

    wl = load_workload(str(write_sim_workload(tmp_path / "w.toml", steps=10, gpus=4, seed=1)))
    assert wl.reward.cpu_workers == 4
    model = CostModel(wl, seed=0)
    processes = 3
    assert model.reward_lanes(processes) * processes == wl.reward.cpu_workers


class _Meter:
    def __init__(self):
        self.items = 0

    def set(self, **_kw):
        pass

    def add(self, items=0, **_kw):
        self.items += items


class _Ctx:
    def __init__(self, cfg):
        self.cfg = cfg
        self.counted = 0

    def count(self, n):
        self.counted += n


def test_sim_reward_does_not_count_rejected_groups_as_scored(tmp_path):
    """A group that arrives scored is dead-lettered, and neither counted nor charged as scored (the real
    reward worker counts only the groups it scores)."""
    import numpy as np

    from pipeline.chaos import write_sim_workload
    from pipeline.dataplane import messages
    from pipeline.dataplane.streams import Reject
    from pipeline.sim.job import sim_config
    from pipeline.sim.worker import Clock, CostModel, SimReward
    from pipeline.sim.workload import load_workload

    wl = load_workload(str(write_sim_workload(tmp_path / "w.toml", steps=10, gpus=4, seed=1)))
    cfg = sim_config(wl, job="j", reward_workers=2)

    def group(pid: str) -> messages.Group:
        trajs = tuple(messages.Trajectory(sample_idx=i, completion=np.zeros(1, np.int32), mask=np.ones(1, np.uint8),
                                          logprobs=np.zeros(1, np.float32), text="", finish="sim", turns=1,
                                          tool_calls=0, tool_latency_s=(), tool_timeouts=0) for i in range(4))
        return messages.Group(prompt_id=pid, prompt="q", answer="a", prompt_tokens=np.zeros(1, np.int32), version=0,
                              worker="w", generated_at=0.0, gen_s=0.0, trajectories=trajs)

    ctx, meter = _Ctx(cfg), _Meter()
    stage = SimReward(ctx, CostModel(wl, 0), Clock(1e6), meter)
    out = stage.score([group("p1"), group("p2").with_rewards([1.0] * 4, 0.0)])
    assert isinstance(out[0], messages.Group) and isinstance(out[1], Reject)
    assert (ctx.counted, meter.items) == (4, 4)


# --- the des engine's meter -----------------------------------------------------------------------


def test_meter_backlog_trend_is_the_change_over_the_time_it_took(tmp_path):
    """The backlog's change per second over the window, from its level as the window began (the live
    observer's figure): 10/s for a backlog growing 10/s, not 200 / 30 s (the first tick's end-of-tick
    level over the whole window; a one-tick window read 0)."""
    from pipeline.chaos import write_sim_workload
    from pipeline.control.allocator import Allocation
    from pipeline.sim.meter import Gauges, Meter
    from pipeline.sim.workload import load_workload

    wl = load_workload(str(write_sim_workload(tmp_path / "w.toml", steps=10, gpus=4, seed=1)))
    meter = Meter(wl, concurrency=8)
    for t in (10.0, 20.0, 30.0):
        meter.close_tick(t, backlog=int(10 * t))      # the backlog grows by 10 trajectories a second
    now = Gauges(allocation=Allocation(3, 1), changed_from=None, since_change_s=100.0, inflight=0, queue=0,
                 learner_gpus=1, learner_idle_since=None, remaining=1000)
    m = meter.metrics(30.0, window=3, now=now)
    assert m.backlog == 300
    assert m.backlog_trend_per_s == pytest.approx(10.0)


def test_a_chaos_run_that_injected_nothing_says_so_beside_its_ok():
    """A chaos run whose every kill and restart count was 0 passed, but survived nothing: its verdict says
    no fault was injected instead of a bare "chaos: ok"."""
    from pipeline.chaos import format_summary

    s = {"kills_by_role": {}, "worker_kills": 0, "controller_kills": 0, "controller_restarts": 0,
         "controller_processes": 1, "agent_kills": 0, "agent_restarts": 0, "agent_processes": 1,
         "redis_restarts": 0, "redis_appendfsync": "always", "worker_exits": {}, "steps": 4, "steps_planned": 4,
         "audit_ok": True, "lost": 0, "duplicated": 0, "wall_s": 10.0, "ok": True, "problems": []}
    assert format_summary(s).endswith("chaos: ok (no fault was injected: every kill and restart count was 0)")
    assert format_summary({**s, "worker_kills": 1, "kills_by_role": {"rollout": 1}}).endswith("chaos: ok")
