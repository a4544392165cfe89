"""End to end: libra-ctl run with real Redis, real vLLM on CPU and the real learner.

Runs the quick start as shipped on the embedded Redis 6.2, and a shorter job
on a Redis 7 server. Checks that the policy version advances, that the pipeline really is asynchronous (some
trajectories are trained one or more versions after they were generated)
without ever exceeding the staleness bound, that behaviour log-probs equal the
learner's for the same weights, and that the rollout engine's greedy outputs
after a publish are the learner's model's for those weights. The quick start
must also learn: held-out success and the training reward rise by margins
chosen from measured run-to-run spread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.dataplane.keys import JobKeys
from pipeline.dataplane.redisconn import ENV_URL, connect
from tests.test_tracking import wandb_run

ROOT = Path(__file__).resolve().parent.parent

# |log pi_learner - log pi_behaviour| per policy token at staleness 0. Both
# sides run the same float32 weights; the difference is kernel rounding:
# measured 2.6e-5 at most and 1.3e-7 on average per step (quick start, seed 0).
# The bounds are tests/test_engine_vllm.py's 1e-3 (a 0.1% weight error, far below
# what moves a ratio) and ~100x the measured mean; a misaligned token, a wrong
# temperature or half-precision weights on one side lands orders of magnitude above.
LOGPROB_TOL_MAX = 1e-3
LOGPROB_TOL_MEAN = 1e-5

# The quick start as shipped learns. Held-out greedy success starts at 32.0%
# (the warm start: the same weights every run, evaluated greedily; an earlier
# warm start began at 27.0%, and the figures below are its). On this version,
# 32.0% -> 59.0% and 60.2% (seed 0, twice, 2026-12-07). With lr
# 2.5e-4 it ended at 43.0% (seed 0), 43.4% (seed 1) and 40.2% (seed 2) on a
# 2-core AMD EPYC machine, the last two beside two other runs; a fourth seed-0
# run under that load stood at 38.3% at version 35 (+11.3). Gains +11.3 to
# +16.4 points. A build that does not learn ends where it started (no update:
# exactly; a wrong-signed one: below), so the margin is 5 points: under half the
# lowest gain. (lr 5e-4, the quick start's earlier setting, learned on another
# machine, +11.7 to +26.6 in four runs, and in none of eight here: 17.2% twice.)
# The training reward over the last 5 steps against the first 5 rose by 0.20 to
# 0.27 in the three finished runs (0.05 -> 0.26-0.32); its margin is 0.08.
SUCCESS_MARGIN = 0.05
REWARD_MARGIN = 0.08

SHORT = [
    "job.steps=6", "job.eval_size=48", "job.eval_every=0", "learner.batch_size=64",
    "learner.checkpoint_every=3", "learner.max_staleness=2", "learner.publish_every=1",
    "rollout.groups_per_call=4", "streams.max_queue_size=192",
]


def run_job(tmp_path: Path, redis_url: str | None, settings: list[str], prompts: Path | None = None):
    """``libra-ctl run examples/quickstart.toml`` with ``settings``; returns its run directory, output and statuses."""
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    if redis_url:
        env[ENV_URL] = redis_url
    runs = tmp_path / "runs"
    args = [sys.executable, "-m", "pipeline.cli", "run", "examples/quickstart.toml",
            "--set", f"run.runs_dir={json.dumps(str(runs))}", "--set", "job.name=e2e",
            *sum((["--set", s] for s in settings), [])]
    if prompts:
        args += ["--set", f"job.train_prompts={json.dumps(str(prompts))}"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    statuses = poll_status(proc, runs, env)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out
    run_dir = next(runs.iterdir())
    return run_dir, out, statuses


def poll_status(proc, runs: Path, env: dict) -> list[dict]:
    """While the job runs, `libra-ctl status --json` answers and each stage has its group."""
    seen = []
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline and len(seen) < 3:
        urls = list(runs.glob("*/redis.url"))
        if urls:
            url = urls[0].read_text().strip()
            st = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--json", "--redis", url],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            if st.returncode == 0:
                doc = json.loads(st.stdout)
                roles = {w["role"] for w in doc["jobs"][0]["workers"]} if doc["jobs"] else set()
                if roles >= {"rollout", "reward", "learner"}:  # the agent has brought every stage up
                    r = connect(url)
                    groups = {s["stream"]: [g["name"].decode() for g in r.xinfo_groups(s["stream"])]
                              for s in doc["jobs"][0]["stages"]}
                    seen.append({"status": doc, "groups": groups})
        time.sleep(3)
    return seen


def check_run(run_dir: Path, out: str, statuses: list[dict], steps: int, batch: int, evals: int) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["config"]["job"]["name"] == "e2e" and manifest["packages"]["torch"]
    assert summary["policy_version"] >= steps
    assert summary["trajectories_trained"] == steps * batch
    for key in ("success_rate_start", "success_rate_end", "dropped_stale", "wall_s"):
        assert key in summary

    assert statuses, "libra-ctl status --json never answered during the run"
    job = statuses[-1]["status"]["jobs"][0]
    assert {w["role"] for w in job["workers"]} >= {"rollout", "reward", "learner"}
    assert [s["name"] for s in job["stages"]] == ["rollout", "reward", "learner"]
    for stage in job["stages"]:
        assert statuses[-1]["groups"][stage["stream"]] == [stage["name"]]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [s for s in records if s["kind"] == "learner_step"]
    staleness = {int(k) for s in records for k in s["staleness_hist"]}
    assert max(staleness) <= 2, "a group staler than max_staleness was trained"
    assert max(staleness) >= 1, "no trajectory was trained after a newer version: the pipeline ran in lock-step"
    fresh = [s for s in records if s["ratio_fresh_tokens"]]
    assert fresh, "no staleness-0 trajectory reached the learner"
    assert max(s["ratio_fresh_max_abs_log"] for s in fresh) < LOGPROB_TOL_MAX
    assert max(s["ratio_fresh_mean_abs_log"] for s in fresh) < LOGPROB_TOL_MEAN
    assert "held-out greedy success at start" in out and "run directory:" in out
    check_tensorboard(run_dir, steps, evals)


def check_learning(run_dir: Path) -> None:
    """Held-out success ends SUCCESS_MARGIN above its start, and the training reward rises by REWARD_MARGIN."""
    summary = json.loads((run_dir / "summary.json").read_text())
    start, end = summary["success_rate_start"], summary["success_rate_end"]
    assert end - start >= SUCCESS_MARGIN, f"held-out success {start:.1%} -> {end:.1%}: the policy did not learn"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [s["reward_mean"] for s in steps if s["kind"] == "learner_step"]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= REWARD_MARGIN, f"training reward {first:.3f} -> {last:.3f} over the first and last 5 steps"


def check_tensorboard(run_dir: Path, steps: int, evals: int) -> None:
    """The run's metrics are in TensorBoard events too: every learner step, the samples and both evaluations."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert {"train/loss", "train/reward_mean", "stale/staleness_mean", "time/wait_s", "eval/success_rate",
            "throughput/learner_samples_per_s"} <= set(tags), tags
    assert [e.step for e in ea.Scalars("train/loss")] == list(range(1, steps + 1))
    assert len(ea.Scalars("eval/success_rate")) == evals


