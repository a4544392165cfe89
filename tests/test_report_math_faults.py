"""The run report, the experiment comparison and their measures on the data that trips them: evaluations that
judged nothing, negative rewards, a damaged metrics.jsonl, a skipped step's infinite loss, a percentile.

Pure functions on small synthetic data: no Redis, no processes, no browser.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.observe import compare
from pipeline.observe.charts import H, PAD_B, PAD_T
from pipeline.observe.compare_report import curves_svg
from pipeline.observe.measures import read_jsonl, tool_stats
from pipeline.observe.report import headline, load_run, render

T0 = 1.7e9


def _run_dir(tmp_path: Path, *, summary: dict | None = None, steps: list[dict] = ()) -> Path:
    run = tmp_path / "20260101-000000-demo"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"run_id": run.name, "created_at": T0,
                                                   "config": {"job": {"name": "demo"}}}))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "learner_step", **s}) + "\n" for s in steps))
    return run


def _cy_inside_plot(svg: str) -> list[float]:
    """The y of every data point drawn (``<circle class="pt" cy=...>``) in an SVG fragment."""
    return [float(v) for v in re.findall(r'<circle class="pt"[^>]* cy="([-\d.]+)"', svg)]


# --- a held-out evaluation that judged no episode is not a 0% success -------------------------------------
# docs/environments.md: "an episode the reward cannot judge is left out of the success rate ... never scored 0
# ... an environment without a reward then has no held-out success, and the run says 'none judged' instead of
# 0%". workers/episode.evaluate returns 0.0 for such an evaluation, with n = 0 in its record.

def _summary_none_judged() -> dict:
    return {"started_at": T0, "success_rate_start": 0.0, "success_rate_end": 0.0, "eval_prompts_start": 0,
            "eval_prompts": 0, "wall_s": 100.0, "trajectories_trained": 64, "dropped_stale": 0, "steps": 2,
            "trajectories_per_s": 0.64,
            "evals": [{"tag": "start", "version": 0, "success_rate": 0.0, "n": 0, "at": T0},
                      {"tag": "final", "version": 2, "success_rate": 0.0, "n": 0, "at": T0 + 100}]}


def test_experiment_figures_do_not_count_an_unjudged_evaluation_as_zero_success():
    """An evaluation that judged no episode (n = 0) has no success: the experiment's figures say None. Before,
    0%, which dragged the seeds' mean, the default target and the "success no worse" verdict down."""
    steps = [{"step": i, "policy_version": i, "at": T0 + 10 * i, "reward_mean": 0.5, "trajectories": 32,
              "trained_total": 32 * i} for i in (1, 2)]
    fig = compare.run_figures(_summary_none_judged(), steps, [])
    # no episode judged: no held-out success, not 0% (which would drag the seeds' mean, the default target and
    # the "success no worse" verdict down, and give every run a 0 s time to a 0% target)
    assert fig["success_final"] is None, fig["success_final"]
    assert fig["success_start"] is None, fig["success_start"]


def test_unjudged_evaluations_are_left_out_of_the_held_out_curve():
    """The held-out curve leaves such evaluations out. Before, they were 0% points (and fed time-to-target)."""
    steps = [{"step": i, "policy_version": i, "at": T0 + 10 * i, "trained_total": 32 * i} for i in (1, 2)]
    evals = [{"tag": "start", "version": 0, "success_rate": 0.0, "n": 0},
             {"tag": "periodic", "version": 1, "success_rate": 0.4, "n": 20},
             {"tag": "final", "version": 2, "success_rate": 0.0, "n": 0}]
    curve = compare.eval_curve(evals, steps, T0)
    assert [p["version"] for p in curve] == [1], curve


def test_run_report_headline_says_none_judged_not_zero_percent(tmp_path):
    """The report's headline says "none judged", as the run's summary does. Before, "0.0% → 0.0%"."""
    d = load_run(_run_dir(tmp_path, summary=_summary_none_judged()))
    row = dict(headline(d))["held-out success"]
    assert "0.0%" not in row, row


# --- negative rewards ---------------------------------------------------------------------------------------
# A reward model's score is its raw logit (workers/reward_model.py), so a reward mean below 0 is ordinary; the
# reward charts pin their y axis at 0 (report._outcome_row, compare_report._kwargs: y_min=0) and draw those
# points below the plot area.

def test_run_report_reward_chart_shows_negative_rewards(tmp_path):
    """The reward chart's axis reaches below 0 for negative rewards. Before, it started at 0 and drew the points
    below the plot area."""
    steps = [{"step": i, "policy_version": i, "at": T0 + 10 * i, "reward_mean": -2.0 + 0.1 * i, "reward_std": 0.3,
              "success_rate": 0.0, "trajectories": 32, "trained_total": 32 * i} for i in range(1, 6)]
    page = render(load_run(_run_dir(tmp_path, steps=steps)))
    fig = re.search(r'<figure class="chart" data-chart="reward">.*?</figure>', page, re.S).group(0)
    ys = _cy_inside_plot(fig)
    assert ys, "no reward points drawn"
    assert all(PAD_T - 0.5 <= y <= H - PAD_B + 0.5 for y in ys), (ys, H - PAD_B)


