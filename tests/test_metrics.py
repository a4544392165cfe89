"""The metrics sampler: pure aggregation, and samples of the four kinds read from a real Redis.

``fake_job`` lays out what the workers of a live job leave in Redis (state,
streams, counters, the workers table, learner steps); the Prometheus, top and
doctor tests use it too.
"""

from __future__ import annotations

import json
import os
import socket
import time
from types import SimpleNamespace

import pytest

from pipeline.dataplane import messages
from pipeline.dataplane.keys import JOBS, JobKeys
from pipeline.observe.measures import aggregate_steps, rates, read_jsonl, slot_busy, tool_stats
from pipeline.observe.metrics import MetricsSampler, read_samples, start_sampler
from pipeline.observe.resources import ResourceProbe
from pipeline.dataplane.streams import ensure_groups


def learner_step(step: int, **kw) -> dict:
    base = {"step": step, "policy_version": step, "loss": 0.1, "reward_mean": 0.5, "reward_std": 0.4,
            "success_rate": 0.5, "entropy": 0.9, "staleness_mean": 0.5, "staleness_max": 1,
            "staleness_hist": {"0": 32, "1": 32}, "trajectories": 64, "groups": 8, "zero_signal_groups": 2,
            "dropped_stale": 0, "grad_norm": 0.3, "wait_s": 0.2, "train_s": 1.8, "at": time.time()}
    base.update(kw)
    return base


def fake_job(r, job: str = "obs", *, workers: dict | None = None, steps: list[dict] = (),
             counters: dict | None = None, backlog: dict | None = None) -> JobKeys:
    """A job as its processes leave it in Redis; the workers default to this test process."""
    keys = JobKeys(job)
    r.sadd(JOBS, job)
    r.hset(keys.state, mapping={"phase": "running", "started_at": time.time() - 20, "run_dir": "/nowhere"})
    r.hset(keys.policy, mapping={"version": len(steps), "path": "/nowhere", "step": len(steps)})
    ensure_groups(r, keys)
    for stage, n in (backlog or {}).items():
        stream = dict((s, st) for s, st, _g in keys.stages)[stage]
        for i in range(n):
            r.xadd(stream, {messages.FIELD: b"x"})
    r.hset(keys.counters, mapping=counters or {"issued": 128, "generated": 96, "scored": 80, "trained": 64})
    node = socket.gethostname()
    for wid, (role, state) in (workers or {"learner-0": ("learner", "running"),
                                           "rollout-n-0": ("rollout", "running"),
                                           "reward-n-0": ("reward", "running")}).items():
        r.hset(keys.workers, wid, json.dumps({"id": wid, "role": role, "pid": os.getpid(), "node": node,
                                              "slots": [], "state": state, "heartbeat": time.time(),
                                              "rate_per_s": 3.0, "policy_version": len(steps)}))
    for s in steps:
        r.xadd(keys.metrics, {"kind": "learner_step", "data": json.dumps(s)})
    return keys


# --- pure parts ---------------------------------------------------------------------------------


def test_rates_from_counter_deltas():
    out = rates({"generated": 10, "trained": 0}, {"generated": 70, "trained": 40, "rollout_tokens": 500}, 10.0)
    assert out["trajectories_per_min"] == pytest.approx(360.0)
    assert out["learner_samples_per_s"] == pytest.approx(4.0)
    assert out["rollout_tokens_per_s"] == pytest.approx(50.0)
    assert rates({}, {"generated": 5}, 1.0)["rollout_tokens_per_s"] is None  # not counted yet


