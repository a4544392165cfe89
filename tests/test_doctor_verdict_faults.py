"""``libra-ctl doctor``'s verdicts on runs whose bottleneck is known, where a review of its balance rules found
them wrong: a job still loading its engines (fresh or resumed), windows too thin to judge, one batch landing
as a "rising queue", a rollout-bound job whose reward is half busy, a learner-bound one just under a fixed
threshold, a crash loop of a job doctor samples itself, and one slow tool sample. The docstrings say what
doctor said before.

Each synthetic window copies the figures the real sampler recorded on the run named in the test's docstring
(a quick-start run on this 2-core machine, or sim jobs of tests/test_doctor_faults.py's kind); the live tests
run real sim workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pipeline.dataplane.keys import JobKeys
from pipeline.observe.doctor import diagnose

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job, start, stop_all, wait_for
except ModuleNotFoundError:
    from test_sim_workers import sim_job, start, stop_all, wait_for

ROOT = Path(__file__).resolve().parent.parent
QS_CONFIG = {"job": {"name": "quickstart"},
             "rollout": {"workers": 1, "group_size": 8, "tool_timeout_s": 2.0, "max_turns": 4,
                         "max_tokens_per_turn": 40},
             "learner": {"batch_size": 256, "checkpoint_every": 10, "max_staleness": 2, "publish_every": 1},
             "streams": {"max_queue_size": 512}}
SIM_CONFIG = {"job": {"name": "sim"}, "rollout": {"workers": 2, "group_size": 8, "tool_timeout_s": 2.0},
              "learner": {"batch_size": 64}, "streams": {"max_queue_size": 512}}


def sample(at: float, *, counters: dict, wait, workers: dict, stages: dict, busy: dict | None = None,
           gen_per_s: float = 0.0, trained_per_s: float = 0.0, dt: float = 10.0) -> dict:
    """One sample in the sampler's schema (pipeline/observe/metrics.py); ``stages``: stage -> (lag, pending)."""
    return {
        "kind": "sample", "schema": 1, "at": at, "job": "quickstart", "dt_s": dt, "phase": "running",
        "allocation": {}, "workers": workers, "counters": counters,
        "throughput": {"trajectories_per_min": gen_per_s * 60, "learner_samples_per_s": trained_per_s},
        "resources": {"node": {"host": "vm"}, "by_role": {}, "workers": {}, "gpus": [],
                      "slot_busy": {"by_role": {k: {"frac": v} for k, v in (busy or {}).items()}}},
        "queues": {"stages": {k: {"lag": lag, "pending": pend, "backlog": lag + pend}
                              for k, (lag, pend) in stages.items()},
                   "learner_wait_ratio": wait, "dead_letters": 0, "tool_calls": 0, "tool_timeouts": 0,
                   "tool_latency_p95_s": None},
        "quality": {},
    }


# --- (a) a real quick-start run ------------------------------------------------------------------------


def _loading_samples(t0: float, n: int) -> list[dict]:
    """A quick-start run's first samples, as recorded (runs/<id>/metrics.jsonl, 15:33:56): the rollout worker
    loads its vLLM engine (state starting), the learner waits, and the counters hash has no ``generated``
    field yet (a Redis hash field exists from its first HINCRBY): {"issued": 512, "issued_prompts": 64}."""
    return [sample(t0 + i, counters={"issued": 512, "issued_prompts": 64}, wait=1.0,
                   workers={"feeder": {"waiting": 1}, "learner": {"waiting": 1}, "reward": {"running": 1},
                            "rollout": {"starting": 1}},
                   stages={"rollout": (64, 0), "reward": (0, 0), "learner": (0, 0)},
                   busy={"reward": 0.0, "learner": 0.0, "rollout": 0.0}, dt=1.0) for i in range(n)]


