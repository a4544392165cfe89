"""Numbers that disagreed between surfaces, or carried the wrong unit, after a resume: each test's docstring says
what happened before the fix. The step lines below have the
shape of a real resumed quick-start run (``libra-ctl verify-resume --hard --kill-at-step 5`` with
``checkpoint_every=3``, ``batch_size=64``, 8 steps): the learner trained steps 1..5, the run was killed,
the resume restored checkpoint 3 and trained steps 4 and 5 again (new versions 7, 8), then 6..8. So
``metrics.jsonl`` and the Redis ``metrics`` stream hold 10 step lines for 8 standing steps, and every
surface that counts trained trajectories should say 512.
"""

from __future__ import annotations

import json
import time

import pytest

from pipeline.observe import compare
from pipeline.observe.report import load_run, staleness_bars

T0 = 1_796_646_260.0


def _step(step: int, version: int, at: float, trained_total: int, hist: dict, reward: float) -> dict:
    return {"kind": "learner_step", "step": step, "policy_version": version, "at": T0 + at,
            "trajectories": 64, "groups": 8, "zero_signal_groups": 4, "trained_total": trained_total,
            "dropped_stale": 0, "dropped_stale_total": 0, "staleness_hist": hist,
            "staleness_mean": float(next(iter(hist))), "staleness_max": int(next(iter(hist))),
            "wait_s": 0.5, "train_s": 0.9, "reward_mean": reward, "reward_std": 0.3, "success_rate": reward,
            "loss": 0.01, "entropy": 0.1, "grad_norm": 0.2}


# steps 1..5, kill, restore of checkpoint 3, steps 4 and 5 again, then 6..8 (as recorded by the real run)
RESUMED_STEPS = [
    _step(1, 1, 38.5, 64, {"0": 64}, 0.078125),
    _step(2, 2, 39.5, 128, {"1": 64}, 0.171875),
    _step(3, 3, 42.1, 192, {"2": 64}, 0.03125),
    _step(4, 4, 46.3, 256, {"1": 64}, 0.109375),
    _step(5, 5, 47.2, 320, {"2": 64}, 0.15625),
    _step(4, 7, 72.9, 256, {"1": 64}, 0.109375),
    _step(5, 8, 74.0, 320, {"2": 64}, 0.15625),
    _step(6, 9, 95.7, 384, {"0": 64}, 0.203125),
    _step(7, 10, 97.9, 448, {"1": 64}, 0.21875),
    _step(8, 11, 98.5, 512, {"2": 64}, 0.25),
]
TRAINED = 512


def _resumed_run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"run_id": "run", "created_at": T0,
                                                    "config": {"job": {"name": "quickstart"}}}))
    (run / "summary.json").write_text(json.dumps({
        "run_id": "run", "job": "quickstart", "started_at": T0, "resumed_at": T0 + 55.5,
        "success_rate_start": 0.21875, "success_rate_end": 0.25, "eval_prompts": 32, "eval_prompts_start": 32,
        "evals": [], "trajectories_trained": TRAINED, "trajectories_generated": 704, "policy_version": 11,
        "steps": 8, "dropped_stale": 0, "dead_lettered": 0, "wall_s": 45.5, "trajectories_per_s": 7.03}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in RESUMED_STEPS))
    return run


def test_report_staleness_histogram_counts_replayed_steps_once(tmp_path):
    """report.html's "Staleness of trained trajectories" bars must add up to the trajectories trained.

    Before: after a resume the report summed the staleness histogram of every step line, the dead learner's lines
    of the replayed steps included: the real run showed bars 128/256/256 (640 trajectories) beside a
    headline of 512 trained, while ``compare.run_figures`` (``standing_steps``) counts each step once.
    """
    run = _resumed_run_dir(tmp_path)
    d = load_run(run)
    labels, values, _colors = staleness_bars(d)
    assert "dropped" not in labels
    # the figures the experiment comparison takes from the same run count 512
    figures = compare.run_figures(d.summary, d.steps, d.samples)
    assert figures["trained"] == TRAINED
    assert sum(values) == TRAINED, (labels, values)


def test_prometheus_staleness_count_matches_trained_total_after_a_resume(r):
    """One scrape of ``/metrics`` must not say 640 trajectories in ``libra_staleness_versions`` ("every trained
    trajectory") beside ``libra_trajectories_trained_total`` 512.

    Before: a ``libra-ctl metrics-serve`` started after a resume (or a controller restarted with it) folded every
    ``learner_step`` line of the stream, the replayed steps twice, but read ``trained`` as Redis holds it
    (no fall was seen, so none was added back). Now both count every training. Measured on the real resumed run: count 640, sum 768,
    trained_total 512.
    """
    from prometheus_client.parser import text_string_to_metric_families

    from pipeline.observe.prometheus import exposition
    from tests.test_metrics import fake_job

    steps = [{**s, "at": time.time()} for s in RESUMED_STEPS]
    fake_job(r, "resumed", steps=steps,
             counters={"issued": 704, "generated": 704, "scored": 704, "trained": TRAINED, "dropped_stale": 0})
    got = {}
    for fam in text_string_to_metric_families(exposition(r, ["resumed"])):
        for smp in fam.samples:
            got[smp.name] = smp.value
    # both count every training (work done), replays included, whenever the server started
    assert got["libra_trajectories_trained_total"] == TRAINED + 2 * 64
    assert got["libra_staleness_versions_count"] == got["libra_trajectories_trained_total"]


def test_top_worker_memory_column_is_in_the_unit_it_names():
    """Before: ``libra-ctl top`` headed its memory column ``rss MB`` but divided by 2**20 (MiB): 1 GB showed as
    954."""
    from pipeline.observe.top import _worker_table

    w = {"id": "rollout-n-0", "role": "rollout", "state": "running", "pid": 1, "rate_per_s": 0.0}
    lines = _worker_table([w], {"rollout-n-0": {"rss_bytes": 1_000_000_000, "cpu_percent": 50.0}}, lambda t, *_: t)
    header, row = lines[1], lines[2]
    value = float(row.split()[5])
    if "MiB" in header:
        assert value == pytest.approx(1_000_000_000 / 2**20, abs=1)
    else:
        assert "rss MB" in header
        assert value == pytest.approx(1000, abs=1), row