def test_experiment_reward_curves_show_negative_rewards():
    """The same for the experiment's reward curves (success keeps its floor at 0)."""
    def run(seed):
        return {"ok": True, "seed": seed, "curve": [],
                "reward_curve": [{"step": s, "t_s": 10.0 * s, "trajectories": 32 * s, "reward": -3.0 + 0.2 * s}
                                 for s in range(1, 5)]}
    doc = {"groups": [{"label": "lr=1", "runs": [run(0), run(1)]}], "target": 0.5}
    svg = curves_svg(doc)
    ys = _cy_inside_plot(svg)
    assert ys, "no reward points drawn"
    assert all(PAD_T - 0.5 <= y <= H - PAD_B + 0.5 for y in ys), (ys, H - PAD_B)


# --- the tool latency p95 -----------------------------------------------------------------------------------

class _Traj:
    def __init__(self, lat):
        self.tool_latency_s, self.tool_calls, self.tool_timeouts = lat, len(lat), 0


class _Group:
    def __init__(self, trajectories):
        self.trajectories = trajectories


def test_tool_latency_p95_is_the_95th_percentile_not_the_maximum():
    """The p95 is the nearest-rank 95th percentile. Before, one rank high: the maximum of 20 latencies."""
    twenty = tool_stats([_Group([_Traj([float(i) for i in range(1, 21)])])])
    # nearest rank: ceil(0.95 * 20) = 19th value; linear interpolation 19.05; never the maximum 20
    assert twenty["tool_latency_p95_s"] < 20.0, twenty
    hundred = tool_stats([_Group([_Traj([float(i) for i in range(1, 101)])])])
    assert hundred["tool_latency_p95_s"] <= 95.05, hundred   # measures.tool_stats gives 96, the 96th value


# --- damaged metrics.jsonl -----------------------------------------------------------------------------------

def test_a_line_cut_short_by_a_crash_does_not_take_the_next_writers_line_with_it(tmp_path):
    """A crash (or a full disk) leaves a line without its newline; the next writer (a resumed run, the sampler)
    appends its whole line right after it. The reader keeps that record. Before, it dropped both."""
    path = tmp_path / "metrics.jsonl"
    good = {"kind": "learner_step", "step": 7, "at": T0 + 70}
    path.write_text('{"kind": "learner_step", "step": 6, "at": 17000' + json.dumps(good) + "\n")
    assert read_jsonl(path) == [good]


def test_bytes_that_are_not_utf8_do_not_stop_the_reader(tmp_path):
    """A damaged block in metrics.jsonl: its line is skipped, as a JSON error is. Before, UnicodeDecodeError
    stopped libra-ctl report and the experiment's figures."""
    path = tmp_path / "metrics.jsonl"
    good = {"kind": "learner_step", "step": 2, "at": T0 + 20}
    path.write_bytes(b'{"kind": "learner_step", "step": 1, "at": \xff\xfe\x00\n' + json.dumps(good).encode() + b"\n")
    assert read_jsonl(path) == [good]


# --- a skipped non-finite step's inf -------------------------------------------------------------------------
# workers/update.py skips a step whose loss or gradient norm is not finite and the learner still records it
# (``skipped_nonfinite``), loss and grad_norm included. measures._weighted_mean leaves NaN out of a window's
# mean but not inf, so the sampler's line (json.dumps in observe.metrics) carries ``Infinity``, which JSON
# parsers other than Python's (jq, JSON.parse) reject.

def test_window_means_leave_out_infinite_values_as_they_do_nan():
    """A window's means leave out a skipped step's inf as they leave out NaN. Before, the window's loss was inf,
    and the sample line carried Infinity (which jq and JSON.parse reject)."""
    from pipeline.observe.measures import aggregate_steps

    steps = [{"step": 1, "loss": float("inf"), "grad_norm": float("inf"), "entropy": 0.8, "trajectories": 32,
              "reward_mean": 0.5, "skipped_nonfinite": 1},
             {"step": 2, "loss": 0.1, "grad_norm": 1.0, "entropy": 0.8, "trajectories": 32, "reward_mean": 0.5}]
    agg = aggregate_steps(steps)
    json.dumps(agg, allow_nan=False)          # raises ValueError on inf
    assert agg["loss"] == 0.1 and agg["grad_norm"] == 1.0, agg


def test_a_learner_step_with_an_infinite_loss_is_written_as_json_every_reader_takes():
    """logs.json_line writes inf and NaN as null (the learner's step lines, the sampler's, the events). Before,
    json.dumps wrote Infinity, which is not JSON."""
    from pipeline.logs import json_line

    line = json_line({"kind": "learner_step", "loss": float("inf"), "grad_norm": float("nan"), "x": [1.0, -float("inf")]})
    assert json.loads(line) == {"kind": "learner_step", "loss": None, "grad_norm": None, "x": [1.0, None]}
    assert "Infinity" not in line and "NaN" not in line
