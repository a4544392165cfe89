"""The random workload generator and ``libra-ctl bench policy --sweep``.

The generator's draws go through ``parse_workload`` and back through TOML
(``to_toml``); the sweep runs on clusters of 16–20 GPUs so that it stays a
few seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from pipeline.sim import bench_allocator, bench_sweep, workload_gen
from pipeline.sim.workload import load_workload, parse_workload

DRAWS = 300


@pytest.fixture(scope="module")
def draws():
    return [bench_sweep.workload_at(seed, i) for seed in range(3) for i in range(DRAWS // 3)]


def test_every_draw_is_valid_and_writes_back_as_the_same_toml(draws):
    for d in draws:
        wl = parse_workload(d, d["name"])
        assert tomllib.loads(workload_gen.to_toml(d, "a comment\non two lines")) == d
        assert not wl.multi_job and 1 <= len(wl.job.phases) <= workload_gen.MAX_PHASES
        assert workload_gen.GPUS[0] <= wl.cluster.gpus <= workload_gen.GPUS[1]
        assert 0.8 <= wl.learner.scaling_exponent <= 1.0
        assert wl.job.steps * wl.job.batch_size <= workload_gen.MAX_TRAJECTORIES
        assert wl.job.steps >= max(workload_gen.MIN_STEPS, workload_gen.STEPS_PER_PHASE * len(wl.job.phases))
        prev = 0
        for ph in wl.job.phases:      # every phase lasts its minimum
            assert ph.until_step - prev >= workload_gen.STEPS_PER_PHASE
            prev = ph.until_step


def test_draws_cover_both_reward_modes_the_gpu_range_ends_and_each_phase_count(draws):
    wls = [parse_workload(d, d["name"]) for d in draws]
    assert {wl.reward.gpu for wl in wls} == {True, False}
    gpus = [wl.cluster.gpus for wl in wls]
    assert min(gpus) < 24 and max(gpus) > 700        # log-uniform: ~10% of draws at each end
    assert {len(wl.job.phases) for wl in wls} == {1, 2, 3}
    assert any(ph.tool_calls.per_trajectory == 0 for wl in wls for ph in wl.job.phases)
    assert {wl.job.max_staleness for wl in wls} == {1, 2, 4, 8}


def test_a_seed_gives_the_same_workloads_and_another_seed_others():
    assert bench_sweep.workload_at(7, 3) == bench_sweep.workload_at(7, 3)
    assert bench_sweep.workload_at(7, 3) != bench_sweep.workload_at(7, 4)
    assert bench_sweep.workload_at(7, 3) != bench_sweep.workload_at(8, 3)
    a = workload_gen.random_workload(np.random.default_rng(11), "x", (16, 20))
    assert a == workload_gen.random_workload(np.random.default_rng(11), "x", (16, 20))
    assert 16 <= a["cluster"]["gpus"] <= 20


def test_a_bad_gpu_range_names_the_fix():
    with pytest.raises(ValueError, match="3 <= min <= max"):
        workload_gen.random_workload(np.random.default_rng(0), "x", (64, 16))


def _cli(argv) -> int:
    parser = argparse.ArgumentParser()
    bench_allocator.add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


SMALL = ["policy", "--sweep", "3", "--seed", "4", "--sweep-gpus", "16", "20", "--modes", "libra,ideal"]


def test_small_sweep_reports_the_distribution_and_saves_the_minimum(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert _cli(SMALL + ["--json", str(out), "--save-worst", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    assert "libra/ideal" in cap.out and "min " in cap.out and "p10 " in cap.out and "median " in cap.out
    assert "worst 3 by libra/ideal" in cap.out
    assert cap.err.count("bench policy: sweep ") == 3 + 1     # a line per workload, then the total
    data = json.loads(out.read_text())
    ratios = [w["libra/ideal"] for w in data["workloads"]]
    assert data["distribution"]["libra/ideal"]["min"] == min(ratios)
    assert data["distribution"]["libra/ideal"]["median"] == float(np.median(ratios))
    assert all(0 < r <= 1.0 for r in ratios)           # the bound holds
    assert "libra dropped %" in data["distribution"] and "static/ideal" not in data["distribution"]
    # each workload's stale floor, and libra/ideal again over those whose floor is within the drop budget
    floors = [w[bench_sweep.FLOOR_KEY] for w in data["workloads"]]
    assert all(f >= 0 for f in floors) and data["distribution"][bench_sweep.FLOOR_KEY]["max"] == max(floors)
    ok_rows = [w for w in data["workloads"] if w[bench_sweep.FLOOR_KEY] <= 0.5]
    ok = [w["libra/ideal"] for w in ok_rows]
    assert 0 < len(ok) < len(floors), "this sweep has workloads on both sides of the budget"
    assert data["distribution"]["libra/ideal, floor ok"]["n"] == len(ok)
    assert data["distribution"]["libra/ideal, floor ok"]["min"] == min(ok)
    assert f"libra/ideal on the {len(ok)} with a stale floor <= 0.5%" in cap.out
    # the minimum over those is saved beside the minimum, when the floor left some out
    saved_ok = tmp_path / bench_sweep.MIN_OK_FILE
    best_case = min(ok_rows, key=lambda w: w["libra/ideal"])
    assert load_workload(saved_ok).name == best_case["name"] and "stale floor is <= 0.5%" in saved_ok.read_text()
    assert str(saved_ok) in cap.err
    saved = tmp_path / bench_sweep.MIN_FILE
    text = saved.read_text()
    assert "seed 4: workload index" in text and "--sweep-gpus 16 20" in text
    wl = load_workload(saved)
    worst = data["workloads"][data["worst"][0]]
    assert wl.name == worst["name"] and worst["libra/ideal"] == min(ratios)
    assert wl.cluster.gpus == worst["features"]["gpus"]

    # the same seed gives the same figures
    again = tmp_path / "again.json"
    assert _cli(SMALL + ["--json", str(again)]) == 0
    assert json.loads(again.read_text())["distribution"] == data["distribution"]


@pytest.mark.parametrize("argv,msg", [
    (["policy"], "give a workload file, or --sweep N"),
    (["policy", "w.toml", "--sweep", "3"], "give no workload file"),
    (["policy", "--sweep", "0"], "at least one workload"),
    (["policy", "--sweep", "3", "--engine", "live"], "des engine"),
    (["policy", "--sweep", "3", "--modes", "static,ideal"], "needs the modes libra,ideal"),
    (["policy", "--save-worst"], "need --sweep N"),
    (["policy", "--sweep", "3", "--sweep-gpus", "2", "10"], "3 <= min <= max"),
])
def test_sweep_bad_input_exits_2(capsys, argv, msg):
    assert _cli(argv) == 2
    assert msg in capsys.readouterr().err


def test_distribution_gives_libra_over_each_other_mode_and_the_subset_whose_floor_is_within_budget():
    rows = [{"libra/ideal": r, "static/ideal": r / q, "libra dropped %": d, bench_sweep.FLOOR_KEY: f,
             "ratios": {"libra/static": q, "libra/ideal": r}}
            for r, q, d, f in [(0.6, 1.0, 9.0, 20.0), (0.9, 1.1, 0.2, 0.0), (0.95, 1.05, 0.1, 0.5)]]
    dist = bench_sweep._distribution(rows)
    assert dist["libra/static"] == {"min": 1.0, "p10": pytest.approx(1.01), "median": 1.05, "max": 1.1}
    # the 20% floor is out; the 0.5% one is at the budget and counts
    assert dist["libra/ideal, floor ok"] == {"n": 2, "min": 0.9, "p10": pytest.approx(0.905), "median": 0.925,
                                             "max": 0.95}
    assert dist[bench_sweep.FLOOR_KEY]["max"] == 20.0 and dist["libra/ideal"]["min"] == 0.6


@pytest.mark.parametrize("name", [bench_sweep.MIN_FILE, bench_sweep.MIN_OK_FILE])
def test_the_saved_minimums_are_the_workloads_their_headers_name(name):
    # examples/bench keeps the sweep's minimums; the header's seed and index must still make that workload
    text = (Path(__file__).resolve().parents[1] / "examples" / "bench" / name).read_text()
    seed, index = map(int, re.search(r"default_rng\(\[(\d+), (\d+)\]\)", text).groups())
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    made = "\n".join(line for line in workload_gen.to_toml(bench_sweep.workload_at(seed, index)).splitlines()
                     if not line.startswith("#"))
    assert body.strip() == made.strip()
