"""The statistics, the verdict and the page of ``libra-ctl baseline`` / ``experiment``
(``pipeline.observe.compare``, ``compare_report``): pure functions on plain data."""

from __future__ import annotations

import statistics
import xml.etree.ElementTree as ET

import pytest

from pipeline.observe import compare
from pipeline.observe.compare_report import curves_svg, render

T0 = 1_000_000.0


# --- spread and noise -----------------------------------------------------------------------------------


def test_spread_over_seeds_ignores_missing_values():
    s = compare.spread([0.2, None, 0.4, 0.3])
    assert s["mean"] == pytest.approx(0.3) and s["sd"] == pytest.approx(0.1)
    assert (s["min"], s["max"], s["n"]) == (0.2, 0.4, 3)
    one = compare.spread([0.5])
    assert one["mean"] == 0.5 and one["sd"] is None and one["n"] == 1
    assert compare.spread([None])["mean"] is None


def test_noise_is_sd_from_three_seeds_and_half_range_with_two():
    assert compare.noise([0.30, 0.40, 0.35]) == pytest.approx(statistics.stdev([0.30, 0.40, 0.35]))
    assert compare.noise([0.30, 0.42]) == pytest.approx(0.06)
    assert compare.noise([0.3]) is None


def test_an_environment_is_noisy_when_seeds_disagree_by_more_than_the_effect():
    assert compare.is_noisy([0.30, 0.42], effect=0.05) is True      # half range 0.06
    assert compare.is_noisy([0.30, 0.36], effect=0.05) is False     # 0.03
    assert compare.is_noisy([0.30, 0.36], effect=0.02) is True
    assert compare.is_noisy([0.30], effect=0.05) is None            # one seed cannot tell


# --- curves and the target ------------------------------------------------------------------------------


def step(n: int, at: float, reward: float = 0.5, **kw) -> dict:
    return {"kind": "learner_step", "step": n, "policy_version": n, "at": T0 + at, "reward_mean": reward,
            "trajectories": 32, "trained_total": 32 * n, "dropped_stale_total": n, "wait_s": 1.0, "train_s": 3.0,
            **kw}


def test_eval_curve_places_each_version_where_the_learner_produced_it():
    steps = [step(1, 10), step(2, 20), step(3, 30)]
    evals = [{"tag": "start", "version": 0, "success_rate": 0.1}, {"tag": "periodic", "version": 2, "success_rate": 0.3},
             {"tag": "final", "version": 3, "success_rate": 0.5}, {"tag": "periodic", "version": 3, "success_rate": 0.9},
             {"tag": "periodic", "version": 7, "success_rate": 0.9}]   # no step made v7: left out
    curve = compare.eval_curve(evals, steps, T0)
    assert curve == [{"version": 0, "success": 0.1, "t_s": 0.0, "trajectories": 0},
                     {"version": 2, "success": 0.3, "t_s": 20.0, "trajectories": 66},
                     {"version": 3, "success": 0.5, "t_s": 30.0, "trajectories": 99}]


def test_time_to_target_interpolates_along_the_curve():
    curve = [{"success": 0.1, "t_s": 0.0, "trajectories": 0}, {"success": 0.3, "t_s": 20.0, "trajectories": 64},
             {"success": 0.5, "t_s": 30.0, "trajectories": 96}]
    assert compare.time_to_target(curve, 0.4) == pytest.approx(25.0)
    assert compare.time_to_target(curve, 0.4, "trajectories") == pytest.approx(80.0)
    assert compare.time_to_target(curve, 0.3) == pytest.approx(20.0)
    assert compare.time_to_target(curve, 0.05) == 0.0            # already there at the start
    assert compare.time_to_target(curve, 0.6) is None            # never
    # the first crossing counts, not a later one after a dip
    dip = curve + [{"success": 0.2, "t_s": 40.0, "trajectories": 128}, {"success": 0.45, "t_s": 50.0, "trajectories": 160}]
    assert compare.time_to_target(dip, 0.4) == pytest.approx(25.0)


def sample(at: float, frac: float | None, slot_s: float = 10.0, phase: str = "running", lq: int = 2,
           rq: int = 0, gpus=()) -> dict:
    busy = {} if frac is None else {"frac": frac, "busy_s": frac * slot_s, "slot_s": slot_s}
    return {"kind": "sample", "at": T0 + at, "phase": phase,
            "resources": {"slot_busy": busy, "gpus": [{"index": i, "util_percent": u} for i, u in enumerate(gpus)]},
            "queues": {"learner_queue": lq, "reward_queue": rq, "learner_wait_ratio": 0.5}}