def test_aggregate_steps_weights_and_sums():
    steps = [learner_step(1, reward_mean=0.0, trajectories=32, wait_s=1.0, train_s=1.0,
                          tool_calls=10, tool_timeouts=1, tool_latency_mean_s=0.1, tool_latency_p95_s=0.2),
             learner_step(2, reward_mean=1.0, trajectories=96, wait_s=0.0, train_s=2.0, staleness_max=2,
                          staleness_hist={"2": 96}, diversity_groups=8, diversity_distinct_rate=0.75,
                          tool_calls=30, tool_timeouts=0, tool_latency_mean_s=0.3, tool_latency_p95_s=0.5)]
    a = aggregate_steps(steps)
    assert a["steps"] == 2 and a["step"] == 2 and a["trained"] == 128
    assert a["reward_mean"] == pytest.approx(0.75)  # weighted by trajectories
    assert a["staleness_hist"] == {"0": 32, "1": 32, "2": 96}
    assert a["staleness_max"] == 2
    assert a["wait_ratio"] == pytest.approx(1.0 / 4.0)
    assert a["zero_signal_share"] == pytest.approx(4 / 16)
    assert a["diversity_distinct_rate"] == 0.75
    assert a["tool_calls"] == 40 and a["tool_timeouts"] == 1
    assert a["tool_latency_mean_s"] == pytest.approx((0.1 * 10 + 0.3 * 30) / 40)
    assert a["tool_latency_p95_s"] == 0.5


def test_aggregate_empty_window():
    a = aggregate_steps([])
    assert a["steps"] == 0 and a["reward_mean"] is None and a["wait_ratio"] is None


def test_tool_stats_of_groups():
    t = lambda lat, to: SimpleNamespace(tool_calls=len(lat), tool_latency_s=tuple(lat), tool_timeouts=to)
    groups = [SimpleNamespace(trajectories=[t([0.1, 0.2], 0), t([2.0], 1)]), SimpleNamespace(trajectories=[t([], 0)])]
    s = tool_stats(groups)
    assert s["tool_calls"] == 3 and s["tool_timeouts"] == 1
    assert s["tool_latency_mean_s"] == pytest.approx(2.3 / 3)
    assert s["tool_latency_p95_s"] == 2.0
    assert tool_stats([])["tool_latency_mean_s"] is None


