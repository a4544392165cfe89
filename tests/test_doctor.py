"""``doctor``: each symptom of the field guide, injected into a window of samples and logs, is named;
a healthy window gets no alarm. Then the command, on a live job and on a run directory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


from pipeline.observe.doctor import diagnose

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"rollout": {"workers": 2, "group_size": 8, "max_turns": 4, "max_tokens_per_turn": 48,
                      "tool_timeout_s": 2.0},
          "learner": {"batch_size": 256, "max_staleness": 2, "publish_every": 1},
          "streams": {"max_queue_size": 256}, "job": {"name": "obs"}}


def window(n: int = 30, dt: float = 10.0, *, wait=lambda i: 0.08 + 0.04 * (i % 3),
           learner_backlog=lambda i: 2 + (i % 3), reward_backlog=lambda i: i % 2,
           gpu=lambda i: 88 + (i % 4), dlq=lambda i: 0, trained=64, dropped=lambda i: 0,
           tool=(120, 0), distinct=0.85, equal=0.3, t0: float = 1.7e9) -> list[dict]:
    """Samples in the sampler's schema; the defaults describe a healthy, balanced run."""
    out = []
    for i in range(n):
        out.append({
            "kind": "sample", "schema": 1, "at": t0 + i * dt, "job": "obs", "dt_s": dt,
            "counters": {"trained": trained * i, "dropped_stale": sum(dropped(k) for k in range(i + 1)),
                         "generated": 70 * (i + 1)},
            "throughput": {"trajectories_per_min": 6.6 * 60, "learner_samples_per_s": 6.4},
            "resources": {"node": {"host": "n1"}, "by_role": {}, "workers": {},
                          "gpus": [{"index": 0, "util_percent": float(gpu(i))},
                                   {"index": 1, "util_percent": float(gpu(i + 1))}]},
            "queues": {"stages": {"rollout": {"backlog": 10}, "reward": {"backlog": reward_backlog(i)},
                                  "learner": {"backlog": learner_backlog(i)}},
                       "learner_wait_ratio": wait(i), "dead_letters": dlq(i),
                       "tool_calls": tool[0], "tool_timeouts": tool[1], "tool_latency_p95_s": 0.3},
            "quality": {"diversity_distinct_rate": distinct, "diversity_similarity": 0.3,
                        "diversity_equal_reward_share": equal},
        })
    return out


HEALTHY_LOGS = [{"event": "trained", "worker": "learner-0", "step": 3, "train_s": 1.2, "wait_s": 0.1},
                {"event": "weights_reloaded", "worker": "rollout-n-0", "reload_s": 0.2},
                "rollout-n-0: INFO: engine started", {"event": "checkpointed", "worker": "learner-0"}]


def test_healthy_run_gets_no_alarm():
    d = diagnose(window(), HEALTHY_LOGS, config=CONFIG)
    assert d.healthy, [(f.code, f.evidence) for f in d.findings]
    statuses = {c.name: c.status for c in d.checks}
    assert set(statuses.values()) == {"ok"}, statuses
    # The troubleshooting order: logs, inputs, resources, balance, quality.
    assert [c.step for c in d.checks] == sorted([c.step for c in d.checks],
                                                key=["logs", "inputs", "resources", "balance", "quality"].index)


def test_learner_waiting_means_rollout_is_short():
    d = diagnose(window(wait=lambda i: 0.45, learner_backlog=lambda i: 0), [], config=CONFIG)
    assert d.codes() == ["rollout_short"]
    assert d.primary.bottleneck == "rollout"
    assert any("45%" in e for e in d.primary.evidence)
    assert "rollout.workers=2" in d.primary.action


def test_one_instant_of_waiting_is_not_a_bottleneck():
    d = diagnose(window(wait=lambda i: 1.0 if i == 7 else 0.05), [], config=CONFIG)
    assert d.healthy  # the rule of thumb is an average over a period, not one instant


