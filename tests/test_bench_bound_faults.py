"""The ideal bound at the edges of the workload format, and static-best on a pool of one split.

A learner that scales better than linearly (scaling_exponent in (1, 1.5], which the format allows) makes
stages taking turns on every GPU beat any split: the single-job and pool bounds charge the learner on its
largest share then. Workloads are tiny (8 GPUs or fewer, fixed lengths) so each test runs in about a second.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pipeline.sim import bench_allocator, bench_pool, fluid
from pipeline.sim.sync import simulate_sync
from pipeline.sim.workload import parse_workload

NOISE = 1.02   # a mode may beat a bound by rounding, never by more than this


def _wl(text: str, name: str = "w.toml"):
    return parse_workload(tomllib.loads(text), name)


# --- a superlinear learner (scaling_exponent > 1) -----------------------------------------------------------------
#
# The format allows scaling_exponent up to 1.5. ideal is "the best real-valued split": rollout x and learner y GPUs
# at once. With n**1.5 the learner is most efficient on the whole pool, so time-sharing every GPU (the sync mode:
# generate, then train on all 8) does more than any split: sync 18.0 trajectories/s against ideal 15.4.
SUPERLINEAR = """
name = "superlinear"
[cluster]
gpus = 8
switch_cost_s = 5.0
[rollout]
concurrency = 4
decode_tokens_per_s = 100.0
prefill_tokens_per_s = 100000.0
weight_sync_s = 0.0
[reward]
gpu = false
seconds = 0.0
cpu_workers = 1
[learner]
train_tokens_per_s = 200.0
scaling_exponent = 1.5
weight_publish_s = 0.0
[job]
batch_size = 32
group_size = 4
max_staleness = 2
steps = 10
seed = 1
[[phase]]
until_step = 10
prompt_tokens = 10
response_tokens = { median = 100, p99 = 100 }
"""


def test_ideal_bounds_sync_with_a_superlinear_learner():
    """With scaling_exponent 1.5, ideal is the rate of every GPU taking each stage in turn, which sync's
    waves cannot beat. Before, ideal was the best split (15.4 trajectories/s) and sync made 18.0."""
    wl = _wl(SUPERLINEAR)
    sync = simulate_sync(wl, seed=1)
    ideal = fluid.ideal_rate(wl)
    assert sync.trajectories_per_s <= ideal * NOISE, (
        f"sync {sync.trajectories_per_s:.3f} beats the ideal bound {ideal:.3f} with scaling_exponent 1.5")


# --- the pool's bound with a superlinear learner --------------------------------------------------------------
#
# Two identical jobs of the superlinear workload above (8 slots a rollout GPU) on its 8 GPUs.
# fluid.job_work_gpu_s charges the learner at its one-GPU rate, "more learner GPUs only cost more per trajectory
# (scaling_exponent <= 1)"; the format allows up to 1.5, where they cost less. The work bound (54 s) then exceeds
# what the static partition actually takes (41 s), and ideal = max(work, split) is below static and libra (1.32x).
POOL_SUPERLINEAR = (SUPERLINEAR.split("[job]")[0].replace('name = "superlinear"', 'name = "pool-superlinear"')
                    .replace("concurrency = 4", "concurrency = 8")) + """
[[jobs]]
name = "a"
batch_size = 32
group_size = 4
max_staleness = 2
steps = 10
[[jobs.phase]]
until_step = 10
prompt_tokens = 10
response_tokens = { median = 100, p99 = 100 }
[[jobs]]
name = "b"
batch_size = 32
group_size = 4
max_staleness = 2
steps = 10
[[jobs.phase]]
until_step = 10
prompt_tokens = 10
response_tokens = { median = 100, p99 = 100 }
"""


def test_pool_ideal_bounds_the_static_partition_with_a_superlinear_learner():
    """The pool's work bound charges a superlinear learner on the job's largest share, and the split bound
    (no bound when taking turns beats a split) is left out. Before, the learner was charged at its one-GPU
    rate: a 54 s bound against a static partition that finished in 41 s (1.32 x ideal)."""
    wl = _wl(POOL_SUPERLINEAR)
    out = bench_pool.run_pool_bench(wl, ["static", "ideal"], None, lambda line: None)
    static = out["modes"]["static"]["trajectories_per_s"]
    ideal = out["modes"]["ideal"]
    assert static <= ideal["trajectories_per_s"] * NOISE, (
        f"static {static:.3f} beats the pool's ideal {ideal['trajectories_per_s']:.3f} "
        f"(work bound {ideal['work_bound_s']:.1f} s, split bound {ideal['split_bound_s']:.1f} s)")


# --- static-best on a pool of one split --------------------------------------------------------------------------
#
# gpus = 2 (or 3 with reward.gpu) admits one split only. search_static_best starts at fluid_best_split, finds no
# neighbour, so rate(cur) is never called and `return cur, cache[cur]` raises KeyError unless the static run was
# handed in as `known` (it is only when 'static' is among the modes).
SMALLEST = """
name = "smallest"
[cluster]
gpus = GPUS
switch_cost_s = 5.0
[rollout]
concurrency = 4
decode_tokens_per_s = 100.0
prefill_tokens_per_s = 1000.0
weight_sync_s = 0.5
[reward]
gpu = REWARD_GPU
seconds = 0.01
cpu_workers = 4
[learner]
train_tokens_per_s = 300.0
scaling_exponent = 1.0
weight_publish_s = 1.0
[job]
batch_size = 4
group_size = 4
max_staleness = 1
steps = 1
[[phase]]
until_step = 1
prompt_tokens = 100
response_tokens = { median = 200, p99 = 200 }
tool_calls = { per_trajectory = 1.5, latency_median_s = 0.3, latency_p99_s = 0.3 }
"""


@pytest.mark.parametrize("gpus,reward_gpu,split", [(2, "false", {"rollout": 1, "reward": 0, "learner": 1}),
                                                    (3, "true", {"rollout": 1, "reward": 1, "learner": 1})])
def test_static_best_alone_runs_on_a_pool_of_one_split(tmp_path: Path, gpus, reward_gpu, split):
    """`--modes static-best` without static on a pool that admits one split runs that split. Before, the
    search found no neighbour, never ran the split, and raised KeyError: a traceback."""
    p = tmp_path / "smallest.toml"
    p.write_text(SMALLEST.replace("GPUS", str(gpus)).replace("REWARD_GPU", reward_gpu))
    res = bench_allocator.run_bench(p, "static-best")
    assert res["modes"]["static-best"]["final_allocation"] == split
    assert res["modes"]["static-best"]["trajectories_per_s"] > 0