def test_read_jsonl_skips_cut_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"kind": "sample", "at": 1}\n{"kind": "learner_step"}\n{"kind": "sam')
    assert [x["at"] for x in read_jsonl(p, "sample")] == [1]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


# --- against Redis ------------------------------------------------------------------------------


def test_sample_has_the_four_kinds(r, tmp_path):
    keys = fake_job(r, steps=[learner_step(1), learner_step(2, reward_mean=0.7)], backlog={"learner": 3})
    sampler = MetricsSampler(r, "obs", tmp_path, interval_s=10)
    s = sampler.sample()
    assert s["kind"] == "sample" and s["schema"] == 1 and s["policy_version"] == 2
    assert s["allocation"] == {"learner": 1, "rollout": 1, "reward": 1}
    assert s["throughput"]["learner_samples_per_s"] > 0  # since the job's start
    assert s["throughput"]["learner_steps"] == 2
    me = s["resources"]["workers"]["learner-0"]
    assert me["pid"] == os.getpid() and me["rss_bytes"] > 0
    assert s["resources"]["by_role"]["rollout"]["workers"] == 1
    assert s["resources"]["node"]["memory_total_bytes"] > 0
    q = s["queues"]
    assert q["stages"]["learner"]["lag"] == 3 and q["learner_queue"] == 3 and q["dead_letters"] == 0
    assert q["learner_wait_ratio"] == pytest.approx(0.1)
    assert s["quality"]["reward_mean"] == pytest.approx(0.6) and s["quality"]["steps"] == 2
    # Recorded in both places.
    assert read_jsonl(tmp_path / "metrics.jsonl", "sample")[0]["at"] == s["at"]
    assert read_samples(r, "obs")[0]["at"] == s["at"]

    # The next sample sees only what happened since: rates from deltas, no learner step.
    r.hincrby(keys.counters, "trained", 640)
    r.hset(keys.workers, "learner-0", json.dumps({"id": "learner-0", "role": "learner", "pid": os.getpid(),
                                                  "node": socket.gethostname(), "state": "waiting",
                                                  "heartbeat": time.time()}))
    time.sleep(0.05)
    s2 = sampler.sample()
    assert s2["throughput"]["learner_samples_per_s"] > 640 / 10
    assert s2["quality"]["steps"] == 0 and s2["quality"]["reward_mean"] is None
    assert s2["queues"]["learner_wait_ratio"] == 1.0  # waiting, and no step finished
    assert s2["resources"]["workers"]["learner-0"]["cpu_percent"] is not None  # measured since the first


def test_sampler_skips_workers_of_other_nodes_and_exited(r, tmp_path):
    fake_job(r, workers={"learner-0": ("learner", "running"), "rollout-x-0": ("rollout", "exited")})
    rec = json.loads(r.hget(JobKeys("obs").workers, "learner-0"))
    rec["node"] = "elsewhere"
    r.hset(JobKeys("obs").workers, "learner-0", json.dumps(rec))
    s = MetricsSampler(r, "obs", None, probe=ResourceProbe(use_gpu=False)).sample()
    assert s["resources"]["workers"] == {}
    assert s["workers"] == {"learner": {"running": 1}, "rollout": {"exited": 1}}


def test_attaching_to_a_running_job_reads_only_new_steps(r):
    keys = fake_job(r, steps=[learner_step(1), learner_step(2)])
    sampler = MetricsSampler(r, "obs", None, from_start=False)
    assert sampler.sample()["quality"]["steps"] == 0
    r.xadd(keys.metrics, {"kind": "learner_step", "data": json.dumps(learner_step(3))})
    assert sampler.sample()["quality"]["step"] == 3


def test_start_sampler_thread_stops_with_a_last_sample(r, tmp_path):
    fake_job(r)
    handle = start_sampler(r, "obs", tmp_path, interval_s=0.05)
    time.sleep(0.4)
    handle.stop()
    assert not handle.thread.is_alive()
    lines = read_jsonl(tmp_path / "metrics.jsonl", "sample")
    assert len(lines) >= 3
    assert len(read_samples(r, "obs")) == len(lines)
    assert all(b["at"] > a["at"] for a, b in zip(lines, lines[1:]))


# --- libra-ctl top (a view of the same figures) ---------------------------------------------------


def test_top_once_shows_allocation_streams_rates_staleness_reward(r, redis_url, capsys):
    from pipeline.cli import main

    keys = fake_job(r, steps=[learner_step(1)], backlog={"learner": 4})
    r.hset(keys.learner_stats, mapping={k: json.dumps(v) for k, v in learner_step(1, reward_mean=0.625).items()})
    MetricsSampler(r, "obs", None).sample()
    assert main(["top", "--once", "--redis", redis_url, "--job", "obs"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # --once: no terminal escapes
    assert "allocation (auto)  learner 1  reward 1  rollout 1" in out
    assert "learner" in out and "reward 0.625" in out and "staleness    mean 0.50  max 1" in out
    assert "wait 10%" in out and "learner-0" in out


def test_top_rates_over_snapshots():
    from pipeline.observe.top import Rates

    rates = Rates()
    rates.add({"t": 0.0, "status": {"counters": {"trained": 0}}})
    out = rates.add({"t": 2.0, "status": {"counters": {"trained": 64, "rollout_tokens": 1000}}})
    assert out["trained"] == 32.0 and out["rollout_tokens"] == 500.0


def stand_in_nvml(monkeypatch, count: int, **calls) -> None:
    """A pynvml module with ``count`` GPUs (handle i for GPU i, UUID "GPU-i") and ``calls`` for the readings."""
    import sys

    class NVMLError(Exception):
        pass

    fake = SimpleNamespace(**{"NVMLError": NVMLError, "nvmlInit": lambda: None, "nvmlDeviceGetCount": lambda: count,
                              "nvmlDeviceGetHandleByIndex": lambda i: i, "nvmlDeviceGetUUID": lambda h: f"GPU-{h}",
                              "nvmlDeviceGetComputeRunningProcesses": lambda h: [], **calls})
    monkeypatch.setitem(sys.modules, "pynvml", fake)


def test_gpu_figures_through_nvml(monkeypatch, r):
    """The NVML path with a stand-in pynvml module (CI has no GPU): devices, peaks, per-worker memory."""
    used = {"v": 10 * 2**30}
    stand_in_nvml(
        monkeypatch, 1,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87, memory=40),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=used["v"], total=141 * 2**30),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(pid=os.getpid(), usedGpuMemory=3 * 2**30)])
    fake_job(r, workers={"rollout-n-0": ("rollout", "running")})
    sampler = MetricsSampler(r, "obs", None, probe=ResourceProbe(use_gpu=True))
    s = sampler.sample()
    (gpu,) = s["resources"]["gpus"]
    assert gpu["util_percent"] == 87.0 and gpu["memory_total_bytes"] == 141 * 2**30
    assert s["resources"]["workers"]["rollout-n-0"]["gpu_memory_bytes"] == 3 * 2**30
    assert s["resources"]["by_role"]["rollout"]["gpu_memory_bytes"] == 3 * 2**30
    used["v"] = 2 * 2**30
    assert sampler.sample()["resources"]["gpus"][0]["memory_peak_bytes"] == 10 * 2**30


