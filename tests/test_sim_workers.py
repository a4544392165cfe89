"""The sim backend: its cost model, and its workers over the real streams (no agent, no controller).

``write_workload`` and ``sim_job`` are shared with test_agent.py and
test_controller.py (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.dataplane import messages
from pipeline.observe.audit import audit
from pipeline.dataplane.keys import GROUP_ROLLOUT, JobKeys
from pipeline.dataplane.redisconn import ENV_URL
from pipeline.dataplane.streams import group_pending
from pipeline.sim.workload import parse_workload
from pipeline.sim.job import prepare_sim_run, sim_config
from pipeline.sim.worker import Clock, CostModel

ROOT = Path(__file__).resolve().parent.parent

BASE = {
    "name": "tiny",
    "cluster": {"gpus": 8, "switch_cost_s": 5.0},
    "rollout": {"concurrency": 8, "decode_tokens_per_s": 50.0, "prefill_tokens_per_s": 100000.0,
                "weight_sync_s": 0.5},
    "reward": {"gpu": False, "seconds": 0.01, "cpu_workers": 4},
    "learner": {"train_tokens_per_s": 3000.0, "scaling_exponent": 0.9, "weight_publish_s": 0.1},
    "job": {"batch_size": 32, "group_size": 4, "max_staleness": 2, "steps": 1000, "seed": 0},
    "phase": [{"until_step": 1000, "prompt_tokens": 100,
               "response_tokens": {"median": 200, "p99": 400, "max": 800}}],
}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def write_workload(path: Path, **sections) -> Path:
    """A workload file: BASE with some tables replaced key by key (``job={"steps": 6}``)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for name, values in sections.items():
        if name == "phase":
            data["phase"] = values
        else:
            data[name] = {**data[name], **values}
    if "steps" in sections.get("job", {}) and "phase" not in sections:
        data["phase"] = [{**BASE["phase"][0], "until_step": sections["job"]["steps"]}]
    lines = [f"name = {json.dumps(data['name'])}"]
    for table in ("cluster", "rollout", "reward", "learner", "job"):
        lines.append(f"\n[{table}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in data[table].items()]
    for ph in data["phase"]:
        lines.append("\n[[phase]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in ph.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def sim_job(r, url: str, tmp_path: Path, name: str = "simtest", time_scale: float = 5.0, control=None,
            **sections) -> Path:
    """A prepared sim job (run directory, manifest, job state in Redis); returns the run directory."""
    wl = write_workload(tmp_path / f"{name}.toml", **sections)
    return prepare_sim_run(r, wl, tmp_path / "runs", job=name, time_scale=time_scale, redis_url=url,
                           control=control)


def start(role: str, run_dir: Path, worker: str, url: str, slots: str = "") -> subprocess.Popen:
    """A worker process started by the test itself (these tests have no agent)."""
    module = ["-m", "workers.feeder"] if role == "feeder" else ["-m", "pipeline.sim.worker", "--role", role]
    env = dict(os.environ, **{ENV_URL: url, "LIBRA_SLOTS": slots})
    log = open(run_dir / "logs" / f"{worker}.out", "ab")
    return subprocess.Popen([sys.executable, *module, "--run-dir", str(run_dir), "--worker-id", worker],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(cond, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --- the cost model ---------------------------------------------------------------------------


def test_rollout_cost_is_the_workloads_fluid_gpu_time(tmp_path):
    wl = parse_workload({**BASE, "phase": [{**BASE["phase"][0], "tool_calls": {
        "per_trajectory": 1, "latency_median_s": 0.3, "latency_p99_s": 2.0}}]})
    m = CostModel(wl, seed=1)
    calls = [m.rollout(0, groups=2, group_size=4) for _ in range(3000)]
    per_traj = sum(c.gpu_s for c in calls) / (3000 * 8)
    assert per_traj == pytest.approx(m.mean_rollout_gpu_s(), rel=0.03)
    mean_tokens = sum(sum(c.group_tokens) for c in calls) / (3000 * 8)
    ph = wl.job.phases[0]
    assert mean_tokens == pytest.approx(ph.prompt_tokens + ph.response_tokens.mean(), rel=0.03)
    assert all(c.tool_calls == (1,) * 8 for c in calls[:5])


def test_learner_and_reward_costs():
    wl = parse_workload(BASE)
    m = CostModel(wl, seed=0)
    assert m.train_s(3000.0, 1) == pytest.approx(1.0)
    assert m.train_s(3000.0, 4) == pytest.approx(1 / 4 ** 0.9)
    assert m.reward_lanes(1) == 4 and m.reward_lanes(3) == pytest.approx(4 / 3)   # 3 processes: 4 scorers together
    assert m.reward_s(8, lanes=4) == pytest.approx(0.02)
    assert m.groups_per_call(4) == 2


def test_clock_compresses_time():
    clock = Clock(100.0)
    assert 0.009 <= clock.sleep(1.0) < 1.0
    with pytest.raises(ValueError):
        Clock(0)


def test_sim_config_follows_the_workload(tmp_path):
    wl = parse_workload({**BASE, "job": {**BASE["job"], "batch_size": 64, "max_staleness": 3, "steps": 7},
                         "phase": [{**BASE["phase"][0], "until_step": 7}]})
    cfg = sim_config(wl, job="x")
    assert (cfg.learner.batch_size, cfg.rollout.group_size, cfg.learner.max_staleness, cfg.job.steps) == (64, 4, 3, 7)
    assert cfg.streams.max_queue_size == 64 * 4
    assert Path(cfg.job.train_prompts).is_absolute()


def test_prepare_sim_run_writes_manifest_and_job_state(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path, control={"cooldown_s": 3.0})
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["sim"]["time_scale"] == 5.0 and Path(manifest["sim"]["workload"]).exists()
    assert manifest["control"] == {"cooldown_s": 3.0}
    keys = JobKeys("simtest")
    assert r.hget(keys.state, "phase") == b"running" and r.hget(keys.policy, "version") == b"0"
    assert {g["name"] for g in r.xinfo_groups(keys.prompts)} == {GROUP_ROLLOUT.encode()}


# --- the workers over real streams -------------------------------------------------------------------


@pytest.mark.slow
def test_sim_pipeline_trains_every_trajectory_once(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path, time_scale=20.0, job={"steps": 6})
    procs = [start("feeder", run_dir, "feeder-0", redis_url), start("rollout", run_dir, "rollout-n-0", redis_url),
             start("rollout", run_dir, "rollout-n-1", redis_url), start("reward", run_dir, "reward-n-c0", redis_url),
             start("learner", run_dir, "learner-0", redis_url, slots="2,3")]
    try:
        wait_for(lambda: r.hget(JobKeys("simtest").state, "phase") == b"trained", 120, "6 learner steps")
        assert procs[-1].wait(timeout=30) == 0          # the learner exits by itself when done
    finally:
        stop_all(procs)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(s["gpus"] == 2 and s["tokens"] > 0 and s["train_s"] > 0 for s in steps)
    a = audit(r, "simtest", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 6 * 32 and a["duplicates_trained"] == 0
    costs = {w: json.loads(v) for w, v in r.hgetall(JobKeys("simtest").worker_costs).items()}
    assert costs[b"rollout-n-0"]["busy_s"] > 0 and costs[b"rollout-n-0"]["pause_s"] > 0
    assert costs[b"reward-n-c0"]["lanes"] == 4


@pytest.mark.slow
def test_drained_rollout_finishes_its_batch_and_loses_nothing(r, redis_url, tmp_path):
    # one call of 2 groups lasts ~2 s of wall time: long enough to SIGTERM it mid-batch
    run_dir = sim_job(r, redis_url, tmp_path, time_scale=1.0,
                      rollout={"decode_tokens_per_s": 100.0, "weight_sync_s": 0.0})
    keys = JobKeys("simtest")
    for i in range(2):
        r.xadd(keys.prompts, {messages.FIELD: messages.encode(messages.Prompt(f"p{i}", "Q", 1, time.time()))})
    p = start("rollout", run_dir, "rollout-n-0", redis_url)
    try:
        wait_for(lambda: group_pending(r, keys.prompts, GROUP_ROLLOUT) == 2, 30, "the batch in hand")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        stop_all([p])
    assert group_pending(r, keys.prompts, GROUP_ROLLOUT) == 0        # acked ...
    assert r.xlen(keys.rollouts) == 2                               # ... with its output written
    assert int(r.hget(keys.counters, "generated")) == 8


@pytest.mark.slow
def test_learner_resumes_at_its_step_with_a_new_world_size(r, redis_url, tmp_path):
    run_dir = sim_job(r, redis_url, tmp_path, time_scale=20.0, job={"steps": 8})
    keys = JobKeys("simtest")
    procs = [start("feeder", run_dir, "feeder-0", redis_url), start("rollout", run_dir, "rollout-n-0", redis_url),
             start("rollout", run_dir, "rollout-n-1", redis_url), start("reward", run_dir, "reward-n-c0", redis_url)]
    first = start("learner", run_dir, "learner-0", redis_url, slots="4")
    try:
        wait_for(lambda: int(r.hget(keys.sim_learner, "step") or 0) >= 3, 120, "3 steps on one slot")
        first.send_signal(signal.SIGTERM)        # drain: it commits the step in hand and exits
        assert first.wait(timeout=30) == 0
        stopped_at = int(r.hget(keys.sim_learner, "step"))
        version_before = int(r.hget(keys.policy, "version"))
        second = start("learner", run_dir, "learner-0", redis_url, slots="4,5,6")
        procs.append(second)
        wait_for(lambda: r.hget(keys.state, "phase") == b"trained", 120, "the remaining steps on three slots")
    finally:
        stop_all(procs + [first])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert {s["gpus"] for s in steps[:stopped_at]} == {1} and {s["gpus"] for s in steps[stopped_at:]} == {3}
    # a restore publishes under a new version, so no number names two weight sets
    assert steps[stopped_at]["policy_version"] == version_before + 2
    a = audit(r, "simtest", str(run_dir))
    assert a["ok"], a["problems"]
    assert a["trained"] == 8 * 32 and a["duplicates_trained"] == 0


def test_reward_ids_are_reproducible():
    from pipeline.sim.worker import reward_of

    assert [reward_of("p", i, 0) for i in range(8)] == [reward_of("p", i, 0) for i in range(8)]
    assert 0 < np.mean([reward_of(f"p{i}", 0, 0) for i in range(300)]) < 1


def _scored(prompt_id: str, version: int, group_size: int = 4) -> messages.Group:
    trajs = tuple(messages.Trajectory(sample_idx=i, completion=np.zeros(1, dtype=np.int32),
                                      mask=np.ones(1, dtype=np.uint8), logprobs=np.zeros(1, dtype=np.float32),
                                      text="", finish="sim", turns=1, tool_calls=0, tool_latency_s=(),
                                      tool_timeouts=0, reward=1.0) for i in range(group_size))
    return messages.Group(prompt_id=prompt_id, prompt="Q", answer=1, prompt_tokens=np.zeros(1, dtype=np.int32),
                          version=version, worker="test", generated_at=time.time(), gen_s=0.0, trajectories=trajs,
                          extra={"sim_tokens": 100.0})


@pytest.mark.slow
def test_sim_learner_judges_staleness_along_the_version_tree_after_a_restore(r, redis_url, tmp_path):
    """A committed step 2 (v2) restores as v3, the weights of v2: a group of v1 is 1 update old, not 2.

    At max_staleness=1, counting version numbers drops it (3 - 1 > 1) and the step never fills.
    """
    run_dir = sim_job(r, redis_url, tmp_path, time_scale=20.0,
                      job={"steps": 3, "batch_size": 8, "max_staleness": 1})
    keys = JobKeys("simtest")
    r.hset(keys.sim_learner, mapping={"step": 2, "version": 2})
    r.hset(keys.policy, mapping={"version": 2, "step": 2})
    for g in (_scored("p1@0", 1), _scored("p2@0", 2)):
        r.xadd(keys.scored, {messages.FIELD: messages.encode(g)})
    p = start("learner", run_dir, "learner-0", redis_url)
    try:
        wait_for(lambda: r.hget(keys.state, "phase") == b"trained", 60, "step 3 from the two groups")
        assert p.wait(timeout=30) == 0
    finally:
        stop_all([p])
    step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert (step["step"], step["policy_version"], step["dropped_stale"]) == (3, 4, 0)
    assert step["staleness_hist"] == {"0": 4, "1": 4}


def test_the_sim_rollout_dead_letters_what_is_not_a_prompt(r, redis_url, tmp_path):
    """As the vLLM rollout worker: a well-formed group on the prompts stream is rejected, not turned into a new
    group of the same prompt id."""
    import structlog

    from pipeline.dataplane.streams import Reject
    from pipeline.dataplane.worker import CostMeter, WorkerContext, load_run_config
    from pipeline.sim.worker import SimRollout, sim_settings
    from pipeline.sim.workload import load_workload
    from tests.test_streams import unscored_group

    run_dir = sim_job(r, redis_url, tmp_path)
    keys = JobKeys("simtest")
    ctx = WorkerContext(cfg=load_run_config(run_dir), run_dir=run_dir, keys=keys, r=r, worker_id="rollout-n-0",
                        role="rollout", log=structlog.get_logger(), node="n")
    sim = sim_settings(run_dir)
    wl = load_workload(sim["workload"], sim.get("job"))
    stage = SimRollout(ctx, CostModel(wl, seed=1), Clock(1e6), CostMeter(r, keys, ctx.worker_id, "rollout"))
    prompt = messages.Prompt("p@0", "Q", 1, 0.0)
    out = stage.generate([unscored_group("g@0"), prompt, unscored_group("h@0")])
    assert [type(o).__name__ for o in out] == ["Reject", "Group", "Reject"]
    assert out[0].reason == "rollout stage expects a prompt" and isinstance(out[2], Reject)
    assert out[1].prompt_id == "p@0" and len(out[1].trajectories) == stage.group_size