def test_learner_waiting_with_a_growing_reward_queue_blames_reward():
    d = diagnose(window(wait=lambda i: 0.5, reward_backlog=lambda i: 2 * i, learner_backlog=lambda i: 0), [])
    assert d.primary.code == "reward_short" and d.primary.bottleneck == "reward"


def test_rising_backlog_means_learner_is_short():
    d = diagnose(window(wait=lambda i: 0.0, learner_backlog=lambda i: 3 + i + (i % 2)), [], config=CONFIG)
    assert d.codes() == ["learner_short"]
    assert "learner queue rose from 3" in d.primary.evidence[0]


def test_queue_always_full_means_learner_is_short():
    d = diagnose(window(wait=lambda i: 0.0, learner_backlog=lambda i: 30, reward_backlog=lambda i: 2), [],
                 config=CONFIG)  # (30 + 2) groups x 8 = 256 = max_queue_size
    assert d.codes() == ["learner_short"]
    assert "max_queue_size" in d.primary.evidence[0]


def test_gpu_dropping_to_zero_periodically_is_a_sync_stall():
    d = diagnose(window(gpu=lambda i: 0 if i % 5 == 4 else 92), HEALTHY_LOGS, config=CONFIG)
    assert d.codes() == ["sync_stalls"]
    assert d.primary.bottleneck == "weight sync"
    assert any("weight syncs logged" in e for e in d.primary.evidence)
    # An idle GPU that never worked is not a periodic stall.
    assert diagnose(window(gpu=lambda i: 0), [], config=CONFIG).healthy


def test_tool_timeouts_point_at_the_tool_service():
    d = diagnose(window(tool=(100, 12)), [], config=CONFIG)
    assert d.codes() == ["tool_timeouts"] and d.primary.bottleneck == "tool service"
    assert d.primary.severity == "critical"
    assert diagnose(window(tool=(100, 1)), []).healthy  # 1% is noise