def test_run_figures_of_the_four_kinds():
    summary = {"started_at": T0, "success_rate_start": 0.1, "success_rate_end": 0.5, "trajectories_trained": 192,
               "dropped_stale": 6, "wall_s": 70.0, "trajectories_per_s": 2.74, "steps": 6,
               "evals": [{"version": 0, "success_rate": 0.1}, {"version": 6, "success_rate": 0.5}]}
    steps = [step(i, 10 * i, reward=0.1 * i, trajectories=32 if i != 6 else 64) for i in range(1, 7)]
    steps[3]["diversity_distinct_rate"] = 0.8
    samples = [sample(10, 0.2, 10, lq=1, rq=3, gpus=(50, 70)), sample(20, 0.6, 30, lq=3, rq=1, gpus=(90, 90)),
               sample(25, 0.5, 10, phase="trained", lq=9),            # closes training: its busy time counts
               sample(30, 0.0, 10, phase="trained", lq=9)]            # after training: not counted
    f = compare.run_figures(summary, steps, samples)
    assert f["trajectories_per_s"] == 2.74
    assert f["slot_busy"] == pytest.approx((2 + 18 + 5) / 50)         # slot-seconds busy over held
    assert f["slot_busy_sd"] == pytest.approx(statistics.pstdev([0.2, 0.6]))
    assert f["gpu_util"] == pytest.approx(75.0) and f["gpu_util_sd"] == pytest.approx(15.0)
    assert f["learner_queue"] == pytest.approx(2.0) and f["reward_queue"] == pytest.approx(2.0)
    assert f["learner_wait"] == pytest.approx(0.25)                    # 6 s waiting of 24
    # last FINAL_STEPS steps (2..6), weighted by trajectories: step 6 counts twice
    assert f["reward_final"] == pytest.approx((0.2 + 0.3 + 0.4 + 0.5 + 2 * 0.6) / 6)
    assert f["diversity"] == 0.8 and f["success_final"] == 0.5 and f["trajectories"] == 198
    assert f["curve"][-1] == {"version": 6, "success": 0.5, "t_s": 60.0, "trajectories": 198}
    assert [p["reward"] for p in f["reward_curve"]] == pytest.approx([0.1 * i for i in range(1, 7)])


def test_a_short_runs_work_reported_as_training_ends_is_counted():
    # a 2-step run on a loaded machine: its one rollout call and both learner steps ended with the training,
    # so every running sample saw 0 busy and the sample that closed the phase all of it (measured: 0.0 -> 0.03)
    samples = [sample(t, 0.0, 1.0) for t in range(1, 11)] + [sample(11, 0.74, 1.0, phase="trained"),
                                                             sample(12, 0.5, 1.0, phase="trained")]
    f = compare.run_figures({"started_at": T0}, [], samples)
    assert f["slot_busy"] == pytest.approx(0.74 / 11)
    assert compare.training_window(samples) == samples[:11]
    assert compare.training_window(samples[11:]) == samples[11:]      # no running sample: all of them


def test_run_figures_without_samples_are_none_not_zero():
    f = compare.run_figures({"success_rate_end": 0.3}, [], [])
    assert f["slot_busy"] is None and f["slot_busy_sd"] is None and f["learner_queue"] is None
    assert f["reward_final"] is None and f["curve"] == []


def test_mean_curve_over_seeds_with_a_band():
    a = [{"version": 0, "t_s": 0, "success": 0.1}, {"version": 5, "t_s": 50, "success": 0.3}]
    b = [{"version": 0, "t_s": 0, "success": 0.3}, {"version": 5, "t_s": 70, "success": 0.5},
         {"version": 9, "t_s": 90, "success": 0.6}]
    pts = compare.mean_curve([a, b], "version", "t_s", "success")
    assert [p["x"] for p in pts] == [0, 60, 90]
    assert pts[1]["y"] == pytest.approx(0.4) and pts[1]["n"] == 2
    sd = statistics.stdev([0.3, 0.5])
    assert (pts[1]["lo"], pts[1]["hi"]) == (pytest.approx(0.4 - sd), pytest.approx(0.4 + sd))
    assert pts[2]["lo"] is None and pts[2]["n"] == 1                # one seed: no band


# --- the verdict ----------------------------------------------------------------------------------------


def runs(times, fluct, rewards, success) -> list[dict]:
    return [{"ok": True, "time_to_target_s": t, "trajectories_to_target": None if t is None else 10 * t,
             "slot_busy_sd": f, "reward_final": r, "success_final": s}
            for t, f, r, s in zip(times, fluct, rewards, success)]


