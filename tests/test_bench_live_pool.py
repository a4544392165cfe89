"""The live engine of ``bench policy`` on a multi-job workload: every job at once on one control plane.

The workload is ``test_bench_multijob``'s pair (8 GPUs, jobs a and b with
minimums 2 and 3), cut to a few steps so that both modes run in well under a
minute of wall time at 20 simulated seconds per wall second.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.control.allocator import Allocation
from pipeline.dataplane.keys import CONTROLLER_LEASE
from pipeline.observe.audit import audit
from pipeline.sim import bench_allocator, pool
from pipeline.sim.bench_live import LiveBench, LiveEngineError, LiveSettings, control_settings
from pipeline.sim.workload import WorkloadError, load_workload

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_bench_live import _sim_processes
    from tests.test_bench_multijob import POOL
except ModuleNotFoundError:
    from test_bench_live import _sim_processes
    from test_bench_multijob import POOL

STEPS = 6


def write_pair(tmp_path: Path, text: str = POOL, steps: int = STEPS) -> Path:
    p = tmp_path / "pair.toml"
    p.write_text(text.replace("steps = 10", f"steps = {steps}").replace("until_step = 10", f"until_step = {steps}"))
    return p


def test_a_job_of_a_multi_job_workload_is_its_one_job_view(tmp_path):
    path = write_pair(tmp_path)
    b = load_workload(path, "b")
    assert not b.multi_job and b.name == "b" and b.job.min_gpus == 3 and b.cluster.gpus == 8
    assert b == load_workload(path).view("b") == pool.job_views(load_workload(path))["b"]
    with pytest.raises(WorkloadError, match="no job named 'c'; its jobs: a, b"):
        load_workload(path, "c")
    # the job's guarantee, cap and priority reach the controller as its [control] settings
    c = control_settings(b, 20.0)
    assert (c["min_slots"], c["max_slots"], c["priority"]) == (3, 6, 1.0)
    assert (control_settings(load_workload(path, "a"), 20.0)["min_slots"]) == 2


def test_live_settings_of_a_multi_job_workload_are_checked(tmp_path):
    big = write_pair(tmp_path, POOL.replace("gpus = 8", "gpus = 65"))
    with pytest.raises(bench_allocator.BenchInputError, match="up to 64 slots"):
        bench_allocator.run_bench(big, "static,libra", engine="live")
    with pytest.raises(bench_allocator.BenchInputError, match="time-scale"):
        bench_allocator.run_bench(write_pair(tmp_path), "static", engine="live", live=LiveSettings(time_scale=0))


def test_jobs_whose_minimums_the_agent_cannot_hold_are_refused(r, redis_url, tmp_path):
    # minimums 4 + 5 on 8 slots: the des engine refuses this workload first; here the live engine's own check,
    # on the jobs as the controller reads them from their manifests
    path = write_pair(tmp_path, POOL.replace("min_gpus = 2", "min_gpus = 4").replace("min_gpus = 3", "min_gpus = 5"))
    wl = load_workload(path)
    bench = LiveBench(wl, path, LiveSettings(redis_url=redis_url, runs_dir=str(tmp_path)), lambda line: None)
    bench.r, bench.url = r, redis_url
    traces = [bench._prepare(f"bench-static-{name}", view, Allocation(rollout=2, learner=2, reward=0), 1, name)
              for name, view in pool.job_views(wl).items()]
    with pytest.raises(LiveEngineError, match="refused by admission on the agent's 8 slots"):
        bench._admit(traces)
    manifest = json.loads((traces[1].run_dir / "manifest.json").read_text())
    assert manifest["sim"]["job"] == "b" and manifest["control"]["min_slots"] == 5


@pytest.mark.slow
def test_live_engine_runs_every_job_of_a_pool_at_once(r, redis_url, tmp_path):
    path = write_pair(tmp_path)
    wl = load_workload(path)
    mins = {j.name: j.min_gpus for j in wl.jobs}
    lines: list[str] = []
    res = bench_allocator.run_bench(path, "static,libra,ideal", engine="live", report=lines.append,
                                    live=LiveSettings(time_scale=20.0, redis_url=redis_url, runs_dir=str(tmp_path)))
    d = res["details"]
    assert res["engine"] == "live" and res["jobs"] == ["a", "b"]
    assert {m: d[m]["engine"] for m in res["modes"]} == {"static": "live", "libra": "live", "ideal": "des"}
    for mode in ("static", "libra"):
        m = res["modes"][mode]
        for job in ("a", "b"):
            # every job trains every step, and holds its minimum from its first prompt on
            assert [p["step"] for p in d[mode]["timelines"][job]] == list(range(1, STEPS + 1)), (mode, job)
            assert d[mode]["slots"][job][0]["held"] >= mins[job], (mode, job, d[mode]["slots"][job])
            # ... and is never given fewer (what below_min_gpu_s integrates)
            assert all(p["ordered"] >= mins[job] for p in d[mode]["slots"][job]), (mode, job, d[mode]["slots"][job])
            assert m["jobs"][job]["trajectories_per_s"] > 0
            a = audit(r, f"bench-{mode}-{job}", d[mode]["run_dirs"][job])
            assert a["ok"] and a["duplicates_trained"] == 0, a["problems"]
        assert m["makespan_s"] == pytest.approx(max(j["finish_s"] for j in m["jobs"].values()))
        assert 0 < m["jain_fairness"] <= 1 and res["live_vs_des"][mode] > 0
    assert res["modes"]["libra"]["below_min_gpu_s"] == 0.0
    assert all(j["below_min_gpu_s"] == 0.0 for j in res["modes"]["libra"]["jobs"].values())
    # static: each job stays at its static share's split, pinned
    shares = pool.static_shares(wl)
    for job, view in pool.job_views(wl).items():
        split = pool.start_split(view, shares[job])
        assert res["modes"]["static"]["jobs"][job]["final_allocation"] == split.as_dict()
    assert any(line.startswith("libra: bench-libra-a step") for line in lines)
    table = bench_allocator.format_table(res)
    assert "2 jobs on one pool" in table and "live/des: static" in table
    out = bench_allocator.readme_json(res)
    assert set(out) == {"workload", "engine", "live_vs_des", "jobs", "modes", "ratios"}
    assert set(out["modes"]["libra"]) == {"trajectories_per_s", "makespan_s", "gpu_busy_frac", "below_min_gpu_s",
                                          "jain_fairness", "moved_between_jobs", "jobs"}
    json.dumps(out)
    # each job's slots over the pool's clock: a job holds none from its last publish on
    for mode in ("static", "libra"):
        assert d[mode]["shares"][-1]["shares"] == {"a": 0, "b": 0}
    try:
        bench_allocator.plot(res, tmp_path / "pool.png")
        assert (tmp_path / "pool.png").stat().st_size > 0
    except ImportError:
        pass                     # matplotlib is optional
    # the control plane is gone, and no sim worker of any job is left running
    assert r.get(CONTROLLER_LEASE) is None
    assert not _sim_processes(str(tmp_path))