def test_a_sample_shows_the_gpus_of_its_jobs_workers_not_their_neighbours(monkeypatch, r):
    """Four GPUs on the node; the job's workers see GPU 1 (by index) and GPU 3 (by UUID), as their agent
    set CUDA_VISIBLE_DEVICES: the other two belong to another job and are left out of this job's sample."""
    stand_in_nvml(monkeypatch, 4, nvmlDeviceGetUUID=lambda h: f"GPU-{h}".encode(),   # older pynvml: bytes
                  nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=10 * h, memory=0),
                  nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=h, total=8))
    keys = fake_job(r, workers={"rollout-n-0": ("rollout", "running"), "learner-0": ("learner", "running"),
                                "reward-n-0": ("reward", "running")})
    for wid, devices in (("rollout-n-0", ["1"]), ("learner-0", ["GPU-3"]), ("reward-n-0", [])):  # reward: a CPU slot
        rec = json.loads(r.hget(keys.workers, wid))
        r.hset(keys.workers, wid, json.dumps({**rec, "devices": devices}))
    sampler = MetricsSampler(r, "obs", None, probe=ResourceProbe(use_gpu=True))
    assert [(g["index"], g["uuid"]) for g in sampler.sample()["resources"]["gpus"]] == [(1, "GPU-1"), (3, "GPU-3")]
    # a worker that sees every GPU (started without CUDA_VISIBLE_DEVICES): the sample shows them all
    rec = json.loads(r.hget(keys.workers, "reward-n-0"))
    del rec["devices"]
    r.hset(keys.workers, "reward-n-0", json.dumps(rec))
    assert [g["index"] for g in sampler.sample()["resources"]["gpus"]] == [0, 1, 2, 3]


def test_a_worker_records_the_devices_its_agent_gave_it(monkeypatch):
    from pipeline.dataplane.worker import visible_devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices() is None                      # not set: it sees every GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_devices() == []                        # a CPU slot: none
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, GPU-5f3a")
    assert visible_devices() == ["2", "GPU-5f3a"]