BASE = compare.aggregate(runs([100, 120, 110], [0.10, 0.12, 0.11], [0.50, 0.52, 0.48], [0.40, 0.44, 0.42]))


def by_name(v: dict) -> dict:
    return {c["name"]: c["ok"] for c in v["criteria"]}


def test_faster_steadier_and_no_worse_is_better():
    cand = compare.aggregate(runs([80, 90, 85], [0.05, 0.06, 0.05], [0.49, 0.51, 0.50], [0.41, 0.43, 0.42]))
    v = compare.verdict(BASE, cand)
    assert v["outcome"] == "better", v
    assert all(by_name(v).values())


def test_reward_bought_with_throughput_is_not_better():
    # baseline reward sd 0.02 over 3 seeds: tolerance max(2 * 0.02 / sqrt(3), 0.01) = 0.023
    cand = compare.aggregate(runs([60, 65, 70], [0.05, 0.05, 0.05], [0.46, 0.47, 0.46], [0.41, 0.43, 0.42]))
    v = compare.verdict(BASE, cand)
    assert v["outcome"] == "not better" and by_name(v)["reward no worse"] is False
    assert by_name(v)["time down"] is True and "not reward no worse" in v["summary"]
    within = compare.aggregate(runs([60, 65, 70], [0.05, 0.05, 0.05], [0.49, 0.48, 0.49], [0.41, 0.43, 0.42]))
    assert by_name(compare.verdict(BASE, within))["reward no worse"] is True   # -0.013 > -0.023


def test_the_no_worse_tolerance_is_the_floor_without_a_baseline_sd():
    one = compare.aggregate(runs([100], [0.1], [0.50], [0.40]))
    cand = compare.aggregate(runs([90], [0.05], [0.485], [0.40]))
    crit = compare.no_worse(one, cand, "reward_final", "reward no worse")
    assert crit.ok is False and "tolerance 0.010" in crit.detail
    assert compare.no_worse(one, compare.aggregate(runs([90], [0.05], [0.495], [0.40])), "reward_final", "r").ok


def test_time_is_not_down_when_fewer_runs_reach_the_target():
    cand = compare.aggregate(runs([50, None, 55], [0.05] * 3, [0.5] * 3, [0.42] * 3))
    v = compare.verdict(BASE, cand)
    assert by_name(v)["time down"] is False
    never = compare.aggregate(runs([None] * 3, [0.05] * 3, [0.5] * 3, [0.42] * 3))
    neither = compare.verdict(never, never)
    assert by_name(neither)["time down"] is None and neither["outcome"] in ("inconclusive", "not better")


def test_reaching_the_target_in_more_runs_counts_the_misses_at_their_wall_time():
    """Baseline 2 of 3 runs (48 s, 82 s, one never within its 107 s), candidate 3 of 3 (40, 88, 89 s): comparing
    only the runs that reached it says 72 s vs 65 s, slower; with the miss counted as at least 107 s the baseline
    took at least 79 s on average, and the candidate's 72 s is down."""
    def timed(times, walls):
        return [{**r, "time_to_target_bound_s": t if t is not None else w, "wall_s": w}
                for r, t, w in zip(runs(times, [0.1] * 3, [0.5] * 3, [0.45] * 3), times, walls)]
    base = compare.aggregate(timed([48, 82, None], [111, 119, 107]))
    cand = compare.aggregate(timed([40, 88, 89], [102, 116, 126]))
    crit = compare.time_down(base, cand)
    assert crit.ok is True and "at least 79 s" in crit.detail
    slow = compare.aggregate(timed([40, 100, 110], [102, 116, 126]))   # 83 s: not below the baseline's bound
    assert compare.time_down(base, slow).ok is None
    bound = compare.with_target({"curve": [{"success": 0.1, "t_s": 0, "trajectories": 0}], "wall_s": 99.0}, 0.5)
    assert bound["time_to_target_s"] is None and bound["time_to_target_bound_s"] == 99.0


def test_unknown_fluctuation_makes_it_inconclusive_not_better():
    cand = compare.aggregate(runs([80, 90, 85], [None] * 3, [0.5] * 3, [0.42] * 3))
    v = compare.verdict(BASE, cand)
    assert v["outcome"] == "inconclusive" and by_name(v)["fluctuation down"] is None


