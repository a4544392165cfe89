"""``/metrics``: parses with prometheus_client's parser and carries the four kinds of metrics."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.observe.metrics import MetricsSampler
from pipeline.observe.prometheus import exposition, serve
from tests.test_metrics import fake_job, learner_step

REQUIRED = ["libra_stream_length", "libra_stream_pending", "libra_stream_lag", "libra_trajectories_trained_total",
            "libra_rollout_tokens_total", "libra_learner_wait_ratio", "libra_staleness_versions_bucket",
            "libra_policy_version", "libra_workers", "libra_reward_mean", "libra_dead_letters_total"]
KINDS = {
    "throughput": ["libra_trajectories_trained_total", "libra_rollout_tokens_total",
                   "libra_trajectories_generated_total"],
    "resources": ["libra_worker_cpu_ratio", "libra_worker_resident_memory_bytes"],
    "queues": ["libra_stream_length", "libra_stream_lag", "libra_stream_pending", "libra_learner_wait_ratio",
               "libra_dead_letters_total", "libra_tool_timeouts_total"],
    "quality": ["libra_reward_mean", "libra_success_ratio", "libra_learner_loss", "libra_staleness_versions_count",
                "libra_diversity_distinct_ratio"],
}


def samples_by_name(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def one(samples, name, **labels):
    hits = [s for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0].value


def job_with_history(r):
    steps = [learner_step(1, staleness_hist={"0": 64}, wait_s=1.0, train_s=1.0, tool_calls=10, tool_timeouts=2,
                          tool_latency_mean_s=0.5),
             learner_step(2, staleness_hist={"1": 48, "2": 16}, wait_s=0.0, train_s=2.0, diversity_groups=8,
                          diversity_distinct_rate=0.875, diversity_similarity=0.4,
                          diversity_equal_reward_share=0.25)]
    keys = fake_job(r, steps=steps, backlog={"reward": 2, "learner": 5},
                    counters={"issued": 256, "generated": 192, "scored": 160, "trained": 128, "rollout_tokens": 9000,
                              "dead_letter_messages": 1, "dead_lettered": 8})
    r.hset(keys.learner_stats, mapping={k: json.dumps(v) for k, v in steps[-1].items()})
    MetricsSampler(r, "obs", None).sample()  # resources come from the sampler's newest sample
    return keys


def test_exposition_parses_and_has_the_four_kinds(r):
    job_with_history(r)
    s = samples_by_name(exposition(r))
    for name in REQUIRED:
        assert name in s, name
    for kind, names in KINDS.items():
        for name in names:
            assert name in s, (kind, name)
    assert one(s, "libra_stream_lag", job="obs", stage="learner") == 5
    assert one(s, "libra_stream_length", job="obs", stage="reward") == 2
    assert one(s, "libra_trajectories_trained_total", job="obs") == 128
    assert one(s, "libra_rollout_tokens_total", job="obs") == 9000
    assert one(s, "libra_dead_letters_total", job="obs") == 1
    assert one(s, "libra_workers", job="obs", role="learner", state="running") == 1
    assert one(s, "libra_policy_version", job="obs") == 2
    assert one(s, "libra_learner_wait_ratio", job="obs") == pytest.approx(1.0 / 4.0)
    assert one(s, "libra_reward_mean", job="obs") == 0.5
    assert one(s, "libra_diversity_distinct_ratio", job="obs") == 0.875
    assert one(s, "libra_tool_timeouts_total", job="obs") == 2
    assert one(s, "libra_worker_resident_memory_bytes", job="obs", role="learner") > 0
    # Staleness histogram: cumulative buckets over every trained trajectory.
    assert one(s, "libra_staleness_versions_bucket", job="obs", le="0.0") == 64
    assert one(s, "libra_staleness_versions_bucket", job="obs", le="1.0") == 112
    assert one(s, "libra_staleness_versions_bucket", job="obs", le="+Inf") == 128
    assert one(s, "libra_staleness_versions_sum", job="obs") == 48 + 32


def test_labels_stay_low_cardinality(r):
    job_with_history(r)
    allowed = {"job", "stage", "role", "state", "phase", "node", "gpu", "le"}
    for fam in text_string_to_metric_families(exposition(r)):
        assert fam.name.startswith("libra_")
        for smp in fam.samples:
            assert set(smp.labels) <= allowed, (smp.name, smp.labels)


def test_fold_is_incremental_and_restarts_with_a_new_run(r):
    from pipeline.observe.prometheus import registry_for
    from prometheus_client import generate_latest

    keys = job_with_history(r)
    reg = registry_for(r, ["obs"])
    scrape = lambda: samples_by_name(generate_latest(reg).decode())
    assert one(scrape(), "libra_staleness_versions_count", job="obs") == 128
    r.xadd(keys.metrics, {"kind": "learner_step", "data": json.dumps(learner_step(3, staleness_hist={"0": 64}))})
    assert one(scrape(), "libra_staleness_versions_count", job="obs") == 192  # only the new step was added
    r.hset(keys.state, mapping={"started_at": 1.0, "run_dir": "/runs/next"})  # a new run of the job
    r.delete(keys.metrics)
    assert one(scrape(), "libra_staleness_versions_count", job="obs") == 0


def test_serve_answers_http(r):
    job_with_history(r)
    server = serve(r, 0)
    try:
        body = urllib.request.urlopen(server.url, timeout=10).read().decode()
    finally:
        server.stop()
    assert "libra_stream_length" in samples_by_name(body)


def test_metrics_serve_once(r, redis_url, capsys):
    from pipeline.cli import main

    job_with_history(r)
    assert main(["metrics-serve", "--once", "--redis", redis_url, "--job", "obs"]) == 0
    assert "libra_trajectories_trained_total" in samples_by_name(capsys.readouterr().out)


def test_grafana_dashboard_uses_only_exported_metrics(r):
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parent.parent / "deploy/grafana/libra.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\blibra_[a-z_]+", e)}
    job_with_history(r)
    exported = set()
    for fam in text_string_to_metric_families(exposition(r)):
        exported.add(fam.name)
        exported.update(s.name for s in fam.samples)
    assert used <= exported, used - exported
    kinds = {k: any(n in used for n in names) for k, names in KINDS.items()}
    assert all(kinds.values()), kinds