def test_no_nvml_means_no_gpu_figures(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert ResourceProbe().gpus() == []


# --- the slot busy share (measures.slot_busy), from the workers' cost reports ------------------------------


def cost(role: str, since: float, busy: float, at: float, **kw) -> dict:
    return {"role": role, "since": since, "at": at, "busy_s": busy, "pause_s": 0.0, "items": 0, "tokens": 0,
            "lanes": 1, **kw}


def worker(wid: str, role: str, slots: list[int], state: str = "running") -> dict:
    return {"id": wid, "role": role, "slots": slots, "state": state}


def test_slot_busy_weights_workers_by_their_slots_and_window():
    prev = {"rollout-0": cost("rollout", 0, 10.0, 100), "learner-0": cost("learner", 0, 20.0, 100)}
    now = {"rollout-0": cost("rollout", 0, 16.0, 108),          # 6 s of engine time in 10 s
           "learner-0": cost("learner", 0, 28.0, 109),          # 8 rank-seconds on 2 slots: 4 s of 10
           "rollout-1": cost("rollout", 105, 2.5, 109),         # started mid-window: 2.5 s of 5
           "reward-0": cost("reward", 0, 3.0, 110, lanes=2)}    # beside the slots
    workers = [worker("rollout-0", "rollout", [0]), worker("learner-0", "learner", [1, 2]),
               worker("rollout-1", "rollout", [3]), worker("reward-0", "reward", [])]
    b = slot_busy(prev, now, workers, 100.0, 110.0)
    roles = b["by_role"]
    assert roles["rollout"]["frac"] == pytest.approx((6 + 2.5) / 15, abs=1e-3)
    assert roles["learner"]["frac"] == pytest.approx(0.4, abs=1e-3) and roles["learner"]["slots"] == 2
    assert roles["reward"]["frac"] == pytest.approx(3 / 20, abs=1e-3) and roles["reward"]["slots"] == 0
    assert b["slot_s"] == pytest.approx(10 + 20 + 5, abs=1e-3)             # reward holds no slot
    assert b["frac"] == pytest.approx((6 + 8 + 2.5) / 35, abs=1e-3)


def test_slot_busy_restarted_exited_and_overfull_workers():
    prev = {"rollout-0": cost("rollout", 0, 50.0, 100)}
    restarted = {"rollout-0": cost("rollout", 104, 3.0, 110)}   # a new process: its meter starts at 0
    assert slot_busy(prev, restarted, [worker("rollout-0", "rollout", [0])], 100, 110)["frac"] == \
        pytest.approx(0.5, abs=1e-3)
    gone = {"rollout-0": cost("rollout", 0, 54.0, 105)}         # exited at 105: alive 5 s of the window
    assert slot_busy(prev, gone, [worker("rollout-0", "rollout", [0], "exited")], 100, 110)["frac"] == \
        pytest.approx(0.8, abs=1e-3)
    long_call = {"rollout-0": cost("rollout", 0, 70.0, 110)}     # a 20 s call reported in a 10 s window
    assert slot_busy(prev, long_call, [worker("rollout-0", "rollout", [0])], 100, 110)["frac"] == 1.0
    assert slot_busy({}, {}, [], 100, 110)["frac"] is None


def test_a_sample_has_the_slot_busy_share_of_the_interval(r, tmp_path):
    keys = fake_job(r, workers={"learner-0": ("learner", "running"), "rollout-n-0": ("rollout", "running")})
    now = time.time()
    r.hset(keys.worker_costs, mapping={
        "learner-0": json.dumps(cost("learner", now - 10, 0.0, now)),
        "rollout-n-0": json.dumps(cost("rollout", now - 10, 0.0, now))})
    sampler = MetricsSampler(r, "obs", tmp_path, probe=ResourceProbe(use_gpu=False))
    sampler.sample()
    time.sleep(0.2)
    r.hset(keys.worker_costs, "rollout-n-0", json.dumps(cost("rollout", now - 10, 0.15, time.time())))
    s = sampler.sample()["resources"]["slot_busy"]
    # rollout busy 0.15 s of ~0.2 s, learner idle: about 0.375 of the two slots
    assert 0.25 < s["by_role"]["rollout"]["frac"] <= 1.0 and s["by_role"]["learner"]["frac"] == 0.0
    assert s["frac"] == pytest.approx(s["busy_s"] / s["slot_s"], abs=1e-3) and s["slot_s"] > 0