def test_a_value_whose_runs_all_failed_is_failed():
    cand = compare.aggregate([{"ok": False}, {"ok": False}])
    assert compare.verdict(BASE, cand)["outcome"] == "failed"


# --- tables ---------------------------------------------------------------------------------------------


def group(label: str, agg: dict, outcome: str) -> dict:
    return {"label": label, "aggregate": agg, "verdict": {"outcome": outcome, "criteria": [], "summary": outcome}}


def test_comparison_table_rows_and_markdown():
    part = compare.aggregate(runs([50, None], [0.05] * 2, [0.5] * 2, [0.4] * 2) + [{"ok": False}])
    never = compare.aggregate(runs([None], [0.05], [0.5], [0.4]))
    header, rows = compare.comparison_table([group("lr=1", BASE, "baseline"), group("lr=2|x", part, "not better"),
                                             group("lr=3", never, "inconclusive")], 0.42)
    assert header[:4] == ["value", "runs ok", "time to 42.0% (s)", "trajectories to 42.0%"]
    assert header[-1] == "verdict" and all(len(r) == len(header) for r in rows)
    assert rows[0][1] == "3/3" and rows[0][2] == "110 ± 10"
    assert rows[1][1] == "2/3" and rows[1][2] == "50 (1/2)"
    assert rows[2][2] == "never" and rows[2][-1] == "inconclusive"
    md = compare.render_markdown(header, rows)
    lines = md.splitlines()
    assert lines[1] == "|" + "---|" * len(header) and len(lines) == 2 + len(rows)
    assert "lr=2\\|x" in md                                          # a pipe in a cell is escaped
    text = compare.render_text(header, rows).splitlines()
    assert text[0].index("runs ok") == text[2].index("3/3")          # columns aligned


def test_spread_table_lists_only_recorded_figures():
    agg = compare.aggregate([{"ok": True, "success_final": 0.4, "trajectories_per_s": 3.0, "gpu_util": None},
                             {"ok": True, "success_final": 0.5, "trajectories_per_s": 5.0, "gpu_util": None}])
    header, rows = compare.spread_table(agg)
    figures = {r[1]: r for r in rows}
    assert header == ["kind", "figure", "mean", "sd", "min", "max", "seeds"]
    assert figures["trajectories/s trained"][2:] == ["4.00", "1.41", "3.00", "5.00", "2"]
    assert "GPU utilisation (%)" not in figures and figures["final held-out success"][0] == "quality"


# --- the page and the SVG ---------------------------------------------------------------------------------


def doc_of_two_values() -> dict:
    def run(seed, shift):
        return {"ok": True, "seed": seed, "run_dir": None,
                "curve": [{"version": v, "t_s": 10.0 * v, "trajectories": 32 * v, "success": 0.1 + shift + 0.05 * v}
                          for v in range(4)],
                "reward_curve": [{"step": s, "t_s": 10.0 * s, "trajectories": 32 * s, "reward": 0.2 + shift}
                                 for s in range(1, 4)]}
    groups = [group("lr=1", BASE, "baseline"), group("lr=2", BASE, "better")]
    groups[0]["runs"] = [run(0, 0.0), run(1, 0.02)]
    groups[1]["runs"] = [run(0, 0.1), run(1, 0.12), {"ok": False, "seed": 2, "exit_code": 1, "error": "boom <x>"}]
    return {"id": "exp", "key": "lr", "config": "c.toml", "sets": [], "seeds": [0, 1, 2], "target": 0.3,
            "target_source": "test", "baseline": {"label": "lr=1", "source": "first value"},
            "warnings": ["too noisy"], "groups": groups}


def test_report_page_has_the_table_verdict_and_banded_curves(tmp_path):
    page = render(doc_of_two_values(), tmp_path)
    assert page.count('data-chart="') == 4 and page.count('class="band"') == 8   # 2 values x 4 charts
    assert "<th>verdict</th>" in page and "better" in page and "too noisy" in page
    assert "boom &lt;x&gt;" in page and "<x>" not in page                         # a log tail is escaped
    assert "target 30.0%" in page


def test_curves_svg_stands_alone():
    svg = curves_svg(doc_of_two_values())
    root = ET.fromstring(svg)                                   # well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    ns = {"s": "http://www.w3.org/2000/svg"}
    assert root.find("s:style", ns) is not None                 # carries its own style
    series = root.findall(".//s:path[@class='series']", ns)
    bands = root.findall(".//s:path[@class='band']", ns)
    assert len(series) == 4 and len(bands) == 4                 # 2 values x (success, reward)
    assert "lr=2 (2 seeds)" in svg
