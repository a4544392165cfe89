"""The field guide's experiment tools on inputs they used to judge wrongly.

A run whose learner restored a checkpoint (replayed steps logged twice); a
rejudge with another target; a target given as a percentage; values whose
names differ only in punctuation; a varied entry of a table-valued setting;
``--parallel -1``; a baseline none of whose runs finished. Inputs are built
by hand (records, stand-in runs): nothing trains.
"""

from __future__ import annotations

import json

import pytest

from pipeline import experiment as ex
from pipeline.observe import compare
from tests import test_experiment
from tests.test_experiment import QUICK

fake_runs = test_experiment.fake_runs   # the stand-in runs fixture

T0 = 1_000_000.0


def step(n: int, at: float, reward: float, version: int | None = None, **kw) -> dict:
    return {"kind": "learner_step", "step": n, "policy_version": n if version is None else version, "at": T0 + at,
            "reward_mean": reward, "trajectories": 32, "trained_total": 32 * n, "dropped_stale_total": 0,
            "wait_s": 1.0, "train_s": 3.0, **kw}


def resumed_steps() -> list[dict]:
    """metrics.jsonl of a 10-step run whose learner was killed after step 9 and restored checkpoint 8: step 9 is
    logged twice, first by the killed learner (reward 0.0), then by the restored one (0.9)."""
    pre = [step(i, 10.0 * i, 0.9) for i in range(1, 10)]
    pre[-1]["reward_mean"] = 0.0                               # the killed learner's step 9
    post = [step(9, 100.0, 0.9, version=11), step(10, 110.0, 0.9, version=12)]
    return pre + post


SUMMARY = {"started_at": T0, "success_rate_start": 0.1, "success_rate_end": 0.5, "wall_s": 120.0,
           "trajectories_trained": 320, "dropped_stale": 0, "trajectories_per_s": 2.7, "steps": 10,
           "evals": [{"tag": "start", "version": 0, "success_rate": 0.1}]}


# --- a run whose learner was restarted: replayed steps appear twice in metrics.jsonl -------------------------


def test_final_reward_of_a_run_with_replayed_steps_counts_each_step_once():
    """The final reward is the mean of the last 5 steps' standing records (the restored learner's): 0.9,
    not 0.72 (step 9 twice, the dead learner's 0.0 among them: a drop that would fail 'reward no worse')."""
    figs = compare.run_figures(SUMMARY, resumed_steps(), [])
    assert figs["reward_final"] == pytest.approx(0.9)


def test_reward_curve_of_a_run_with_replayed_steps_has_one_point_per_step():
    """One point per learner step, and one seed averaged as one at every step (step 9 was there twice: a band
    of n = 2 and a mean drawn from the superseded record)."""
    figs = compare.run_figures(SUMMARY, resumed_steps(), [])
    assert [p["step"] for p in figs["reward_curve"]] == list(range(1, 11))
    pts = compare.mean_curve([figs["reward_curve"]], "step", "t_s", "reward")
    assert all(p["n"] == 1 and p["lo"] is None for p in pts)


# --- rejudge and --target ------------------------------------------------------------------------------------


def test_rejudge_with_another_target_drops_the_warning_about_the_old_target(tmp_path, fake_runs, capsys):
    """After ``rejudge --target 0.5`` the warning about the old target (5%, below the 10% every run starts
    at) is gone from experiment.json and report.html."""
    assert ex.experiment(QUICK, [], "learner.lr=5e-4,1e-3", repeat=1, target=0.05, out=str(tmp_path / "e"),
                         parallel=2) == 0
    doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
    assert any("no higher than the baseline's held-out success at the start" in w for w in doc["warnings"])
    assert ex.rejudge(str(tmp_path / "e"), target=0.5) == 0
    doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
    assert doc["target"] == 0.5
    assert not any("no higher than the baseline's held-out success at the start" in w for w in doc["warnings"])
    assert "give a higher --target" not in (tmp_path / "e" / "report.html").read_text()


def test_experiment_rejects_a_target_outside_0_1_before_any_run(tmp_path, fake_runs, capsys):
    """``libra-ctl experiment --target 50`` (a percentage, not a rate) exits 2 before any run, as rejudge
    does (every run used to be started and judged against 5000%)."""
    from pipeline.cli import main

    code = main(["experiment", QUICK, "--vary", "learner.lr=1e-3", "--repeat", "1", "--target", "50",
                 "--out", str(tmp_path / "e")])
    assert code == 2 and fake_runs == []


# --- planning -------------------------------------------------------------------------------------------------


def test_values_that_differ_only_in_punctuation_get_their_own_run_directories(tmp_path):
    """``data/a_b.jsonl`` and ``data/a/b.jsonl`` (one slug) get a runs directory and a log each: one shared
    home gave both groups the newest run's result and lost the other's."""
    values = ["data/a_b.jsonl", "data/a/b.jsonl"]
    groups = [(f"job.train_prompts={v}", v, [f"job.train_prompts={v}"]) for v in values]
    specs = ex.plan_runs(QUICK, [], groups, 1, "e", tmp_path, parallel=1)
    assert len({s.home for s in specs}) == 2 and len({s.log for s in specs}) == 2


def test_varying_a_key_inside_env_options_is_not_reported_as_a_second_difference():
    """Varying ``env.options.tool_delay_s`` against a baseline that differs in nothing else finds no other
    difference (the table ``env.options`` was listed: a false 'more than one variable')."""
    base = {"job": {"seed": 0, "steps": 40}, "env": {"entry": "calc", "options": {"tool_delay_s": 0.1}}}
    other = {"job": {"seed": 0, "steps": 40}, "env": {"entry": "calc", "options": {"tool_delay_s": 0.5}}}
    assert ex.config_differences(base, other, "env.options.tool_delay_s") == []


@pytest.mark.parametrize("counts", [["--repeat", "1", "--parallel", "-1"], ["--repeat", "0"]])
def test_a_negative_parallel_is_refused_or_clamped_not_a_runner_that_never_starts_a_run(tmp_path, fake_runs,
                                                                                      monkeypatch, capsys, counts):
    """``--parallel -1`` exits 2 as bad input; it used to give the Runner no free place and loop forever
    (the Runner here is guarded so that the old behaviour fails instead of hanging). Neither it nor
    ``--repeat 0`` leaves an experiment directory behind."""
    from pipeline.cli import main

    class Guarded(ex.Runner):
        def run(self):
            assert self.free, f"a Runner with no free place never starts a run (parallel {self.plan.parallel})"
            return super().run()

    monkeypatch.setattr(ex, "Runner", Guarded)
    code = main(["experiment", QUICK, "--vary", "learner.lr=1e-3", *counts, "--out", str(tmp_path / "e")])
    assert code == 2 and fake_runs == [] and not (tmp_path / "e").exists()


def test_target_is_not_called_the_baselines_mean_when_no_baseline_run_finished(tmp_path, fake_runs, capsys):
    """With every baseline run failed the 100% target used is not recorded as the baseline's mean."""
    code = ex.experiment(QUICK, [], "learner.lr=2e-3,1e-3", repeat=1, out=str(tmp_path / "e"), parallel=2)
    assert code == 1                                                    # the baseline value's run failed
    doc = json.loads((tmp_path / "e" / "experiment.json").read_text())
    assert doc["groups"][0]["aggregate"]["ok"] == 0
    assert not (doc["target"] == 1.0 and doc["target_source"] == "the baseline's mean final held-out success")
