"""What a learner's restore, a resume, a kill and an unmounted run directory do to the observe tools.

A learner that restores its checkpoint sets the job's ``trained`` and drop
counters back to the checkpoint's; a resume keeps every counter and writes a
new ``started_at``; a kill can cut ``summary.json`` short. None of these
may show as a spike, a negative rate, a false finding or a traceback.
"""

from __future__ import annotations

import json
import time

import pytest

from pipeline.observe.metrics import MetricsSampler
from pipeline.observe.resources import ResourceProbe
from tests.test_metrics import fake_job
from tests.test_report import make_run


def test_the_first_sample_after_a_resume_measures_from_the_resume_not_the_jobs_history(r):
    """A resumed job keeps its counters (``trained`` 64,000 from before the kill) and gets a new
    ``started_at``; its sampler (``from_start=False``, as ``libra-ctl resume`` starts it) measures from
    its own start: nothing trained since gives ~0/s, not 64,000 over 20 s (3,200/s, a spike the report,
    the doctor and ``top`` would all show)."""
    keys = fake_job(r, counters={"issued": 70000, "generated": 66000, "scored": 65000, "trained": 64000})
    r.hset(keys.state, "started_at", time.time() - 20)      # the resume, 20 s ago; nothing trained since
    sampler = MetricsSampler(r, "obs", None, probe=ResourceProbe(use_gpu=False), from_start=False)
    s = sampler.sample()
    assert s["throughput"]["learner_samples_per_s"] < 1.0, s["throughput"]


def test_report_of_a_run_killed_while_writing_summary_json(tmp_path):
    """A ``summary.json`` cut short (a kill while an older run wrote it whole-file): ``libra-ctl report``
    still writes the page from metrics.jsonl and the manifest, and says the summary was left out."""
    from pipeline.cli import main

    run = make_run(tmp_path)
    (run / "summary.json").write_text('{"run_id": "20260101-000000-demo", "job": "de')
    assert main(["report", str(run)]) == 0
    assert "summary.json could not be read" in (run / "report.html").read_text()


def test_prometheus_trained_counter_never_goes_down_when_the_learner_restores(r):
    """``trained`` set back from 640 to 512 by a restore, in the same run: the exported
    ``libra_trajectories_trained_total`` does not go down (Prometheus would read a reset to zero and
    ``rate()`` would count all 512 again); the fall is added back."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pipeline.observe.prometheus import registry_for

    def trained(text: str) -> float:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "libra_trajectories_trained_total" and s.labels.get("job") == "obs":
                    return s.value
        raise AssertionError("no libra_trajectories_trained_total")

    keys = fake_job(r, counters={"issued": 1024, "generated": 900, "scored": 800, "trained": 640})
    registry = registry_for(r)           # one server, scraped twice
    first = trained(generate_latest(registry).decode())
    r.hset(keys.counters, "trained", 512)   # the learner restored checkpoint step 8 (512 trained)
    second = trained(generate_latest(registry).decode())
    assert first == 640
    assert second >= first, f"counter went down {first} -> {second}"


def test_top_rates_are_never_negative_after_a_learner_restore():
    """``libra-ctl top`` across a restore (``trained`` 640 -> 512 in 10 s): a rate of 0, not -12.8/s."""
    from pipeline.observe.top import Rates

    rates = Rates()
    rates.add({"t": 0.0, "status": {"counters": {"trained": 640}}})
    out = rates.add({"t": 10.0, "status": {"counters": {"trained": 512}}})
    assert out["trained"] >= 0, out


def test_doctor_stale_check_across_a_learner_restore():
    """A restore inside the doctor's window (``trained`` 640/512/576, ``dropped_stale`` 100/80/81): the
    stale check counts what rose (+64 trained, +1 dropped: 1.5%, no finding), not last minus first
    (-19 dropped against -64 trained, read as 23%)."""
    from pipeline.observe.doctor import diagnose

    samples = [{"at": 1000.0 + 10 * i, "phase": "running", "counters": {"trained": t, "dropped_stale": d}}
               for i, (t, d) in enumerate([(640, 100), (512, 80), (576, 81)])]
    d = diagnose(samples)
    stale = [f for f in d.findings if f.code == "stale_drops"]
    assert not stale, stale[0].evidence


def test_audit_from_a_machine_that_cannot_see_the_run_directory(r, redis_url, capsys):
    """``libra-ctl audit --job J`` where the run directory Redis records is not on this machine: a
    message naming it and ``--run``, a non-zero exit, no traceback."""
    from pipeline.cli import main

    fake_job(r)    # its state names run_dir /nowhere
    with pytest.raises(SystemExit) as exc:
        main(["audit", "--job", "obs", "--redis", redis_url])
    assert "pass --run RUN_DIR" in str(exc.value.code)


def test_the_reports_trained_rate_from_learner_steps_is_never_negative_across_a_restore(tmp_path):
    """Without sampler lines the report's trained rate comes from consecutive learner steps; a restore
    sets ``trained_total`` back to its checkpoint's, and the pair across it gave a negative rate. A
    NaN in a plotted series is left out of the page, not drawn at ``cy="nan"``."""
    from pipeline.observe.charts import Series, line_chart
    from pipeline.observe.report import load_run, throughput_series

    run = make_run(tmp_path, samples=False, steps=12)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    replay = [dict(x, at=x["at"] + 200) for x in lines if x.get("kind") == "learner_step" and x["step"] > 8]
    with open(run / "metrics.jsonl", "a") as f:     # the restored learner logs steps 9-12 again
        f.writelines(json.dumps(x) + "\n" for x in replay)
    traj, _tok, _src = throughput_series(load_run(run))
    trained = next(s for s in traj if s.name == "trained /s")
    assert trained.ys and min(trained.ys) >= 0, trained.ys
    svg = line_chart("k", "t", [Series("s", [0.0, 1.0, 2.0], [1.0, float("nan"), 2.0], "#000")])
    assert "nan" not in svg.lower()