def check_greedy_matches_learner(run_dir: Path, redis_url: str) -> None:
    """The engine's greedy completions at the final version equal the torch model's on those weights."""
    from workers.envs.calc import Problem, read_prompt_file
    from workers.tiny_policy import greedy_episodes, load_model, load_tokenizer

    r = connect(redis_url)
    final = [f for _i, f in r.xrange(JobKeys("e2e").eval_results) if f[b"tag"] == b"final"][0]
    import msgpack

    samples = msgpack.unpackb(final[b"samples"])
    version = int(final[b"version"])
    weights = run_dir / "policy" / f"v{version:06d}"
    problems = {p.prompt_id: p for p in read_prompt_file(ROOT / "examples/data/calc_eval.jsonl")
                if isinstance(p, Problem)}
    model, tok = load_model(weights), load_tokenizer(weights)
    eps = greedy_episodes(model, tok, [problems[s["prompt_id"]] for s in samples], 4, 40)
    assert [e.completion_tokens for e in eps] == [s["completion"] for s in samples]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 318-383 s alone on 2 cores; 585-643 s beside two other such runs
def test_e2e_embedded_redis(tmp_path):
    """The README's main job as shipped (40 steps of 256): it runs, and it learns."""
    run_dir, out, statuses = run_job(tmp_path, None, [])
    check_run(run_dir, out, statuses, steps=40, batch=256, evals=40 // 5 + 1)   # every 5 steps, and at the start
    check_learning(run_dir)
    assert "redis: embedded server" in out
    # The embedded server is gone with the run; its AOF stays in the run directory.
    assert (run_dir / "redis" / "appendonly.aof").exists()
    # and `libra-ctl audit --run` serves it again for the audit (before, "no Redis to talk to"), from a
    # directory with no runs/ of its own, so that no other run's Redis is found first
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "audit", "--job", "e2e", "--run", str(run_dir),
                           "--json"], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    a = json.loads(done.stdout)
    assert a["ok"] and a["trained"] == 40 * 256 and a["duplicates_trained"] == 0, a
    # the summary counts what the rollout workers generated up to their stop, as the audit does
    assert json.loads((run_dir / "summary.json").read_text())["trajectories_generated"] == a["generated"]
    assert "serving its data" in done.stderr


