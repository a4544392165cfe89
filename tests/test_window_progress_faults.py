"""A sampler window's tool-latency p95, the experiment's progress reader, and its default parallel count under a
CPU quota."""

from __future__ import annotations

import json
import os

import pytest

from pipeline import experiment as ex
from pipeline.observe.measures import aggregate_steps


# --- a window's tool latency p95 ------------------------------------------------------------------------------


def test_window_tool_latency_p95_is_not_one_lone_call_of_one_step():
    """A sampler window of two learner steps: one with 1000 tool calls (mean 5 ms, p95 10 ms), one with a single
    10 s call. Of the window's 1001 calls one took 10 s, so its 95th percentile is far below 10 s: the steps'
    p95s weighted by their calls give 10 ms. Before, the window's p95 was the max of the steps' p95s, 10 s: the
    lone call's latency (``queues.tool_latency_p95_s`` of the sample, plotted as
    ``queues/tool_latency_p95_s``)."""
    steps = [{"step": 1, "trajectories": 32, "tool_calls": 1000, "tool_latency_mean_s": 0.005,
              "tool_latency_p95_s": 0.01},
             {"step": 2, "trajectories": 32, "tool_calls": 1, "tool_latency_mean_s": 10.0,
              "tool_latency_p95_s": 10.0}]
    a = aggregate_steps(steps)
    assert a["tool_calls"] == 1001
    assert a["tool_latency_p95_s"] == 0.01, a["tool_latency_p95_s"]


# --- the progress reader's last learner step ---------------------------------------------------------------


def test_current_step_finds_a_learner_step_older_than_the_last_64_kib(tmp_path):
    """A run whose learner step 7 was logged, followed by the sampler's samples (about 3.3 KB each on the
    quick start, one every metrics.interval_s; more with more workers) while step 8 trains for a few minutes:
    ``current_step`` says 7, and reads on from where it stopped. Before, it read only the last 64 KiB, found no
    ``learner_step`` line there and returned 0: the progress line went back to "step 0/N" mid-run and the ETA
    lost the running runs' share of steps."""
    run = tmp_path / "20260101-000000-quickstart"
    run.mkdir()
    sample = {"kind": "sample", "at": 0.0, "phase": "running",
              "resources": {"workers": {f"rollout-host-{i}": {"role": "rollout", "pid": 1000 + i,
                                                               "cpu_percent": 99.5, "rss_bytes": 123456789,
                                                               "processes": 2} for i in range(24)}}}
    line = json.dumps(sample)
    n = ex.STEP_READ_BYTES // len(line) + 5
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, 8):
            f.write(json.dumps({"kind": "learner_step", "step": s, "policy_version": s}) + "\n")
        for k in range(n):
            f.write(line.replace('"at": 0.0', f'"at": {k}.0') + "\n")
    assert (run / "metrics.jsonl").stat().st_size > ex.STEP_READ_BYTES
    assert ex.current_step(tmp_path) == 7


# --- the default parallel count under a CPU quota -----------------------------------------------------------


@pytest.mark.parametrize("layout", ["v2-namespaced", "v2-host", "v1-cpu-cpuacct", "no-quota"])
def test_usable_cpus_counts_a_cgroup_cpu_quota(tmp_path, monkeypatch, layout):
    """A container limited to 2 CPUs by a CFS quota (``docker --cpus 2``, a Kubernetes CPU limit) whose
    affinity still shows the host's 16 cores runs 2 // CORES_PER_RUN = 1 run at a time. Before, the count was
    the affinity's alone (16): 8 runs shared 2 CPUs' worth of time, and the wall times and throughput the
    experiment compares were measured under throttling. Files as the kernel lays them out, under a temporary
    root: cgroup v2 ``cpu.max`` (at the namespace's root, or at the process's path on a host), v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in a ``cpu,cpuacct`` hierarchy; "max" is no quota."""
    from pipeline import cgroup

    root, me = tmp_path / "sys-fs-cgroup", tmp_path / "proc-self-cgroup"
    if layout == "v2-namespaced":
        me.write_text("0::/\n")
        files = {"cpu.max": "200000 100000\n"}
    elif layout == "v2-host":
        me.write_text("0::/system.slice/job.scope\n")
        files = {"system.slice/job.scope/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"}
    elif layout == "v1-cpu-cpuacct":
        me.write_text("5:memory:/\n4:cpu,cpuacct:/\n")
        files = {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    else:
        me.write_text("0::/\n")
        files = {"cpu.max": "max 100000\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(cgroup, "ROOT", root)
    monkeypatch.setattr(cgroup, "SELF", me)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert ex.usable_cpus() == (16 if layout == "no-quota" else 2)


def test_current_step_reads_on_from_where_it_stopped(tmp_path):
    """Each call reads what was appended since the last (whole lines only): a step written in two parts is
    read once whole, and a file written again from the start is read from its start."""
    run = tmp_path / "20260101-000000-again"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "learner_step", "step": 3}) + "\n" + '{"kind": "learner_st')
    assert ex.current_step(tmp_path) == 3
    with open(metrics, "a") as f:
        f.write('ep", "step": 4}\n')
    assert ex.current_step(tmp_path) == 4
    metrics.write_text(json.dumps({"kind": "learner_step", "step": 1}) + "\n")
    assert ex.current_step(tmp_path) == 1
