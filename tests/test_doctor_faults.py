"""``libra-ctl doctor`` on bottlenecks made on purpose: a learner-bound and a reward-bound pipeline of real sim
workers (feeder, rollout, reward and learner processes over the suite's Redis, as tests/test_sim_workers.py
runs them), the learner's entries held until its checkpoint, a job still loading its engines, slow tools, a
crash loop, vLLM's prefixed tracebacks, and windows too thin to judge. A review found each named wrongly
(or called balanced); the docstrings say what doctor said before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pipeline.dataplane.keys import JobKeys

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job, start, stop_all, wait_for
except ModuleNotFoundError:
    from test_sim_workers import sim_job, start, stop_all, wait_for

ROOT = Path(__file__).resolve().parent.parent

# one rollout slot decodes a 64-trajectory batch in ~0.25 s virtual, the learner trains it in ~10 s virtual
FAST_ROLLOUT = {"concurrency": 16, "decode_tokens_per_s": 5000.0, "prefill_tokens_per_s": 20000.0,
                "weight_sync_s": 0.1}
JOB = {"batch_size": 64, "group_size": 8, "max_staleness": 2, "steps": 400, "seed": 0}
PHASE = [{"until_step": 400, "prompt_tokens": 100, "response_tokens": {"median": 200, "p99": 200}}]


def doctor(*args) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def _diagnose_live(r, redis_url, tmp_path, name, steps, **sections) -> tuple[int, dict]:
    """A sim job of 2 rollout workers, one reward worker and a learner; `doctor --json` once it has trained
    ``steps`` steps (its exit code and document)."""
    run_dir = sim_job(r, redis_url, tmp_path, name=name, time_scale=20.0, job=JOB, phase=PHASE, rollout=FAST_ROLLOUT,
                      **sections)
    procs = [start("feeder", run_dir, "feeder-0", redis_url)]
    procs += [start("rollout", run_dir, f"rollout-n-{i}", redis_url) for i in range(2)]
    procs += [start("reward", run_dir, "reward-n-c0", redis_url),
              start("learner", run_dir, "learner-0", redis_url, slots="5")]
    try:
        wait_for(lambda: int(r.hget(JobKeys(name).policy, "step") or 0) >= steps, 90, f"{steps} learner steps")
        code, out = doctor("--redis", redis_url, "--job", name, "--json", "--sample-s", "8")
    finally:
        stop_all(procs)
    return code, json.loads(out)


def test_learner_bound_run_is_not_called_balanced(r, redis_url, tmp_path):
    """Learner slow (10 s virtual a step), rollout 40x faster: the learner is the bottleneck.

    The feeder's hold (streams.backlog_batches) caps the buffer well below
    streams.max_queue_size, so the learner queue neither rises nor sits "at
    max_queue_size": before, doctor said the pipeline was balanced while the learner
    was busy 100% and the rollout slots ~4%.
    """
    code, doc = _diagnose_live(r, redis_url, tmp_path, "lbound", 4,
                               learner={"train_tokens_per_s": 1920.0, "scaling_exponent": 1.0,
                                        "weight_publish_s": 0.1},
                               reward={"seconds": 0.001, "cpu_workers": 1})
    assert doc["bottleneck"] == "learner", json.dumps(doc["checks"], indent=1)
    assert code == 1


def test_reward_bound_run_is_not_blamed_on_rollout(r, redis_url, tmp_path):
    """A slow verifier (0.5 s virtual per trajectory, one scorer): reward is the bottleneck.

    The reward queue plateaus at the feeder's admission bound instead of
    rising, so doctor's ``reward_short`` (which needed a *rising* reward queue)
    never fired, and before, the waiting learner was blamed on rollout: "Give rollout
    more", which cannot help.
    """
    _code, doc = _diagnose_live(r, redis_url, tmp_path, "rbound", 2,
                                learner={"train_tokens_per_s": 192000.0, "scaling_exponent": 1.0,
                                         "weight_publish_s": 0.1},
                                reward={"seconds": 0.5, "cpu_workers": 1})
    assert doc["bottleneck"] == "reward", (doc["primary"] or {}).get("evidence")


def test_run_dir_with_no_data_is_not_reported_balanced(tmp_path):
    """A run that died before its first sample or step: every check is 'no data'.

    Before, doctor printed "no bottleneck found: the pipeline looks balanced" and exits
    0 (healthy); it should say there is nothing to judge (exit 2, as for a run
    path without a manifest), not that the pipeline is balanced.
    """
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": {"job": {"name": "early"}}}))
    (run / "redis.url").write_text("unix:///nonexistent/redis.sock\n")
    (run / "metrics.jsonl").write_text("")
    code, out = doctor("--run", str(run))
    assert "balanced" not in out, out
    assert code != 0, out


def test_learner_steps_alone_do_not_claim_backlogs_steady(tmp_path):
    """A run directory with learner steps but no samples (every sim job: no sampler).

    Before, the balance line said "backlogs steady" and the rollout finding quotes
    "learner queue mean 0.0 entries", though no backlog was read at all.
    """
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": {"job": {"name": "stepsonly"}}}))
    (run / "redis.url").write_text("unix:///nonexistent/redis.sock\n")
    t0 = time.time() - 60
    steps = [{"kind": "learner_step", "step": i, "at": t0 + i, "wait_s": 0.0 if busy else 1.0, "train_s": 1.0,
              "trajectories": 64, "dropped_stale": 0} for i, busy in ((i, True) for i in range(1, 11))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    _code, out = doctor("--run", str(run), "--json")
    doc = json.loads(out)
    balance = [c for c in doc["checks"] if c["name"] == "learner wait and backlog"][0]
    assert "backlogs steady" not in balance["detail"], balance


def test_entries_held_until_the_checkpoint_are_not_a_learner_pile_up(r, redis_url):
    """The learner acks a step's scored entries only at its checkpoint (README, "The pipeline").

    So between checkpoints the learner stream's backlog (lag + pending) grows by
    one batch of entries per step even when the learner keeps up: in the quick
    start (checkpoint_every = 10) it rose 16 -> 320 entries and fell to 0 at the
    checkpoint. Here the learner consumes every entry as it arrives and trains
    busily (wait 2%), the real sampler records it, and before, doctor called it "the learner
    is short: scored trajectories pile up".
    """
    from pipeline.dataplane import messages
    from pipeline.dataplane.keys import GROUP_LEARNER
    from pipeline.observe.metrics import MetricsSampler

    from tests.test_metrics import fake_job

    keys = fake_job(r, "held")
    sampler = MetricsSampler(r, "held", None, from_start=False)
    for step in range(1, 9):
        for _ in range(4):   # one batch of 4 groups scored, then read by the learner at once
            r.xadd(keys.scored, {messages.FIELD: b"x"})
        r.xreadgroup(GROUP_LEARNER, "learner-0", {keys.scored: ">"})   # pending until the checkpoint
        r.xadd(keys.metrics, {"kind": "learner_step", "data": json.dumps(
            {"step": step, "at": time.time(), "wait_s": 0.02, "train_s": 1.0, "trajectories": 32,
             "dropped_stale": 0})})
        time.sleep(0.3)
        s = sampler.collect()
        r.xadd(keys.metric_samples, {"data": json.dumps(s)})
    assert s["queues"]["stages"]["learner"]["lag"] == 0          # nothing waits for the learner
    code, out = doctor("--redis", redis_url, "--job", "held", "--json", "--sample-s", "0")
    doc = json.loads(out)
    assert "learner_short" not in [f["code"] for f in doc["findings"]], doc["primary"]


def test_a_job_still_starting_up_is_not_rollout_short(r, redis_url):
    """Seen on a real quick-start run: doctor asked ~40 s after ``libra-ctl run`` started, while the
    rollout worker was still loading its engine (state ``starting``) and nothing had been generated.

    The learner 'waits' because nothing has started, and before, doctor named rollout the
    bottleneck ("generated 0.0 trajectories/s ... Give rollout more") instead of saying the
    job is still starting.
    """
    from tests.test_metrics import fake_job

    fake_job(r, "boot", workers={"learner-0": ("learner", "waiting"), "rollout-n-0": ("rollout", "starting"),
                                 "reward-n-0": ("reward", "running")},
             counters={"issued": 512, "generated": 0, "scored": 0, "trained": 0})
    code, out = doctor("--redis", redis_url, "--job", "boot", "--json", "--sample-s", "3")
    doc = json.loads(out)
    assert doc["bottleneck"] != "rollout", doc["primary"]["evidence"]


def test_slow_tools_are_quoted_when_rollout_is_short(tmp_path):
    """A real quick-start run with env.options={tool_delay_s=0.2}: tool latency p95 1.6 s against
    rollout.tool_timeout_s = 2.0, no timeouts, learner waiting 84%.

    Before, doctor said "rollout is short ... raise the rollout:learner ratio" and its tool line says only
    "0 of 3941 tool calls timed out"; the tool latency it has in every sample is quoted nowhere,
    so the user is sent to add rollout workers (more load on the slow tool service).
    """
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    cfg = {"job": {"name": "slowtool"}, "rollout": {"workers": 1, "group_size": 8, "tool_timeout_s": 2.0},
           "learner": {"batch_size": 256}, "streams": {"max_queue_size": 512}}
    (run / "manifest.json").write_text(json.dumps({"config": cfg}))
    (run / "redis.url").write_text("unix:///nonexistent/redis.sock\n")
    t0 = time.time() - 100
    samples = [{"kind": "sample", "schema": 1, "at": t0 + 3 * i, "dt_s": 3.0, "job": "slowtool",
                "counters": {"trained": 256 * (i // 3), "dropped_stale": 0, "generated": 128 * i},
                "throughput": {"trajectories_per_min": 42.4 * 60, "learner_samples_per_s": 21.0},
                "workers": {"rollout": {"running": 1}, "learner": {"waiting": 1}},
                "queues": {"stages": {"rollout": {"backlog": 16}, "reward": {"backlog": 0},
                                      "learner": {"backlog": 0}},
                           "learner_wait_ratio": 0.85, "dead_letters": 0, "tool_calls": 490, "tool_timeouts": 0,
                           "tool_latency_mean_s": 0.87, "tool_latency_p95_s": 1.60}} for i in range(20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    _code, out = doctor("--run", str(run))
    assert "1.60" in out or "1.6 s" in out, out


def _run_with_output(tmp_path, out_text: str, agent_text: str = ""):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": {"job": {"name": "crashy"},
                                                              "rollout": {"workers": 1}}}))
    (run / "redis.url").write_text("unix:///nonexistent/redis.sock\n")
    (run / "metrics.jsonl").write_text("")
    (run / "logs" / "rollout-vm-1.out").write_text(out_text)
    if agent_text:
        (run / "logs" / "agent.out").write_text(agent_text)
    return run


VLLM_CRASH = (
    "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "/x/vllm/v1/core/kv_cache_utils.py", line 1010, in _check_enough_kv_cache_memory\n'
    "[rank0]:     raise ValueError(\n"
    "[rank0]: ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`\n")


def test_a_crash_looping_worker_is_seen_between_restarts(tmp_path):
    """Real run with rollout.kv_cache_bytes=1024: the rollout engine crashed at start-up 4 times, the agent
    restarted it each time (agent.out: worker_crashed ... restarts=4). Between two starts the latest
    start's output has no traceback yet, and before, doctor, reading only the latest start, missed the crash
    loop entirely and says "rollout is short ... Give rollout more".
    """
    out = ("--- libra: output of a new start of this process, at 2026-12-07T15:05:03Z ---\n"
           "Traceback (most recent call last):\n  File \"/x/engine.py\", line 1, in load\n"
           "ValueError: No available memory for the cache blocks.\n"
           "--- libra: output of a new start of this process, at 2026-12-07T15:05:21Z ---\n"
           "INFO: loading engine\n")
    agent = ("2026-12-07T15:05:13Z [warning  ] worker_crashed                 key=crashy/rollout-vm-1 node=vm "
             "restart_in_s=8.0 restarts=1 role=agent\n")
    code, out_text = doctor("--run", str(_run_with_output(tmp_path, out, agent)), "--json")
    doc = json.loads(out_text)
    assert "worker_crashed" in [f["code"] for f in doc["findings"]], doc["checks"]


def test_a_vllm_rank_prefixed_traceback_is_a_crash(tmp_path):
    """vLLM's engine core prefixes its traceback lines with "[rank0]: " (seen in the real run's
    rollout .out). Neither "Traceback (most recent call last)" nor the exception line matches at the
    line start, so before, the crash was not reported even in the latest start's output.
    """
    out = "--- libra: output of a new start of this process, at 2026-12-07T15:05:03Z ---\n" + VLLM_CRASH
    code, out_text = doctor("--run", str(_run_with_output(tmp_path, out)), "--json")
    doc = json.loads(out_text)
    assert "worker_crashed" in [f["code"] for f in doc["findings"]], doc["checks"]
