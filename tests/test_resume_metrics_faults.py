"""A second review of this session's resume and metrics changes: replay accounting of /metrics, the clock of a run
resumed twice, the experiment runner's report of a resumed run. Each docstring says what happened before the
fix."""

from __future__ import annotations

import io
import subprocess
import sys

from pipeline import experiment as ex
from pipeline.observe import compare
from pipeline.observe.prometheus import _Fold


def _line(step: int, trained: int, dropped: int) -> dict:
    return {"step": step, "trajectories": trained, "dropped_stale": dropped, "staleness_hist": {"0": trained},
            "wait_s": 0.1, "train_s": 1.0}


def test_prometheus_dropped_total_after_a_restore_counts_each_drop_once():
    """A learner trained steps 1..3 (no stale drops), died, restored checkpoint 1 and trained steps 2 and 3
    again; the replay of step 2 dropped 16 stale trajectories. 16 trajectories were dropped in all (the step
    lines say so, and so does Redis's ``dropped_stale`` counter). Before: ``libra_trajectories_dropped_stale_total``
    said 32: ``_Fold.add`` adds the *replay's* drops back, where the restore took away the *first* training's
    (none). The same holds for ``trained``: the total disagrees with the staleness histogram whenever a replayed
    step trains a different count than its first training."""
    fold = _Fold(run=b"/run")
    for s in (1, 2, 3):                               # first training: 64 each, no drops
        fold.add(_line(s, 64, 0))
    assert fold.total("trained", 192) == 192 and fold.total("dropped_stale", 0) == 0
    # restore of checkpoint 1: the counters go back to it; steps 2 and 3 again, step 2 drops 16 and trains 48
    fold.add(_line(2, 48, 16))
    fold.add(_line(3, 64, 0))
    trained_counter, dropped_counter = 64 + 48 + 64, 0 + 16
    dropped = fold.total("dropped_stale", dropped_counter)
    trained = fold.total("trained", trained_counter)
    every_drop = sum(x["dropped_stale"] for x in (_line(1, 64, 0), _line(2, 64, 0), _line(3, 64, 0),
                                                  _line(2, 48, 16), _line(3, 64, 0)))
    assert dropped == every_drop == 16, dropped
    # every training, as the histogram counts it (64 x 3 first, then 48 + 64)
    assert trained == sum(fold.hist.values()) == 304, (trained, sum(fold.hist.values()))


def test_run_figures_of_a_run_resumed_twice_with_a_silent_middle_process_keep_a_positive_wall():
    """A run trained 100 s (steps, samples up to T0+100), was stopped; resumed at T0+1000, that process died at
    once without recording anything; resumed again at T0+2000 and ran 50 s more. Its experiment figures must say
    it ran about 150 s (at most 1055 s if the silent process's life counts as running), never a negative time.

    Before: ``run_clock`` measured each resume's gap from the last record before it, so the gap of the
    second resume (2000 - 100) includes the first gap (1000 - 100) again: wall_s = -750 and the reward curve's
    last points lie at negative seconds."""
    t0 = 1_800_000_000.0
    steps = [{"step": i, "at": t0 + 10 * i, "trajectories": 8, "trained_total": 8 * i, "reward_mean": 0.1}
             for i in range(1, 11)]
    steps += [{"step": 10 + i, "at": t0 + 2000 + 10 * i, "trajectories": 8, "trained_total": 80 + 8 * i,
               "reward_mean": 0.2} for i in range(1, 6)]
    summary = {"started_at": t0, "resumed_at": t0 + 2000, "resumes": [t0 + 1000, t0 + 2000], "wall_s": 50.0,
               "trajectories_trained": 120, "dropped_stale": 0, "steps": 15, "evals": []}
    fig = compare.run_figures(summary, steps, [])
    assert fig["wall_s"] is not None and 100 <= fig["wall_s"] <= 1100, fig["wall_s"]
    ts = [p["t_s"] for p in fig["reward_curve"]]
    assert all(t >= 0 for t in ts) and ts == sorted(ts), ts


def test_runner_reports_a_resumed_run_that_finished_as_finished_not_failed(tmp_path, monkeypatch):
    """``libra-ctl resume EXPERIMENT``: a resumed run that ends with exit 0 is reported as finished. Before: it
    was reported as ``FAILED <tag> (exit 0); last lines of ...`` on the console. The commit that left a resumed run's time out of
    the ETA joined ``spec.resume_dir is None`` to the success test of ``Runner._reap``, so its else branch (the
    failure report) now takes every successful resumed run."""
    specs = [ex.RunSpec("g0", None, 0, [], "n0", tmp_path / "h0", tmp_path / "l0.log", 4,
                        resume_dir=tmp_path / "h0" / "run")]

    def start(config, spec, devices):
        spec.home.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(ex, "start_run", start)
    monkeypatch.setattr(ex, "POLL_S", 0.05)
    out = io.StringIO()
    outcomes, interrupted = ex.Runner(ex.Plan("c", specs, 1), out).run()
    assert [o.code for o in outcomes] == [0] and not interrupted
    assert "FAILED" not in out.getvalue(), out.getvalue()