def test_quickstart_still_loading_its_engine_is_not_rollout_short():
    """`libra-ctl doctor --run RUN_DIR` ~15 s into a real quick-start run (./scripts/demo's job, 20 steps):
    exit 1, "bottleneck: rollout - rollout is short", evidence "generated 0.0 trajectories/s". The
    start-up rule only looks for ``counters.generated == 0``; a real run has no such field until its
    first trajectory, so it never fires (and the filter ``!= 0`` keeps those samples)."""
    d = diagnose(_loading_samples(1.7e9, 4), [], config=QS_CONFIG)
    assert d.primary is None or d.primary.bottleneck != "rollout", d.primary.evidence
    assert not d.judged, [(c.name, c.status, c.detail) for c in d.checks]


def test_quickstart_still_loading_through_the_cli_exits_2(tmp_path):
    """The same, as a user reads it: a run directory whose samples are the quick start's loading ones.
    Documented: "nothing generated yet while the engines load: nothing to judge yet, exit 2"."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": QS_CONFIG}))
    (run / "redis.url").write_text("unix:///nonexistent/redis.sock\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n"
                                               for s in _loading_samples(time.time() - 20, 5)))
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", "--run", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "rollout is short" not in p.stdout, p.stdout


def test_too_few_to_judge_is_not_called_balanced():
    """Seen twice in the real quick start (doctor at +6 s and +29 s): exit 0, "no bottleneck found: the
    pipeline looks balanced", ``"judged": true, "healthy": true``, while its own balance line said
    "4 samples, 0 learner steps: too few to judge the balance". Here trajectories are already generated
    (so the start-up rule is not what decides) but the learner is still loading: no wait ratio in any
    sample, no learner step. doctor_checks.BalanceChecks.balance marks the line "ok" whenever there are
    >= 3 samples, even with no wait figure at all."""
    samples = [sample(1.7e9 + 10 * i, counters={"issued": 512, "generated": 128 * (i + 1)}, wait=None,
                      workers={"learner": {"starting": 1}, "rollout": {"running": 1}, "reward": {"running": 1}},
                      stages={"rollout": (32, 16), "reward": (0, 0), "learner": (0, 0)},
                      gen_per_s=12.8) for i in range(4)]
    d = diagnose(samples, [], config=QS_CONFIG)
    balance = next(c for c in d.checks if c.name == "learner wait and backlog")
    assert not d.healthy, (balance.status, balance.detail)
    assert not d.judged, (balance.status, balance.detail)


def test_one_batch_arriving_at_reward_is_not_reward_short():
    """Real quick start (doctor at step ~17): exit 1, critical "the reward stage is short ... reward queue
    rose from 0 to 16 entries in 91 s", one call after and before "rollout is short". Rollout emits
    groups_per_call = 16 groups at once; the last sample happened to land just as a batch reached the
    reward worker, whose slots were busy 3% (rollout's 100%). These are the run's recorded samples:
    ``_rising`` needs only the last value 4 above the first and most *non-zero* moves upward, so one
    sample of 16 after zeros is a "rising queue" (docs: "A single instant never fires a rule")."""
    rec = [  # (generated, trained, learner state, wait, rollout, reward, learner (lag, pending), busy r/rw/l)
        (128, None, "waiting", 1.0, (32, 16), (0, 0), (0, 16), (0.22, 0.006, 0.0)),
        (640, 256, "running", 0.92, (0, 16), (0, 0), (16, 64), (1.0, 0.009, 0.17)),
        (1152, 1024, "waiting", 0.25, (32, 16), (0, 0), (0, 144), (0.81, 0.005, 1.0)),
        (1920, 1792, "waiting", 0.31, (32, 16), (0, 0), (0, 240), (1.0, 0.005, 0.78)),
        (2688, 2304, "running", 0.39, (0, 16), (0, 0), (16, 320), (1.0, 0.005, 0.44)),
        (3456, 3328, "running", 0.18, (32, 16), (0, 0), (0, 112), (0.88, 0.004, 0.84)),
        (4480, 4096, "running", 0.32, (0, 16), (0, 16), (0, 224), (1.0, 0.028, 0.71)),
    ]
    samples = [sample(1.7e9 + 10 * i, counters={"generated": g, **({"trained": t} if t else {})}, wait=w,
                      workers={"rollout": {"running": 1}, "learner": {ls: 1}, "reward": {"running": 1}},
                      stages={"rollout": ro, "reward": rw, "learner": le},
                      busy={"rollout": b[0], "reward": b[1], "learner": b[2]}, gen_per_s=70, trained_per_s=70)
               for i, (g, t, ls, w, ro, rw, le, b) in enumerate(rec)]
    d = diagnose(samples, [], config=QS_CONFIG)
    assert d.primary is not None and d.primary.bottleneck == "rollout", (d.codes(), d.primary.evidence)


# --- (b) sim jobs at known splits ----------------------------------------------------------------------


def test_rollout_bound_with_a_half_busy_reward_is_not_reward_short():
    """Sim job (2 rollout workers, decode 31 tok/s; learner 9600 tok/s; one reward scorer at 0.1 s virtual
    per trajectory, time scale 20): rollout-bound, the learner waits 85%, the reward workers are busy 55%.
    Three `doctor --json` calls in a row said rollout, REWARD (critical, "groups were at reward in 100% of
    samples (mean 3.0), some unread in 50%, reward workers busy 55%"), rollout. A reward worker holds the
    group it is scoring pending, so "lag + pending > 0 in >= 80% of samples" holds for any reward worker that
    is busy most of the time, short or not; adding reward workers cannot help here."""
    samples = [sample(1.7e9 + i, counters={"generated": 1000 + 94 * i}, wait=0.85,
                      workers={"rollout": {"running": 2}, "learner": {"waiting": 1}, "reward": {"running": 1}},
                      stages={"rollout": (2, 32), "reward": (i % 2, 2 + i % 3), "learner": (0, 0)},
                      busy={"rollout": 1.0, "reward": 0.55, "learner": 0.15}, gen_per_s=94, trained_per_s=94,
                      dt=1.0) for i in range(8)]
    d = diagnose(samples, [], config=SIM_CONFIG)
    assert d.primary is not None and d.primary.bottleneck == "rollout", (d.codes(), d.primary.evidence)


def test_learner_bound_sim_job_is_not_called_balanced():
    """Sim job (2 rollout workers, decode 31 tok/s; learner 960 tok/s, scaling 1.0; reward 0.001 s): the
    learner takes ~20 s virtual a batch where rollout makes one in ~14 s. The sampler recorded the
    learner busy 96-100% and waiting 0.03%, rollout slots busy 55-73% (mean ~0.62). Three doctor calls:
    exit 0, "no bottleneck found: the pipeline looks balanced". ``_learner_flat_out`` wants rollout busy
    <= 60%; here the learner is 100% busy and rollout idles 38% of the time, waiting on it.
    (Windows around 0.6 flip between "balanced" and "learner short".)"""
    rollout = [0.56, 0.73, 0.56, 0.55, 0.70, 0.62, 0.66, 0.64]
    samples = [sample(1.7e9 + i, counters={"generated": 1000 + 60 * i}, wait=0.0003,
                      workers={"rollout": {"running": 2}, "learner": {"running": 1}, "reward": {"running": 1}},
                      stages={"rollout": (4, 4), "reward": (0, 0), "learner": (1, 16)},
                      busy={"rollout": x, "reward": 0.005, "learner": 0.98}, gen_per_s=60, trained_per_s=60,
                      dt=1.0) for i, x in enumerate(rollout)]
    d = diagnose(samples, [], config=SIM_CONFIG)
    assert d.primary is not None and d.primary.bottleneck == "learner", \
        [(c.name, c.status, c.detail) for c in d.checks]


FAST_ROLLOUT_31 = {"concurrency": 16, "decode_tokens_per_s": 31.0, "prefill_tokens_per_s": 20000.0,
                   "weight_sync_s": 0.1}
JOB = {"batch_size": 64, "group_size": 8, "max_staleness": 2, "steps": 2000, "seed": 0}
PHASE = [{"until_step": 2000, "prompt_tokens": 100, "response_tokens": {"median": 200, "p99": 200}}]


def test_live_rollout_bound_sim_job_with_a_busy_reward_is_never_blamed_on_reward(r, redis_url, tmp_path):
    """Live: the rollout-bound sim job above with the reward scorer at 0.156 s virtual per trajectory (busy
    ~77%; rollout is still what sets the pace: the learner waits ~85%). In the review, two of three
    consecutive doctor calls named reward (critical, "Add reward workers"), one rollout."""
    name = "rvbusy"
    run_dir = sim_job(r, redis_url, tmp_path, name=name, time_scale=20.0, job=JOB, phase=PHASE,
                      rollout=FAST_ROLLOUT_31,
                      learner={"train_tokens_per_s": 9600.0, "scaling_exponent": 1.0, "weight_publish_s": 0.1},
                      reward={"seconds": 0.156, "cpu_workers": 1})
    procs = [start("feeder", run_dir, "feeder-0", redis_url)]
    procs += [start("rollout", run_dir, f"rollout-n-{i}", redis_url) for i in range(2)]
    procs += [start("reward", run_dir, "reward-n-c0", redis_url),
              start("learner", run_dir, "learner-0", redis_url, slots="5")]
    verdicts = []
    try:
        wait_for(lambda: int(r.hget(JobKeys(name).policy, "step") or 0) >= 3, 90, "3 learner steps")
        for _ in range(3):
            p = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", "--redis", redis_url, "--job",
                                name, "--json", "--sample-s", "6"], cwd=ROOT, capture_output=True, text=True,
                               timeout=120)
            doc = json.loads(p.stdout)
            verdicts.append((doc["bottleneck"], (doc["primary"] or {}).get("evidence")))
    finally:
        stop_all(procs)
    assert all(b == "rollout" for b, _ev in verdicts), verdicts


# --- (d) a resumed run -----------------------------------------------------------------------------------


def test_a_resumed_run_still_loading_its_engine_is_not_rollout_short():
    """`libra-ctl resume RUN_DIR` after a stop at step 18 of a real quick start: the resume's first sample
    (metrics.jsonl) has the rollout worker ``starting`` and the job's cumulative counters (generated 5504,
    trained 5376). The start-up rule asks "was anything *ever* generated" (``counters.generated`` non-zero),
    so a resume's loading samples are judged like running ones: with the learner waiting on the engine,
    "rollout is short ... generated 0.0 trajectories/s ... Give rollout more", which is the very verdict the
    rule was added to stop, only on every resumed run. Nothing is generated in this window."""
    samples = [sample(1.7e9 + 10 * i, counters={"issued": 5632, "generated": 5504, "trained": 5376}, wait=1.0,
                      workers={"feeder": {"waiting": 1}, "learner": {"waiting": 1}, "reward": {"running": 1},
                               "rollout": {"starting": 1}},
                      stages={"rollout": (48, 0), "reward": (0, 0), "learner": (0, 0)},
                      busy={"rollout": 0.0, "learner": 0.0, "reward": 0.0}) for i in range(4)]
    d = diagnose(samples, [], config=QS_CONFIG)
    assert d.primary is None or d.primary.bottleneck != "rollout", d.primary.evidence
    assert not d.judged


# --- (e) several jobs, exit codes ------------------------------------------------------------------------


def test_a_job_with_no_worker_alive_is_not_balanced(r, redis_url, tmp_path):
    """A job on the Redis whose workers are all gone (or never came: here a prepared sim job with none
    started). In the review, `libra-ctl doctor --redis URL --json` over 9 jobs said "balanced" for the 8
    whose workers had stopped or never generated ("judged": true, "healthy": true), each with the balance
    line "8 samples, 0 learner steps: too few to judge the balance". Alone, such a job exits 0: healthy."""
    sim_job(r, redis_url, tmp_path, name="nobody", time_scale=20.0, job=JOB, phase=PHASE)
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", "--redis", redis_url, "--job", "nobody",
                        "--json", "--sample-s", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    doc = json.loads(p.stdout)
    balance = next(c for c in doc["checks"] if c["name"] == "learner wait and backlog")
    assert (p.returncode, doc["judged"], doc["healthy"]) == (2, False, False), balance


# --- (c) crashes and restarts ----------------------------------------------------------------------------


def test_a_crash_loop_of_a_live_job_without_a_sampler_is_seen_over_the_window(r, redis_url, tmp_path):
    """A live job no `libra-ctl run` samples (a sim-job, workers of a Procfile pool): doctor samples it itself
    for --sample-s seconds, and ``LogChecks._restarts`` counts only the agent's worker_crashed lines since
    the window's *first sample*, i.e. the last few seconds, not the --window (300 s) the user asked for.
    Here the agent restarted the rollout worker three times in the last 90 s (a crash loop; its latest start
    has no traceback yet): doctor reports no crash at all."""
    from datetime import datetime, timezone

    try:
        from tests.test_metrics import fake_job
    except ModuleNotFoundError:
        from test_metrics import fake_job

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": {**SIM_CONFIG, "job": {"name": "loop"}}}))
    iso = lambda ago: datetime.fromtimestamp(time.time() - ago, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    (run / "logs" / "agent.out").write_text("".join(
        f"{iso(ago)} [warning  ] worker_crashed                 key=loop/rollout-n-0 node=vm "
        f"restart_in_s={w} restarts={n} role=agent\n" for n, (ago, w) in enumerate(((90, 8.0), (60, 16.0),
                                                                                      (20, 32.0)), 1)))
    (run / "logs" / "rollout-n-0.out").write_text(
        f"--- libra: output of a new start of this process, at {iso(10)} ---\nINFO: loading engine\n")
    fake_job(r, "loop")
    r.hset(JobKeys("loop").state, "run_dir", str(run))
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", "--redis", redis_url, "--job", "loop",
                        "--json", "--sample-s", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    doc = json.loads(p.stdout)
    crash = [f for f in doc["findings"] if f["code"] == "worker_crashed"]
    assert crash and crash[0]["severity"] == "critical", [c for c in doc["checks"] if c["step"] == "logs"]


def _qs_window(n: int, *, wait: float, learner_lag=lambda i: 0, tool_p95=lambda i: 0.02) -> list[dict]:
    """A quick-start-like window: one rollout worker emitting 16 groups a call, a cheap verifier."""
    out = []
    for i in range(n):
        s = sample(1.7e9 + 10 * i, counters={"generated": 512 * (i + 1), "trained": 512 * i}, wait=wait,
                   workers={"rollout": {"running": 1}, "learner": {"running": 1}, "reward": {"running": 1}},
                   stages={"rollout": (16, 16), "reward": (0, 0), "learner": (learner_lag(i), 128)},
                   busy={"rollout": 0.95, "reward": 0.005, "learner": 0.8}, gen_per_s=51, trained_per_s=51)
        s["queues"].update(tool_calls=400, tool_timeouts=0, tool_latency_p95_s=tool_p95(i))
        out.append(s)
    return out


def test_one_batch_unread_at_the_learner_is_not_learner_short():
    """The learner's side of the one-instant rise above: a healthy window (learner waits 12%) in which the
    last sample lands as a rollout call's 16 groups reach the learner unread (the quick start's learner lag
    reads 0 or 16: 0,16,0,0,16,0 ... in metrics.jsonl). ``_rising("learner")``: last - first = 16 >= 4, the
    only move is upward, so "the learner is short: scored trajectories pile up" (critical)."""
    d = diagnose(_qs_window(8, wait=0.12, learner_lag=lambda i: 16 if i == 7 else 0), [], config=QS_CONFIG)
    assert "learner_short" not in d.codes(), d.primary.evidence


def test_one_slow_tool_sample_does_not_blame_the_tool_service():
    """A rollout-short window whose tool latency p95 is 0.02 s in 29 samples and 1.2 s in one (of 400 calls
    each): ``_tool_latency`` takes the window's *max* p95, so rollout_short names "tool service" ("Check the
    tool service first: its calls take most of their timeout") though tools took 1% of the timeout nearly
    all the window. A single instant should not move the verdict (docs: "A single instant never fires a
    rule")."""
    d = diagnose(_qs_window(30, wait=0.45, tool_p95=lambda i: 1.2 if i == 13 else 0.02), [], config=QS_CONFIG)
    assert d.primary is not None and d.primary.code == "rollout_short", d.codes()
    assert d.primary.bottleneck == "rollout", d.primary.evidence