def test_growing_dead_letter_stream():
    reasons = {"verifier error after 3 attempts on sample 2: boom": 14}
    d = diagnose(window(dlq=lambda i: i // 2), [], dead_letter_reasons=reasons)
    assert d.codes() == ["dlq_growing"] and d.primary.severity == "critical"
    assert "reward function" in d.primary.action
    assert any("14x verifier error" in e for e in d.primary.evidence)
    assert diagnose(window(dlq=lambda i: 5), []).healthy  # old dead letters, none new


def test_many_trajectories_dropped_as_stale():
    d = diagnose(window(dropped=lambda i: 24), [], config=CONFIG)
    assert d.codes() == ["stale_drops"]
    assert "max_staleness=2" in d.primary.evidence[1]


def test_out_of_memory_in_logs_comes_first():
    logs = HEALTHY_LOGS + ["learner-0: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    d = diagnose(window(wait=lambda i: 0.45, learner_backlog=lambda i: 0), logs, config=CONFIG)
    assert d.codes() == ["oom", "rollout_short"]  # logs before balance, as the field guide orders them
    assert "rollout.group_size=8" in d.primary.action
    assert diagnose(window(), [{"event": "worker_exited", "worker": "rollout-n-0",
                                "error": "exited with code -9"}]).codes() == ["oom"]


def test_redis_full_is_backpressure_not_oom():
    d = diagnose(window(), [{"event": "redis_full_waiting", "worker": "rollout-n-0", "delay_s": 0.1},
                            "reward-n-0: OOM command not allowed when used memory > 'maxmemory'"])
    assert d.codes() == ["redis_full"]


def test_collapsed_diversity():
    d = diagnose(window(distinct=0.125, equal=0.95), [])
    assert d.codes() == ["diversity_collapsed"]


def test_learner_steps_alone_are_a_window():
    steps = [{"at": 1.7e9 + i, "wait_s": 3.0, "train_s": 2.0, "trajectories": 64, "dropped_stale": 0}
             for i in range(5)]
    d = diagnose([], [], steps=steps)
    assert d.codes() == ["rollout_short"]
    assert "5 learner steps" in d.primary.evidence[0]


def test_learner_wait_counts_from_the_first_trajectory_generated():
    """docs/observability.md, rollout_short: the learner's wait counts "from the first trajectory generated". A
    review's 3-step run: step 1 waited 10.9 s, nearly all of it while vLLM loaded, before any trajectory; over
    the steps (a finished run's fallback) doctor said "learner waited 95%: rollout is short" of a learner that
    waited 6% from the first trajectory on. The steps' wait now starts at the first rollout call's end."""
    t0 = 1.7e9
    steps = [{"at": t0 + 12.0, "wait_s": 10.9, "train_s": 1.0, "trajectories": 32, "dropped_stale": 0},
             {"at": t0 + 13.1, "wait_s": 0.1, "train_s": 1.0, "trajectories": 32, "dropped_stale": 0},
             {"at": t0 + 14.2, "wait_s": 0.1, "train_s": 1.0, "trajectories": 32, "dropped_stale": 0}]
    first_call = {"event": "span", "phase": "rollout", "role": "rollout", "start": t0 + 2.0, "dur_s": 8.9}
    assert diagnose([], [], steps=steps).codes() == ["rollout_short"]   # without the logs: every second counts
    d = diagnose([], [first_call], steps=steps)
    assert "rollout_short" not in d.codes(), d.primary.evidence if d.primary else d.codes()


def test_a_resumes_engine_load_is_left_out_of_the_learner_wait_as_the_starts_is():
    """A review of the fix above: a resumed run loads its engines again, and the resume's first step waits that
    load out before any trajectory of that process exists. Counting from the first rollout call in the logs
    (the first process's) left that wait in: "learner waited 91%, rollout short" of a learner that waited ~8%
    once trajectories came. Each start of a rollout worker in the logs now opens a load, which ends with the
    next rollout call's end."""
    t0 = 1.7e9
    step = lambda at, wait: {"at": at, "wait_s": wait, "train_s": 1.0, "trajectories": 32, "dropped_stale": 0}
    first_proc = [step(t0 + 12.0, 10.9), step(t0 + 13.1, 0.1), step(t0 + 14.2, 0.1)]
    resumed = [step(t0 + 1062.0, 60.9), step(t0 + 1063.1, 0.1), step(t0 + 1064.2, 0.1)]   # resumed at t0+1000

    def started(at: float) -> dict:
        return {"event": "worker_started", "role": "rollout", "timestamp": at}

    logs = [started(t0), {"event": "span", "phase": "rollout", "role": "rollout", "start": t0 + 2.0, "dur_s": 8.9},
            started(t0 + 1000.0),
            {"event": "span", "phase": "rollout", "role": "rollout", "start": t0 + 1052.0, "dur_s": 8.9}]
    d = diagnose([], logs, steps=first_proc + resumed)
    assert "rollout_short" not in d.codes(), d.primary.evidence if d.primary else d.codes()
    # a learner that waited for a rollout working all along is still told so
    slow = [step(t0 + 1062.0 + 10 * i, 9.0) for i in range(4)]
    busy = [{"event": "span", "phase": "rollout", "role": "rollout", "start": t0 + 1050.0 + 10 * i, "dur_s": 9.5}
            for i in range(5)]
    assert "rollout_short" in diagnose([], logs + busy, steps=slow).codes()


def test_too_little_data_is_no_data_not_an_alarm():
    d = diagnose(window(n=2, wait=lambda i: 0.9), [])
    assert not d.findings and not d.judged and not d.healthy   # no verdict: neither an alarm nor "balanced"
    assert {c.name: c.status for c in d.checks}["learner wait and backlog"] == "no data"


# --- the command -----------------------------------------------------------------------------------


def doctor(*args) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_doctor_on_a_live_job(r, redis_url, tmp_path):
    from tests.test_metrics import fake_job

    keys = fake_job(r)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": CONFIG}))
    r.hset(keys.state, "run_dir", str(run))
    now = time.time()
    for s in window(n=12, t0=now - 120, wait=lambda i: 0.0, learner_backlog=lambda i: 2 + 2 * i):
        r.xadd(keys.metric_samples, {"data": json.dumps(s)})
    code, out = doctor("--redis", redis_url, "--job", "obs", "--json")
    assert code == 1, out
    doc = json.loads(out)
    assert doc["bottleneck"] == "learner" and doc["source"] == "live" and doc["run_dir"] == str(run)
    code, text = doctor("--redis", redis_url, "--job", "obs")
    assert "bottleneck: learner" in text and "checked, in the field guide's order" in text


def test_doctor_samples_a_live_job_that_has_no_sampler(r, redis_url):
    from tests.test_metrics import fake_job

    fake_job(r)
    code, out = doctor("--redis", redis_url, "--job", "obs", "--json", "--sample-s", "1")
    doc = json.loads(out)
    assert doc["window"]["samples"] >= 3 and code == (0 if doc["healthy"] else 1)


def test_doctor_on_a_run_directory_without_redis(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": CONFIG}))
    (run / "redis.url").write_text("unix:///nonexistent/redis.sock\n")
    lines = [json.dumps(s) for s in window(dropped=lambda i: 40)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "logs" / "learner-0.out").write_text("Traceback...\nRuntimeError: CUDA out of memory.\n")
    code, out = doctor("--run", str(run), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["source"] == "run directory"
    assert [f["code"] for f in doc["findings"]] == ["oom", "stale_drops"]
    code, out = doctor("--run", str(run))
    assert "bottleneck: memory" in out


def test_doctor_on_a_finished_job_reads_its_run_directory(r, redis_url, tmp_path):
    from tests.test_metrics import fake_job

    keys = fake_job(r)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in window(wait=lambda i: 0.5,
                                                                                   learner_backlog=lambda i: 0)))
    r.hset(keys.state, mapping={"phase": "done", "run_dir": str(run)})
    code, out = doctor("--redis", redis_url, "--job", "obs", "--json")
    doc = json.loads(out)
    assert doc["source"] == "run directory" and doc["bottleneck"] == "rollout"


def test_a_crashed_worker_is_named_from_its_traceback():
    out = ["Traceback (most recent call last):",
           '  File "/work/main/workers/rollout.py", line 41, in __init__',
           "    self.engine = VLLMEngine(path)",
           "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
           "  Value error, User-specified max_model_len (512) is greater than the derived max_model_len (256)"]
    logs = HEALTHY_LOGS + [f"rollout-n-0: {line}" for line in out]  # as read_logs gives a worker's .out
    d = diagnose(window(wait=lambda i: 1.0, learner_backlog=lambda i: 0), logs, config=CONFIG)
    assert d.codes() == ["worker_crashed", "rollout_short"]
    assert d.primary.bottleneck == "rollout"
    assert "max_model_len (512)" in d.primary.evidence[0] and "logs/rollout-n-0.out" in d.primary.action
    # An out-of-memory traceback is the oom finding, not a second one.
    oom = ["learner-0: Traceback (most recent call last):", "learner-0: torch.OutOfMemoryError: CUDA out of memory."]
    assert diagnose(window(), oom).codes() == ["oom"]


def test_learner_starving_while_rollout_is_paused_is_a_stall():
    """Seen live: rollout paused at the queue bound by entries the learner holds until its checkpoint."""
    w = window(wait=lambda i: 1.0, learner_backlog=lambda i: 24, reward_backlog=lambda i: 0)
    for s in w:
        s["workers"] = {"rollout": {"waiting": 1}, "learner": {"waiting": 1}, "reward": {"running": 1}}
    d = diagnose(w, [], config=CONFIG)
    assert d.codes() == ["rollout_paused"]
    assert d.primary.bottleneck == "queue bound" and "checkpoint_every" in d.primary.action
    for s in w:
        s["workers"]["rollout"] = {"running": 1}
    assert diagnose(w, [], config=CONFIG).codes() == ["rollout_short"]