@pytest.mark.slow
def test_e2e_redis_server(tmp_path, server_redis_url, wandb_env):
    """A shorter job on a Redis 7 server, skipping the bad lines of its prompt file, tracked by W&B offline."""
    from pipeline.observe.audit import audit

    bad = tmp_path / "prompts.jsonl"
    lines = (ROOT / "examples/data/calc_train.jsonl").read_text().splitlines()[:300]
    lines.insert(2, "{not json")
    lines.insert(5, '{"prompt_id": "x", "prompt": "Q:1+1\\n"}')
    bad.write_text("\n".join(lines) + "\n")
    run_dir, out, statuses = run_job(tmp_path, server_redis_url, [*SHORT, "tracking.wandb=offline"], prompts=bad)
    check_run(run_dir, out, statuses, steps=6, batch=64, evals=2)   # at the start and the end
    assert f"{bad}:3:" in out and f"{bad}:6:" in out and "line skipped" in out
    assert connect(server_redis_url).info("server")["redis_version"].startswith("7")
    check_greedy_matches_learner(run_dir, server_redis_url)
    # W&B's run summary is summary.json as settled once the workers stopped (before, the tracker was closed
    # with the count read at the last step, short of what the rollout workers generated up to their stop)
    summary = json.loads((run_dir / "summary.json").read_text())
    a = audit(connect(server_redis_url), "e2e", str(run_dir))
    [offline] = list((run_dir / "wandb").glob("offline-run-*"))
    _run, _rows, tracked = wandb_run(offline)
    assert tracked["run/trajectories_generated"] == summary["trajectories_generated"] == a["generated"], \
        (tracked["run/trajectories_generated"], summary["trajectories_generated"], a["generated"])
    assert tracked["run/trajectories_trained"] == 6 * 64


@pytest.mark.slow
def test_e2e_synchronous_with_dynamic_sampling(tmp_path, server_redis_url):
    """max_staleness = 0: every trained token comes from the weights being trained, nothing is dropped, and
    dynamic sampling's refills (issued while a batch fills) are generated with that batch's weights too."""
    from pipeline.observe.audit import audit

    run_dir, out, _statuses = run_job(tmp_path, server_redis_url, [
        *SHORT, "learner.max_staleness=0", "learner.dynamic_sampling=true", "learner.mini_batches=2"])
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "learner_step"]
    assert len(steps) == 6 and summary["dropped_stale"] == 0
    assert all(set(s["staleness_hist"]) == {"0"} for s in steps), "an off-policy group was trained"
    # each step trained a full batch of groups with signal (or read dynamic_sampling_max batches' worth)
    for s in steps:
        assert s["trajectories"] - s["filtered_no_signal"] >= 64 or s["trajectories"] >= 4 * 64
        assert s["optimizer_steps"] == 2 and s["ratio_fresh_max_abs_log"] < LOGPROB_TOL_MAX
    assert sum(s["filtered_no_signal"] for s in steps) > 0, "no group without signal: dynamic sampling untested"
    r = connect(server_redis_url)
    a = audit(r, "e2e", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["duplicates_trained"] == 0
    assert int(r.hget(JobKeys("e2e").counters, "filtered_no_signal")) == sum(s["filtered_no_signal"] for s in steps)
