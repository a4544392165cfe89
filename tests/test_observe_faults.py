"""What a learner's restore, a resume, a kill and an unmounted run directory do to the observe tools.

A learner that restores its checkpoint sets the job's ``trained`` and drop
counters back to the checkpoint's; a resume keeps every counter and writes a
new ``started_at``; a kill can cut ``summary.json`` short. None of these
may show as a spike, a negative rate, a false finding or a traceback. Also:
the sampler names its node as the run's agent does, and log lines never
carry a URL password, whatever the type of the value holding it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.observe.metrics import MetricsSampler
from pipeline.observe.prometheus import registry_for
from pipeline.observe.resources import ResourceProbe
from tests.test_metrics import fake_job
from tests.test_report import make_run

ROOT = Path(__file__).resolve().parents[1]


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


def _trained(text: str, job: str = "obs") -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "libra_trajectories_trained_total" and s.labels.get("job") == job:
                return s.value
    raise AssertionError("no libra_trajectories_trained_total")


def test_prometheus_trained_counter_does_not_go_down_across_a_resume_and_its_restore(r):
    """``libra-ctl resume`` keeps the job's run directory and counters and writes a new ``started_at``; its
    learner then restores the last checkpoint and sets ``trained`` back (640 -> 512). A scrape server that
    outlives the resume (the controller, ``metrics-serve``) keeps exporting a total that never goes down.
    Before, the new ``started_at`` started a new fold, the amount added back was lost and 512 was exported:
    Prometheus read a counter reset and counted all 512 again."""
    keys = fake_job(r, counters={"issued": 1024, "generated": 900, "scored": 800, "trained": 640})
    run_dir = r.hget(keys.state, "run_dir")
    registry = registry_for(r)
    before = _trained(generate_latest(registry).decode())
    # the resume: same run directory, counters kept, a new started_at; the learner restores step 8 (512)
    r.hset(keys.state, mapping={"started_at": time.time(), "run_dir": run_dir})
    r.hset(keys.counters, "trained", 512)
    after = _trained(generate_latest(registry).decode())
    assert before == 640
    assert after >= before, f"libra_trajectories_trained_total went down across the resume: {before} -> {after}"


def test_log_lines_redact_a_url_password_held_in_a_non_string_value(tmp_path):
    """A URL password in a log value that is not a string (an exception, bytes) is redacted too. Before,
    such values went through as they were and the JSON renderer wrote their repr, the password in clear.
    (In a child process: ``logs.configure`` changes process-wide logging.)"""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from pipeline import logs
        log = logs.configure(Path({str(tmp_path)!r}), "w", console=False)
        log.warning("redis_unreachable", error=ConnectionError("cannot reach redis://u:hunter2@h:6379/0"),
                    url=b"redis://u:hunter3@h:6379/0")
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    text = (tmp_path / "w.jsonl").read_text()
    assert "redis_unreachable" in text
    assert "hunter2" not in text and "hunter3" not in text, text


def test_a_sample_measures_the_workers_a_local_agent_started_on_a_host_with_a_dotted_name(r, monkeypatch):
    """On a host named ``gpu01.example.org`` the run's local agent (and so its workers' records) names the
    node ``gpu01``; the run's sampler, which measures the workers of its own node, takes the same name and
    measures them. Before, it took the full host name, matched none of them, and the run's resource
    figures (TensorBoard ``resources/*``, Prometheus ``libra_worker_*``) never appeared."""
    import json
    import os
    import socket


    monkeypatch.setattr(socket, "gethostname", lambda: "gpu01.example.org")
    keys = fake_job(r)
    for wid, raw in r.hgetall(keys.workers).items():   # as the agent's workers record themselves
        rec = json.loads(raw)
        rec["node"] = "gpu01"
        r.hset(keys.workers, wid, json.dumps(rec))
    s = MetricsSampler(r, "obs", None, probe=ResourceProbe(use_gpu=False)).sample()
    assert s["resources"]["workers"].get("learner-0", {}).get("pid") == os.getpid(), s["resources"]["workers"]
    assert s["resources"]["by_role"].get("learner", {}).get("workers") == 1, s["resources"]["by_role"]
